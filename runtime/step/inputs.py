"""A step's inputs, gathered on the host from the persistent batch by tensor ops, then moved to
the device in one copy. The flat batch is laid out decodes first (sorted by length, so that the
CPU path groups similar lengths), then prefill chunks in scheduling order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.models.attention import AttentionMetadata
from runtime.sampling.plan import SamplingPlan, padded_token_ids, plan_sampling
from runtime.step.input_batch import InputBatch
from scheduler.request import Request

_LAST = 1 << 62  # sort key that puts prefill chunks after every decode


@dataclass
class HostStep:
    """What the host knows about a step; `parts` are the tensors to stage."""

    num_tokens: int
    num_decode: int
    max_blocks: int
    sample_requests: list[Request]
    sample_rows: torch.Tensor  # [num_samples] rows of the persistent batch
    sample_positions: torch.Tensor  # [num_samples] where each sampled token will go
    sampling: SamplingPlan | None
    parts: dict[str, torch.Tensor]


@dataclass
class StepInputs:
    """The device side of a step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    sample_index: torch.Tensor  # [num_samples] token of each sampling row in the flat batch
    sample_rows: torch.Tensor  # [num_samples] rows of the persistent batch
    staged: dict[str, torch.Tensor]


def prepare_host_step(
    batch: InputBatch,
    scheduled: list[tuple[Request, int]],
    block_size: int,
    previous: HostStep | None = None,
) -> HostStep:
    """previous: the launched step whose sampled tokens have not landed yet (async
    scheduling); a scheduled token the host does not know is one of them."""
    rows = torch.tensor(batch.update(scheduled), dtype=torch.int64)  # [num_seqs]
    num_new = torch.tensor([n for _, n in scheduled], dtype=torch.int64)
    computed = torch.tensor([r.num_computed_tokens for r, _ in scheduled], dtype=torch.int64)
    known = batch.num_tokens[rows]  # [num_seqs] tokens in the host table
    pending = [r.num_pending_tokens for r, _ in scheduled]
    total = known + torch.tensor(pending, dtype=torch.int64) if any(pending) else known
    is_decode = (num_new == 1) & (computed == total - 1)
    order = torch.where(is_decode, computed, _LAST).sort(stable=True).indices
    rows, num_new, computed = rows[order], num_new[order], computed[order]
    known, total = known[order], total[order]
    seq_lens = computed + num_new  # [num_seqs]
    ends = num_new.cumsum(0)  # [num_seqs] end of each sequence's tokens in the flat batch
    num_tokens = int(ends[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(rows)), num_new)  # [num_tokens]
    positions = torch.arange(num_tokens) - (ends - num_new)[seq_of_token] + computed[seq_of_token]
    token_rows = rows[seq_of_token]
    slots = batch.block_table[token_rows, positions // block_size] * block_size
    slots += positions % block_size
    num_decode = int(is_decode.sum())
    samples = (seq_lens == total).nonzero().flatten()  # [num_samples]
    sample_rows = rows[samples]
    parts = {
        "input_ids": batch.token_ids[token_rows, positions],
        "positions": positions,
        "slot_mapping": slots,
        "seq_lens": seq_lens,
        "seq_rows": rows,
        "query_start_loc": torch.cat(
            [torch.zeros(1, dtype=torch.int64), ends[num_decode:] - num_decode]
        ),
        "sample_index": ends[samples] - 1,
        "sample_rows": sample_rows,
        **batch.take_updates(),
    }
    if any(pending):
        unknown = (positions >= known[seq_of_token]).nonzero().flatten()  # [num_unknown]
        order_list = order.tolist()
        owners = [scheduled[order_list[s]][0] for s in seq_of_token[unknown].tolist()]
        parts["pending_dst"] = unknown
        parts["pending_src"] = _sample_index_in(previous, owners)
    requests = [batch.row_state[row].request for row in sample_rows.tolist()]
    sampling = _plan_sampling(batch, sample_rows, requests, parts)
    return HostStep(
        num_tokens=num_tokens,
        num_decode=num_decode,
        max_blocks=int(batch.num_blocks[rows].max()),
        sample_requests=requests,
        sample_rows=sample_rows,
        sample_positions=seq_lens[samples],
        sampling=sampling,
        parts=parts,
    )


def _sample_index_in(previous: HostStep | None, owners: list[Request]) -> torch.Tensor:
    """Where each owner's pending token is among the previous step's sampled ids."""
    index = {r.request_id: i for i, r in enumerate(previous.sample_requests)} if previous else {}
    missing = [r.request_id for r in owners if r.request_id not in index]
    if missing:
        raise RuntimeError(f"pending tokens of {missing} were not sampled by the step in flight")
    return torch.tensor([index[r.request_id] for r in owners], dtype=torch.int64)


def _plan_sampling(batch, sample_rows, requests, parts) -> SamplingPlan | None:
    if not requests:
        return None
    plan = plan_sampling(batch.params[sample_rows], requests)
    parts.update({f"s_{name}": index for name, index in plan.host_indices.items()})
    if plan.has_penalties:
        penalised = [requests[i] for i in plan.penalty_rows]
        parts["s_prompt_ids"] = padded_token_ids([r.prompt_token_ids for r in penalised])
        parts["s_output_ids"] = padded_token_ids([r.output_token_ids for r in penalised])
    return plan


def device_step(
    batch: InputBatch,
    host: HostStep,
    staged: dict[str, torch.Tensor],
    previous_ids: torch.Tensor | None = None,
) -> StepInputs:
    """On the device, after the copy: apply the table updates, fill in the pending tokens from
    the previous step's sampled ids (previous_ids [num_samples], still on the device), and build
    the metadata views."""
    batch.apply_updates(staged)
    if "pending_dst" in staged:
        staged["input_ids"][staged["pending_dst"]] = previous_ids[staged["pending_src"]]
    num_decode = host.num_decode
    tables = batch.device_block_table[staged["seq_rows"], : host.max_blocks]  # [num_seqs, width]
    seq_lens = staged["seq_lens"].int()
    attn = AttentionMetadata(
        slot_mapping=staged["slot_mapping"],
        num_decode_tokens=num_decode,
        decode_block_tables=tables[:num_decode],
        decode_seq_lens=seq_lens[:num_decode],
        prefill_block_tables=tables[num_decode:],
        prefill_query_start_loc=staged["query_start_loc"].int(),
        prefill_seq_lens=seq_lens[num_decode:],
    )
    return StepInputs(
        input_ids=staged["input_ids"],
        positions=staged["positions"],
        attn=attn,
        sample_index=staged["sample_index"],
        sample_rows=staged["sample_rows"],
        staged=staged,
    )

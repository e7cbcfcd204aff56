"""A step's inputs: gathered on the host from the persistent batch by tensor ops, staged into one
int64 host buffer (pinned on CUDA) and moved to the device in one non-blocking copy; the sampled
ids come back in one copy. `copy_to_device` and `copy_to_host` are the only places that move
step data across, so a test can count them. The flat batch is laid out decodes first (sorted by
length, so that the CPU path groups similar lengths), then prefill chunks in scheduling order.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from runtime.models.attention import AttentionMetadata
from runtime.sampling.plan import (
    NUM_PARAMS,
    SamplingIndices,
    SamplingPlan,
    padded_token_ids,
    plan_sampling,
)
from runtime.step.input_batch import InputBatch
from scheduler.request import Request

_LAST = 1 << 62  # sort key that puts prefill chunks after every decode


@dataclass
class StepTensors:
    """The tensors a step stages, int64 (float64 carried bit for bit): host tensors before the
    copy, views of the device buffer after it."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    seq_lens: torch.Tensor  # [num_seqs]
    seq_rows: torch.Tensor  # [num_seqs] rows of the persistent batch
    query_start_loc: torch.Tensor  # [num_prefill_seqs + 1]
    sample_index: torch.Tensor  # [num_samples] token of each sampling row in the flat batch
    sample_rows: torch.Tensor  # [num_samples]
    block_cells: torch.Tensor  # [3, num_cells] (row, column, block id) of the new table cells
    param_rows: torch.Tensor  # [num_new_rows] rows whose sampling settings are new
    param_values: torch.Tensor  # [num_new_rows, NUM_PARAMS] float64
    sampling: SamplingIndices
    pending_dst: torch.Tensor | None = None  # [num_pending] tokens not known to the host ...
    pending_src: torch.Tensor | None = None  # ... taken from the previous step's sampled ids
    # speculative decoding: the k + 1 tokens of each drafted row whose logits are verified
    verify_index: torch.Tensor | None = None  # [sum(k_i + 1)]
    decode_token_seqs: torch.Tensor | None = None  # [num_decode_tokens] sequence of each


@dataclass
class HostStep:
    """What the host knows about a step."""

    num_tokens: int
    num_decode: int
    max_blocks: int
    sample_request_ids: list[str]
    has_grammar: bool  # some sampling row is constrained
    sampling: SamplingPlan | None
    tensors: StepTensors
    verify_request_ids: list[str] = dataclasses.field(default_factory=list)  # drafted rows


@dataclass
class StepInputs:
    """The device side of a step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    staged: StepTensors


def prepare_host_step(
    batch: InputBatch,
    scheduled: list[tuple[Request, int]],
    block_size: int,
    previous: HostStep | None = None,
    drafts: dict[str, list[int]] | None = None,
) -> HostStep:
    """previous: the launched step whose sampled tokens have not landed yet (async
    scheduling); a scheduled token the host does not know is one of them. drafts: speculative
    drafts of steady decodes (in the batch's token table after their rows' tokens): such a
    row stays a decode row of k + 1 query positions, each attending as a decode of its own
    (the arithmetic of k = 0, so that verified tokens round as plain decodes do).

    In numpy, as the batch's host tables are: a step's few dozen index operations on a handful
    of rows took 0.5 ms a step as torch calls (SmolLM2's batch-1 step: 8 ms), numpy's cost a
    tenth of that; the tensors staged are made from the arrays at the end."""
    num_seqs = len(scheduled)
    rows = np.fromiter((batch.row_of(r.request_id) for r, _ in scheduled), np.int64, num_seqs)
    num_new = np.fromiter((n for _, n in scheduled), np.int64, num_seqs)
    computed = np.fromiter((r.num_computed_tokens for r, _ in scheduled), np.int64, num_seqs)
    known = batch.num_tokens[rows]  # [num_seqs] tokens in the host table
    pending = [r.num_pending_tokens for r, _ in scheduled]
    total = known + np.array(pending, dtype=np.int64) if any(pending) else known
    is_decode = (num_new == 1) & (computed == total - 1)
    num_drafts = _num_drafts(scheduled, drafts)  # [num_seqs] or None
    if num_drafts is not None:
        num_new = num_new + num_drafts
    order = np.argsort(np.where(is_decode, computed, _LAST), kind="stable")
    rows, num_new, computed = rows[order], num_new[order], computed[order]
    known, total = known[order], total[order]
    seq_lens = computed + num_new  # [num_seqs]
    ends = np.cumsum(num_new)  # [num_seqs] end of each sequence's tokens in the flat batch
    num_tokens = int(ends[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), num_new)  # [num_tokens]
    positions = np.arange(num_tokens) - (ends - num_new)[seq_of_token] + computed[seq_of_token]
    token_rows = rows[seq_of_token]
    slots = batch.block_table[token_rows, positions // block_size] * block_size
    slots += positions % block_size
    num_decode = int(is_decode.sum())  # sequences
    num_decode_tokens = int(ends[num_decode - 1]) if num_decode else 0
    samples = np.flatnonzero(seq_lens == total)  # [num_samples]
    sample_rows = rows[samples]
    sample_states = [batch.row_state[row] for row in sample_rows.tolist()]
    sample_ids = [state.request_id for state in sample_states]
    plan, sampling = _plan_sampling(batch, sample_rows, sample_ids)
    updates = batch.take_updates()
    tensors = StepTensors(
        input_ids=_tensor(batch.token_ids[token_rows, positions]),
        positions=_tensor(positions),
        slot_mapping=_tensor(slots),
        seq_lens=_tensor(seq_lens),
        seq_rows=_tensor(rows),
        query_start_loc=_tensor(np.concatenate([[0], ends[num_decode:] - num_decode_tokens])),
        sample_index=_tensor(ends[samples] - 1),
        sample_rows=_tensor(sample_rows),
        block_cells=_tensor(np.array(updates.block_cells, dtype=np.int64).reshape(-1, 3).T),
        param_rows=_tensor(np.array(updates.param_rows, dtype=np.int64)),
        param_values=_tensor(np.array(updates.params, dtype=np.float64).reshape(-1, NUM_PARAMS)),
        sampling=sampling,
    )
    if num_decode_tokens != num_decode:
        tensors.decode_token_seqs = _tensor(seq_of_token[:num_decode_tokens])
    verify_ids = []
    if num_drafts is not None:
        num_drafts = num_drafts[order]
        verify_index, verify_ids = _verify_index(ends, num_drafts, order, scheduled)
        tensors.verify_index = _tensor(verify_index)
    if any(pending):
        unknown = positions >= known[seq_of_token]
        if num_drafts is not None:  # draft positions are known: they follow known tokens
            unknown &= positions < total[seq_of_token]
        unknown = np.flatnonzero(unknown)  # [num_unknown]
        order_list = order.tolist()
        owners = [scheduled[order_list[s]][0] for s in seq_of_token[unknown].tolist()]
        tensors.pending_dst = _tensor(unknown)
        tensors.pending_src = _sample_index_in(previous, owners)
    return HostStep(
        num_tokens=num_tokens,
        num_decode=num_decode,
        max_blocks=int(batch.num_blocks[rows].max()),
        sample_request_ids=sample_ids,
        has_grammar=any(state.has_grammar for state in sample_states),
        sampling=plan,
        tensors=tensors,
        verify_request_ids=verify_ids,
    )


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A host tensor over the array's memory (int64, or float64, or the table's int32)."""
    return torch.from_numpy(np.ascontiguousarray(array))


def _num_drafts(scheduled: list[tuple[Request, int]], drafts) -> np.ndarray | None:
    if not drafts:
        return None
    counts = [len(drafts.get(r.request_id, ())) for r, _ in scheduled]
    return np.array(counts, dtype=np.int64)


def _verify_index(ends, num_drafts, order, scheduled) -> tuple[np.ndarray, list[str]]:
    """The last k + 1 tokens of each drafted row (its last known token and its k drafts), in
    the flat batch, and the rows' request ids, in batch order."""
    drafted = np.flatnonzero(num_drafts > 0)  # [num_drafted]
    counts = num_drafts[drafted] + 1
    starts = ends[drafted] - counts
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    index = np.repeat(starts, counts) + offsets
    order_list = order.tolist()
    request_ids = [scheduled[order_list[s]][0].request_id for s in drafted.tolist()]
    return index, request_ids


def _sample_index_in(previous: HostStep | None, owners: list[Request]) -> torch.Tensor:
    """Where each owner's pending token is among the previous step's sampled ids."""
    ids = previous.sample_request_ids if previous is not None else []
    index = {request_id: i for i, request_id in enumerate(ids)}
    missing = [r.request_id for r in owners if r.request_id not in index]
    if missing:
        raise RuntimeError(f"pending tokens of {missing} were not sampled by the step in flight")
    return torch.tensor([index[r.request_id] for r in owners], dtype=torch.int64)


def _plan_sampling(batch: InputBatch, sample_rows: np.ndarray, request_ids: list[str]):
    if not request_ids:
        return None, SamplingIndices()
    seeds = [batch.row_state[row].seed for row in sample_rows.tolist()]
    plan, indices = plan_sampling(batch.params[sample_rows], request_ids, seeds)
    if plan.has_penalties:
        penalised = sample_rows[indices.penalty_rows.numpy()]
        prompts, outputs = batch.seen_token_ids(penalised.tolist())
        indices.prompt_ids = padded_token_ids(prompts)
        indices.output_ids = padded_token_ids(outputs)
    return plan, indices


def device_step(
    batch: InputBatch,
    host: HostStep,
    staged: StepTensors,
    previous_ids: torch.Tensor | None = None,
) -> StepInputs:
    """On the device, after the copy: apply the table updates, fill in the pending tokens from
    the previous step's sampled ids (previous_ids [num_samples], still on the device), and build
    the metadata views."""
    rows, columns, block_ids = staged.block_cells
    if rows.numel():
        batch.device_block_table[rows, columns] = block_ids.int()
    if staged.param_rows.numel():
        batch.device_params[staged.param_rows] = staged.param_values
    if staged.pending_dst is not None:
        staged.input_ids[staged.pending_dst] = previous_ids[staged.pending_src]
    num_decode = host.num_decode
    tables = batch.device_block_table[staged.seq_rows, : host.max_blocks]  # [num_seqs, width]
    seq_lens = staged.seq_lens.int()
    decode_tables, decode_lens = tables[:num_decode], seq_lens[:num_decode]
    if staged.decode_token_seqs is not None:  # drafted rows: a decode query per position
        decode_tables = tables[staged.decode_token_seqs]
        decode_lens = (staged.positions[: len(decode_tables)] + 1).int()
    attn = AttentionMetadata(
        slot_mapping=staged.slot_mapping,
        num_decode_tokens=len(decode_tables),
        decode_block_tables=decode_tables,
        decode_seq_lens=decode_lens,
        prefill_block_tables=tables[num_decode:],
        prefill_query_start_loc=staged.query_start_loc.int(),
        prefill_seq_lens=seq_lens[num_decode:],
    )
    return StepInputs(staged.input_ids, staged.positions, attn, staged)


# ---- the copies ---------------------------------------------------------------------------------
def copy_to_device(host: torch.Tensor, device_buffer: torch.Tensor) -> None:
    """The step's one host-to-device copy (non-blocking from pinned memory on CUDA)."""
    device_buffer.copy_(host, non_blocking=True)


def copy_to_host(device_tensor: torch.Tensor) -> PendingCopy:
    """The step's one device-to-host copy, started here (non-blocking into pinned memory on
    CUDA) and waited for by PendingCopy.result(), so the host can work in between."""
    if device_tensor.device.type != "cuda":
        return PendingCopy(device_tensor.clone(), None)
    host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)
    host.copy_(device_tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device_tensor.device))
    return PendingCopy(host, done)


@dataclass
class PendingCopy:
    host: torch.Tensor
    done: object | None  # a CUDA event, None when the copy is already complete

    def result(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


class StagingBuffer:
    """Two host buffers used in turn (the one a pending copy reads is never overwritten) and
    one device buffer that each step's tensors are views of."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.hosts = [self._host(capacity), self._host(capacity)]
        self.events: list = [None, None]
        self.device_buffer = torch.empty(capacity, dtype=torch.int64, device=device)
        self.turn = 0

    def _host(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity, dtype=torch.int64, pin_memory=self.pin)

    def stage(self, tensors):
        """tensors: a dataclass of host tensors (int64 or float64; None, nested dataclasses and
        lists of them allowed) -> the same with device views of the same shapes, after one copy."""
        leaves = _leaves(tensors, [])
        flat = [_as_int64(t).reshape(-1) for t in leaves]
        sizes = [t.numel() for t in flat]
        total = sum(sizes)
        host = self._host_for(total)
        torch.cat(flat, out=host[:total])
        if total > self.device_buffer.numel():
            self.device_buffer = torch.empty(2 * total, dtype=torch.int64, device=self.device)
        copy_to_device(host[:total], self.device_buffer[:total])
        self._record()
        views = self.device_buffer[:total].split(sizes)  # one call for every leaf's view
        return _rebuild(tensors, iter(map(_shaped_as, views, leaves)))

    def _host_for(self, total: int) -> torch.Tensor:
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer is done
        if total > self.hosts[self.turn].numel():
            self.hosts[self.turn] = self._host(2 * total)
        return self.hosts[self.turn]

    def _record(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.events[self.turn] = event


def _shaped_as(view: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A flat int64 view of the device buffer, shaped and typed as the host tensor t."""
    if t.dim() != 1:
        view = view.view(t.shape)
    return view.view(torch.float64) if t.dtype == torch.float64 else view


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _leaves(value, found: list) -> list:
    """The tensors in value (a tensor, a list, a dataclass, nested), in order, into found."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, list):
        for item in value:
            _leaves(item, found)
    elif dataclasses.is_dataclass(value):
        for name in _field_names(type(value)):
            _leaves(getattr(value, name), found)
    return found


def _rebuild(value, views):
    """The same structure as `value`, walked in `_leaves`' order, with the next of `views`
    for each tensor."""
    if isinstance(value, torch.Tensor):
        return next(views)
    if isinstance(value, list):
        return [_rebuild(item, views) for item in value]
    if dataclasses.is_dataclass(value):
        changes = {
            name: _rebuild(getattr(value, name), views) for name in _field_names(type(value))
        }
        return dataclasses.replace(value, **changes)
    return value


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float64:
        return t.contiguous().view(torch.int64)
    return t if t.dtype == torch.int64 else t.long()

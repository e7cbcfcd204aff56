"""Carries out a scheduler step on the model: swap blocks, prepare a flat ragged batch, run the
forward pass, sample. Makes no scheduling decisions."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.config import EngineConfig
from runtime.models.attention import AttentionBackend, ForwardContext
from runtime.models.cpu_kernels import int8_activations, step_kind
from runtime.models.loader import ModelSource, load_model, open_model
from runtime.sampling.plan import penalty_inputs, unpack
from runtime.sampling.sampler import Sampler
from runtime.spec.verify import RejectionSampler, VerifyRow, accept_greedy
from runtime.step.input_batch import InputBatch
from runtime.step.inputs import (
    HostStep,
    PendingCopy,
    StagingBuffer,
    StepInputs,
    copy_to_host,
    device_step,
    prepare_host_step,
)
from runtime.step.kv_cache import AUTO, KVCache, auto_kv_bytes, parse_bytes
from scheduler.output import SchedulerOutput, new_row
from scheduler.request import Request

log = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose device work is queued; `collect` waits for its sampled ids."""

    host: HostStep | None
    sampled: PendingCopy | None  # ids [num_samples], or packed ids and logprobs, on their way
    token_ids: torch.Tensor | None = None  # [num_samples] the sampled ids, on the device
    needs_host_tokens: bool = False  # its requests' next step needs these tokens on the host
    verified: dict[str, Verified] | None = None  # speculative rows, verified on the host

    @property
    def has_samples(self) -> bool:
        return self.sampled is not None


@dataclass(slots=True)
class Verified:
    """A drafted row after verification: its accepted drafts and the token after them."""

    token_ids: list[int]
    num_drafts: int
    num_accepted: int


class ModelRunner:
    def __init__(self, config: EngineConfig, model: ModelSource | Path) -> None:
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.block_size = config.block_size
        source = open_model(model)
        self.model_config = source.config
        self.backend = AttentionBackend(self.device, config.block_size, self.dtype)
        self.model = load_model(
            source,
            self.model_config,
            self.dtype,
            self.device,
            self.backend,
            config.quantization,
        )
        self.int8_activations = int8_activations(
            config.quantized_activations, type(self.model), config.dtype
        )
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.kv_cache = self._allocate_kv_cache(config)
        self.sampler = Sampler(self.model_config.vocab_size)
        self.verifier = RejectionSampler(self.model_config.vocab_size, generators=self.sampler)
        self.input_batch = InputBatch(
            config.max_num_seqs + 4,  # + 4: rows for the start-up's throw-away requests
            self.max_model_len,
            min(-(-self.max_model_len // self.block_size), self.num_gpu_blocks),
            self.device,
        )
        self.staging = StagingBuffer(self.device)
        self.grammar_masks = None  # runtime.structured.MaskBuilder, set by the engine
        self.decode_graphs = self.mixed_graphs = None  # runtime.step.cuda_graphs, CUDA only
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs(config)
        if self.device.type == "cuda":
            self.warm_up()  # Triton compiles on first use: not on the first request's time

    def _capture_graphs(self, config: EngineConfig) -> None:
        """Mixed-step graphs (token buckets) first, then the decode graphs, in one pool."""
        from runtime.step.cuda_graphs import DecodeGraphs, MixedGraphs

        width = self.input_batch.device_block_table.shape[1]
        self.mixed_graphs = MixedGraphs(
            self.model, self.kv_cache, config.max_batch_tokens, config.max_num_seqs, width
        )
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_cache, min(config.max_num_seqs, 512), width
        )
        self.decode_graphs.capture(self.mixed_graphs.capture())

    def use_grammar_masks(self, masks) -> None:
        """masks: runtime.structured.MaskBuilder, filling the constrained rows' masks while the
        forward pass runs."""
        self.grammar_masks = masks

    @property
    def bytes_per_block(self) -> int:
        mc = self.model_config
        return KVCache.bytes_per_block(
            mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype
        )

    def _blocks_in_memory(self, config: EngineConfig, swap_bytes: int) -> int:
        if config.kv_cache_memory != AUTO:
            return parse_bytes(config.kv_cache_memory) // self.bytes_per_block
        num_blocks = auto_kv_bytes(self.device, swap_bytes) // self.bytes_per_block
        most_usable = config.max_num_seqs * -(-self.max_model_len // self.block_size)
        num_blocks = min(num_blocks, most_usable)
        log.info(
            "KV cache: %d blocks (%.2f GiB) from the memory left on %s",
            num_blocks, num_blocks * self.bytes_per_block / 2**30, self.device,
        )  # fmt: skip
        return num_blocks

    def _allocate_kv_cache(self, config: EngineConfig) -> KVCache:
        mc = self.model_config
        swap_bytes = int(config.swap_space * 2**30)
        num_cpu_blocks = swap_bytes // self.bytes_per_block
        num_blocks = config.num_kv_blocks or self._blocks_in_memory(config, swap_bytes)
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        return KVCache(
            mc.num_layers,
            num_blocks,
            num_cpu_blocks,
            self.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.gpu.shape[2]

    @property
    def num_cpu_blocks(self) -> int:
        return self.kv_cache.cpu.shape[2]

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[list[int], list]]:
        """Returns {request_id: (sampled tokens, their logprobs or None)} for requests that
        sample (one token each today)."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Swap blocks, stage the inputs (one copy), queue the forward pass and the sampling,
        and start the copy of the sampled ids back; returns without waiting for the device.
        previous: the step in flight (async scheduling), whose sampled ids this step's pending
        tokens are, taken on the device."""
        self._apply(out)
        if not out.scheduled:
            return LaunchedStep(None, None)
        before = previous.host if previous is not None else None
        host = prepare_host_step(
            self.input_batch, out.scheduled, self.block_size, before, out.draft_token_ids
        )
        staged = self.staging.stage(host.tensors)
        previous_ids = previous.token_ids if previous is not None else None
        inputs = device_step(self.input_batch, host, staged, previous_ids)
        self.backend.prepare(inputs.attn)
        mask = self._start_grammar_masks(host)  # filled on a worker while the forward runs
        drafted = bool(host.verify_request_ids)
        with self._kernel_kind(out.scheduled, len(out.scheduled) if drafted else 0):
            hidden = self._forward(inputs)  # [num_tokens, hidden]
        verified = None
        if drafted:  # scored as the logits of the same rows' samples without drafts would be
            plain_samples = len(host.sample_request_ids) + len(host.verify_request_ids)
            with self._kernel_kind((), plain_samples):  # no prompt rows among them
                verified = self._verify(hidden, host, inputs, out)
        if not host.sample_request_ids:
            return LaunchedStep(host, None, verified=verified)
        rows = hidden[inputs.staged.sample_index]  # [num_samples, hidden]: only rows that sample
        if self._can_project_greedy(host, mask):
            result = self.model.compute_greedy_tokens(rows)
        else:
            result = self._sample(self.model.compute_logits(rows), host, inputs, mask)
        return LaunchedStep(
            host,
            copy_to_host(result),
            token_ids=sampled_token_ids(result),
            needs_host_tokens=mask is not None or host.sampling.has_penalties or bool(verified),
            verified=verified,
        )

    def _verify(self, hidden, host: HostStep, inputs: StepInputs, out) -> dict[str, Verified]:
        """Score each drafted row's k + 1 positions and accept its drafts (greedy: exact;
        random: rejection sampling); waits for the device."""
        rows = hidden[inputs.staged.verify_index]  # [sum(k_i + 1), hidden]
        params = {r.request_id: r.sampling_params for r, _ in out.scheduled}
        verify_rows = [
            VerifyRow(rid, params[rid], out.draft_token_ids[rid]) for rid in host.verify_request_ids
        ]
        if self.model.greedy_projection is not None and all(
            row.params.is_greedy for row in verify_rows
        ):
            greedy_ids = self.model.compute_greedy_tokens(rows).tolist()
            results = _accept_all_greedy(verify_rows, greedy_ids)
        else:
            result = self.verifier.verify(self.model.compute_logits(rows), verify_rows)
            results = zip(result.num_accepted, result.token_ids)
        return {
            row.request_id: Verified(tokens, len(row.draft_token_ids), num_accepted)
            for row, (num_accepted, tokens) in zip(verify_rows, results)
        }

    def _apply(self, out: SchedulerOutput) -> None:
        """The scheduler's word: rows leave, join and grow (drafts after their tokens); blocks
        swap out and in."""
        self.input_batch.apply(out)
        if out.draft_token_ids:
            self.input_batch.write_drafts(out.draft_token_ids)
        for request_id in out.finished_ids:
            self.sampler.release(request_id)
        if out.blocks_to_swap_out:
            self.kv_cache.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.kv_cache.swap_in(out.blocks_to_swap_in)

    def _can_project_greedy(self, host: HostStep, mask) -> bool:
        """Every sampling row plain greedy, no logprobs, no grammar mask: the argmax of the logits
        is all the step needs, and the model finds it without writing them (native, CPU)."""
        plan = host.sampling
        return (
            self.model.greedy_projection is not None
            and mask is None
            and plan.is_plain_greedy
            and plan.max_top_n is None
        )

    def _start_grammar_masks(self, host: HostStep):
        if self.grammar_masks is None or not host.has_grammar:
            return None
        return self.grammar_masks.start(host.sample_request_ids)

    def _sample(self, logits, host: HostStep, inputs: StepInputs, mask=None) -> torch.Tensor:
        plan, indices = host.sampling, inputs.staged.sampling
        params = None  # [num_samples, P], not read where every row is plain greedy
        if not plan.is_plain_greedy:
            params = self.input_batch.device_params[inputs.staged.sample_rows]
        penalties = None
        if plan.has_penalties:
            penalties = penalty_inputs(
                params, indices.penalty_rows, indices.prompt_ids, indices.output_ids
            )
        grammar_mask = mask.result() if mask is not None else None
        return self.sampler.sample_on_device(logits, plan, params, indices, penalties, grammar_mask)

    def collect(self, step: LaunchedStep) -> dict[str, tuple[list[int], list]]:
        """Wait for a launched step's sampled ids (the step's one copy back) and hand them out."""
        tokens = {} if step.verified is None else _verified_tokens(step.verified)
        if step.sampled is None:
            return tokens
        host = step.host
        sampled = unpack(step.sampled.result(), host.sampling)
        tokens.update(
            (request_id, ([token], [logprobs]))
            for request_id, token, logprobs in zip(
                host.sample_request_ids, sampled.token_ids, sampled.logprobs
            )
        )
        return tokens

    def _kernel_kind(self, scheduled: list[tuple[Request, int]] | tuple, drafted_seqs: int):
        """quant.step_kind where the model has quantized weights (their matmuls' kernel), for
        the rows of `scheduled` (request, tokens)."""
        if not self.model.quantized_names:
            return contextlib.nullcontext()
        computes_prompt = any(r.num_computed_tokens < r.num_prompt_tokens for r, _ in scheduled)
        return step_kind(computes_prompt, drafted_seqs, self.int8_activations)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        for graphs in (self.decode_graphs, self.mixed_graphs):
            if graphs is not None and graphs.can_run(inputs.attn, inputs.input_ids.shape[0]):
                return graphs.run(inputs.input_ids, inputs.positions, inputs.attn)
        ctx = ForwardContext(inputs.attn, self.kv_cache.k_caches, self.kv_cache.v_caches)
        return self.model(inputs.input_ids, inputs.positions, ctx)

    # ---- start-up ------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Run every kernel variant a step can need once, on throw-away requests: a mixed step
        with a short decode (one decode partition), a long decode (split-K) and a prefill chunk,
        eagerly and then as a mixed graph's replay, then a decode-only step (graph replay, or
        the eager decode path)."""
        short = _warm_up_request("__warmup_short__", 8, decoding=True)
        long = _warm_up_request("__warmup_long__", 4 * 256 + 8, decoding=True)
        prefill = _warm_up_request("__warmup_prefill__", 40, decoding=False)
        batch = [(short, 1), (long, 1), (prefill, 40)]
        if not self._assign_warm_up_blocks(batch):
            batch = [(short, 1), (prefill, 40)]  # a small cache: no long decode
            if not self._assign_warm_up_blocks(batch):
                return
        mixed_graphs, self.mixed_graphs = self.mixed_graphs, None
        joining = [new_row(request) for request, _ in batch]
        try:  # the eager decode and prefill kernels
            self.execute(SchedulerOutput(scheduled=batch, new_rows=joining))
        finally:
            self.mixed_graphs = mixed_graphs
        if mixed_graphs is not None:
            self.execute(SchedulerOutput(scheduled=batch))  # replays a mixed graph
        self.execute(SchedulerOutput(scheduled=[(short, 1)]))
        self._forget([request for request, _ in batch])

    def _forget(self, throw_away: list[Request]) -> None:
        self.execute(SchedulerOutput(finished_ids=[r.request_id for r in throw_away]))

    def _assign_warm_up_blocks(self, batch: list[tuple[Request, int]]) -> bool:
        next_block = 0
        for request, _ in batch:
            num_blocks = -(-(request.num_tokens + 1) // self.block_size)
            request.block_ids = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
        return next_block <= self.num_gpu_blocks

    # ---- start-up measurements for the preemption cost model --------------------------------
    def measure_prefill_rate(self, num_tokens: int = 64) -> float:
        """Tokens/s of a prefill on the real model, using a throw-away request on block 0..n."""
        num_tokens = min(num_tokens, self.input_batch.max_model_len - 1)  # the batch's row width
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.num_gpu_blocks:
            return 1e4
        request = Request("__warmup__", list(range(1, num_tokens + 1)))
        request.block_ids = list(range(num_blocks))
        self.execute(SchedulerOutput([(request, num_tokens)], new_rows=[new_row(request)]))
        start = time.perf_counter()  # the second run: warmed up
        self.execute(SchedulerOutput([(request, num_tokens)]))
        self._forget([request])
        return num_tokens / max(time.perf_counter() - start, 1e-9)


def _accept_all_greedy(rows: list[VerifyRow], greedy_ids: list[int]) -> list[tuple[int, list]]:
    results, offset = [], 0
    for row in rows:
        end = offset + len(row.draft_token_ids) + 1
        results.append(accept_greedy(row.draft_token_ids, greedy_ids[offset:end]))
        offset = end
    return results


def _verified_tokens(verified: dict[str, Verified]) -> dict[str, tuple[list[int], list]]:
    return {rid: (v.token_ids, [None] * len(v.token_ids)) for rid, v in verified.items()}


def sampled_token_ids(result: torch.Tensor) -> torch.Tensor:
    """The sampler's result (ids, or ids packed with logprobs) -> ids [num_samples] int64."""
    return result if result.dtype == torch.int64 else result[:, 0].long()


def _warm_up_request(request_id: str, num_prompt: int, decoding: bool) -> Request:
    """A throw-away request, either about to decode (its prompt and one output token in the
    cache but the last) or about to prefill its prompt."""
    request = Request(request_id, [1 + i % 100 for i in range(num_prompt)])
    if decoding:
        request.output_token_ids = [1]
        request.num_computed_tokens = num_prompt
    return request

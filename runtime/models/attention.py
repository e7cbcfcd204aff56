"""One attention interface over the paged KV cache: torch references on CPU, Triton on CUDA.

A step's batch is laid out decodes first, then prefill chunks:
  tokens [0, num_decode_tokens)           one query per decoding sequence (a sequence with k
                                          drafts: k + 1, each with its own seq_len)
  tokens [num_decode_tokens, num_tokens)  prompt chunks, ragged, described by query_start_loc
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from kernels import native, reference
from kernels.dispatch import get_kernels

NATIVE_DECODE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class PrefillPart:
    """CPU path: some of a step's prefill sequences, attended together. token_index: their
    tokens among the step's prefill tokens (None: all of them, in order)."""

    token_index: torch.Tensor | None
    plan: reference.CausalPlan | reference.PagedPlan


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_seqs, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decode_seqs] int32
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefill_seqs + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefill_seqs] int32
    # CPU path, built once per step and shared by all layers: decodes in groups of similar length
    # (the runner sorts them by length) so that few keys are padded
    decode_plans: list[tuple[int, int, reference.PagedPlan]] | None = None
    prefill_parts: list[PrefillPart] | None = None
    # CPU path: (decode_plans, prefill_parts) of each sliding window, built by its first layer
    windowed_plans: dict[int, tuple] = field(default_factory=dict)

    @property
    def num_prefill_seqs(self) -> int:
        return int(self.prefill_seq_lens.numel())


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the token ids: scoped to one step."""

    attn: AttentionMetadata
    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    # CPU path: this step's cos/sin rows of each rope table ("global", "local")
    rope: dict[str, reference.RotaryPlan] = field(default_factory=dict)


class AttentionBackend:
    """Kernels for one device; `prepare` runs once per step, `forward` once per layer."""

    def __init__(
        self, device: torch.device, block_size: int, dtype: torch.dtype = torch.float32
    ) -> None:
        self.block_size = block_size
        self.use_triton = device.type == "cuda"
        self.kernels = get_kernels(device)
        # the native decode where it runs this dtype; else the reference's planned groups
        use_native = not self.use_triton and dtype in NATIVE_DECODE_DTYPES
        self.native = native.native_ops() if use_native else None

    def prepare(self, attn: AttentionMetadata) -> None:
        if not self.use_triton:
            attn.decode_plans, attn.prefill_parts = self._plans(attn, None)

    def _plans(self, attn: AttentionMetadata, window: int | None) -> tuple:
        """(decode plans, prefill parts) of the CPU path for keys masked to `window`."""
        decode_plans = prefill_parts = None
        if attn.num_decode_tokens and self.native is None:
            decode_plans = [
                (start, end, self._decode_plan(attn, start, end, window))
                for start, end in length_groups(attn.decode_seq_lens.tolist())
            ]
        if attn.num_prefill_seqs:
            prefill_parts = self._prefill_parts(attn, window)
        return decode_plans, prefill_parts

    def _plans_of_window(self, attn: AttentionMetadata, window: int | None) -> tuple:
        """A window longer than every sequence of the step hides nothing: the plain plans."""
        if window is None:
            return attn.decode_plans, attn.prefill_parts
        if window not in attn.windowed_plans:
            hides_keys = window < _longest_seq(attn)
            plans = self._plans(attn, window) if hides_keys else None
            attn.windowed_plans[window] = plans or (attn.decode_plans, attn.prefill_parts)
        return attn.windowed_plans[window]

    def _decode_plan(
        self, attn: AttentionMetadata, start: int, end: int, window: int | None
    ) -> reference.PagedPlan:
        qsl = torch.arange(end - start + 1, dtype=torch.int32)
        tables = attn.decode_block_tables[start:end]
        return reference.prepare_paged_plan(
            tables, qsl, attn.decode_seq_lens[start:end], self.block_size, window
        )

    def _prefill_parts(self, attn: AttentionMetadata, window: int | None) -> list[PrefillPart]:
        """First chunks (the query is the whole sequence so far) go in groups of similar length
        through the causal path; chunks with cached keys before them (a continued prompt, a
        prefix-cache hit) in groups of similar context length through the paged one."""
        starts = attn.prefill_query_start_loc.tolist()
        q_lens = [end - start for start, end in zip(starts, starts[1:])]
        seq_lens = attn.prefill_seq_lens.tolist()
        first = sorted(
            (s for s in range(len(q_lens)) if q_lens[s] == seq_lens[s]), key=q_lens.__getitem__
        )
        later = sorted(
            (s for s in range(len(q_lens)) if q_lens[s] != seq_lens[s]), key=seq_lens.__getitem__
        )
        parts = [
            self._causal_part(first[i:j], starts, q_lens, window)
            for i, j in length_groups([q_lens[s] for s in first], min_group=1)
        ]
        parts += [
            self._paged_part(attn, later[i:j], starts, q_lens, window)
            for i, j in length_groups([seq_lens[s] for s in later], min_group=1)
        ]
        if len(parts) == 1 and _in_order(parts[0].token_index, starts[-1]):
            parts[0].token_index = None
        return parts

    def _causal_part(self, seqs, starts, q_lens, window: int | None) -> PrefillPart:
        plan = reference.prepare_causal_plan([q_lens[s] for s in seqs], window)
        return PrefillPart(_token_index(seqs, starts, q_lens), plan)

    def _paged_part(self, attn: AttentionMetadata, seqs, starts, q_lens, window) -> PrefillPart:
        rows = torch.tensor(seqs)
        query_start_loc = [0, *accumulate(q_lens[s] for s in seqs)]
        plan = reference.prepare_paged_plan(
            attn.prefill_block_tables[rows],
            torch.tensor(query_start_loc, dtype=torch.int32),
            attn.prefill_seq_lens[rows],
            self.block_size,
            window,
        )
        return PrefillPart(_token_index(seqs, starts, q_lens), plan)

    def prepare_rotary(
        self, ctx: ForwardContext, positions, cos_sin_cache, dtype, table: str = "global"
    ) -> None:
        if not self.use_triton:
            ctx.rope[table] = self.kernels.prepare_rotary(positions, cos_sin_cache, dtype)

    def rotary(self, ctx: ForwardContext, positions, q, k, cos_sin_cache, table: str = "global"):
        if table in ctx.rope:
            return self.kernels.rotary_with_plan(q, k, ctx.rope[table])
        return self.kernels.rotary_embedding(positions, q, k, cos_sin_cache)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim].
        sliding_window: a query at position p sees the keys at positions > p - sliding_window
        (None: all keys up to p)."""
        self.kernels.store_kvcache(k, v, k_cache, v_cache, attn.slot_mapping)
        num_decode = attn.num_decode_tokens
        window = sliding_window
        if not attn.num_prefill_seqs:
            return self._decode(q, k_cache, v_cache, attn, scale, window)
        prefill = (q[num_decode:], k[num_decode:], v[num_decode:])
        if not num_decode:
            return self._prefill(*prefill, k_cache, v_cache, attn, scale, window)
        out = torch.empty_like(q)
        out[:num_decode] = self._decode(q[:num_decode], k_cache, v_cache, attn, scale, window)
        out[num_decode:] = self._prefill(*prefill, k_cache, v_cache, attn, scale, window)
        return out

    def _decode(self, q, k_cache, v_cache, attn: AttentionMetadata, scale: float, window=None):
        tables, seq_lens = attn.decode_block_tables, attn.decode_seq_lens
        if self.native is not None:
            return self.native.paged_attention_decode(
                q, k_cache, v_cache, tables, seq_lens, scale, window or 0
            )
        decode_plans = None if self.use_triton else self._plans_of_window(attn, window)[0]
        if decode_plans is not None:
            parts = [
                reference.paged_attention_with_plan(q[start:end], k_cache, v_cache, plan, scale)
                for start, end, plan in decode_plans
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.kernels.paged_attention_decode(
            q, k_cache, v_cache, tables, seq_lens, scale, sliding_window=window
        )

    def _prefill(self, q, k, v, k_cache, v_cache, attn: AttentionMetadata, scale, window=None):
        """q: [num_prefill_tokens, num_heads, head_dim]; k/v: this step's keys and values of
        the same tokens (already in the cache)."""
        parts = None if self.use_triton else self._plans_of_window(attn, window)[1]
        if parts is not None:
            if parts[0].token_index is None:
                return _attend_part(q, k, v, k_cache, v_cache, parts[0].plan, scale)
            out = torch.empty_like(q)
            for part in parts:
                i = part.token_index
                out[i] = _attend_part(q[i], k[i], v[i], k_cache, v_cache, part.plan, scale)
            return out
        return self.kernels.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            attn.prefill_block_tables,
            attn.prefill_query_start_loc,
            attn.prefill_seq_lens,
            scale,
            sliding_window=window,
        )


def _longest_seq(attn: AttentionMetadata) -> int:
    lens = [attn.decode_seq_lens, attn.prefill_seq_lens]
    return max((int(x.max()) for x in lens if x.numel()), default=0)


def _attend_part(q, k, v, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
    if isinstance(plan, reference.CausalPlan):
        return reference.causal_attention_with_plan(q, k, v, plan, scale)
    return reference.paged_attention_with_plan(q, k_cache, v_cache, plan, scale)


def _token_index(seqs: list[int], starts: list[int], q_lens: list[int]) -> torch.Tensor:
    """Indices of the tokens of `seqs` (in that order) among the step's prefill tokens."""
    return torch.cat([torch.arange(starts[s], starts[s] + q_lens[s]) for s in seqs])


def _in_order(index: torch.Tensor, num_tokens: int) -> bool:
    return index.numel() == num_tokens and bool((index == torch.arange(num_tokens)).all())


def length_groups(
    seq_lens: list[int], min_group: int = 16, max_padding: float = 0.25
) -> list[tuple[int, int]]:
    """Split sorted sequence lengths into [start, end) groups whose padded keys (to the group's
    longest) stay under `max_padding` of the real ones; groups hold at least `min_group`."""
    groups, start = [], 0
    while start < len(seq_lens):
        end = min(start + min_group, len(seq_lens))
        while end < len(seq_lens) and _padding(seq_lens[start : end + 1]) <= max_padding:
            end += 1
        groups.append((start, end))
        start = end
    return groups


def _padding(lens: list[int]) -> float:
    return (max(lens) * len(lens) - sum(lens)) / max(sum(lens), 1)

"""One attention interface over the paged KV cache: torch references on CPU, Triton on CUDA.

A step's batch is laid out decodes first, then prefill chunks:
  tokens [0, num_decode_tokens)           one query per decoding sequence
  tokens [num_decode_tokens, num_tokens)  prompt chunks, ragged, described by query_start_loc
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference


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
    prefill_plan: reference.PagedPlan | None = None

    @property
    def num_prefill_seqs(self) -> int:
        return int(self.prefill_seq_lens.numel())


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the token ids: scoped to one step."""

    attn: AttentionMetadata
    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    rope: reference.RotaryPlan | None = None  # CPU path: this step's cos/sin rows


class AttentionBackend:
    """Kernels for one device; `prepare` runs once per step, `forward` once per layer."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.block_size = block_size
        self.use_triton = device.type == "cuda"
        if self.use_triton:
            from kernels.dispatch import get_kernels

            self.kernels = get_kernels(device)
        else:
            self.kernels = reference

    def prepare(self, attn: AttentionMetadata) -> None:
        if self.use_triton:
            return
        if attn.num_decode_tokens:
            attn.decode_plans = [
                (start, end, self._decode_plan(attn, start, end))
                for start, end in decode_groups(attn.decode_seq_lens.tolist())
            ]
        if attn.num_prefill_seqs:
            attn.prefill_plan = reference.prepare_paged_plan(
                attn.prefill_block_tables,
                attn.prefill_query_start_loc,
                attn.prefill_seq_lens,
                self.block_size,
            )

    def _decode_plan(self, attn: AttentionMetadata, start: int, end: int) -> reference.PagedPlan:
        qsl = torch.arange(end - start + 1, dtype=torch.int32)
        tables = attn.decode_block_tables[start:end]
        return reference.prepare_paged_plan(
            tables, qsl, attn.decode_seq_lens[start:end], self.block_size
        )

    def prepare_rotary(self, ctx: ForwardContext, positions, cos_sin_cache, dtype) -> None:
        if not self.use_triton:
            ctx.rope = reference.prepare_rotary(positions, cos_sin_cache, dtype)

    def rotary(self, ctx: ForwardContext, positions, q, k, cos_sin_cache):
        if ctx.rope is not None:
            return reference.rotary_with_plan(q, k, ctx.rope)
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
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]."""
        self.kernels.store_kvcache(k, v, k_cache, v_cache, attn.slot_mapping)
        num_decode = attn.num_decode_tokens
        if not attn.num_prefill_seqs:
            return self._decode(q, k_cache, v_cache, attn, scale)
        if not num_decode:
            return self._prefill(q, k_cache, v_cache, attn, scale)
        out = torch.empty_like(q)
        out[:num_decode] = self._decode(q[:num_decode], k_cache, v_cache, attn, scale)
        out[num_decode:] = self._prefill(q[num_decode:], k_cache, v_cache, attn, scale)
        return out

    def _decode(self, q, k_cache, v_cache, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        if attn.decode_plans is not None:
            parts = [
                reference.paged_attention_with_plan(q[start:end], k_cache, v_cache, plan, scale)
                for start, end, plan in attn.decode_plans
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.kernels.paged_attention_decode(
            q, k_cache, v_cache, attn.decode_block_tables, attn.decode_seq_lens, scale
        )

    def _prefill(self, q, k_cache, v_cache, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        if attn.prefill_plan is not None:
            return reference.paged_attention_with_plan(
                q, k_cache, v_cache, attn.prefill_plan, scale
            )
        return self.kernels.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            attn.prefill_block_tables,
            attn.prefill_query_start_loc,
            attn.prefill_seq_lens,
            scale,
        )


def decode_groups(
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

"""Pure-torch references of the kernels: the CPU path of the engine and the oracle of the Triton tests.

Shapes follow the Triton kernels exactly:
  key/value:     [num_tokens, num_kv_heads, head_dim]
  k/v cache:     [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables:  [num_seqs, max_blocks] int32 (entries past a sequence's end are ignored)
  seq_lens:      [num_seqs] int32, tokens in the cache for each sequence, the current ones included
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key/value into its cache slot; slot -1 means skip (CUDA-graph padding)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    slots = slot_mapping.long()
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value)


@dataclass
class PagedPlan:
    """Index and mask tensors for one attention call; shared by all layers of one step."""

    block_ids: torch.Tensor  # [num_seqs * blocks_per_seq] blocks to gather (past the end: block 0)
    mask: torch.Tensor  # [num_seqs, 1, max_q_len, max_kv_len] bool, True = attend
    token_rows: torch.Tensor  # [num_tokens] row of each query in the padded [num_seqs*max_q_len]
    num_seqs: int
    max_q_len: int
    max_kv_len: int
    _folded_masks: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def folded_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (0 or -inf) for `group` query heads folded into the query axis (see
        paged_attention_with_plan): [num_seqs, 1, group * max_q_len, max_kv_len], built once
        per step, not once per layer (SDPA would convert a bool mask on every call)."""
        key = (group, dtype)
        if key not in self._folded_masks:
            mask = self.mask if self.max_q_len == 1 else self.mask.repeat(1, 1, group, 1)
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._folded_masks[key] = additive.masked_fill_(~mask, float("-inf"))
        return self._folded_masks[key]


def _gather_block_ids(
    block_tables: torch.Tensor, first_blocks: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Whole blocks are gathered (one memcpy each), sequence s's from its table column
    first_blocks[s] on; table entries past a sequence's end are never trusted: they become
    block 0, whose keys the mask hides."""
    kv_lens = seq_lens - first_blocks * block_size
    blocks_per_seq = (int(kv_lens.max()) + block_size - 1) // block_size
    columns = first_blocks[:, None] + torch.arange(blocks_per_seq, device=block_tables.device)
    in_use = columns * block_size < seq_lens[:, None]
    columns = columns.clamp(max=block_tables.shape[1] - 1)
    tables = block_tables.gather(1, columns).long()
    return torch.where(in_use, tables, 0).flatten()


def prepare_paged_plan(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> PagedPlan:
    """Plan for a ragged batch: sequence s owns queries query_start_loc[s]:query_start_loc[s+1],
    which are its last q_len positions (causal over the cached prefix plus the chunk; with a
    sliding window, a query at position p sees only the keys at positions > p - window, and
    blocks before the first query's window are not gathered)."""
    device = block_tables.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_lens = seq_lens.long()
    num_seqs = int(seq_lens.numel())
    max_q_len = int(q_lens.max())
    first_blocks = torch.zeros_like(seq_lens)
    if sliding_window is not None:
        first_key = (seq_lens - q_lens - sliding_window + 1).clamp(min=0)
        first_blocks = first_key // block_size
    k_start = first_blocks * block_size  # [num_seqs] position of each sequence's key 0
    max_kv_len = int((seq_lens - k_start).max())
    q_index = torch.arange(max_q_len, device=device)
    q_pos = (seq_lens - q_lens)[:, None] + q_index  # [num_seqs, max_q_len]
    k_pos = k_start[:, None] + torch.arange(max_kv_len, device=device)  # [num_seqs, max_kv_len]
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    # padded query rows attend to their first key only, so their softmax stays finite; they
    # are dropped
    pad_rows = q_index[None, :] >= q_lens[:, None]
    mask = torch.where(pad_rows[:, :, None], (k_pos == k_start[:, None])[:, None, :], mask)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    index_in_seq = (
        torch.arange(int(q_lens.sum()), device=device) - query_start_loc[:-1].long()[seq_of_token]
    )
    return PagedPlan(
        block_ids=_gather_block_ids(block_tables, first_blocks, seq_lens, block_size),
        mask=mask[:, None],
        token_rows=seq_of_token * max_q_len + index_in_seq,
        num_seqs=num_seqs,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
    )


def paged_attention_with_plan(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedPlan, scale: float
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    Grouped-query attention is folded into the query axis: the `group` query heads that share a
    kv head become `group` x max_q_len query rows of that kv head, so keys and values are never
    repeated per query head (SDPA's enable_gqa path on CPU is 3x slower here)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = _gather(k_cache, plan)  # [num_seqs, num_kv_heads, max_kv_len, head_dim], strided
    v = _gather(v_cache, plan)
    q_padded = _fold_queries(q, plan, num_kv_heads, group)
    out = F.scaled_dot_product_attention(
        q_padded, k, v, attn_mask=plan.folded_mask(group, q.dtype), scale=scale
    )  # [num_seqs, num_kv_heads, group * max_q_len, head_dim]
    return _unfold_outputs(out, plan, num_heads, group)


def _fold_queries(q: torch.Tensor, plan: PagedPlan, num_kv_heads: int, group: int) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] -> [num_seqs, num_kv_heads, group * max_q_len, head_dim]
    with row g * max_q_len + i holding query head (kv_head * group + g) of the i-th token."""
    head_dim = q.shape[-1]
    if plan.max_q_len == 1:
        return q.reshape(plan.num_seqs, num_kv_heads, group, head_dim)
    q_rows = q.new_zeros(plan.num_seqs * plan.max_q_len, q.shape[1], head_dim)
    q_rows[plan.token_rows] = q
    q_rows = q_rows.view(plan.num_seqs, plan.max_q_len, num_kv_heads, group, head_dim)
    return q_rows.permute(0, 2, 3, 1, 4).reshape(
        plan.num_seqs, num_kv_heads, group * plan.max_q_len, head_dim
    )


def _unfold_outputs(out: torch.Tensor, plan: PagedPlan, num_heads: int, group: int) -> torch.Tensor:
    num_seqs, num_kv_heads, _, head_dim = out.shape
    if plan.max_q_len == 1:
        return out.reshape(num_seqs, num_heads, head_dim)
    out = out.view(num_seqs, num_kv_heads, group, plan.max_q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs * plan.max_q_len, num_heads, head_dim)[plan.token_rows]


@dataclass
class CausalPlan:
    """Sequences whose query is their whole context so far (a first prompt chunk): their keys
    are the step's own keys, so the cache is not read, and right-padded to the longest they
    meet SDPA's is_causal, which skips the masked half instead of computing it."""

    token_rows: torch.Tensor  # [num_tokens] row of each token in the padded [num_seqs * max_len]
    num_seqs: int
    max_len: int
    # with a sliding window: [max_len, max_len] bool, True = attend (is_causal cannot say it)
    window_mask: torch.Tensor | None = None
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """0 / -inf form of window_mask, built once per step and dtype, not once per layer."""
        if self.window_mask is None:
            return None
        if dtype not in self._additive:
            additive = torch.zeros(self.window_mask.shape, dtype=dtype)
            self._additive[dtype] = additive.masked_fill_(~self.window_mask, float("-inf"))
        return self._additive[dtype]


def prepare_causal_plan(q_lens: list[int], sliding_window: int | None = None) -> CausalPlan:
    """q_lens: tokens of each sequence, laid out one sequence after the other; token t of a
    sequence attends its tokens (t - sliding_window, t] (no window: [0, t])."""
    max_len = max(q_lens)
    rows = [seq * max_len + i for seq, q_len in enumerate(q_lens) for i in range(q_len)]
    window_mask = None
    if sliding_window is not None and sliding_window < max_len:
        pos = torch.arange(max_len)
        diff = pos[:, None] - pos[None, :]  # query - key
        window_mask = (diff >= 0) & (diff < sliding_window)
    return CausalPlan(torch.tensor(rows), len(q_lens), max_len, window_mask)


def causal_attention_with_plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CausalPlan, scale: float
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]
    -> [num_tokens, num_heads, head_dim]; token t of a sequence attends its tokens 0..t."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    mask = plan.additive_mask(q.dtype)
    out = F.scaled_dot_product_attention(
        _pad_sequences(q, plan),
        _pad_sequences(k, plan),
        _pad_sequences(v, plan),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=group > 1,
    )  # [num_seqs, num_heads, max_len, head_dim]; padded query rows are dropped below
    out = out.transpose(1, 2).reshape(plan.num_seqs * plan.max_len, num_heads, head_dim)
    return out[plan.token_rows]


def _pad_sequences(x: torch.Tensor, plan: CausalPlan) -> torch.Tensor:
    """[num_tokens, heads, head_dim] -> [num_seqs, heads, max_len, head_dim], zeros past the end."""
    rows = x.new_zeros(plan.num_seqs * plan.max_len, *x.shape[1:])
    rows[plan.token_rows] = x
    return rows.view(plan.num_seqs, plan.max_len, *x.shape[1:]).transpose(1, 2)


def _gather(cache: torch.Tensor, plan: PagedPlan) -> torch.Tensor:
    """A strided view, not a copy: SDPA reads [seq, kv_head, position, dim] with positions
    num_kv_heads * head_dim apart as fast as a contiguous tensor, and a copy would cost more."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.view(num_blocks, -1).index_select(0, plan.block_ids)
    seqs = blocks.view(plan.num_seqs, -1, num_kv_heads, head_dim)[:, : plan.max_kv_len]
    return seqs.transpose(1, 2)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    plan = prepare_paged_plan(
        block_tables, query_start_loc, seq_lens, k_cache.shape[1], sliding_window
    )
    return paged_attention_with_plan(q, k_cache, v_cache, plan, scale)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim], one query per sequence at position seq_len - 1."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_prefill(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual) * weight, x + residual); residual None means zero.
    Normalises in float32 like HF Llama, then casts back to x's dtype before the weight."""
    if residual is not None:
        x = x + residual
    residual = x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), residual


def silu_and_mul(both: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP's middle: both [..., 2 i] -> silu(gate) * up [..., i], gate and up its halves."""
    gate, up = both.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_in_float32(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    rms_norm=rms_norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's norm over rows in a narrower dtype: x + residual in x's dtype, then normalised and
    multiplied by weight (float32: its 1 + w) in float32 by `rms_norm`, rounded once to x's
    dtype (Gemma's reference: (1 + w) in bfloat16 would round w away)."""
    if residual is not None:
        x = x + residual
    out, _ = rms_norm(x.float(), weight, eps)
    return out.to(x.dtype), x


@dataclass
class RotaryPlan:
    """cos/sin rows of one step's positions in the activations' dtype (as HF Llama casts them);
    shared by all layers."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim]: cos, cos
    sin: torch.Tensor  # [num_tokens, 1, head_dim]: -sin, sin


def prepare_rotary(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> RotaryPlan:
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)
    return RotaryPlan(
        torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)
    )


def rotary_with_plan(
    q: torch.Tensor, k: torch.Tensor, plan: RotaryPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, plan), _rotate(k, plan)


def _rotate(x: torch.Tensor, plan: RotaryPlan) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * plan.cos + torch.cat((x2, x1), dim=-1) * plan.sin


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE (rotate halves), as HF Llama. q: [num_tokens, num_heads, head_dim],
    k: [num_tokens, num_kv_heads, head_dim], cos_sin_cache: [max_position, head_dim] float32
    holding cos in the first half and sin in the second."""
    return rotary_with_plan(q, k, prepare_rotary(positions, cos_sin_cache, q.dtype))


def greedy_projection(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden: [num_rows, hidden_size], weight: [vocab, hidden_size] -> [num_rows] int64, the
    first index of each row's largest logit, the logits in hidden's dtype (as the model's
    compute_logits returns them before the sampler widens them)."""
    return F.linear(hidden, weight).float().argmax(dim=-1)

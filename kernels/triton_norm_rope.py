"""Fused RMSNorm (with residual add) and NeoX rotary embedding in Triton.

Both compute in float32 from values upcast right after loading (bf16 arithmetic is wrong under
Triton's interpreter) and round where the torch references round, so they match them bit for bit
on a GPU up to float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden
):
    # one program per row; out and residual_out are contiguous [num_rows, hidden]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the sum in x's dtype
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # cast back before weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (weight * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual) * weight, x + residual); residual None means zero.
    x, residual: [..., hidden] with contiguous rows; weight: [hidden]."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous() and x.stride(-1) == 1
    x_rows = x.reshape(-1, hidden)  # [num_rows, hidden]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual_rows = residual.reshape(-1, hidden)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        residual_rows, residual_out = x_rows, x
    if x_rows.shape[0] == 0:
        return out, residual_out
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows, residual_rows, weight, out, residual_out,
        x_rows.stride(0), residual_rows.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        num_warps=4 if hidden <= 4096 else 8,
    )  # fmt: skip
    return out, residual_out


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    token_stride,
    head_stride,
    cos,  # [1, HALF_PAD] float32
    sin,
    half_mask,  # [1, HALF_PAD]
    num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """In place: x[token, h] = (x1 cos - x2 sin, x2 cos + x1 sin) for every head h."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    halves = tl.arange(0, HALF_PAD)[None, :]
    offsets = token * token_stride + heads * head_stride + halves  # [HEADS_PAD, HALF_PAD]
    mask = (heads < num_heads) & half_mask
    x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(x_ptr + offsets, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(x_ptr + offsets + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cos_sin_stride,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
):
    # one program per token: all its query and key heads
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    halves = tl.arange(0, HALF_PAD)[None, :]
    half_mask = halves < HALF
    cos_ptr = cos_sin_ptr + position * cos_sin_stride + halves  # [1, HALF_PAD]
    cos = tl.load(cos_ptr, mask=half_mask, other=0.0)
    sin = tl.load(cos_ptr + HALF, mask=half_mask, other=0.0)
    _rotate_heads(
        q_ptr, token, q_token_stride, q_head_stride, cos, sin, half_mask, num_heads,
        HALF, HALF_PAD, HEADS_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, token, k_token_stride, k_head_stride, cos, sin, half_mask, num_kv_heads,
        HALF, HALF_PAD, KV_HEADS_PAD,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE, in place on q and k, which are returned. q: [num_tokens, num_heads,
    head_dim], k: [num_tokens, num_kv_heads, head_dim], cos_sin_cache: [max_position, head_dim]
    float32 holding cos in the first half and sin in the second."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert positions.shape == (num_tokens,) and k.shape == (num_tokens, num_kv_heads, head_dim)
    assert q.stride(2) == 1 and k.stride(2) == 1 and head_dim % 2 == 0
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads, HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
    )  # fmt: skip
    return q, k

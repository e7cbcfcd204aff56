"""kernels/cpu/layer_ops.cpp's RMSNorm, rotary embedding, KV-cache store and SwiGLU middle behind
kernels/reference.py's signatures; what the native ops do not take (float16, a weight in another
dtype, strided rows) goes to the reference, which is also their oracle (tests/test_layer_ops.py)."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.native import native_ops

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm: (norm(x + residual) * weight, x + residual)."""
    if not _norm_fits(x, weight, residual, weight_dtype=x.dtype):
        return reference.rms_norm(x, weight, eps, residual)
    return _native_norm(x, weight, eps, residual)


def rms_norm_in_float32(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm_in_float32 (Gemma's norm: bfloat16 rows, a float32 weight) in one
    native call, without the rows' float32 copy: the kernel computes in float32 and rounds once."""
    if x.dtype != torch.bfloat16 or not _norm_fits(x, weight, residual, torch.float32):
        return reference.rms_norm_in_float32(x, weight, eps, residual, rms_norm=rms_norm)
    return _native_norm(x, weight, eps, residual)


def _norm_fits(x, weight, residual, weight_dtype: torch.dtype) -> bool:
    """Rows strided apart without a residual (Gemma's q/k heads, views of the q/k/v projection)
    fit too: they are copied together first, as the fused Gemma layer does
    (kernels/cpu/decode_layer.cpp's head_norm)."""
    if not _native_fits(weight_dtype, (weight,)):
        return False
    if residual is not None:
        return _native_fits(x.dtype, (x, residual))
    rows_fit = x.is_contiguous() or (x.dim() > 1 and x.stride(-1) == 1)
    return rows_fit and x.dtype in NATIVE_DTYPES and not x.is_cuda


def _native_norm(x, weight, eps, residual) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.contiguous().reshape(-1, x.shape[-1])
    extra = None if residual is None else residual.reshape(rows.shape)
    out, total = native_ops().rms_norm(rows, weight, eps, extra)
    return out.view(x.shape), x if residual is None else total.view(x.shape)


def prepare_rotary(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> reference.RotaryPlan:
    """reference.prepare_rotary: the step's cos/sin rows, shared by every layer."""
    if dtype not in NATIVE_DTYPES or not _native_fits(torch.float32, (cos_sin_cache,)):
        return reference.prepare_rotary(positions, cos_sin_cache, dtype)
    return reference.RotaryPlan(*native_ops().rotary_plan(positions, cos_sin_cache, dtype))


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """reference.store_kvcache: each token's key/value into its slot; slot -1 skipped."""
    fits = all(t.stride(-1) == 1 and t.dtype == k_cache.dtype for t in (key, value, v_cache))
    if not (fits and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    native_ops().store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def silu_and_mul(both: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul in one pass over the rows (torch's silu and multiply made two, over
    the halves' strided views)."""
    if both.dim() != 2 or both.shape[-1] % 2 or not _native_fits(both.dtype, (both,)):
        return reference.silu_and_mul(both)
    return native_ops().silu_and_mul(both)


def rotary_with_plan(
    q: torch.Tensor, k: torch.Tensor, plan: reference.RotaryPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rotary_with_plan: NeoX RoPE of q and k with the step's cos/sin rows."""
    if (
        q.dtype not in NATIVE_DTYPES
        or q.stride(-1) != 1
        or k.stride(-1) != 1
        or not (plan.cos.dtype == plan.sin.dtype == k.dtype == q.dtype)
    ):
        return reference.rotary_with_plan(q, k, plan)
    return native_ops().rotary_with_plan(q, k, plan.cos.contiguous(), plan.sin.contiguous())


def _native_fits(dtype: torch.dtype, tensors) -> bool:
    return dtype in NATIVE_DTYPES and all(
        t.dtype == dtype and t.is_contiguous() and not t.is_cuda for t in tensors
    )

"""Matmuls on GGUF-quantized weights in Triton, on the planes kernels/gguf_planes.py repacks a
file's blocks into at load (each weight value read and dequantized in registers inside the K
loop).

A tiled kernel (tl.dot over BLOCK_M x BLOCK_N tiles, each weight tile dequantized) runs many rows;
a few rows (decode) run kernels/triton_gguf_dot.py's integer dot products, split along K where
the output rows alone would not fill the GPU.

Arithmetic is float32 from the loaded values on (bf16 arithmetic is wrong under Triton's
interpreter); on a GPU the tiled kernel's dot takes 16-bit activations and the weight tile
rounded to their dtype, accumulating in float32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.triton_gguf_blocks import _plane_value, check_planes

GEMV_ROWS = 4  # at most this many rows run the integer-dot GEMV; more run the tiled kernel


@triton.jit
def _tiled_kernel(
    x_ptr, qs_ptr, qh_ptr, sm_ptr, d_ptr, out_ptr,
    num_rows, out_features, in_features, x_stride, columns,
    QTYPE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out [num_rows, out_features] contiguous; program (m, n) computes one BLOCK_M x BLOCK_N tile
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [M, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [1, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rows < num_rows) & (ks[None, :] < in_features)
        x = tl.load(x_ptr + rows.to(tl.int64) * x_stride + ks[None, :], mask=x_mask, other=0.0)
        w_mask = (ks[:, None] < in_features) & (cols < out_features)
        w = _plane_value(
            qs_ptr, qh_ptr, sm_ptr, d_ptr, ks[:, None], cols, columns, w_mask, QTYPE
        )  # fmt: skip  [K, N]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out_mask = (rows < num_rows) & (cols < out_features)
    out_offsets = rows.to(tl.int64) * out_features + cols
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize_kernel(
    qs_ptr, qh_ptr, sm_ptr, d_ptr, ids_ptr, out_ptr,
    num_ids, in_features, columns,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out [num_ids, in_features] contiguous: the weight rows ids (output rows, the planes'
    # columns); program (n, k) writes a BLOCK_N x BLOCK_K tile
    picks = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [1, N]
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]  # [K, 1]
    cols = tl.load(ids_ptr + picks, mask=picks < num_ids, other=0)
    mask = (ks < in_features) & (picks < num_ids) & (cols >= 0) & (cols < columns)  # no stray read
    w = _plane_value(qs_ptr, qh_ptr, sm_ptr, d_ptr, ks, cols, columns, mask, QTYPE)  # [K, N]
    offsets = picks.to(tl.int64) * in_features + ks
    tl.store(out_ptr + offsets, w.to(out_ptr.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def gguf_matmul(x: torch.Tensor, planes, quantized=None, out=None, bias=None) -> torch.Tensor:
    """x [rows, in_features] (float32/16, bfloat16) @ W^T (+ bias) -> [rows, out_features] in
    x's dtype, W a weight repacked into kernels/gguf_planes.py's Planes; float32 accumulation.
    quantized: x as triton_gguf_dot.quantize_x made it (rows <= GEMV_ROWS only); out: the
    result's place, columns contiguous (the GEMV writes there directly, bias added)."""
    if x.shape[0] <= GEMV_ROWS:
        from kernels.triton_gguf_dot import gguf_dot

        return gguf_dot(x, planes, asm=not _interpreted(), quantized=quantized, out=out,
                        bias=bias)  # fmt: skip
    y = gguf_tiled(x, planes)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y if out is None else out.copy_(y)


def gguf_tiled(x: torch.Tensor, planes) -> torch.Tensor:
    """The tiled kernel (gguf_matmul's arguments)."""
    check_planes(planes)
    out = torch.empty(x.shape[0], planes.out_features, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    assert x.shape[1] == planes.in_features and x.stride(1) == 1
    block_m = min(64, max(16, triton.next_power_of_2(x.shape[0])))
    block_n, block_k = 64, 32  # 64 x 64 x 64 spills registers on sm_90 (ptxas -v)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(planes.out_features, block_n))
    _tiled_kernel[grid](
        x, *planes.pointers(), out, x.shape[0], planes.out_features, planes.in_features,
        x.stride(0), planes.columns, QTYPE=int(planes.qtype),
        DOT_FP32=_interpreted() or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8,
    )  # fmt: skip
    return out


def gguf_dequantize(planes, dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The weight rows `ids` (all by default) -> [len(ids), in_features] in dtype."""
    check_planes(planes)
    if ids is None:
        ids = torch.arange(planes.out_features, device=planes.data.device)
    out = torch.empty(ids.numel(), planes.in_features, dtype=dtype, device=planes.data.device)
    if ids.numel() == 0:
        return out
    block_n, block_k = 32, 64
    grid = (triton.cdiv(ids.numel(), block_n), triton.cdiv(planes.in_features, block_k))
    _dequantize_kernel[grid](
        *planes.pointers(), ids.reshape(-1), out, ids.numel(), planes.in_features,
        planes.columns, QTYPE=int(planes.qtype), BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out

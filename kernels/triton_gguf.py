"""Matmuls on GGUF-quantized weights in Triton: the weight stays in the file's blocks
([out_features, row_bytes] uint8, ggml-common.h layouts, little-endian float16 scales) and each
tile is dequantized in registers inside the K loop.

A tiled kernel (tl.dot over BLOCK_M x BLOCK_N tiles, each weight tile dequantized) runs many rows;
a few rows (decode) run kernels/triton_gguf_dot.py's integer dot products, split along K where
the output rows alone would not fill the GPU.

Arithmetic is float32 from the loaded bytes on (bf16 arithmetic is wrong under Triton's
interpreter); on a GPU the tiled kernel's dot takes 16-bit activations and the weight tile
rounded to their dtype, accumulating in float32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.triton_gguf_blocks import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    _byte,
    _half,
    _k_scale_min,
    _nibble,
    _signed_byte,
    check_blocks,
)

GEMV_ROWS = 4  # at most this many rows run the integer-dot GEMV; more run the tiled kernel


@triton.jit
def _dequantize_32(rows_ptr, k, mask, QTYPE: tl.constexpr):
    """Types of 32-value blocks. rows_ptr: [1, N] row starts, k: [K, 1] -> [K, N] float32."""
    i = k % 32
    if QTYPE == Q8_0:
        base = rows_ptr + (k // 32) * 34
        w = _half(base, 0, mask) * _signed_byte(base, 2 + i, mask).to(tl.float32)
    elif QTYPE == Q4_0:
        base = rows_ptr + (k // 32) * 18
        q = _nibble(base, 2 + i % 16, i // 16, mask) - 8
        w = _half(base, 0, mask) * q.to(tl.float32)
    elif QTYPE == Q4_1:
        base = rows_ptr + (k // 32) * 20
        q = _nibble(base, 4 + i % 16, i // 16, mask)
        w = _half(base, 0, mask) * q.to(tl.float32) + _half(base, 2, mask)
    else:  # Q5_0: 32 high bits (little-endian uint32) after the scale, then the nibbles
        base = rows_ptr + (k // 32) * 22
        high = (_byte(base, 2 + i // 8, mask) >> (i % 8)) & 1
        q = (_nibble(base, 6 + i % 16, i // 16, mask) | (high << 4)) - 16
        w = _half(base, 0, mask) * q.to(tl.float32)
    return w


@triton.jit
def _dequantize_256(rows_ptr, k, mask, QTYPE: tl.constexpr):
    """K-quants (256-value super-blocks of eight 32-value sub-blocks), shapes as _dequantize_32."""
    j = k % 256
    sub, i = j // 32, j % 32
    if QTYPE == Q6_K:
        base = rows_ptr + (k // 256) * 210
        half = sub // 4
        low = _nibble(base, half * 64 + (sub % 2) * 32 + i, (sub // 2) % 2, mask)
        high = (_byte(base, 128 + half * 32 + i, mask) >> ((sub % 4) * 2)) & 3
        scale = _signed_byte(base, 192 + j // 16, mask).to(tl.float32)
        q = (low | (high << 4)) - 32
        w = _half(base, 208, mask) * scale * q.to(tl.float32)
    else:
        if QTYPE == Q4_K:
            base = rows_ptr + (k // 256) * 144
            q = _nibble(base, 16 + (sub // 2) * 32 + i, sub % 2, mask)
        else:  # Q5_K: bit `sub` of byte i of the 32 high-bit bytes
            base = rows_ptr + (k // 256) * 176
            high = (_byte(base, 16 + i, mask) >> sub) & 1
            q = _nibble(base, 48 + (sub // 2) * 32 + i, sub % 2, mask) | (high << 4)
        scale, minimum = _k_scale_min(base + 4, sub, mask)
        scale, minimum = scale.to(tl.float32), minimum.to(tl.float32)
        d, dmin = _half(base, 0, mask), _half(base, 2, mask)
        w = d * scale * q.to(tl.float32) - dmin * minimum
    return w


@triton.jit
def _dequantize(rows_ptr, k, mask, QTYPE: tl.constexpr):
    """[K, N] float32 weights W[n, k] (zero where masked); rows_ptr: [1, N], k: [K, 1]."""
    if QTYPE >= Q4_K:
        w = _dequantize_256(rows_ptr, k, mask, QTYPE)
    else:
        w = _dequantize_32(rows_ptr, k, mask, QTYPE)
    return tl.where(mask, w, 0.0)


@triton.jit
def _tiled_kernel(
    x_ptr,
    blocks_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    x_stride,
    row_bytes,
    QTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # out [num_rows, out_features] contiguous; program (m, n) computes one BLOCK_M x BLOCK_N tile
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [M, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [1, N]
    weight_rows = blocks_ptr + cols.to(tl.int64) * row_bytes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rows < num_rows) & (ks[None, :] < in_features)
        x = tl.load(x_ptr + rows.to(tl.int64) * x_stride + ks[None, :], mask=x_mask, other=0.0)
        w_mask = (ks[:, None] < in_features) & (cols < out_features)
        w = _dequantize(weight_rows, ks[:, None], w_mask, QTYPE)  # [K, N]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out_mask = (rows < num_rows) & (cols < out_features)
    out_offsets = rows.to(tl.int64) * out_features + cols
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize_kernel(
    blocks_ptr,
    out_ptr,
    num_rows,
    in_features,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # out [num_rows, in_features] contiguous; program (n, k) writes a BLOCK_N x BLOCK_K tile
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # weight rows, [1, N]
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]  # [K, 1]
    mask = (ks < in_features) & (cols < num_rows)
    w = _dequantize(blocks_ptr + cols.to(tl.int64) * row_bytes, ks, mask, QTYPE)  # [K, N]
    offsets = cols.to(tl.int64) * in_features + ks
    tl.store(out_ptr + offsets, w.to(out_ptr.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def gguf_matmul(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int
) -> torch.Tensor:
    """x [rows, in_features] (float32/16, bfloat16) @ W^T -> [rows, out_features] in x's dtype,
    W the GGUF blocks [out_features, row_bytes] uint8 of `ggml_type`; float32 accumulation."""
    if x.shape[0] <= GEMV_ROWS:
        from kernels.triton_gguf_dot import gguf_dot

        return gguf_dot(x, blocks, ggml_type, out_features, in_features, asm=not _interpreted())
    return gguf_tiled(x, blocks, ggml_type, out_features, in_features)


def gguf_tiled(x, blocks, ggml_type, out_features, in_features) -> torch.Tensor:
    """The tiled kernel (gguf_matmul's arguments)."""
    check_blocks(blocks, ggml_type, out_features, in_features)
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    assert x.shape[1] == in_features and x.stride(1) == 1
    block_m = min(64, max(16, triton.next_power_of_2(x.shape[0])))
    block_n, block_k = 64, 32  # 64 x 64 x 64 spills registers on sm_90 (ptxas -v)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(out_features, block_n))
    _tiled_kernel[grid](
        x, blocks, out, x.shape[0], out_features, in_features, x.stride(0), blocks.stride(0),
        QTYPE=int(ggml_type), DOT_FP32=_interpreted() or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8,
    )  # fmt: skip
    return out


def gguf_dequantize(blocks: torch.Tensor, ggml_type: int, in_features: int, dtype) -> torch.Tensor:
    """blocks [num_rows, row_bytes] uint8 -> [num_rows, in_features] in dtype."""
    check_blocks(blocks, ggml_type, blocks.shape[0], in_features)
    out = torch.empty(blocks.shape[0], in_features, dtype=dtype, device=blocks.device)
    if blocks.shape[0] == 0:
        return out
    block_n, block_k = 32, 64
    grid = (triton.cdiv(blocks.shape[0], block_n), triton.cdiv(in_features, block_k))
    _dequantize_kernel[grid](
        blocks, out, blocks.shape[0], in_features, blocks.stride(0),
        QTYPE=int(ggml_type), BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out

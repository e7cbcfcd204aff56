"""What the Triton GGUF kernels share (kernels/triton_gguf.py's tiled matmul and dequantizer,
kernels/triton_gguf_dot.py's integer-dot GEMV): the ggml type numbers, the check of a weight's
planes (kernels/gguf_planes.py's layout) and the reader of single values from them."""

from __future__ import annotations

import triton
import triton.language as tl

Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)
TYPES = (2, 3, 6, 8, 12, 13, 14)


def check_planes(planes) -> None:
    import torch

    assert int(planes.qtype) in TYPES and planes.data.dtype == torch.int32
    assert planes.in_features % (256 if int(planes.qtype) >= 12 else 32) == 0


@triton.jit
def _signed(byte):
    return byte - ((byte & 128) << 1)


@triton.jit
def _half(word, shift):
    """float32 of the float16 in bits shift .. shift + 15 of int32 word."""
    return ((word >> shift) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load(pointers, mask):
    """Words at pointers; 0 where mask is False (None: no mask, every pointer valid)."""
    if mask is None:
        words = tl.load(pointers)
    else:
        words = tl.load(pointers, mask=mask, other=0)
    return words


@triton.jit
def _scales(sm_ptr, d_ptr, sub, col, columns, mask, QTYPE: tl.constexpr):
    """Sub-block sub's (32 values) float d and, for K-quants, its integer scale and minimum;
    Q4_1's m as d_min, with minimum 1. (Q6_K's scales are per 16: see _plane_value.)"""
    scale, minimum, d_min = 1, 0, 0.0
    if QTYPE >= Q4_K:
        words = _load(d_ptr + (sub // 8) * columns + col, mask)
        d = _half(words, 0)
        if QTYPE != Q6_K:
            d_min = _half(words, 16)
            packed = _load(sm_ptr + (sub // 2) * columns + col, mask)
            scale = (packed >> (16 * (sub % 2))) & 255
            minimum = (packed >> (16 * (sub % 2) + 8)) & 255
    elif QTYPE == Q4_1:
        words = _load(d_ptr + sub * columns + col, mask)
        d, d_min, minimum = _half(words, 0), _half(words, 16), 1
    else:
        words = _load(d_ptr + (sub // 2) * columns + col, mask)
        d = _half(words, 16 * (sub % 2))
    return d, scale, minimum, d_min


@triton.jit
def _plane_value(qs_ptr, qh_ptr, sm_ptr, d_ptr, k, n, columns, mask, QTYPE: tl.constexpr):
    """W[n, k] float32 (0 where masked) for broadcastable index tensors k, n (output rows)."""
    col = n.to(tl.int64)
    sub, i = k // 32, k % 32
    if QTYPE == Q8_0:
        word = tl.load(qs_ptr + (k // 4) * columns + col, mask=mask, other=0)
        q = _signed((word >> (8 * (k % 4))) & 255)
    else:
        word = tl.load(qs_ptr + (k // 8) * columns + col, mask=mask, other=0)
        q = (word >> (8 * (i % 4) + 4 * ((i % 8) // 4))) & 15
        if QTYPE == Q5_0 or QTYPE == Q5_K:
            high = tl.load(qh_ptr + sub * columns + col, mask=mask, other=0)
            q |= ((high >> (8 * (i % 4) + i // 4)) & 1) << 4
        if QTYPE == Q6_K:
            high = tl.load(qh_ptr + (k // 16) * columns + col, mask=mask, other=0)
            q |= ((high >> (8 * (i % 4) + 2 * ((k % 16) // 4))) & 3) << 4
    d, scale, minimum, d_min = _scales(sm_ptr, d_ptr, sub, col, columns, mask, QTYPE)
    if QTYPE == Q8_0:
        w = d * q.to(tl.float32)
    elif QTYPE == Q4_0:
        w = d * (q - 8).to(tl.float32)
    elif QTYPE == Q5_0:
        w = d * (q - 16).to(tl.float32)
    elif QTYPE == Q4_1:
        w = d * q.to(tl.float32) + d_min
    elif QTYPE == Q6_K:
        packed = tl.load(sm_ptr + (k // 64) * columns + col, mask=mask, other=0)
        scale = _signed((packed >> (8 * ((k % 64) // 16))) & 255).to(tl.float32)
        w = d * scale * (q - 32).to(tl.float32)
    else:
        w = d * scale.to(tl.float32) * q.to(tl.float32) - d_min * minimum.to(tl.float32)
    return tl.where(mask, w, 0.0)

"""What the Triton GGUF kernels share (kernels/triton_gguf.py's tiled matmul and dequantizer,
kernels/triton_gguf_dot.py's integer-dot GEMV): the ggml type numbers, each type's block shape,
the check of a weight's blocks, and the readers of bytes, float16 scales and K-quant scales inside
a block."""

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
# ggml type -> (values, bytes) of one block
BLOCK_SHAPES = {
    2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176),
    14: (256, 210),
}  # fmt: skip


def check_blocks(blocks, ggml_type: int, out_features: int, in_features: int) -> None:
    """blocks: [out_features, row_bytes] uint8, rows contiguous, of `ggml_type`."""
    import torch

    block_values, block_bytes = BLOCK_SHAPES[int(ggml_type)]
    assert blocks.dtype == torch.uint8 and blocks.stride(1) == 1 and in_features % block_values == 0
    assert blocks.shape == (out_features, in_features // block_values * block_bytes)


@triton.jit
def _byte(ptr, offset, mask):
    return tl.load(ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _signed_byte(ptr, offset, mask):
    value = _byte(ptr, offset, mask)
    return value - ((value & 128) << 1)


@triton.jit
def _half(ptr, offset, mask):
    """float32 of the little-endian float16 at ptr + offset."""
    bits = _byte(ptr, offset, mask) | (_byte(ptr, offset + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(ptr, offset, high, mask):
    """The low (high == 0) or high (high == 1) four bits of the byte at ptr + offset."""
    return (_byte(ptr, offset, mask) >> (high * 4)) & 15


@triton.jit
def _k_scale_min(ptr, sub, mask):
    """Q4_K / Q5_K: the 6-bit scale and min (int32) of sub-block `sub` (0..7) from the 12 bytes at
    ptr."""
    low = sub % 4
    scale_bits = _byte(ptr, low, mask)
    min_bits = _byte(ptr, low + 4, mask)
    high_bits = _byte(ptr, low + 8, mask)
    scale = tl.where(sub < 4, scale_bits & 63, (high_bits & 15) | ((scale_bits >> 2) & 48))
    minimum = tl.where(sub < 4, min_bits & 63, (high_bits >> 4) | ((min_bits >> 2) & 48))
    return scale, minimum

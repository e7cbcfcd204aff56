"""Decode matmuls on GGUF blocks by integer dot products, as llama.cpp's MMVQ does on CUDA: a small
kernel quantizes x to int8 per 32 values (a float scale per 32), once per matmul; the GEMV reads
the weight's quants as 32-bit words of four 8-bit values and multiplies four at a time with `dp4a`
(an emulation of it under Triton's interpreter). Scales are applied once per 4 or 32 values, never
per value.

Every type is read as sub-blocks of 32 values: 8 words per sub-block, with per word an integer
scale and the integer offset of its quants (q - offset), and per sub-block a float multiplier of
the integer sum and a float multiplier of x's sum (the types with a minimum). Then, per sub-block,

    y += d * dx * sum_t scale_t * (dot(q_t, xq_t) - offset * dot(1, xq_t)) + d_min * dx * sum(xq)

Blocks: [out_features, row_bytes] uint8 in ggml-common.h's layouts. Q8_0, Q4_0, Q5_0 and Q6_K
blocks have sizes that are not multiples of four: their words are read as two 16-bit halves (every
quant array starts at an even byte).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_gguf_blocks import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_K,
    Q8_0,
    _half,
    _k_scale_min,
    _signed_byte,
    check_blocks,
)

LOW_NIBBLES = tl.constexpr(0x0F0F0F0F)
LOW_BITS = tl.constexpr(0x01010101)
TWO_BITS = tl.constexpr(0x03030303)
SUBS_PER_STEP = 16  # sub-blocks of 32 values each program reads per loop step
QUANTIZE_SUBS = 16  # sub-blocks of x each program of the quantizing kernel takes
TARGET_PROGRAMS = 132  # one wave of an H100's SMs: fewer programs split K


@triton.jit
def _dot4(a, b, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """Per element, the dot product of the four 8-bit lanes of a (unsigned, or signed when
    SIGNED_A) with the four signed 8-bit lanes of b, as int32."""
    if ASM:
        if SIGNED_A:
            op: tl.constexpr = "dp4a.s32.s32 $0, $1, $2, $3;"
        else:
            op: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
        a, b = tl.broadcast(a, b)
        return tl.inline_asm_elementwise(
            op, "=r,r,r,r", [a, b, tl.zeros_like(a)], dtype=tl.int32, is_pure=True, pack=1
        )
    total = tl.zeros_like(a + b)
    for lane in tl.static_range(4):
        a_lane = (a >> (8 * lane)) & 255
        if SIGNED_A:
            a_lane = a_lane - ((a_lane & 128) << 1)
        b_lane = (b >> (8 * lane)) & 255
        total += a_lane * (b_lane - ((b_lane & 128) << 1))
    return total


@triton.jit
def _word32(ptr, index, mask):
    """The 32-bit word `index` words after ptr, which is 4-byte aligned (Q4_1, Q4_K, Q5_K blocks):
    indices contiguous along a row let the compiler read several words in one load."""
    return tl.load(ptr.to(tl.pointer_type(tl.int32)) + index, mask=mask, other=0)


@triton.jit
def _word16(ptr, index, mask):
    """The little-endian 32-bit word of the 16-bit halves index and index + 1 after ptr, which is
    2-byte aligned only (Q8_0, Q4_0, Q5_0, Q6_K blocks)."""
    halves = ptr.to(tl.pointer_type(tl.uint16))
    low = tl.load(halves + index, mask=mask, other=0).to(tl.int32)
    high = tl.load(halves + index + 1, mask=mask, other=0).to(tl.int32)
    return low | (high << 16)


@triton.jit
def _sub_block(row_ptr, sub, t, mask, QTYPE: tl.constexpr):
    """Sub-block `sub` (32 values from value 32 * sub of the row) of rows row_ptr [N, 1, 1],
    sub [1, S, 1], word t [1, 1, 8] -> (quants [N, S, 8] int32 words, integer scale per word,
    integer offset of the quants, float d [N, S, 1], float d_min [N, S, 1] or 0.0)."""
    if QTYPE >= Q4_K:
        base = row_ptr + (sub // 8) * (144 if QTYPE == Q4_K else (176 if QTYPE == Q5_K else 210))
        j = sub % 8
    else:
        base = row_ptr + sub * (18 if QTYPE == Q4_0 else (20 if QTYPE == Q4_1 else (
            22 if QTYPE == Q5_0 else 34)))  # fmt: skip
    d_min = 0.0
    if QTYPE == Q8_0:
        quants, scale, offset = _word16(base, 1 + 2 * t, mask), 1, 0
        d = _half(base, 0, mask)
    elif QTYPE == Q4_0 or QTYPE == Q4_1:
        if QTYPE == Q4_0:
            packed = _word16(base, 1 + 2 * (t % 4), mask)
        else:
            packed = _word32(base, 1 + t % 4, mask)
        quants, scale = (packed >> (4 * (t // 4))) & LOW_NIBBLES, 1
        offset = 8 if QTYPE == Q4_0 else 0
        d = _half(base, 0, mask)
        if QTYPE == Q4_1:
            d_min = _half(base, 2, mask)
    elif QTYPE == Q5_0:
        packed = _word16(base, 3 + 2 * (t % 4), mask)
        high_bits = (_word16(base, 1, mask) >> (4 * t)) & 15  # bit p -> lane p's bit 4 below
        high = ((high_bits * 0x00204081) & LOW_BITS) << 4
        quants, scale, offset = ((packed >> (4 * (t // 4))) & LOW_NIBBLES) | high, 1, 16
        d = _half(base, 0, mask)
    elif QTYPE == Q4_K or QTYPE == Q5_K:
        quants_at = 4 if QTYPE == Q4_K else 12  # words
        packed = _word32(base, quants_at + (j // 2) * 8 + t, mask)
        quants = (packed >> (4 * (j % 2))) & LOW_NIBBLES
        if QTYPE == Q5_K:
            quants |= ((_word32(base, 4 + t, mask) >> j) & LOW_BITS) << 4
        scale, minimum = _k_scale_min(base + 4, j, mask)
        offset = 0
        d = _half(base, 0, mask)
        d_min = -_half(base, 2, mask) * minimum.to(tl.float32)
    else:  # Q6_K: 128-value halves n; in each, four 32-value rows r of 4-bit low and 2-bit high
        n, r = j // 4, j % 4
        low = (_word16(base, 32 * n + (r % 2) * 16 + 2 * t, mask) >> (4 * (r // 2))) & LOW_NIBBLES
        high = (_word16(base, 64 + 16 * n + 2 * t, mask) >> (2 * r)) & TWO_BITS
        quants, offset = low | (high << 4), 32
        scale = _signed_byte(base, 192 + 8 * n + 2 * r + t // 4, mask)
        d = _half(base, 208, mask)
    return quants, scale, offset, d, d_min


@triton.jit
def _quantize_x_kernel(x_ptr, words_ptr, scales_ptr, x_stride, num_rows, in_features,
                       SUBS: tl.constexpr):  # fmt: skip
    # program (row, s): x's sub-blocks s * SUBS .. + SUBS of one row -> words [rows, subs * 8]
    # int32 of four int8 xq, scales [2, rows, subs]: dx (x ~ dx * xq) and dx * sum of xq
    row, num_subs = tl.program_id(0), in_features // 32
    subs = tl.program_id(1) * SUBS + tl.arange(0, SUBS)[:, None, None]
    words = tl.arange(0, 8)[None, :, None]
    lanes = tl.arange(0, 4)[None, None, :]
    ks = subs * 32 + words * 4 + lanes
    x = tl.load(x_ptr + row * x_stride + ks, mask=ks < in_features, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [SUBS]
    inverse = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)[:, None, None]
    xq = tl.floor(x * inverse + 0.5).to(tl.int32)
    packed = tl.sum((xq & 255) << (8 * lanes), axis=2)  # disjoint bytes: the sum is an OR
    word_at = row * num_subs * 8 + subs.reshape(SUBS, 1) * 8 + words.reshape(1, 8)
    tl.store(words_ptr + word_at, packed, mask=subs.reshape(SUBS, 1) < num_subs)
    dx = amax / 127.0
    scale_at = row * num_subs + subs.reshape(SUBS)
    in_range = subs.reshape(SUBS) < num_subs
    tl.store(scales_ptr + scale_at, dx, mask=in_range)
    x_sum = dx * tl.sum(tl.sum(xq, axis=2), axis=1).to(tl.float32)
    tl.store(scales_ptr + num_rows * num_subs + scale_at, x_sum, mask=in_range)


@triton.jit
def _dot_kernel(
    words_ptr,
    scales_ptr,
    blocks_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    row_bytes,
    subs_per_split,  # a multiple of SUBS
    QTYPE: tl.constexpr,
    ROWS: tl.constexpr,  # next power of two >= num_rows
    BLOCK_N: tl.constexpr,
    SUBS: tl.constexpr,
    ASM: tl.constexpr,
):
    # out [num_splits, num_rows, out_features] (float32 partial sums, or x's dtype for one split).
    # Sums stay per thread until the loop ends: no reduction across threads inside it.
    split = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows
    row_ptr = blocks_ptr + cols[:, None, None].to(tl.int64) * row_bytes
    t = tl.arange(0, 8)[None, None, :]
    rows = tl.arange(0, ROWS)[:, None, None]
    num_subs = in_features // 32
    acc = tl.zeros([ROWS, BLOCK_N, SUBS, 8], dtype=tl.float32)
    acc_min = tl.zeros([ROWS, BLOCK_N, SUBS], dtype=tl.float32)
    for s0 in range(0, subs_per_split, SUBS):
        subs = split * subs_per_split + s0 + tl.arange(0, SUBS)[None, :, None]  # [1, S, 1]
        mask = (cols[:, None, None] < out_features) & (subs < num_subs)
        quants, scale, offset, d, d_min = _sub_block(row_ptr, subs, t, mask, QTYPE)
        x_mask = (rows < num_rows) & (subs < num_subs)  # [ROWS, S, 1]
        xq = tl.load(words_ptr + (rows * num_subs + subs) * 8 + t, mask=x_mask, other=0)
        at = rows * num_subs + subs
        dx = tl.load(scales_ptr + at, mask=x_mask, other=0.0)  # [ROWS, S, 1]
        dots = _dot4(quants[None], xq[:, None], QTYPE == Q8_0, ASM)  # [ROWS, N, S, 8]
        if offset != 0:
            ones = tl.full([1, 1, 8], 0x01010101, tl.int32)
            dots -= offset * _dot4(ones, xq, False, ASM)[:, None]
        acc += (d[None] * dx[:, None]) * (dots * scale).to(tl.float32)
        if QTYPE == Q4_1 or QTYPE == Q4_K or QTYPE == Q5_K:
            x_sum = tl.load(scales_ptr + num_rows * num_subs + at, mask=x_mask, other=0.0)
            acc_min += (d_min[None] * x_sum[:, None]).reshape(ROWS, BLOCK_N, SUBS)
    total = tl.sum(tl.sum(acc, axis=3), axis=2) + tl.sum(acc_min, axis=2)  # [ROWS, N]
    out_rows = tl.arange(0, ROWS)[:, None]
    offsets = (split * num_rows + out_rows).to(tl.int64) * out_features + cols[None, :]
    out_mask = (out_rows < num_rows) & (cols[None, :] < out_features)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=out_mask)


def gguf_dot(
    x, blocks, ggml_type, out_features, in_features, num_splits=None, asm=True,
    block_n=4, subs=SUBS_PER_STEP, num_warps=2,
):  # fmt: skip
    """x [rows <= 16, in_features] @ W^T -> [rows, out_features] in x's dtype, by int8 dot
    products (x quantized per 32 values). num_splits None: enough programs to fill the GPU; asm
    False: dp4a emulated (Triton's interpreter cannot run inline assembly). A program reads
    block_n weight rows, subs sub-blocks of 32 values per loop step."""
    import torch

    check_blocks(blocks, ggml_type, out_features, in_features)
    if x.shape[0] == 0:
        return x.new_empty(0, out_features)
    assert x.shape[1] == in_features and x.stride(1) == 1 and x.shape[0] <= 16
    num_rows, num_subs = x.shape[0], in_features // 32
    words = torch.empty(num_rows, num_subs * 8, dtype=torch.int32, device=x.device)
    scales = torch.empty(2, num_rows, num_subs, dtype=torch.float32, device=x.device)
    _quantize_x_kernel[(num_rows, triton.cdiv(num_subs, QUANTIZE_SUBS))](
        x, words, scales, x.stride(0), num_rows, in_features, SUBS=QUANTIZE_SUBS
    )
    num_tiles, num_steps = triton.cdiv(out_features, block_n), triton.cdiv(num_subs, subs)
    if num_splits is None:
        num_splits = triton.cdiv(TARGET_PROGRAMS, num_tiles)
    steps_per_split = triton.cdiv(num_steps, max(1, min(num_splits, num_steps)))
    num_splits = triton.cdiv(num_steps, steps_per_split)
    out_dtype = x.dtype if num_splits == 1 else torch.float32
    out = torch.empty(num_splits, num_rows, out_features, device=x.device, dtype=out_dtype)
    _dot_kernel[(num_tiles, num_splits)](
        words, scales, blocks, out, num_rows, out_features, in_features, blocks.stride(0),
        steps_per_split * subs, QTYPE=int(ggml_type), ROWS=triton.next_power_of_2(num_rows),
        BLOCK_N=block_n, SUBS=subs, ASM=asm, num_warps=num_warps,
    )  # fmt: skip
    return out[0] if num_splits == 1 else out.sum(0).to(x.dtype)

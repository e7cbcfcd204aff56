"""Decode matmuls on GGUF weights by integer dot products, as llama.cpp's MMVQ does on CUDA: a small
kernel quantizes x to int8 per 32 values (a float scale per 32), once per input; the GEMV reads
the weight's quants from kernels/gguf_planes.py's column-major planes, 16 bytes (four output
rows' words) a load, and multiplies four values at a time with `dp4a` (emulated under Triton's
interpreter). Integer sums run per 32-value sub-block; scales are applied once per sub-block.

Per sub-block s of output row n (x ~ dx * xq, x_sum = dx * sum(xq)):

    y[n] += d * dx * sum_r scale_r * (dot(q_r, xq_r) - offset * dot(1, xq_r)) - dm * mn * x_sum

(r the sub-block's words; scale_r 1 but for Q6_K's per-16 scales; K-quants multiply the integer
sum by the sub-block's 6-bit scale; Q4_1 adds d_min * x_sum instead.)
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
    Q6_K,
    Q8_0,
    _scales,
    _signed,
    check_planes,
)

LOW_NIBBLES = tl.constexpr(0x0F0F0F0F)
LOW_BITS = tl.constexpr(0x01010101)
TWO_BITS = tl.constexpr(0x03030303)
SUBS_PER_STEP = 2  # sub-blocks of 32 values each program reads per loop step
BLOCK_N = 256  # output rows per program: 4 a thread, 2 warps
NUM_WARPS = 2
QUANTIZE_SUBS = 16  # sub-blocks of x each program of the quantizing kernel takes
TARGET_PROGRAMS = 528  # four per SM of an H100 or H200: fewer programs split K
SPLITS_AT_ONCE = 8  # partial sums the last program of a tile loads at a time
FUSED_MAX_TILES = 128  # outputs of at most this many tiles: x quantized inside the GEMV


@triton.jit
def _dot4(a, b, c, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """Per element, c + the dot product of the four 8-bit lanes of a (unsigned, or signed when
    SIGNED_A) with the four signed 8-bit lanes of b, as int32."""
    if ASM:
        if SIGNED_A:
            op: tl.constexpr = "dp4a.s32.s32 $0, $1, $2, $3;"
        else:
            op: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
        a, b = tl.broadcast(a, b)
        c = tl.zeros_like(a) + c
        a, c = tl.broadcast(a, c)
        b, c = tl.broadcast(b, c)
        return tl.inline_asm_elementwise(
            op, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    total = c + tl.zeros_like(a + b)
    for lane in tl.static_range(4):
        a_lane = (a >> (8 * lane)) & 255
        if SIGNED_A:
            a_lane = a_lane - ((a_lane & 128) << 1)
        b_lane = (b >> (8 * lane)) & 255
        total += a_lane * (b_lane - ((b_lane & 128) << 1))
    return total


@triton.jit
def _quantize_x_kernel(x_ptr, words_ptr, scales_ptr, x_stride, num_rows, in_features, num_subs,
                       SUBS: tl.constexpr):  # fmt: skip
    # program (row, s): x's sub-blocks s * SUBS .. + SUBS of one row -> words [rows, subs * 8]
    # int32 of four int8 xq, scales [2, rows, subs]: dx (x ~ dx * xq) and dx * sum of xq;
    # num_subs may pass in_features / 32 (padding: zero words and scales)
    row = tl.program_id(0)
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
def _weight_words(qs_ptr, qh_ptr, sm_ptr, first, s, r, n, columns, QTYPE: tl.constexpr):
    """Sub-blocks s [S, 1, 1] (from `first`), words r [1, R, 1] of output rows n [1, 1, N]: the
    codes as two [S, R, N] words of four 8-bit lanes (low: values 8r .. 8r + 3 of the
    sub-block; high: 8r + 4 ..; Q8_0: one word of signed bytes 4r .., high unused), and Q6_K's
    scale of each word's 16 values (else 1)."""
    if QTYPE == Q8_0:
        w = tl.load(qs_ptr + ((first + s) * 8 + r) * columns + n)
        return w, w, 1
    w = tl.load(qs_ptr + ((first + s) * 4 + r) * columns + n)
    low, high = w & LOW_NIBBLES, (w >> 4) & LOW_NIBBLES
    scale = 1
    if QTYPE == Q5_0 or QTYPE == Q5_K:
        bits = tl.load(qh_ptr + (first + s) * columns + n)  # [S, 1, N]
        low |= ((bits >> (2 * r)) & LOW_BITS) << 4
        high |= ((bits >> (2 * r + 1)) & LOW_BITS) << 4
    if QTYPE == Q6_K:
        t = (first + s) * 2 + r // 2  # 16 values t: 4 bits more in word t, scale byte t % 4
        bits = tl.load(qh_ptr + t * columns + n)
        low |= ((bits >> (4 * (r % 2))) & TWO_BITS) << 4
        high |= ((bits >> (4 * (r % 2) + 2)) & TWO_BITS) << 4
        packed = tl.load(sm_ptr + (t // 4) * columns + n)
        scale = _signed((packed >> (8 * (t % 4))) & 255)
    return low, high, scale


@triton.jit
def _x_step(words_ptr, scales_ptr, x_ptr, x_stride, in_features, row, first, s, r, num_rows,
            num_subs, QTYPE: tl.constexpr, FUSED: tl.constexpr):  # fmt: skip
    """x row `row` at the step's sub-blocks s [S, 1, 1], as the weight words r [1, R, 1] pair
    with it: (low, high) [S, R, 1] words of four int8 xq (Q8_0: low alone), dx and dx * sum(xq)
    [S, 1, 1]. FUSED: x quantized here, as _quantize_x_kernel does it (bit for bit), from
    x_ptr; else read from what that kernel wrote."""
    if FUSED:
        low, high, dx, x_sum = _x_quantized_here(x_ptr, x_stride, in_features, row, first, s, r,
                                                 num_rows, QTYPE)  # fmt: skip
    else:
        row = tl.minimum(row, num_rows - 1)  # a padding row (ROWS > num_rows) reads a real one
        x_words = words_ptr + (row * num_subs + first + s) * 8  # [S, 1, 1]
        at = row * num_subs + first + s
        dx, x_sum = tl.load(scales_ptr + at), tl.load(scales_ptr + num_rows * num_subs + at)
        if QTYPE == Q8_0:
            low = tl.load(x_words + r)
            high = low
        else:
            low, high = tl.load(x_words + 2 * r), tl.load(x_words + 2 * r + 1)
    return low, high, dx, x_sum


@triton.jit
def _x_quantized_here(x_ptr, x_stride, in_features, row, first, s, r, num_rows,
                      QTYPE: tl.constexpr):  # fmt: skip
    LANES: tl.constexpr = 4 if QTYPE == Q8_0 else 8  # values of x a weight word pairs with
    base = x_ptr + row * x_stride + (first + s) * 32 + LANES * r  # [S, R, 1]
    inside = ((first + s) * 32 < in_features) & (s * 0 + row < num_rows)  # x is not padded
    amax = tl.zeros(base.shape, dtype=tl.float32)
    for lane in tl.static_range(LANES):
        value = tl.load(base + lane, mask=inside, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(value))
    amax = tl.max(amax, axis=1, keep_dims=True)  # [S, 1, 1]
    inverse = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    low = tl.zeros(base.shape, dtype=tl.int32)
    high = low
    total = low
    for lane in tl.static_range(LANES):
        value = tl.load(base + lane, mask=inside, other=0.0).to(tl.float32)
        xq = tl.floor(value * inverse + 0.5).to(tl.int32)
        total += xq
        if lane < 4:
            low |= (xq & 255) << (8 * lane)
        else:
            high |= (xq & 255) << (8 * (lane - 4))
    dx = amax / 127.0
    x_sum = dx * tl.sum(total, axis=1, keep_dims=True).to(tl.float32)
    return low, high, dx, x_sum


@triton.jit
def _add_row(acc, row, words_ptr, scales_ptr, x_ptr, x_stride, in_features, first, s, r,
             num_rows, num_subs, low, high, word_scale, d, scale, min_term, QTYPE: tl.constexpr,
             ASM: tl.constexpr, FUSED: tl.constexpr):  # fmt: skip
    x_low, x_high, dx, x_sum = _x_step(words_ptr, scales_ptr, x_ptr, x_stride, in_features, row,
                                       first, s, r, num_rows, num_subs, QTYPE, FUSED)  # fmt: skip
    return acc + _row_step(x_low, x_high, dx, x_sum, low, high, word_scale, d, scale, min_term,
                           QTYPE, ASM)  # fmt: skip


@triton.jit
def _row_step(x_low, x_high, dx, x_sum, low, high, word_scale, d, scale, min_term,
              QTYPE: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """What the step's sub-blocks add to one row of x's sums [S, 1, N] (float32), x as _x_step
    gives it."""
    if QTYPE == Q8_0:
        dots = _dot4(low, x_low, 0, True, ASM)
    else:
        dots = _dot4(high, x_high, _dot4(low, x_low, 0, False, ASM), False, ASM)
        if QTYPE == Q4_0 or QTYPE == Q5_0 or QTYPE == Q6_K:
            offset: tl.constexpr = 8 if QTYPE == Q4_0 else (16 if QTYPE == Q5_0 else 32)
            ones = tl.full([1, 1, 1], 0x01010101, tl.int32)
            x_dot_ones = _dot4(ones, x_high, _dot4(ones, x_low, 0, False, ASM), False, ASM)
            dots -= offset * x_dot_ones
    sums = tl.sum(dots * word_scale, axis=1, keep_dims=True)  # [S, 1, N]
    step = (sums * scale).to(tl.float32) * (d * dx)
    if QTYPE == Q4_1 or QTYPE == Q4_K or QTYPE == Q5_K:
        step -= min_term * x_sum
    return step


@triton.jit
def _dot_kernel(
    words_ptr, scales_ptr, x_ptr, qs_ptr, qh_ptr, sm_ptr, d_ptr, bias_ptr, out_ptr, partial_ptr,
    counter_ptr, num_rows, in_features, x_stride, out_features, out_stride, columns,
    num_subs,  # the planes' padded count
    subs_per_split, num_splits,  # subs_per_split: a multiple of SUBS
    QTYPE: tl.constexpr,
    ROWS: tl.constexpr,  # x's rows, at most 4
    BLOCK_N: tl.constexpr, SUBS: tl.constexpr, ASM: tl.constexpr,
    SPLITS_AT_ONCE: tl.constexpr,
    FUSED: tl.constexpr,  # x quantized here (x_ptr), not read from words_ptr and scales_ptr
    HAS_BIAS: tl.constexpr,  # bias_ptr [out_features] added to the result
):  # fmt: skip
    # out [num_rows, out_features] in x's dtype, rows out_stride apart. Split along K
    # (num_splits > 1), a program writes float32 sums to partial [num_splits, num_rows,
    # out_features] and the last of a tile's programs to count itself in counter_ptr[tile] adds
    # them up (and zeroes the count).
    # Tiles [S, R, N]: S sub-blocks, their R words (a thread holds all), N output rows (4 a
    # thread: 16-byte loads). No masks: planes and x are padded along K, planes along N. A row
    # of x keeps sums of its own until the loop ends.
    split = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = cols[None, None, :]  # [1, 1, N]
    s = tl.arange(0, SUBS)[:, None, None]
    r = tl.arange(0, 8 if QTYPE == Q8_0 else 4)[None, :, None]
    acc0 = tl.zeros([SUBS, 1, BLOCK_N], dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    count = tl.minimum(subs_per_split, num_subs - split * subs_per_split)
    for s0 in range(0, count, SUBS):
        first = split * subs_per_split + s0
        low, high, word_scale = _weight_words(qs_ptr, qh_ptr, sm_ptr, first, s, r, n, columns,
                                              QTYPE)  # fmt: skip
        d, scale, minimum, d_min = _scales(sm_ptr, d_ptr, first + s, n, columns, None, QTYPE)
        min_term = 0.0
        if QTYPE == Q4_1:
            min_term = -d_min
        if QTYPE == Q4_K or QTYPE == Q5_K:
            min_term = d_min * minimum.to(tl.float32)
        acc0 = _add_row(acc0, 0, words_ptr, scales_ptr, x_ptr, x_stride, in_features, first, s,
                        r, num_rows, num_subs, low, high, word_scale, d, scale, min_term, QTYPE,
                        ASM, FUSED)  # fmt: skip
        if ROWS > 1:
            acc1 = _add_row(acc1, 1, words_ptr, scales_ptr, x_ptr, x_stride, in_features, first,
                            s, r, num_rows, num_subs, low, high, word_scale, d, scale, min_term,
                            QTYPE, ASM, FUSED)  # fmt: skip
        if ROWS > 2:
            acc2 = _add_row(acc2, 2, words_ptr, scales_ptr, x_ptr, x_stride, in_features, first,
                            s, r, num_rows, num_subs, low, high, word_scale, d, scale, min_term,
                            QTYPE, ASM, FUSED)  # fmt: skip
            acc3 = _add_row(acc3, 3, words_ptr, scales_ptr, x_ptr, x_stride, in_features, first,
                            s, r, num_rows, num_subs, low, high, word_scale, d, scale, min_term,
                            QTYPE, ASM, FUSED)  # fmt: skip
    if num_splits == 1:
        _store_rows(out_ptr, n, out_features, out_stride, num_rows, acc0, acc1, acc2, acc3,
                    bias_ptr, ROWS, HAS_BIAS)  # fmt: skip
    else:
        at = partial_ptr + split * num_rows * out_features
        _store_rows(at, n, out_features, out_features, num_rows, acc0, acc1, acc2, acc3,
                    bias_ptr, ROWS, False)  # fmt: skip
        tl.debug_barrier()  # every thread's partial sums stored before the count
        tile = tl.program_id(0)
        if tl.atomic_add(counter_ptr + tile, 1) == num_splits - 1:  # acq_rel, GPU scope
            _sum_splits(partial_ptr, out_ptr, n, out_features, out_stride, num_rows, num_splits,
                        bias_ptr, ROWS, SPLITS_AT_ONCE, HAS_BIAS)  # fmt: skip
            tl.atomic_xchg(counter_ptr + tile, 0)


@triton.jit
def _store_rows(out_ptr, n, out_features, out_stride, num_rows, acc0, acc1, acc2, acc3,
                bias_ptr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Rows [num_rows, out_features] at out_ptr (out_stride apart), columns n [1, 1, N], of the
    sums acc* [S, 1, N] (a sum over S left), plus the bias where HAS_BIAS."""
    in_row = n < out_features
    bias = _bias(bias_ptr, n, in_row, HAS_BIAS)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + n, (tl.sum(acc0, axis=0, keep_dims=True) + bias).to(dtype), mask=in_row)
    for row in tl.static_range(1, ROWS):
        acc = acc1 if row == 1 else (acc2 if row == 2 else acc3)
        if row < num_rows:
            total = (tl.sum(acc, axis=0, keep_dims=True) + bias).to(dtype)
            tl.store(out_ptr + row * out_stride + n, total, mask=in_row)


@triton.jit
def _bias(bias_ptr, n, in_row, HAS_BIAS: tl.constexpr):
    bias = tl.zeros(n.shape, dtype=tl.float32)
    if HAS_BIAS:
        bias += tl.load(bias_ptr + n, mask=in_row, other=0.0).to(tl.float32)
    return bias


@triton.jit
def _sum_splits(partial_ptr, out_ptr, n, out_features, out_stride, num_rows, num_splits,
                bias_ptr, ROWS: tl.constexpr, SPLITS_AT_ONCE: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """out rows (out_stride apart) = the bias + the sum over splits of partial [num_splits,
    num_rows, out_features], columns n [1, 1, N]: SPLITS_AT_ONCE loads in flight at a time, read
    past L1 (other SMs wrote them)."""
    in_row = n < out_features
    bias = _bias(bias_ptr, n, in_row, HAS_BIAS)
    splits = tl.arange(0, SPLITS_AT_ONCE)[:, None, None]
    for row in tl.static_range(ROWS):
        if row < num_rows:
            total = tl.zeros(n.shape, dtype=tl.float32)
            for first in range(0, num_splits, SPLITS_AT_ONCE):
                split = first + splits
                at = partial_ptr + (split * num_rows + row) * out_features + n
                parts = tl.load(at, mask=in_row & (split < num_splits), other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                total += tl.sum(parts, axis=0, keep_dims=True)
            tl.store(out_ptr + row * out_stride + n, (total + bias).to(out_ptr.dtype.element_ty),
                     mask=in_row)  # fmt: skip


def quantize_x(x):
    """x [rows, in_features] -> (words [rows, K/4] int32 of four int8 each, scales [2, rows,
    K/32] float32: dx and dx * sum of the sub-block's xq; K in_features padded as the planes
    pad it, the padding zero): what gguf_dot reads."""
    import torch

    from kernels.gguf_planes import padded_in_features

    assert x.stride(1) == 1 and x.shape[1] % 32 == 0
    num_rows, num_subs = x.shape[0], padded_in_features(x.shape[1]) // 32
    words = torch.empty(num_rows, num_subs * 8, dtype=torch.int32, device=x.device)
    scales = torch.empty(2, num_rows, num_subs, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_x_kernel[(num_rows, triton.cdiv(num_subs, QUANTIZE_SUBS))](
            x, words, scales, x.stride(0), num_rows, x.shape[1], num_subs, SUBS=QUANTIZE_SUBS
        )
    return words, scales


def quantizes_in_kernel(planes, block_n: int = BLOCK_N) -> bool:
    """Whether gguf_dot quantizes x inside the GEMV for these planes by default: where the output
    is a few tiles, a kernel launch saved outweighs the work every program repeats on x."""
    return triton.cdiv(planes.out_features, block_n) <= FUSED_MAX_TILES


def gguf_dot(
    x, planes, num_splits=None, asm=True, block_n=BLOCK_N, subs=SUBS_PER_STEP,
    num_warps=NUM_WARPS, quantized=None, target_programs=TARGET_PROGRAMS,
    splits_at_once=SPLITS_AT_ONCE, out=None, fused=None, bias=None,
):  # fmt: skip
    """x [rows <= 4, in_features] @ W^T -> [rows, out_features] in x's dtype (written into
    `out` when given: such a tensor with unit column stride, a fused projection's columns of
    this part, say), W the Planes of kernels/gguf_planes.py, by int8 dot products (x quantized
    per 32 values, or `quantized`, what quantize_x made of x). num_splits None: enough programs
    to fill the GPU; asm False: dp4a emulated (Triton's interpreter cannot run inline assembly).
    A program reads block_n output rows, subs sub-blocks of 32 values per loop step; the last
    program of a tile sums its splits' partial sums splits_at_once at a time. fused: each
    program quantizes the part of x it reads itself (no quantize_x kernel; None: where
    quantizes_in_kernel says so, and `quantized` is None). bias [out_features]: added to the
    result (in float32)."""
    import torch

    check_planes(planes)
    out_features, in_features = planes.out_features, planes.in_features
    if out is None:
        out = x.new_empty(x.shape[0], out_features)
    assert out.shape == (x.shape[0], out_features) and out.dtype == x.dtype
    if x.shape[0] == 0:
        return out
    assert x.shape[1] == in_features and x.shape[0] <= 4 and out.stride(1) == 1
    assert bias is None or (bias.shape == (out_features,) and bias.stride(0) == 1)
    if fused is None:
        fused = quantized is None and quantizes_in_kernel(planes, block_n)
    if fused:
        assert quantized is None and x.stride(1) == 1
        words, scales = x, x  # unread
    else:
        words, scales = quantized if quantized is not None else quantize_x(x)
    num_rows, num_subs = x.shape[0], planes.padded_subs
    assert planes.columns % block_n == 0 and 4 % subs == 0  # no load passes the padding
    num_tiles, num_steps = triton.cdiv(out_features, block_n), triton.cdiv(num_subs, subs)
    if num_splits is None:
        num_splits = triton.cdiv(target_programs, num_tiles)
    steps_per_split = triton.cdiv(num_steps, max(1, min(num_splits, num_steps)))
    num_splits = triton.cdiv(num_steps, steps_per_split)
    partial = out
    if num_splits > 1:
        partial = torch.empty(num_splits, num_rows, out_features, device=x.device,
                              dtype=torch.float32)  # fmt: skip
    _dot_kernel[(num_tiles, num_splits)](
        words, scales, x, *planes.pointers(), out if bias is None else bias, out, partial,
        _split_counters(x.device, num_tiles), num_rows, in_features, x.stride(0), out_features,
        out.stride(0), planes.columns, num_subs, steps_per_split * subs, num_splits,
        QTYPE=int(planes.qtype), ROWS=triton.next_power_of_2(num_rows), BLOCK_N=block_n,
        SUBS=subs, ASM=asm, SPLITS_AT_ONCE=min(splits_at_once, triton.next_power_of_2(num_splits)),
        FUSED=bool(fused), HAS_BIAS=bias is not None, num_warps=num_warps,
    )  # fmt: skip
    return out


_COUNTERS: dict = {}


def _split_counters(device, num_tiles: int):
    """Zeroed int32 counts, one per output tile, that every GEMV on `device` shares (launches on
    one stream never overlap, and each leaves them at zero). Allocated the first time (a warm-up
    before any CUDA graph capture) and kept."""
    import torch

    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < num_tiles:
        counters = torch.zeros(max(num_tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters

"""GGUF-quantized weights (runtime/models/quant.py, kernels/cpu/quant_matmul.cpp) against their
oracle: gguf-py's dequantize, then a float32 matmul."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from kernels import native
from runtime.models import cpu_kernels, quant
from runtime.models.catalog import pull
from runtime.models.quant import QuantizedEmbedding, QuantizedLinear, random_blocks
from runtime.models.source import known_model_file

Q = gguf.GGMLQuantizationType
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)  # gguf-py's quantize makes these
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native.native_ops() is not None, "the native CPU kernels did not build (see the log)"


def oracle(blocks: np.ndarray, qtype, out_features, in_features) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks, qtype).astype(np.float32)
    return torch.from_numpy(values.reshape(out_features, in_features))


def quantized(qtype, out_features, in_features, rng) -> np.ndarray:
    if qtype in K_QUANTS:
        return random_blocks(qtype, out_features, in_features, rng)
    weights = rng.standard_normal((out_features, in_features)).astype(np.float32)
    return gguf.quants.quantize(weights, qtype)


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
def test_dequantize_is_gguf_py(qtype):
    rng = np.random.default_rng(int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    blocks = random_blocks(qtype, 7, 3 * block, rng)  # random bits: every code path of the type
    linear = QuantizedLinear(blocks, qtype, 7, 3 * block)
    torch.testing.assert_close(
        linear.dequantize(), oracle(blocks, qtype, 7, 3 * block), atol=0, rtol=0
    )
    assert linear.weight_nbytes == blocks.nbytes


def x_group(qtype, in_features: int) -> int:
    """The values of x that share a step in quant_dot: a K-quant's block of 256; else the most
    of 256, 128, 64 and 32 that divides a row."""
    if qtype in K_QUANTS:
        return 256
    return next(g for g in (256, 128, 64, 32) if in_features % g == 0)


def rounded_in_groups(x: torch.Tensor, group: int, top: int) -> torch.Tensor:
    """dx * round(x / dx) per group of a row, dx = max|x| / top, in float32 as the kernels."""
    groups = x.float().reshape(x.shape[0], -1, group)
    amax = groups.abs().amax(-1, keepdim=True)
    # a division, as the kernels' 127.f / top: `top / amax` is reciprocal(amax) * top in torch, a
    # second rounding that moved a near-tie (x * inverse = -52.500004) to the other code
    inverse = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    return (torch.round(groups * inverse) * (amax / top)).reshape(x.shape)


def rounded_to_int16_groups(x: torch.Tensor, qtype) -> torch.Tensor:
    """x as quant_dot sees it."""
    return rounded_in_groups(x, x_group(qtype, x.shape[1]), 32767)


def rounded_to_int8_groups(x: torch.Tensor, qtype) -> torch.Tensor:
    """x as quant_gemm_int8 sees it, as the kernel declares it for the type: 8 bits in steps of
    32 values (llama.cpp's Q8_0); 7 bits in steps of 16 against Q8_0 on AVX2 without VNNI."""
    group, top = native.native_ops().quant_int8_x_rounding(int(qtype))
    return rounded_in_groups(x, group, top)


needs_int16_kernels = pytest.mark.skipif(
    not cpu_kernels.integer_dots(), reason="quant_dot and quant_gemm_int16 need x86 with AVX2"
)


@needs_int16_kernels
@pytest.mark.parametrize("kernel", ["quant_dot", "quant_gemm_int16"])
@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16, 41])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int16_kernels_are_the_oracle_on_int16_rounded_activations(kernel, qtype, rows, dtype):
    rng = np.random.default_rng(rows * 17 + int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    out_features, in_features = 29, block * (5 if block == 32 else 2)
    blocks = quantized(qtype, out_features, in_features, rng)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32)).to(dtype)
    x[0, : x_group(qtype, in_features)] = 0  # an all-zero group: step 0
    plain = rows if rows == 1 else rows - 1
    x[plain:, -3] = 40.0  # an outlier: the rest of its group is rounded more coarsely
    weight = oracle(blocks, qtype, out_features, in_features)
    expected = rounded_to_int16_groups(x, qtype) @ weight.T
    got = getattr(native.native_ops(), kernel)(
        x, torch.from_numpy(blocks.copy()), int(qtype), out_features, in_features
    )
    assert got.dtype == dtype
    scale = expected.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the result's own rounding
    torch.testing.assert_close(got.float(), expected, atol=tol * scale, rtol=tol)
    if dtype == torch.float32:  # rows without an outlier: within 1e-4 of float32 activations
        exact = x[:plain] @ weight.T
        torch.testing.assert_close(got[:plain], exact, atol=1e-4 * scale, rtol=1e-4)


@needs_int16_kernels
@pytest.mark.parametrize("kernel", ["quant_dot", "quant_gemm_int16"])
@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, qtype, dtype):
    """A verify of k drafts runs k + 1 rows in one call: each row must come out bit for bit as
    it does alone, as a plain decode step computes it."""
    rng = np.random.default_rng(int(qtype) + 5)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    out_features, in_features = 19, block * (3 if block == 32 else 2)
    blocks = torch.from_numpy(quantized(qtype, out_features, in_features, rng).copy())
    x = torch.from_numpy(rng.standard_normal((13, in_features)).astype(np.float32)).to(dtype)
    multiply = getattr(native.native_ops(), kernel)
    alone = torch.cat([multiply(x[i : i + 1], blocks, int(qtype), out_features, in_features)
                       for i in range(13)])  # fmt: skip
    for rows in (2, 3, 5, 6, 7, 13):
        together = multiply(x[:rows], blocks, int(qtype), out_features, in_features)
        assert torch.equal(together, alone[:rows]), rows


@pytest.mark.skipif(not cpu_kernels.bf16_tiles(), reason="quant_gemm needs AVX-512 BF16 and no AMX")
@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 4, 7, 33])
def test_bf16_tiles_are_the_oracle_on_bfloat16_weights(qtype, rows):
    rng = np.random.default_rng(rows * 17 + int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    # 2 or 3 tiles (at most 256 KiB of bfloat16 each, one per thread at least), the last ragged
    out_features, in_features = 301, block * (8 if block == 32 else 4)
    blocks = quantized(qtype, out_features, in_features, rng)
    weights = oracle(blocks, qtype, out_features, in_features).bfloat16().float()
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32)).bfloat16()
    raw = torch.from_numpy(blocks).view(torch.uint8).reshape(out_features, -1)
    got = native.native_ops().quant_gemm(x, raw, int(qtype), out_features, in_features)
    expected = x.float() @ weights.T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    scale = expected.abs().max().item()  # the only rounding left: the output's to bfloat16
    torch.testing.assert_close(got.float(), expected, atol=1e-3 * scale, rtol=8e-3)


needs_int8_tiles = pytest.mark.skipif(
    not cpu_kernels.int8_tiles(), reason="quant_gemm_int8 needs AVX2"
)


@needs_int8_tiles
@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
# 300 rows: a chunk of 256 (quant_gemm_int8.cpp's kChunkRows) and a ragged one
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_tiles_are_the_oracle_on_int8_rounded_activations(qtype, rows, dtype):
    rng = np.random.default_rng(rows * 13 + int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    # 301 weight rows: 2 or 3 tiles, the last ragged, and not a multiple of the 6 a step takes
    out_features, in_features = 301, block * (8 if block == 32 else 4)
    blocks = quantized(qtype, out_features, in_features, rng)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32)).to(dtype)
    x[0, :256] = 0  # all-zero groups: step 0
    x[rows - 1, -3] = 40.0  # an outlier: the rest of its group is rounded more coarsely
    weight = oracle(blocks, qtype, out_features, in_features).double()
    expected = rounded_to_int8_groups(x, qtype).double() @ weight.T
    raw = torch.from_numpy(blocks).view(torch.uint8).reshape(out_features, -1)
    got = native.native_ops().quant_gemm_int8(x, raw, int(qtype), out_features, in_features)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    scale = expected.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bfloat16: the result's own rounding
    torch.testing.assert_close(got.double(), expected, atol=tol * scale, rtol=tol)


@needs_int8_tiles
@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
def test_x_keeps_8_bits_except_against_q8_0_on_avx2_alone(qtype):
    """vpmaddubsw adds two products into 16 bits: Q8_0's unsigned codes (up to 255) times x up
    to 127 would saturate, so AVX2 without VNNI rounds x to 63 in steps of 16 values against
    Q8_0; vpdpbusd adds into 32 bits and keeps 127 in steps of 32 for every type."""
    rounding = native.native_ops().quant_int8_x_rounding(int(qtype))
    if qtype != Q.Q8_0:
        assert rounding == [32, 127]
    elif "CONVEYOR_NATIVE_MARCH" not in os.environ:  # else the build's flags are not the CPU's
        vnni = {"avx512_vnni", "avx_vnni"} & native.cpu_flags()
        assert rounding == ([32, 127] if vnni else [16, 63])


@needs_int8_tiles
def test_q8_0_codes_at_both_extremes_do_not_saturate():
    """The largest products a 16-bit pair can hold: every weight code -128 or 127 against x at
    its largest code of either sign; the kernel's sums must be exact."""
    in_features, rows = 256, 9
    blocks = np.zeros((4, in_features // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)  # d = 1
    codes = np.array([[-128, 127], [127, -128], [-128, -128], [127, 127]], dtype=np.int8)
    blocks[..., 2:] = np.tile(codes, 16).view(np.uint8)[:, None, :]
    raw = torch.from_numpy(blocks.reshape(4, -1))
    x = torch.tensor([[1.0, -1.0], [-1.0, 1.0], [1.0, 1.0]]).repeat(3, in_features // 2)[:rows]
    weight = oracle(raw.numpy(), Q.Q8_0, 4, in_features).double()
    expected = rounded_to_int8_groups(x, Q.Q8_0).double() @ weight.T
    ops = native.native_ops()
    for kernel in (ops.quant_gemm_int8, ops.quant_dot_int8):
        got = kernel(x, raw, int(Q.Q8_0), 4, in_features).double()
        torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)


@needs_int8_tiles
@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q8_0, Q.Q6_K), ids=lambda t: t.name)
def test_int8_tiles_row_does_not_depend_on_the_rows_beside_it(qtype):
    """A prompt's rows must round the same in one chunk or a few (step_kind)."""
    rng = np.random.default_rng(int(qtype) + 9)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    out_features, in_features = 23, block * (3 if block == 32 else 2)
    blocks = torch.from_numpy(quantized(qtype, out_features, in_features, rng).copy())
    x = torch.from_numpy(rng.standard_normal((270, in_features)).astype(np.float32)).bfloat16()
    ops = native.native_ops()
    together = ops.quant_gemm_int8(x, blocks, int(qtype), out_features, in_features)
    # ymm lanes up to 8 rows; 250-262 across the first chunk of 256 rows (gemm_in's kChunkRows)
    for start, stop in ((0, 1), (3, 5), (2, 10), (16, 33), (34, 35), (250, 262), (200, 270)):
        apart = ops.quant_gemm_int8(x[start:stop], blocks, int(qtype), out_features, in_features)
        assert torch.equal(apart, together[start:stop]), (start, stop)


@needs_int8_tiles
@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dots_are_the_int8_tiles_bit_for_bit(qtype, dtype):
    """quant_dot_int8 (few rows) and quant_gemm_int8 (many) round a row alike, so a decode row
    comes out the same alone, beside its drafts or in a full batch. Ragged tiles of 8 weight
    rows, passes of up to 4 rows of x, an all-zero group and an outlier."""
    rng = np.random.default_rng(int(qtype) + 21)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    ops = native.native_ops()
    for out_features, in_features in (
        (29, block * (5 if block == 32 else 2)),
        (301, 512),
        (1, 256),
    ):
        blocks = torch.from_numpy(quantized(qtype, out_features, in_features, rng).copy())
        x = torch.from_numpy(rng.standard_normal((9, in_features)).astype(np.float32)).to(dtype)
        x[0, :32] = 0
        x[-1, -3] = 40.0
        args = (int(qtype), out_features, in_features)
        for rows in (1, 2, 3, 4, 5, 9):
            dots = ops.quant_dot_int8(x[:rows], blocks, *args)
            assert dots.dtype == dtype and dots.shape == (rows, out_features)
            assert torch.equal(dots, ops.quant_gemm_int8(x[:rows], blocks, *args)), (
                rows,
                out_features,
            )


@needs_int8_tiles
def test_8_bit_rows_take_int8_dots_or_tiles_by_count_unless_told_not_to():
    rng = np.random.default_rng(11)
    blocks = quantized(Q.Q5_0, 40, 96, rng)
    linear = QuantizedLinear(blocks, Q.Q5_0, 40, 96)
    ops = native.native_ops()

    def kernel_of(name, x):
        return getattr(ops, name)(x, linear.blocks, int(Q.Q5_0), 40, 96)

    decode = torch.randn(cpu_kernels.INT8_DECODE_ROWS + 1, 96).bfloat16()
    few = decode[: cpu_kernels.INT8_DECODE_ROWS]
    assert torch.equal(linear(decode), kernel_of("quant_gemm_int8", decode))
    assert torch.equal(linear(few), kernel_of("quant_dot_int8", few))
    for has_prompt_rows, drafted_seqs in ((True, 0), (False, 1)):  # the same kernels
        with cpu_kernels.step_kind(has_prompt_rows, drafted_seqs):
            assert torch.equal(linear(few), kernel_of("quant_dot_int8", few))
            assert torch.equal(linear(decode), kernel_of("quant_gemm_int8", decode))
    with cpu_kernels.step_kind(has_prompt_rows=False, int8_activations=False):  # dtype
        quant_dot = kernel_of("quant_dot", few)
        assert torch.equal(linear(few), quant_dot)
        assert not torch.equal(quant_dot, kernel_of("quant_dot_int8", few))
    if cpu_kernels.int16_tiles():  # AVX2 without AVX-512: decode steps of 7 to 96 rows
        most = torch.randn(cpu_kernels.INT16_TILE_DECODE_ROWS + 1, 96).bfloat16()
        more = most[: cpu_kernels.DECODE_ROWS + 1]
        with cpu_kernels.step_kind(has_prompt_rows=False, int8_activations=False):
            assert torch.equal(linear(more), kernel_of("quant_gemm_int16", more))
            assert torch.equal(linear(more[:-1]), kernel_of("quant_dot", more[:-1]))
            assert torch.equal(linear(most[:-1]), kernel_of("quant_gemm_int16", most[:-1]))
            assert not torch.equal(linear(most), kernel_of("quant_gemm_int16", most))  # tiles
        with cpu_kernels.step_kind(has_prompt_rows=True, int8_activations=False):  # tiles
            assert not torch.equal(linear(more), kernel_of("quant_gemm_int16", more))
    if cpu_kernels.bf16_tiles():
        many = torch.randn(cpu_kernels.DECODE_ROWS + 1, 96).bfloat16()
        with cpu_kernels.step_kind(has_prompt_rows=False, int8_activations=False):
            assert torch.equal(linear(many), kernel_of("quant_gemm", many))


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 17, 512])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_linear_matches_dequantized_matmul(qtype, rows, dtype, tol):
    rng = np.random.default_rng(rows * 31 + int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    out_features, in_features = 37, block * (3 if block == 32 else 2)
    blocks = quantized(qtype, out_features, in_features, rng)
    bias = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32))
    linear = QuantizedLinear(blocks, qtype, out_features, in_features, bias=bias)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32)).to(dtype)
    expected = torch.nn.functional.linear(
        x.float(), oracle(blocks, qtype, out_features, in_features), bias
    )
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    kernel = cpu_kernels.native_kernel(native.native_ops(), x)
    if kernel is not None and kernel.__name__ == "quant_dot":
        tol = max(tol, 2e-4)  # x in int16 per group: ~1e-5 of the largest output
    if kernel is not None and kernel.__name__ in ("quant_gemm_int8", "quant_dot_int8"):
        tol = max(tol, 2e-2)  # x in 8 bits per group
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=tol * scale, rtol=tol)


def test_prefill_tiles_cover_every_output_row(monkeypatch):
    monkeypatch.setattr(quant, "TILE_VALUES", 5 * 64)  # 5 output rows a tile, 41 rows: 9 tiles
    rng = np.random.default_rng(5)
    blocks = quantized(Q.Q8_0, 41, 64, rng)
    with cpu_kernels.step_kind(has_prompt_rows=True, int8_activations=False):
        x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
        expected = x @ oracle(blocks, Q.Q8_0, 41, 64).T
        got = QuantizedLinear(blocks, Q.Q8_0, 41, 64)(x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fallback_without_native_kernels_is_the_oracle(monkeypatch):
    monkeypatch.setattr(quant, "native_ops", lambda: None)
    rng = np.random.default_rng(6)
    blocks = random_blocks(Q.Q6_K, 5, 256, rng)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    expected = x @ oracle(blocks, Q.Q6_K, 5, 256).T
    monkeypatch.setattr(cpu_kernels, "integer_dots", lambda: False)
    got = QuantizedLinear(blocks, Q.Q6_K, 5, 256)(x)  # 64 rows a matmul: float32 rounding apart
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_torch_matmul_on_tiles_rounds_a_row_the_same_in_any_number_of_rows(monkeypatch):
    """Tiles dequantized for torch's matmul (rows not 8-bit, AMX: every prompt step): oneDNN
    picks its kernel by the row count, and a row of 24 rounded otherwise than in 40, so a
    prefix-cache hit (the prompt's last rows alone) flipped a greedy near-tie. Shapes where it
    did: SmolLM2's."""
    monkeypatch.setattr(quant, "native_ops", lambda: None)
    rng = np.random.default_rng(8)
    for out_features, in_features in ((1252, 576), (576, 1536)):
        blocks = random_blocks(Q.Q8_0, out_features, in_features, rng)
        linear = QuantizedLinear(blocks, Q.Q8_0, out_features, in_features)
        x = torch.randn(100, in_features, generator=torch.Generator().manual_seed(8)).bfloat16()
        every_row = linear(x)
        for count in (1, 8, 16, 24, 33, 64, 65, 99):
            assert torch.equal(linear(x[-count:]), every_row[-count:]), (out_features, count)


@pytest.mark.parametrize("qtype", (Q.Q5_0, Q.Q4_K), ids=lambda t: t.name)
def test_embedding_dequantizes_the_rows_looked_up(qtype):
    rng = np.random.default_rng(7)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    blocks = random_blocks(qtype, 50, block, rng)
    embedding = QuantizedEmbedding(blocks, qtype, 50, block)
    ids = torch.tensor([[3, 49, 3], [0, 7, 12]])
    torch.testing.assert_close(
        embedding(ids), oracle(blocks, qtype, 50, block)[ids], atol=0, rtol=0
    )
    with pytest.raises(IndexError):
        embedding(torch.tensor([50]))


def test_shape_that_the_blocks_cannot_hold_is_refused():
    blocks = np.zeros((4, 34), np.uint8)
    with pytest.raises(ValueError):
        QuantizedLinear(blocks, Q.Q8_0, 4, 48)
    with pytest.raises(ValueError):
        QuantizedLinear(blocks, Q.Q8_0, 4, 64)


@pytest.mark.slow
def test_real_tensors_of_every_type_in_the_file():
    pull("qwen2.5-coder-0.5b-instruct")
    reader = gguf.GGUFReader(known_model_file("qwen2.5-coder-0.5b-instruct"))
    checked = set()
    for tensor in reader.tensors:
        if tensor.tensor_type == Q.F32 or tensor.tensor_type in checked:
            continue
        checked.add(tensor.tensor_type)
        linear = QuantizedLinear.from_reader_tensor(tensor)
        assert linear.blocks.data_ptr() == tensor.data.ctypes.data  # a view of the file, no copy
        expected = oracle(tensor.data, tensor.tensor_type, linear.out_features, linear.in_features)
        x = torch.randn(4, linear.in_features, generator=torch.Generator().manual_seed(1))
        kernel = cpu_kernels.native_kernel(native.native_ops(), x)
        if kernel is not None and kernel.__name__ in ("quant_dot_int8", "quant_gemm_int8"):
            x = rounded_to_int8_groups(x, tensor.tensor_type)  # as the kernel sees it
        elif cpu_kernels.integer_dots():
            x = rounded_to_int16_groups(x, tensor.tensor_type)
        torch.testing.assert_close(linear(x), x @ expected.T, atol=1e-3, rtol=1e-3)
    assert checked == {Q.Q8_0, Q.Q5_0, Q.Q6_K, Q.Q4_K}

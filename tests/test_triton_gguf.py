"""kernels/triton_gguf.py against its oracle: gguf-py's dequantize, then a float64 matmul, on the
planes kernels/gguf_planes.py repacks the blocks into.

Weights: gguf-py's quantize of random floats for the types it makes, random blocks with finite
scales for the K-quants (random bits reach every code path), real tensors from the files (slow).
With CUDA the kernels run compiled; without it under Triton's interpreter (set before triton is
first imported, as in test_kernels_triton.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kernels import triton_gguf, triton_gguf_dot  # noqa: E402
from kernels.gguf_planes import plane_nbytes, repack  # noqa: E402
from runtime.models import quant  # noqa: E402
from runtime.models.quant import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)  # gguf-py's quantize makes these
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
TYPES = QUANTIZABLE + K_QUANTS
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def quantized(qtype, out_features: int, in_features: int, rng) -> np.ndarray:
    """[out_features, row_bytes] uint8 blocks of qtype."""
    if qtype in K_QUANTS:
        return random_blocks(qtype, out_features, in_features, rng)
    weights = rng.standard_normal((out_features, in_features)).astype(np.float32)
    return gguf.quants.quantize(weights, qtype)


def oracle(blocks: np.ndarray, qtype) -> torch.Tensor:
    """[out_features, in_features] float64 by gguf-py."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64))


def inputs(qtype, rows: int, out_features: int, num_blocks: int, dtype, seed: int):
    """(x [rows, in] in dtype, the weight's planes on DEVICE, the oracle weight)."""
    rng = np.random.default_rng(seed)
    in_features = gguf.GGML_QUANT_SIZES[qtype][0] * num_blocks
    blocks = quantized(qtype, out_features, in_features, rng)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32))
    planes = repack(torch.from_numpy(blocks).to(DEVICE), qtype, in_features)
    return x.to(DEVICE, dtype), planes, oracle(blocks, qtype)


def assert_matches(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0])
    expected = x.double().cpu() @ weight.T
    error = (y.double().cpu() - expected).norm() / expected.norm()
    assert error < TOLERANCE[x.dtype], f"relative error {error:.2e} in {x.dtype}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_py_bit_for_bit(qtype):
    """Random bits in every field: the repacked planes hold every value of the blocks."""
    rng = np.random.default_rng(int(qtype))
    in_features = gguf.GGML_QUANT_SIZES[qtype][0] * 3
    blocks = random_blocks(qtype, 37, in_features, rng)
    planes = repack(torch.from_numpy(blocks).to(DEVICE), qtype, in_features)
    values = triton_gguf.gguf_dequantize(planes, torch.float32)
    torch.testing.assert_close(values.cpu().double(), oracle(blocks, qtype), atol=0, rtol=0)
    ids = torch.tensor([36, 0, 5, 5], device=DEVICE)  # an embedding lookup picks rows
    picked = triton_gguf.gguf_dequantize(planes, torch.float32, ids).cpu().double()
    torch.testing.assert_close(picked, oracle(blocks, qtype)[ids.cpu()], atol=0, rtol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_planes_take_the_files_bytes_and_at_most_3_percent_more(qtype):
    in_features = 256 * 6
    file_bytes = 512 * quant.row_bytes(qtype, in_features)
    assert file_bytes <= plane_nbytes(qtype, 512, in_features) <= 1.03 * file_bytes


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rows", "out_features", "dtype"),
    [(5, 37, torch.bfloat16), (17, 70, torch.float32), (64, 37, torch.float16)],
)
def test_tiled_kernel_is_the_oracle(qtype, rows, out_features, dtype):
    num_blocks = 3 if qtype in QUANTIZABLE else 2
    x, planes, weight = inputs(qtype, rows, out_features, num_blocks, dtype, seed=rows)
    y = triton_gguf.gguf_tiled(x, planes)
    assert_matches(y, x, weight)


@pytest.mark.parametrize("rows", [0, 1, 4, 5])
def test_matmul_picks_the_integer_dot_for_few_rows(rows, monkeypatch):
    called = []
    for module, name in ((triton_gguf_dot, "gguf_dot"), (triton_gguf, "gguf_tiled")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **kw: (
            called.append(name), real(*a, **kw))[1])  # fmt: skip
    x, planes, weight = inputs(Q.Q8_0, rows, 20, 2, torch.float32, seed=rows)
    y = triton_gguf.gguf_matmul(x, planes)
    assert called == ["gguf_dot" if rows <= triton_gguf.GEMV_ROWS else "gguf_tiled"]
    if rows > triton_gguf.GEMV_ROWS:
        assert_matches(y, x, weight)
    elif rows:  # x quantized to int8 per 32 values
        assert_matches(y.to(torch.bfloat16), x.to(torch.bfloat16), weight)
    assert y.shape == (rows, 20)


def test_kernel_types_per_device(monkeypatch):
    assert quant.quantized_kernel_types("cpu") == quant.NATIVE_TYPES
    assert quant.quantized_kernel_types("cuda") == quant.TRITON_TYPES
    assert quant.quantized_kernel_types("meta") == frozenset()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # triton missing
    assert quant.quantized_kernel_types("cuda") == frozenset()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", (Q.Q4_0, Q.Q4_K, Q.Q6_K), ids=lambda t: t.name)
def test_512_rows_and_a_wider_weight(qtype):
    x, planes, weight = inputs(qtype, 512, 130, 4, torch.bfloat16, seed=512)
    assert_matches(triton_gguf.gguf_matmul(x, planes), x, weight)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def test_real_tensors_of_every_type_in_the_file(model):
    from runtime.models.catalog import pull
    from runtime.models.source import known_model_file

    pull(model)
    checked = set()
    for tensor in gguf.GGUFReader(known_model_file(model)).tensors:
        if tensor.tensor_type not in quant.TRITON_TYPES or tensor.tensor_type in checked:
            continue
        checked.add(tensor.tensor_type)
        blocks = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)[:16]  # 16 rows
        x = torch.randn(2, int(tensor.shape[0]), generator=torch.Generator().manual_seed(1))
        x = x.to(DEVICE)
        planes = repack(torch.from_numpy(blocks.copy()).to(DEVICE), tensor.tensor_type,
                        int(tensor.shape[0]))  # fmt: skip
        for rows in (x, x.repeat(3, 1)):  # integer dots (x quantized to int8), tiled
            y = triton_gguf.gguf_matmul(rows, planes)
            if rows.shape[0] <= triton_gguf.GEMV_ROWS:
                y, rows = y.to(torch.bfloat16), rows.to(torch.bfloat16)
            assert_matches(y, rows, oracle(blocks, tensor.tensor_type))
    assert checked == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0}


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_gguf as g
from kernels.triton_gguf_blocks import TYPES
ints = dict.fromkeys(("num_rows", "out_features", "in_features", "x_stride", "columns"), "i32")
planes = {"qs_ptr": "*i32", "qh_ptr": "*i32", "sm_ptr": "*i32", "d_ptr": "*i32"}
kernels = [
    (g._tiled_kernel, {"x_ptr": "*bf16", **planes, "out_ptr": "*bf16", **ints},
     dict(DOT_FP32=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), 8),
    (g._dequantize_kernel, {**planes, "ids_ptr": "*i64", "out_ptr": "*bf16", "num_ids": "i32",
     "in_features": "i32", "columns": "i32"}, dict(BLOCK_N=32, BLOCK_K=64), 4),
]
for qtype in TYPES:
    for fn, signature, constants, num_warps in kernels:
        constants = {**constants, "QTYPE": qtype}
        signature = {**signature, **dict.fromkeys(constants, "constexpr")}
        constexprs = {(fn.arg_names.index(k),): v for k, v in constants.items()}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps})
        assert "cubin" in compiled.asm
"""


@pytest.mark.slow
def test_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter accepts code that the compiler refuses: compile every kernel for sm_90
    (no GPU needed) in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]

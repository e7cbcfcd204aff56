"""kernels/triton_gguf_dot.py (on kernels/gguf_planes.py's planes) against its oracle: x quantized to int8 per 32 values as the kernel
does, dequantized, then a float64 matmul with gguf-py's dequantized weight (so the only slack is
float32 rounding); and near the unquantized product. With CUDA it runs compiled, with dp4a; without
it under Triton's interpreter with dp4a emulated.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import gguf  # noqa: E402
import pytest  # noqa: E402
from test_triton_gguf import DEVICE, TYPES, inputs  # noqa: E402

from kernels import triton_gguf_dot  # noqa: E402

Q = gguf.GGMLQuantizationType
ASM = DEVICE.type == "cuda"


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32 values, round(x * 127 / amax) * amax / 127 (float64)."""
    blocks = x.double().cpu().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)).float().double()
    codes = torch.floor(blocks * inverse + 0.5)
    return (codes * (amax.float() / 127).double()).reshape(x.shape)


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return float((y.double().cpu() - expected).norm() / expected.norm())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rows", "num_splits", "block_n", "subs"),
    [(1, None, 16, 4), (2, 2, 8, 2), (3, 3, 16, 4), (4, 1, 32, 1), (2, 12, 16, 1)],
)
def test_dot_is_the_oracle_on_quantized_x(qtype, rows, num_splits, block_n, subs):
    num_blocks = 17 if qtype.value < Q.Q4_K.value else 3  # a partial last step and split
    x, planes, weight = inputs(qtype, rows, 37, num_blocks, torch.float32, seed=rows + 7)
    y = triton_gguf_dot.gguf_dot(
        x, planes, num_splits=num_splits, asm=ASM, block_n=block_n, subs=subs
    )
    assert y.shape == (rows, 37) and y.dtype == x.dtype
    assert relative_error(y, quantized_x(x) @ weight.T) < 1e-5
    assert not triton_gguf_dot._COUNTERS[x.device].any()  # the split counts left at zero


@pytest.mark.parametrize("qtype", (Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0), ids=lambda t: t.name)
def test_dot_is_near_the_unquantized_product_in_bfloat16(qtype):
    x, planes, weight = inputs(qtype, 2, 40, 4, torch.bfloat16, seed=3)
    y = triton_gguf_dot.gguf_dot(x, planes, asm=ASM)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, x.double().cpu() @ weight.T) < 1.5e-2


def test_zero_rows_and_a_zero_input():
    x, planes, weight = inputs(Q.Q8_0, 1, 8, 2, torch.float32, seed=1)
    assert triton_gguf_dot.gguf_dot(x[:0], planes, asm=ASM).shape == (0, 8)
    zero = triton_gguf_dot.gguf_dot(torch.zeros_like(x), planes, asm=ASM)
    assert torch.equal(zero.cpu(), torch.zeros(1, 8))  # amax 0: no division by zero


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_gguf_dot as g
from kernels.triton_gguf_blocks import TYPES
ints = ("num_rows", "out_features", "columns", "num_subs", "subs_per_split", "num_splits")
def compiled(fn, signature, constants, num_warps=4):
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    constexprs = {(fn.arg_names.index(k),): v for k, v in constants.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
for qtype in TYPES:
    for rows in (1, 4):
        constants = dict(QTYPE=qtype, ROWS=rows, BLOCK_N=256, SUBS=4, ASM=True)
        signature = {"words_ptr": "*i32", "scales_ptr": "*fp32", "qs_ptr": "*i32",
                     "qh_ptr": "*i32", "sm_ptr": "*i32", "d_ptr": "*i32", "out_ptr": "*bf16",
                     "partial_ptr": "*fp32", "counter_ptr": "*i32", **dict.fromkeys(ints, "i32")}
        assert "dp4a" in compiled(g._dot_kernel, signature, constants).asm["ptx"], qtype
signature = {"x_ptr": "*bf16", "words_ptr": "*i32", "scales_ptr": "*fp32", "x_stride": "i32",
             "num_rows": "i32", "in_features": "i32", "num_subs": "i32"}
assert "cubin" in compiled(g._quantize_x_kernel, signature, dict(SUBS=16)).asm
"""


@pytest.mark.slow
def test_dot_kernel_compiles_to_dp4a_for_a_gpu(tmp_path):
    """Inline assembly never runs under the interpreter: compile the kernels for sm_90 (no GPU
    needed) and find the dp4a instructions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]

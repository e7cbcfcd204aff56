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


# (rows, num_splits, block_n, subs): each type runs one shape with x quantized apart and one with
# x quantized inside the GEMV, in turn, so that every shape meets two or three types
APART = [(1, None, 16, 4), (3, 3, 16, 4), (4, 1, 32, 1)]
INSIDE = [(2, 2, 8, 2), (3, 3, 16, 4), (2, 12, 16, 1)]
DOT_CASES = [
    (qtype, *shapes[i % 3], fused)
    for i, qtype in enumerate(TYPES)
    for shapes, fused in ((APART, False), (INSIDE, True))
]


@pytest.mark.parametrize(
    ("qtype", "rows", "num_splits", "block_n", "subs", "fused"),
    DOT_CASES,
    ids=[f"{c[0].name}-{c[1]}rows-{c[2]}splits-{'inside' if c[5] else 'apart'}" for c in DOT_CASES],
)
def test_dot_is_the_oracle_on_quantized_x(qtype, rows, num_splits, block_n, subs, fused):
    """fused: x quantized inside the GEMV, as quantize_x quantizes it (the same oracle)."""
    num_blocks = 17 if qtype.value < Q.Q4_K.value else 3  # a partial last step and split
    x, planes, weight = inputs(qtype, rows, 37, num_blocks, torch.float32, seed=rows + 7)
    y = triton_gguf_dot.gguf_dot(
        x, planes, num_splits=num_splits, asm=ASM, block_n=block_n, subs=subs, fused=fused
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


@pytest.mark.parametrize(("splits_at_once", "num_splits"), [(1, 6), (4, 6), (32, 6), (8, 1)])
def test_a_result_and_its_bias_written_into_columns_of_a_wider_output(splits_at_once, num_splits):
    x, planes, weight = inputs(Q.Q4_K, 3, 24, 3, torch.float32, seed=5)
    bias = torch.linspace(-2, 2, 24, device=DEVICE)
    wide = torch.full((3, 40), 7.0, device=DEVICE)
    y = triton_gguf_dot.gguf_dot(x, planes, num_splits=num_splits, asm=ASM, block_n=8, subs=1,
                                 splits_at_once=splits_at_once, out=wide[:, 10:34],
                                 bias=bias)  # fmt: skip
    assert y.data_ptr() == wide[:, 10:].data_ptr()
    expected = quantized_x(x) @ weight.T + bias.double().cpu()
    assert relative_error(wide[:, 10:34], expected) < 1e-5
    untouched = torch.cat((wide[:, :10], wide[:, 34:]), dim=1)
    assert torch.equal(untouched.cpu(), torch.full((3, 16), 7.0))
    assert not triton_gguf_dot._COUNTERS[x.device].any()


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
ints = ("num_rows", "in_features", "x_stride", "out_features", "out_stride", "columns",
        "num_subs", "subs_per_split", "num_splits")
def compiled(fn, signature, constants, num_warps=4):
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    constexprs = {(fn.arg_names.index(k),): v for k, v in constants.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
for i, qtype in enumerate(TYPES):  # 1 and 4 rows, x quantized apart and inside, in turn
    rows, fused = (1, 4)[i % 2], i % 4 >= 2
    constants = dict(QTYPE=qtype, ROWS=rows, BLOCK_N=256, SUBS=4, ASM=True, SPLITS_AT_ONCE=8,
                     FUSED=fused, HAS_BIAS=fused)
    signature = {"words_ptr": "*i32", "scales_ptr": "*fp32", "x_ptr": "*bf16", "qs_ptr": "*i32",
                 "qh_ptr": "*i32", "sm_ptr": "*i32", "d_ptr": "*i32", "bias_ptr": "*bf16",
                 "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32",
                 **dict.fromkeys(ints, "i32")}
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

"""The quantized modules on the GPU code path (kernels/gguf_planes.py's planes, the Triton kernels;
under Triton's interpreter where no GPU is present): the weights are repacked once, the blocks
dropped, and every module computes what it computes from the blocks on the CPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_triton_gguf import DEVICE  # noqa: E402

from kernels import triton_gguf_dot  # noqa: E402
from kernels.gguf_planes import plane_nbytes  # noqa: E402
from runtime.models import quant  # noqa: E402
from runtime.models.quant import (  # noqa: E402
    ConcatLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    random_blocks,
    repack_for_gpu,
)

Q = gguf.GGMLQuantizationType


@pytest.fixture
def gpu_path(monkeypatch):
    """Without a GPU, the modules take the GPU code path on the CPU (interpreted kernels)."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(quant.QuantizedWeight, "_on_gpu", lambda self: True)


def blocks(qtype, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks(qtype, out_features, in_features, rng))


def dense(qtype, raw: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return float((y.double().cpu() - expected).norm() / expected.norm())


@pytest.mark.parametrize("fused_max_tiles", (0, 8), ids=("x quantized once", "in each GEMV"))
def test_a_projection_of_mixed_types_on_the_gemv(gpu_path, monkeypatch, fused_max_tiles):
    """Its parts write their columns and biases in place; x is quantized once for all of them,
    or inside each part's GEMV where its output is a few tiles."""
    monkeypatch.setattr(triton_gguf_dot, "FUSED_MAX_TILES", fused_max_tiles)
    q4k, q6k = blocks(Q.Q4_K, 48, 256, seed=1), blocks(Q.Q6_K, 16, 256, seed=2)
    module = ConcatLinear([(Q.Q4_K, 48), (Q.Q6_K, 16)], 256, bias=True).to(DEVICE)
    module.load_part(0, quant.QuantizedTensor(q4k, Q.Q4_K, 256))
    module.load_part(1, quant.QuantizedTensor(q6k, Q.Q6_K, 256))
    bias = torch.linspace(-1, 1, 64)
    module.bias.data.copy_(bias)
    repack_for_gpu(module)
    assert all(part.blocks.numel() == 0 for part in module.parts)  # dropped once repacked
    assert module.weight_nbytes == plane_nbytes(Q.Q4_K, 48, 256) + plane_nbytes(Q.Q6_K, 16, 256)
    calls = []
    real = triton_gguf_dot.quantize_x
    monkeypatch.setattr(triton_gguf_dot, "quantize_x", lambda x: (calls.append(1), real(x))[1])
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y = module(x)
    weight = torch.cat((dense(Q.Q4_K, q4k), dense(Q.Q6_K, q6k)))
    expected = x.double().cpu() @ weight.T + bias.double()
    assert len(calls) == (1 if fused_max_tiles == 0 else 0) and y.shape == (2, 64)
    assert relative_error(y, expected) < 2e-2  # x quantized to int8 per 32 values
    many = x.repeat(3, 1)  # more rows than the GEMV takes: the tiled kernel, x unquantized
    assert relative_error(module(many), expected.repeat(3, 1)) < 1e-5
    assert len(calls) == (1 if fused_max_tiles == 0 else 0)


def test_linear_and_embedding_on_planes_match_their_blocks(gpu_path):
    raw = blocks(Q.Q5_0, 40, 96, seed=4)
    weight = dense(Q.Q5_0, raw)
    linear = QuantizedLinear(raw.clone(), Q.Q5_0, 40, 96).to(DEVICE)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert relative_error(linear(x), x.double().cpu() @ weight.T) < 1e-5
    assert linear.blocks.numel() == 0 and linear.planes is not None  # repacked on first use
    rows = linear.dequantize(slice(3, 7))
    torch.testing.assert_close(rows.double().cpu(), weight[3:7], atol=0, rtol=0)
    embedding = QuantizedEmbedding(raw.clone(), Q.Q5_0, 40, 96).to(DEVICE)
    ids = torch.tensor([[39, 0], [7, 7]], device=DEVICE)
    values = embedding(ids)
    assert values.shape == (2, 2, 96)
    torch.testing.assert_close(values.double().cpu(), weight[ids.cpu()], atol=0, rtol=0)

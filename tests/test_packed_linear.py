"""oneDNN packed projections (CPU, float32 and native bfloat16) against the plain nn.Linear they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.models.layers import Linear, can_pack

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])  # q/k/v bias: Qwen2
@pytest.mark.parametrize("num_rows", [1, 5, 300])
def test_packed_linear_matches_plain(bias, num_rows):
    torch.manual_seed(0)
    linear = Linear(96, 160, bias=bias)
    weight, bias_value = linear.weight.detach().clone(), linear.bias
    x = torch.randn(num_rows, 96)
    expected = F.linear(x, weight, bias_value)
    linear.pack()
    assert linear.weight.numel() == 0  # the packed copy replaces the plain one
    out = linear(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    strided = torch.randn(96, num_rows).t()  # a non-contiguous input works too
    torch.testing.assert_close(linear(strided), F.linear(strided, weight, bias_value))


def test_only_cpu_float32_and_native_bfloat16_pack():
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert can_pack(torch.device("cpu"), torch.bfloat16) == native_bf16
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("meta"), torch.float32)


@pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16), reason="no native bfloat16 on this CPU"
)
@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_packed_bfloat16_is_bit_identical_to_plain(num_rows):
    """Where oneDNN runs bfloat16 natively, F.linear takes the same oneDNN path: packing only
    saves the per-call reorder, so outputs (and greedy tokens) stay exactly the same."""
    torch.manual_seed(0)
    linear = Linear(96, 160, bias=False).to(torch.bfloat16)
    weight = linear.weight.detach().clone()
    x = torch.randn(num_rows, 96, dtype=torch.bfloat16)
    expected = F.linear(x, weight)
    linear.pack()
    assert torch.equal(linear(x), expected)


def test_loaded_model_packs_every_projection_and_the_tied_lm_head(tiny_model_dir):
    from runtime.models.attention import AttentionBackend
    from runtime.models.config import ModelConfig
    from runtime.models.loader import load_model

    config = ModelConfig.from_dir(tiny_model_dir)
    cpu = torch.device("cpu")
    model = load_model(tiny_model_dir, config, torch.float32, cpu, AttentionBackend(cpu, 16))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * config.num_layers and all(m.packed is not None for m in linears)
    hidden = torch.randn(3, config.hidden_size)
    expected = F.linear(hidden, model.embed_tokens.weight)
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)

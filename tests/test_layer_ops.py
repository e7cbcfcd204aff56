"""kernels/cpu/layer_ops.cpp (through kernels/native_layer_ops.py) against its oracle, the
torch references of kernels/reference.py: the same roundings, so bfloat16 agrees to a unit in
the last place of each of its two roundings and float32 to its own rounding."""

from __future__ import annotations

import pytest
import torch

from kernels import native, native_layer_ops, reference
from kernels.dispatch import get_kernels

TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=1.6e-2)}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native.native_ops() is not None, "the native CPU kernels did not build (see the log)"


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_the_reference(dtype, rows, with_residual):
    g = generator(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    residual = torch.randn(rows, 576, generator=g).to(dtype) if with_residual else None
    out, total = native_layer_ops.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_total = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(total, expected_total, atol=0, rtol=0)  # one rounding: the same
    torch.testing.assert_close(out, expected_out, **TOLERANCES[dtype])
    if dtype == torch.bfloat16:  # and only rarely: the sums of squares differ in order only
        assert (out != expected_out).float().mean() < 0.02
    if residual is None:
        assert total is x


def test_rms_norm_keeps_leading_dimensions_and_falls_back_for_float16():
    g = generator(2)
    x = torch.randn(2, 3, 64, generator=g)
    weight = torch.randn(64, generator=g)
    out, _ = native_layer_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6)[0])
    half = x.half()
    out, _ = native_layer_ops.rms_norm(half, weight.half(), 1e-6)
    torch.testing.assert_close(out, reference.rms_norm(half, weight.half(), 1e-6)[0])


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemmas_norm_over_bfloat16_rows_is_the_float32_norm_rounded_once(rows, with_residual):
    """A float32 weight (Gemma's 1 + w) over bfloat16 rows: one native call gives, bit for bit,
    what x.float() through the float32 norm and .to(bfloat16) give."""
    g = generator(rows)
    x = (torch.randn(rows, 640, generator=g) * 3).to(torch.bfloat16)
    weight = torch.randn(640, generator=g) + 1.0
    residual = torch.randn(rows, 640, generator=g).to(torch.bfloat16) if with_residual else None
    out, total = native_layer_ops.rms_norm_in_float32(x, weight, 1e-6, residual)
    composed = reference.rms_norm_in_float32(
        x, weight, 1e-6, residual, rms_norm=native_layer_ops.rms_norm
    )
    assert out.dtype == total.dtype == torch.bfloat16
    assert torch.equal(out, composed[0]) and torch.equal(total, composed[1])
    expected = reference.rms_norm_in_float32(x, weight, 1e-6, residual)  # torch's own ops
    torch.testing.assert_close(out, expected[0], **TOLERANCES[torch.bfloat16])
    heads = (
        torch.randn(rows, 4 * 64 + 128, generator=g).to(torch.bfloat16)[:, :256].view(rows, 4, 64)
    )
    out, _ = native_layer_ops.rms_norm_in_float32(heads, weight[:64].contiguous(), 1e-6)
    composed, _ = reference.rms_norm_in_float32(
        heads, weight[:64], 1e-6, rms_norm=native_layer_ops.rms_norm
    )
    assert torch.equal(out, composed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_strided_heads_is_the_native_kernel_on_their_copy(dtype):
    """Gemma's q/k norms: heads viewed in the q/k/v projection's output (rows strided apart)
    take the native kernel on a contiguous copy, as the fused Gemma layer does."""
    g = generator(5)
    qkv = torch.randn(5, 4 * 64 + 2 * 64, generator=g).to(dtype)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    assert not q.is_contiguous()
    weight = torch.randn(64, generator=g).to(dtype)
    out, _ = native_layer_ops.rms_norm(q, weight, 1e-6)
    expected, _ = native_layer_ops.rms_norm(q.contiguous(), weight, 1e-6)
    assert out.shape == q.shape and torch.equal(out, expected)
    torch.testing.assert_close(out, reference.rms_norm(q, weight, 1e-6)[0], **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_is_the_reference_on_strided_qkv_columns(dtype, tokens):
    g = generator(tokens)
    heads, kv_heads, head_dim = 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided, as the model's
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cache = torch.randn(100, head_dim, generator=g)
    positions = torch.randint(0, 100, (tokens,), generator=g)
    plan = reference.prepare_rotary(positions, cache, dtype)
    got_q, got_k = native_layer_ops.rotary_with_plan(q, k, plan)
    expected_q, expected_k = reference.rotary_with_plan(q, k, plan)
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else TOLERANCES[dtype]
    torch.testing.assert_close(got_q, expected_q, **exact)
    torch.testing.assert_close(got_k, expected_k, **exact)


def test_cpu_kernels_are_the_native_ones_where_built(monkeypatch):
    assert get_kernels("cpu").rms_norm is native_layer_ops.rms_norm
    assert get_kernels("cpu").rotary_with_plan is native_layer_ops.rotary_with_plan
    assert get_kernels("cpu").store_kvcache is native_layer_ops.store_kvcache
    assert get_kernels("cpu").silu_and_mul is native_layer_ops.silu_and_mul
    monkeypatch.setattr(native, "native_ops", lambda: None)
    assert get_kernels("cpu").rms_norm is reference.rms_norm
    assert get_kernels("cpu").silu_and_mul is reference.silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_plan_is_the_reference(dtype):
    g = generator(3)
    cache = torch.randn(50, 32, generator=g)
    positions = torch.tensor([0, 49, 7, 7], dtype=torch.int32)
    got = native_layer_ops.prepare_rotary(positions, cache, dtype)
    expected = reference.prepare_rotary(positions, cache, dtype)
    torch.testing.assert_close(got.cos, expected.cos, atol=0, rtol=0)
    torch.testing.assert_close(got.sin, expected.sin, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="past the table"):
        native_layer_ops.prepare_rotary(torch.tensor([50]), cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_is_the_reference_and_skips_padding_slots(dtype):
    g = generator(4)
    tokens, kv_heads, head_dim = 5, 2, 16
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=g).to(dtype)
    key = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)  # strided views
    value = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, -1, 17, 0, -1])
    caches = [torch.zeros(3, 8, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    native_layer_ops.store_kvcache(key, value, caches[0], caches[1], slots)
    reference.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, kv_heads, head_dim)[17].equal(key[2])
    with pytest.raises(RuntimeError, match="past the cache"):
        native_layer_ops.store_kvcache(key, value, caches[0], caches[1], slots + 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, intermediate", [(1, 1536), (3, 13), (40, 4864)])
def test_silu_and_mul_is_the_reference(dtype, rows, intermediate):
    g = generator(intermediate)
    both = (torch.randn(rows, 2 * intermediate, generator=g) * 4).to(dtype)
    both[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # saturated sigmoids and zeros
    out = native_layer_ops.silu_and_mul(both)
    expected = reference.silu_and_mul(both)
    assert out.dtype == dtype and out.shape == (rows, intermediate)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    if dtype == torch.bfloat16:  # two roundings as the reference's: rarely a unit apart
        assert (out != expected).float().mean() < 0.02
    alone = native_layer_ops.silu_and_mul(both[-1:].clone())
    assert torch.equal(alone, out[-1:])  # a row is the same bits alone or in a batch


def test_silu_and_mul_falls_back_where_the_kernel_does_not_fit():
    both = torch.randn(2, 3, 10)  # more than two dimensions; float16 too
    torch.testing.assert_close(native_layer_ops.silu_and_mul(both), reference.silu_and_mul(both))
    half = both[0].half()
    assert native_layer_ops.silu_and_mul(half).dtype == torch.float16
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        native.native_ops().silu_and_mul(torch.randn(2, 7))

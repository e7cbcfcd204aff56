"""Triton kernels against the torch references on fresh random inputs.

With CUDA the kernels run compiled on the GPU. Without it they run under Triton's interpreter on
CPU, which must be chosen before triton is first imported in the process (triton's own
library functions are @triton.jit too), hence the environment line above the imports. Without
triton installed every test here fails; none skips.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
from itertools import accumulate  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from kernels import native, reference  # noqa: E402
from kernels.dispatch import REFERENCE_KERNELS, _triton_kernels, get_kernels  # noqa: E402

KERNEL_MODULES = ("triton_kvcache", "triton_attention", "triton_norm_rope")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = list(TOLERANCE)
HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS = 64, 16, 40, 2


@pytest.fixture(scope="module")
def under_test():
    """The kernel modules (imported here so that a missing triton fails each test) and the
    device to run them on."""
    modules = {name: importlib.import_module(f"kernels.{name}") for name in KERNEL_MODULES}
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    kernel_kind = type(modules["triton_attention"]._prefill_kernel).__name__
    assert interpreted == (kernel_kind == "InterpretedFunction"), (
        "triton or the kernels were imported before TRITON_INTERPRET was set: "
        "run with TRITON_INTERPRET=1 in the environment"
    )
    device = torch.device("cpu" if interpreted else "cuda")
    return SimpleNamespace(device=device, **modules)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(actual).all()
    error = (actual - expected).norm() / expected.norm()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e} in {dtype}"


def random_caches(dtype, device, num_blocks=NUM_BLOCKS, num_kv_heads=NUM_KV_HEADS):
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def random_block_tables(seq_lens: list[int], device, max_blocks: int | None = None):
    """-> (tables for the kernels with garbage past each end, the same tables made valid for the
    reference); each sequence gets distinct random blocks, in random order."""
    max_blocks = max_blocks or max(-(-n // BLOCK_SIZE) for n in seq_lens)
    clean = torch.stack([torch.randperm(NUM_BLOCKS)[:max_blocks] for _ in seq_lens]).int()
    garbage = clean.clone()
    for row, seq_len in enumerate(seq_lens):
        garbage[row, -(-seq_len // BLOCK_SIZE) :] = 2**30
    return garbage.to(device), clean.to(device)


def qkv_views(num_tokens: int, num_heads: int, num_kv_heads: int, dtype, device):
    """q, k, v as strided views of one fused projection, as the model produces them."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, HEAD_DIM, device=device).to(dtype)
    return qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)


def as_float(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


# ---------------------------------------------------------------- store_kvcache


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_matches_reference(under_test, dtype):
    num_tokens = 21
    _, key, value = qkv_views(num_tokens, 3, NUM_KV_HEADS, dtype, under_test.device)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    slots[[0, 7, 20]] = -1  # graph padding
    slot_mapping = slots.to(under_test.device)
    k_cache, v_cache = random_caches(dtype, under_test.device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(key, value, expected_k, expected_v, slot_mapping)
    under_test.triton_kvcache.store_kvcache(key, value, k_cache, v_cache, slot_mapping.int())
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# ---------------------------------------------------------------- decode attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("partition_size", [None, 64])
def test_paged_attention_decode_matches_reference(under_test, dtype, group, partition_size):
    seq_lens_list = [1, 16, 17, 200, 75]  # 200 spans 13 blocks and 4 partitions of 64
    num_heads = group * NUM_KV_HEADS
    q = qkv_views(len(seq_lens_list), num_heads, NUM_KV_HEADS, dtype, under_test.device)[0]
    k_cache, v_cache = random_caches(dtype, under_test.device)
    tables, clean_tables = random_block_tables(seq_lens_list, under_test.device)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=under_test.device)
    scale = HEAD_DIM**-0.5
    out = under_test.triton_attention.paged_attention_decode(
        q, k_cache, v_cache, tables, seq_lens, scale, partition_size=partition_size
    )
    expected = reference.paged_attention_decode(
        *as_float(q, k_cache, v_cache), clean_tables, seq_lens, scale
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected, dtype)


def test_paged_attention_decode_splits_long_contexts_by_default(under_test):
    seq_lens_list = [600, 3]
    q = torch.randn(2, 3 * NUM_KV_HEADS, HEAD_DIM, device=under_test.device)
    k_cache, v_cache = random_caches(torch.float32, under_test.device)
    tables, clean_tables = random_block_tables(seq_lens_list, under_test.device)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=under_test.device)
    attention = under_test.triton_attention
    num_programs = len(seq_lens_list) * NUM_KV_HEADS
    assert attention._decode_partition_size(num_programs, 600, under_test.device) < 600
    out = attention.paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, 0.1)
    expected = reference.paged_attention_decode(q, k_cache, v_cache, clean_tables, seq_lens, 0.1)
    assert_close(out, expected, torch.float32)


def test_paged_attention_decode_gives_zeros_for_empty_padding_sequences(under_test):
    q = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device=under_test.device)
    k_cache, v_cache = random_caches(torch.float32, under_test.device)
    tables, _ = random_block_tables([0, 40, 0], under_test.device, max_blocks=5)
    seq_lens = torch.tensor([0, 40, 0], dtype=torch.int32, device=under_test.device)
    for partition_size in (64, 128):
        out = under_test.triton_attention.paged_attention_decode(
            q, k_cache, v_cache, tables, seq_lens, 0.1, partition_size=partition_size
        )
        assert torch.isfinite(out).all() and not out[[0, 2]].any()


# ---------------------------------------------------------------- prefill attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_prefill_matches_reference(under_test, dtype, group):
    # (chunk length, cached prefix length): fresh prompts, chunked prefill, prefix-cache hits
    chunks = [(1, 0), (5, 0), (37, 20), (70, 90), (1, 40), (16, 16)]
    q_lens = torch.tensor([q_len for q_len, _ in chunks])
    seq_lens_list = [q_len + prefix for q_len, prefix in chunks]
    num_heads = group * NUM_KV_HEADS
    q = qkv_views(int(q_lens.sum()), num_heads, NUM_KV_HEADS, dtype, under_test.device)[0]
    k_cache, v_cache = random_caches(dtype, under_test.device)
    tables, clean_tables = random_block_tables(seq_lens_list, under_test.device, max_blocks=12)
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int().to(under_test.device)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=under_test.device)
    out = under_test.triton_attention.paged_attention_prefill(
        q, k_cache, v_cache, tables, query_start_loc, seq_lens, 0.125
    )
    expected = reference.paged_attention_prefill(
        *as_float(q, k_cache, v_cache), clean_tables, query_start_loc, seq_lens, 0.125
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected, dtype)


def test_paged_attention_prefill_gives_zeros_for_empty_padding_sequences(under_test):
    """A mixed-step graph's padding: sequences of length 0, one owning the padding tokens (its
    queries get zeros), the others with no queries; the real sequences are unaffected."""
    chunks = [(1, 30), (9, 0), (20, 5)]  # (q_len, cached prefix)
    q_lens = [q_len for q_len, _ in chunks] + [11, 0, 0]  # padding: 11 tokens, 2 empty rows
    seq_lens_list = [q_len + prefix for q_len, prefix in chunks] + [0, 0, 0]
    q = torch.randn(sum(q_lens), 3 * NUM_KV_HEADS, HEAD_DIM, device=under_test.device)
    k_cache, v_cache = random_caches(torch.float32, under_test.device)
    tables, clean_tables = random_block_tables(seq_lens_list, under_test.device, max_blocks=4)
    query_start_loc = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=q.device)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=q.device)
    out = under_test.triton_attention.paged_attention_prefill(
        q, k_cache, v_cache, tables, query_start_loc, seq_lens, 0.125
    )
    num_real = sum(q_lens[:3])
    expected = reference.paged_attention_prefill(
        q[:num_real], k_cache, v_cache, clean_tables[:3], query_start_loc[:4], seq_lens[:3], 0.125
    )
    assert_close(out[:num_real], expected, torch.float32)
    assert torch.isfinite(out).all() and not out[num_real:].any()


# ---------------------------------------------------------------- RMSNorm and RoPE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(under_test, dtype, with_residual):
    hidden = 576  # SmolLM2, not a power of two
    x = torch.randn(2, 7, hidden, device=under_test.device).to(dtype)
    residual = torch.randn_like(x) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, device=under_test.device)).to(dtype)
    out, new_residual = under_test.triton_norm_rope.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == expected_out.dtype and out.shape == x.shape
    assert_close(out, expected_out, dtype)
    assert_close(new_residual, expected_residual, dtype)


def cos_sin_cache(max_position: int, device) -> torch.Tensor:
    inv_freq = 10000.0 ** -(torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)  # [max_position, head_dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
def test_rotary_embedding_matches_reference(under_test, dtype, group):
    num_tokens = 11
    q, k, _ = qkv_views(num_tokens, group * NUM_KV_HEADS, NUM_KV_HEADS, dtype, under_test.device)
    positions = torch.randint(0, 500, (num_tokens,), device=under_test.device)
    cache = cos_sin_cache(512, under_test.device)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, cache)
    out_q, out_k = under_test.triton_norm_rope.rotary_embedding(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert_close(out_q, expected_q, dtype)
    assert_close(out_k, expected_k, dtype)


# ---------------------------------------------------------------- dispatch


def test_dispatch_picks_triton_on_cuda_and_references_elsewhere(monkeypatch):
    assert get_kernels(torch.device("cpu")).name == "native-cpu"  # references + native layer ops
    monkeypatch.setattr(native, "native_ops", lambda: None)
    assert get_kernels(torch.device("cpu")) is REFERENCE_KERNELS
    monkeypatch.undo()
    triton_kernels = get_kernels(torch.device("cuda"))
    assert triton_kernels.name == "triton"
    assert triton_kernels.paged_attention_decode.__module__ == "kernels.triton_attention"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # triton missing
    assert _triton_kernels.__wrapped__() is None

"""Sliding-window attention in every kernel, as transformers masks it (a query at position p sees
the keys at positions > p - window): the torch reference against a dense masked softmax written
here, the native CPU decode and the Triton kernels (interpreted on CPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import native, reference

BLOCK_SIZE, NUM_BLOCKS = 16, 128


def _paged_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    max_blocks = max(seq_lens) // BLOCK_SIZE + 2
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[: len(seq_lens) * max_blocks]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    return {
        "q": q.to(dtype),
        "k_cache": k_cache.to(dtype),
        "v_cache": v_cache.to(dtype),
        "block_tables": tables.view(len(seq_lens), max_blocks).to(torch.int32),
        "query_start_loc": torch.tensor([0, *torch.tensor(q_lens).cumsum(0)], dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


def _dense(case, scale, window):
    """Each query against its sequence's keys, gathered token by token, masked densely."""
    q, out = case["q"].float(), []
    starts = case["query_start_loc"].tolist()
    for s, seq_len in enumerate(case["seq_lens"].tolist()):
        slots = [
            int(case["block_tables"][s, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
            for t in range(seq_len)
        ]
        k = case["k_cache"].flatten(0, 1)[slots].float()  # [seq_len, kv_heads, dim]
        v = case["v_cache"].flatten(0, 1)[slots].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for i in range(starts[s], starts[s + 1]):
            p = seq_len - (starts[s + 1] - i)  # the query's position
            keys = torch.arange(seq_len)
            seen = (keys <= p) & (keys > p - window if window else True)
            scores = torch.einsum("hd,thd->ht", q[i], k) * scale
            weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            out.append(torch.einsum("ht,thd->hd", weights, v))
    return torch.stack(out)


CASES = [  # (seq_lens, q_lens, window)
    ([100, 37, 64, 5], [1, 1, 1, 1], 20),  # decodes far past, just past and inside the window
    ([130, 70, 9], [130, 30, 9], 33),  # a first chunk, a later chunk, a short prompt
    ([200, 48], [70, 48], 48),  # the window a multiple of the block size
    ([90], [90], 1),  # each query sees itself only
]


@pytest.mark.parametrize("seq_lens,q_lens,window", CASES)
def test_reference_masks_keys_older_than_the_window(seq_lens, q_lens, window):
    case = _paged_case(seq_lens, q_lens, 4, 2, 16, seed=window)
    out = reference.paged_attention_prefill(**case, scale=0.3, sliding_window=window)
    torch.testing.assert_close(out, _dense(case, 0.3, window), atol=1e-5, rtol=0)
    # the window is not a no-op here: without it the long sequences differ
    full = reference.paged_attention_prefill(**case, scale=0.3)
    assert not torch.allclose(full, out, atol=1e-3)


@pytest.mark.parametrize("window", [7, 32, 200])
def test_reference_causal_plan_with_a_window(window):
    gen = torch.Generator().manual_seed(window)
    lens = [70, 12, 40]
    q = torch.randn(sum(lens), 4, 16, generator=gen)
    k, v = (
        torch.randn(sum(lens), 2, 16, generator=gen),
        torch.randn(sum(lens), 2, 16, generator=gen),
    )
    plan = reference.prepare_causal_plan(lens, window)
    out = reference.causal_attention_with_plan(q, k, v, plan, 0.25)
    start = 0
    for n in lens:  # each sequence alone, through the paged dense oracle
        case = _paged_case([n], [n], 4, 2, 16, seed=1)
        case["q"] = q[start : start + n]
        slots = torch.tensor(
            [
                int(case["block_tables"][0, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
                for t in range(n)
            ]
        )
        case["k_cache"].flatten(0, 1)[slots] = k[start : start + n]
        case["v_cache"].flatten(0, 1)[slots] = v[start : start + n]
        torch.testing.assert_close(
            out[start : start + n], _dense(case, 0.25, window), atol=1e-5, rtol=0
        )
        start += n


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [16, 12])  # the vector path and the any-dim path
def test_native_decode_with_a_window_matches_reference(dtype, atol, head_dim):
    ops = native.native_ops()
    assert ops is not None, "the native CPU kernels did not build"
    seq_lens = [100, 37, 64, 5, 21]
    case = _paged_case(seq_lens, [1] * 5, 6, 2, head_dim, seed=head_dim, dtype=dtype)
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"])
    for window in (20, 21, 1, 500):
        expected = reference.paged_attention_decode(*args, 0.3, sliding_window=window)
        out = ops.paged_attention_decode(*args, 0.3, window)
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)
    full = ops.paged_attention_decode(*args, 0.3)  # no window: the default
    expected = reference.paged_attention_decode(*args, 0.3)
    torch.testing.assert_close(full.float(), expected.float(), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def triton_attention():
    pytest.importorskip("triton")
    from kernels import triton_attention

    return triton_attention


@pytest.mark.parametrize("seq_lens,q_lens,window", CASES)
def test_triton_prefill_with_a_window_matches_reference(triton_attention, seq_lens, q_lens, window):
    case = _paged_case(seq_lens, q_lens, 4, 2, 16, seed=window)
    expected = reference.paged_attention_prefill(**case, scale=0.3, sliding_window=window)
    out = triton_attention.paged_attention_prefill(**case, scale=0.3, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("partition_size", [None, 64])  # one partition, and split-K
def test_triton_decode_with_a_window_matches_reference(triton_attention, partition_size):
    seq_lens = [300, 37, 130, 5]
    case = _paged_case(seq_lens, [1] * 4, 4, 2, 16, seed=3)
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"])
    for window in (20, 100):
        expected = reference.paged_attention_decode(*args, 0.3, sliding_window=window)
        out = triton_attention.paged_attention_decode(
            *args, 0.3, partition_size=partition_size, sliding_window=window
        )
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


def test_reference_gathers_only_the_blocks_a_window_reaches():
    case = _paged_case([300, 30], [1, 1], 4, 2, 16, seed=5)
    args = (case["block_tables"], case["query_start_loc"], case["seq_lens"], BLOCK_SIZE)
    plan = reference.prepare_paged_plan(*args, sliding_window=20)
    # keys 280..299 lie in blocks 17 and 18; the short sequence's keys 10..29 in blocks 0, 1
    assert plan.max_kv_len == 30  # the longer of 300 - 17 * 16 = 28 and 30
    assert plan.block_ids.view(2, -1)[0].tolist() == case["block_tables"][0, 17:19].tolist()
    assert reference.prepare_paged_plan(*args).max_kv_len == 300

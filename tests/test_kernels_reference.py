"""The torch references against naive per-token Python loops, in float64, at small sizes."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference

HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS = 8, 4, 32, 2


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def naive_store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, k_cache.shape[1])
            k_cache[block, offset] = key[token]
            v_cache[block, offset] = value[token]


def naive_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Each query token, each head: softmax over the keys at positions <= its own."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    for seq, seq_len in enumerate(seq_lens.tolist()):
        first, last = query_start_loc[seq].item(), query_start_loc[seq + 1].item()
        for i, token in enumerate(range(first, last)):
            position = seq_len - (last - first) + i
            slots = [divmod(p, block_size) for p in range(position + 1)]
            blocks = [(block_tables[seq, b].item(), offset) for b, offset in slots]
            for head in range(q.shape[1]):
                kv_head = head // group
                keys = torch.stack([k_cache[b, o, kv_head] for b, o in blocks]).double()
                values = torch.stack([v_cache[b, o, kv_head] for b, o in blocks]).double()
                weights = torch.softmax(keys @ q[token, head].double() * scale, dim=0)
                out[token, head] = weights @ values
    return out


def naive_rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    for row in range(x.shape[0]):
        values = x[row].double()
        inv_rms = 1 / math.sqrt(sum(v * v for v in values.tolist()) / x.shape[1] + eps)
        out[row] = weight * (values * inv_rms).to(x.dtype)
    return out, x


def naive_rotary(positions, x, cos_sin_cache):
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=torch.float64)
    for token, position in enumerate(positions.tolist()):
        cos, sin = cos_sin_cache[position, :half].double(), cos_sin_cache[position, half:].double()
        for head in range(x.shape[1]):
            x1, x2 = x[token, head, :half].double(), x[token, head, half:].double()
            out[token, head] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())


def random_paged_batch(chunks: list[tuple[int, int]], num_heads: int):
    """chunks: (query length, cached prefix length) per sequence -> inputs of the prefill call."""
    q_lens = torch.tensor([q_len for q_len, _ in chunks])
    seq_lens = torch.tensor([q_len + prefix for q_len, prefix in chunks], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // BLOCK_SIZE)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return {
        "q": torch.randn(int(q_lens.sum()), num_heads, HEAD_DIM),
        "k_cache": torch.randn(cache_shape),
        "v_cache": torch.randn(cache_shape),
        "block_tables": torch.stack(
            [torch.randperm(NUM_BLOCKS)[:max_blocks] for _ in chunks]
        ).int(),
        "query_start_loc": torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int(),
        "seq_lens": seq_lens,
        "scale": 0.3,
    }


def test_store_kvcache_matches_loop():
    key, value = torch.randn(2, 9, NUM_KV_HEADS, HEAD_DIM)
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:9]
    slot_mapping[[1, 4]] = -1
    k_cache, v_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    naive_store_kvcache(key, value, expected_k, expected_v, slot_mapping)
    reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_prefill_matches_loop(group):
    batch = random_paged_batch([(1, 0), (3, 0), (6, 5), (1, 9), (9, 2)], group * NUM_KV_HEADS)
    out = reference.paged_attention_prefill(**batch)
    assert relative_error(out, naive_paged_attention(**batch)) < 1e-5


@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_decode_matches_loop(group):
    batch = random_paged_batch([(1, 0), (1, 4), (1, 13)], group * NUM_KV_HEADS)
    del batch["query_start_loc"]
    out = reference.paged_attention_decode(**batch)
    query_start_loc = torch.arange(4, dtype=torch.int32)
    expected = naive_paged_attention(query_start_loc=query_start_loc, **batch)
    assert relative_error(out, expected) < 1e-5


def test_paged_attention_ignores_table_entries_past_the_end():
    batch = random_paged_batch([(1, 0), (1, 13)], NUM_KV_HEADS)
    batch["block_tables"][0, 1:] = 10**6  # the first sequence owns one block only
    del batch["query_start_loc"]
    reference.paged_attention_decode(**batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_loop(dtype, with_residual):
    x = torch.randn(5, 24).to(dtype)
    residual = torch.randn_like(x) if with_residual else None
    weight = (1 + 0.1 * torch.randn(24)).to(dtype)
    out, new_residual = reference.rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_residual = naive_rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, expected_residual)
    assert out.dtype == expected_out.dtype
    assert relative_error(out, expected_out) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_rotary_embedding_matches_loop():
    positions = torch.tensor([0, 3, 7, 2])
    q = torch.randn(4, 3, HEAD_DIM)
    k = torch.randn(4, 1, HEAD_DIM)
    angles = torch.randn(8, HEAD_DIM // 2)
    angles[0] = 0
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    out_q, out_k = reference.rotary_embedding(positions, q, k, cos_sin_cache)
    assert relative_error(out_q, naive_rotary(positions, q, cos_sin_cache)) < 1e-6
    assert relative_error(out_k, naive_rotary(positions, k, cos_sin_cache)) < 1e-6
    assert torch.equal(out_q[0], q[0])  # position 0 is the identity


def store_chunks(batch, chunks: list[tuple[int, int]]):
    """Gives each sequence blocks of its own, then writes new keys/values of every chunk token
    into its slot, as the model does before attention: returns them."""
    num_seqs, max_blocks = batch["block_tables"].shape
    batch["block_tables"] = (
        torch.randperm(NUM_BLOCKS)[: num_seqs * max_blocks].view(num_seqs, max_blocks).int()
    )
    slots = torch.cat(
        [
            batch["block_tables"][seq].long().repeat_interleave(BLOCK_SIZE)[prefix : prefix + n]
            * BLOCK_SIZE
            + torch.arange(prefix, prefix + n) % BLOCK_SIZE
            for seq, (n, prefix) in enumerate(chunks)
        ]
    )
    key = torch.randn(slots.numel(), NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(slots.numel(), NUM_KV_HEADS, HEAD_DIM)
    reference.store_kvcache(key, value, batch["k_cache"], batch["v_cache"], slots)
    return key, value, slots


@pytest.mark.parametrize("group", [1, 3])
def test_causal_attention_matches_loop(group):
    """First chunks: keys are the chunk's own, right-padded under is_causal."""
    batch = random_paged_batch([(5, 0), (1, 0), (9, 0)], group * NUM_KV_HEADS)
    key, value, _ = store_chunks(batch, [(5, 0), (1, 0), (9, 0)])
    plan = reference.prepare_causal_plan([5, 1, 9])
    out = reference.causal_attention_with_plan(batch["q"], key, value, plan, batch["scale"])
    assert relative_error(out, naive_paged_attention(**batch)) < 1e-5


@pytest.mark.parametrize("group", [1, 3])
def test_cpu_backend_prefill_mixes_first_and_later_chunks(group):
    """The CPU backend splits a step's prefills into causal groups and paged groups."""
    from runtime.models.attention import AttentionBackend, AttentionMetadata

    chunks = [(7, 0), (3, 6), (1, 0), (12, 0), (2, 9), (6, 0), (1, 11), (2, 1)]
    batch = random_paged_batch(chunks, group * NUM_KV_HEADS)
    key, value, slots = store_chunks(batch, chunks)
    attn = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=batch["block_tables"],
        prefill_query_start_loc=batch["query_start_loc"],
        prefill_seq_lens=batch["seq_lens"],
    )
    backend = AttentionBackend(torch.device("cpu"), BLOCK_SIZE)
    backend.prepare(attn)
    assert len(attn.prefill_parts) >= 3  # causal groups and paged groups
    k_cache, v_cache = batch["k_cache"], batch["v_cache"]
    out = backend.forward(batch["q"], key, value, k_cache, v_cache, attn, batch["scale"])
    assert relative_error(out, naive_paged_attention(**batch)) < 1e-5

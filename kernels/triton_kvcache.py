"""Writing new keys/values into the paged KV cache (Triton) and swapping blocks between pools.

Layouts (see kernels/reference.py):
  key/value:    [num_tokens, num_kv_heads, head_dim], heads and head_dim contiguous
  k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  slot_mapping: [num_tokens] int32/int64, slot = block_id * block_size + offset, -1 = skip
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    value_token_stride,
    TOKEN_SIZE: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # next power of two >= TOKEN_SIZE
):
    # one program per token: copies its [num_kv_heads * head_dim] row into its slot
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < TOKEN_SIZE
    key = tl.load(key_ptr + token * key_token_stride + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * TOKEN_SIZE + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * TOKEN_SIZE + offsets, value, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key/value into its cache slot; slot -1 means skip (CUDA-graph padding)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
    for x in (key, value):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads must be packed in each row"
    if num_tokens == 0:
        return
    token_size = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        TOKEN_SIZE=token_size,
        BLOCK=triton.next_power_of_2(token_size),
    )

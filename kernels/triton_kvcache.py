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


def swap_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    block_mapping: list[tuple[int, int]],
    stream: torch.cuda.Stream | None = None,
    *,
    block_dim: int = 0,
) -> torch.cuda.Event | None:
    """Copy src_cache[src] -> dst_cache[dst] for each (src, dst) pair, blocks along block_dim.

    On CPU the copy is done when this returns (None). When either cache is on CUDA the copies are
    queued on `stream` (a side stream of the destination's GPU by default) after the work already
    queued on the current stream, and the returned event marks their end: wait on it before
    reading the destination or overwriting the source blocks. With a pinned CPU pool the
    host<->device copies overlap with compute."""
    assert src_cache.shape[:block_dim] == dst_cache.shape[:block_dim]
    assert src_cache.shape[block_dim + 1 :] == dst_cache.shape[block_dim + 1 :]
    assert src_cache.dtype == dst_cache.dtype
    if not block_mapping:
        return None
    if not (src_cache.is_cuda or dst_cache.is_cuda):
        _index_copy_blocks(src_cache, dst_cache, block_mapping, block_dim)
        return None
    stream = stream if stream is not None else _side_stream(_cuda_device(src_cache, dst_cache))
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        if src_cache.device == dst_cache.device:
            _index_copy_blocks(src_cache, dst_cache, block_mapping, block_dim)
        else:
            _copy_block_runs(src_cache, dst_cache, block_mapping, block_dim)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _index_copy_blocks(src_cache, dst_cache, block_mapping, block_dim: int) -> None:
    pairs = torch.tensor(block_mapping, dtype=torch.long, device=src_cache.device)
    blocks = src_cache.index_select(block_dim, pairs[:, 0])
    dst_ids = pairs[:, 1].to(dst_cache.device)
    dst_cache.index_copy_(block_dim, dst_ids, blocks.to(dst_cache.device))


def _copy_block_runs(src_cache, dst_cache, block_mapping, block_dim: int) -> None:
    """One async copy per run of consecutive blocks per leading index: each is a dense chunk, so
    copies from/to pinned memory need no staging buffer."""
    assert src_cache.is_contiguous() and dst_cache.is_contiguous()
    src = src_cache.flatten(0, block_dim - 1) if block_dim else src_cache[None]
    dst = dst_cache.flatten(0, block_dim - 1) if block_dim else dst_cache[None]
    # src/dst: [num_leading, num_blocks, *block_shape]
    for src_start, dst_start, num_blocks in _consecutive_runs(block_mapping):
        for lead in range(src.shape[0]):
            dst[lead, dst_start : dst_start + num_blocks].copy_(
                src[lead, src_start : src_start + num_blocks], non_blocking=True
            )


def _consecutive_runs(block_mapping: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[(src, dst)] -> [(src_start, dst_start, num_blocks)] merging pairs that continue a run."""
    runs: list[list[int]] = []
    for src, dst in sorted(block_mapping):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(src, dst, num) for src, dst, num in runs]


def _cuda_device(*tensors: torch.Tensor) -> torch.device:
    return next(t.device for t in tensors if t.is_cuda)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]

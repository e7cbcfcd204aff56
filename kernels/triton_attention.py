"""Paged attention in Triton: decode (flash-decoding, split-K over the sequence) and ragged prefill.

Layouts (see kernels/reference.py):
  q:            decode [num_seqs, num_heads, head_dim]; prefill [num_tokens, num_heads, head_dim]
  k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
  block_tables: [num_seqs, max_blocks] int32, entries past a sequence's end are never read
  seq_lens:     [num_seqs] int32, tokens in the cache for each sequence, the current ones included

Each program owns one kv head and all the query heads of its group (GQA), so every K/V tile is
read once per group. Softmax is online, in float32, with exp2 and the scale folded into log2(e).
Under Triton's interpreter bf16 arithmetic is wrong, so bf16 tiles are upcast to float32 right
after loading there; on a GPU the dots run in the storage dtype with float32 accumulation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DECODE_BLOCK_N = 64  # keys per tile in decode
DECODE_MIN_PARTITION = 256  # fewest keys worth a partition of their own
DECODE_PROGRAMS_PER_SM = 4  # split-K until the grid has about this many programs per SM
PREFILL_BLOCK_M = 64  # query rows (tokens x heads of a group) per program
PREFILL_BLOCK_N = 64


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    kv_head,
    tokens,  # [BLOCK_N] key positions in the sequence
    token_mask,  # [BLOCK_N] positions that exist
    dims,
    dim_mask,
    cache_block_stride,
    cache_token_stride,
    cache_head_stride,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """-> k, v: [BLOCK_N, HEAD_DIM_PAD], zero where masked (so no NaN from stale slots)."""
    blocks = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    rows = blocks * cache_block_stride + (tokens % BLOCK_SIZE) * cache_token_stride
    offsets = rows[:, None] + kv_head * cache_head_stride + dims[None, :]
    mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0).to(DOT_DTYPE)
    return k, v


@triton.jit
def _online_softmax_step(
    q,  # [M, HEAD_DIM_PAD]
    k,  # [BLOCK_N, HEAD_DIM_PAD]
    v,  # [BLOCK_N, HEAD_DIM_PAD]
    visible,  # [M, BLOCK_N] bool; a row may have seen no visible key yet (sliding window)
    row_max,  # [M] running max of scaled scores (log2 domain)
    row_sum,  # [M]
    acc,  # [M, HEAD_DIM_PAD] float32, unnormalised
    scale_log2e,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    # a row with no visible key so far keeps max -inf: subtract 0 there, not -inf (NaN)
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    correction = tl.exp2(row_max - safe_max)
    p = tl.exp2(scores - safe_max[:, None])
    row_sum = row_sum * correction + tl.sum(p, 1)
    acc = acc * correction[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return new_max, row_sum, acc


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim], written when DIRECT_OUT
    part_max_ptr,  # [num_seqs, num_heads, num_partitions] float32
    part_sum_ptr,  # [num_seqs, num_heads, num_partitions] float32
    part_acc_ptr,  # [num_seqs, num_heads, num_partitions, HEAD_DIM_PAD] float32
    scale_log2e,
    window,  # 0, or the keys a query sees (the last ones, its own included)
    partition_size,  # multiple of BLOCK_N
    num_partitions,
    num_heads,
    q_seq_stride,
    q_head_stride,
    out_seq_stride,
    out_head_stride,
    table_stride,
    cache_block_stride,
    cache_token_stride,
    cache_head_stride,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # >= 16 so tl.dot has a legal shape
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # one partition: normalise and write out, no reduce pass
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # grid: (num_seqs, num_kv_heads, num_partitions); partitions past the sequence do nothing
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # first key seen
    start = partition * partition_size
    # a compile-time branch around the runtime one: with DIRECT_OUT an empty sequence (graph
    # padding) goes on and writes zeros
    if not DIRECT_OUT:  # noqa: SIM102
        if (start >= seq_len) | (start + partition_size <= first):
            return
    end = tl.minimum(start + partition_size, seq_len)
    start = tl.maximum(start, first // BLOCK_N * BLOCK_N)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + group
    head_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    q_offsets = seq * q_seq_stride + heads[:, None] * q_head_stride + dims[None, :]
    q_mask = head_mask[:, None] & dim_mask[None, :]
    # q: [GROUP_PAD, HEAD_DIM_PAD], the heads of this kv head's group
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(DOT_DTYPE)

    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row_ptr = block_tables_ptr + seq * table_stride
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = (tokens < end) & (tokens >= first)
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, tokens, token_mask, dims, dim_mask,
            cache_block_stride, cache_token_stride, cache_head_stride, BLOCK_SIZE, DOT_DTYPE,
        )  # fmt: skip
        row_max, row_sum, acc = _online_softmax_step(
            q, k, v, token_mask[None, :], row_max, row_sum, acc, scale_log2e, DOT_DTYPE, PRECISION
        )

    if DIRECT_OUT:
        out_offsets = seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :]
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part_rows = (seq * num_heads + heads) * num_partitions + partition  # [GROUP_PAD]
        tl.store(part_max_ptr + part_rows, row_max, mask=head_mask)
        tl.store(part_sum_ptr + part_rows, row_sum, mask=head_mask)
        acc_offsets = part_rows[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(part_acc_ptr + acc_offsets, acc, mask=head_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    seq_lens_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    window,
    partition_size,
    num_partitions,
    num_heads,
    out_seq_stride,
    out_head_stride,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
):
    # grid: (num_seqs, num_heads); merges the partitions the sequence actually has
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    parts = tl.arange(0, PARTITIONS_PAD)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    part_mask = (parts < tl.cdiv(seq_len, partition_size)) & (parts >= first // partition_size)
    part_rows = (seq * num_heads + head) * num_partitions + parts
    dims = tl.arange(0, HEAD_DIM_PAD)
    # finite fill, not -inf: a sequence of length 0 (graph padding) must give 0, not NaN
    part_max = tl.load(part_max_ptr + part_rows, mask=part_mask, other=-1e30)
    part_sum = tl.load(part_sum_ptr + part_rows, mask=part_mask, other=0.0)
    acc_offsets = part_rows[:, None] * HEAD_DIM_PAD + dims[None, :]
    part_acc = tl.load(part_acc_ptr + acc_offsets, mask=part_mask[:, None], other=0.0)

    weights = tl.where(part_mask, tl.exp2(part_max - tl.max(part_max, 0)), 0.0)  # [PARTITIONS_PAD]
    total = tl.sum(weights * part_sum, 0)
    out = tl.sum(weights[:, None] * part_acc, 0) / tl.where(total > 0, total, 1.0)
    out_offsets = seq * out_seq_stride + head * out_head_stride + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Sequence owning global query block q_block, where sequence s owns the blocks from
    query_start_loc[s] // BLOCK_Q + s on (enough for its queries, without a host sync)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2e,
    window,  # 0, or the keys a query sees (the last ones, its own included)
    num_seqs,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    table_stride,
    cache_block_stride,
    cache_token_stride,
    cache_head_stride,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows = BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads); spare programs return at once
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, num_seqs, tl.program_id(0), BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = tl.program_id(0) - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached prefix before this chunk

    rows = tl.arange(0, BLOCK_M)
    chunk_tokens = q_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] index in the chunk
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    row_mask = (rows < BLOCK_Q * GROUP) & (chunk_tokens < q_len)
    tokens = q_start + chunk_tokens
    q_offsets = tokens[:, None] * q_token_stride + heads[:, None] * q_head_stride + dims[None, :]
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM_PAD]
    positions = context_len + chunk_tokens  # [BLOCK_M] causal limit of each row

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row_ptr = block_tables_ptr + seq * table_stride
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    # with a window, tiles before the block's first query's window are skipped; a sequence of
    # length 0 (a graph's padding tokens) has no tile and writes zeros
    lowest_hidden = tl.where(window > 0, positions - window, -1)  # [BLOCK_M] keys <= it hidden
    kv_start = tl.where(window > 0, tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0), 0)
    for tile_start in range(kv_start // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        key_mask = key_pos < kv_end
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, key_pos, key_mask, dims, dim_mask,
            cache_block_stride, cache_token_stride, cache_head_stride, BLOCK_SIZE, DOT_DTYPE,
        )  # fmt: skip
        visible = key_mask[None, :] & (key_pos[None, :] <= positions[:, None])
        visible = visible & (key_pos[None, :] > lowest_hidden[:, None])
        row_max, row_sum, acc = _online_softmax_step(
            q, k, v, visible, row_max, row_sum, acc, scale_log2e, DOT_DTYPE, PRECISION
        )

    out_offsets = tokens[:, None] * out_token_stride + heads[:, None] * out_head_stride
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(out_ptr + out_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim] -> out, same shape; one query per sequence at position
    seq_len - 1, which sees the last sliding_window keys (None: all). max_seq_len (a host-side
    bound, default from the table width) and partition_size only tune the split; neither needs
    a device sync, so graphs can capture it."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    max_seq_len = max_seq_len or block_tables.shape[1] * block_size
    partition_size = partition_size or _decode_partition_size(
        num_seqs * num_kv_heads, max_seq_len, q.device
    )
    assert partition_size % DECODE_BLOCK_N == 0
    num_partitions = triton.cdiv(max_seq_len, partition_size)
    head_dim_pad = triton.next_power_of_2(head_dim)
    part_shape = (num_seqs, num_heads, num_partitions)
    part_max = q.new_empty(part_shape, dtype=torch.float32)
    part_sum = q.new_empty(part_shape, dtype=torch.float32)
    part_acc = q.new_empty((*part_shape, head_dim_pad), dtype=torch.float32)
    group = num_heads // num_kv_heads
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_max, part_sum, part_acc,
        scale * math.log2(math.e), sliding_window or 0, partition_size, num_partitions, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, DIRECT_OUT=num_partitions == 1,
        **_dot_config(q.dtype), num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_partitions > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            seq_lens, out, part_max, part_sum, part_acc, sliding_window or 0, partition_size,
            num_partitions,
            num_heads, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, PARTITIONS_PAD=triton.next_power_of_2(num_partitions),
        )  # fmt: skip
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> out, same shape. Sequence s owns the queries
    query_start_loc[s]:query_start_loc[s+1], its last q_len positions (causal; a query at
    position p sees the keys > p - sliding_window where one is given). Graph padding:
    a sequence of length 0 gives zeros for its queries; queries past query_start_loc[-1] are
    left unwritten. Sizes come from the shapes only (no sync), so graphs can capture it."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    assert group <= PREFILL_BLOCK_M
    block_q = PREFILL_BLOCK_M // group
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        scale * math.log2(math.e), sliding_window or 0, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M, BLOCK_Q=block_q,
        BLOCK_N=PREFILL_BLOCK_N, **_dot_config(q.dtype), num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_seqs: int) -> None:
    num_heads, head_dim = q.shape[1:]
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.dim() == 4 and k_cache.shape[3] == head_dim
    assert num_heads % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32


def _decode_partition_size(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split each sequence until the grid fills the GPU, partitions no shorter than the minimum."""
    wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * _num_sms(device), num_programs)
    num_partitions = max(1, min(wanted, triton.cdiv(max_seq_len, DECODE_MIN_PARTITION)))
    keys_per_partition = triton.cdiv(max_seq_len, num_partitions)
    return max(1, triton.cdiv(keys_per_partition, DECODE_BLOCK_N)) * DECODE_BLOCK_N


_NUM_SMS: dict[torch.device, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs: any small number
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def _dot_config(dtype: torch.dtype) -> dict:
    """Dot operand dtype and precision: bf16 is upcast under the interpreter, fp32 stays IEEE."""
    interpreted = type(_prefill_kernel).__name__ == "InterpretedFunction"
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted):
        return {"DOT_DTYPE": tl.float32, "PRECISION": "ieee"}
    return {"DOT_DTYPE": tl.float16 if dtype == torch.float16 else tl.bfloat16, "PRECISION": "tf32"}

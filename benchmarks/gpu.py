"""`conveyor bench gpu`: kernel checks and decode-attention bandwidth on a real GPU.

    conveyor bench gpu            # exits 1 on a mismatch, 0 otherwise (and on CPU)

1. Correctness in bfloat16: each Triton kernel against its torch reference (run in float32 on
   the same bf16 values) on random inputs, plus CUDA-graph capture of decode and of a mixed
   step's padded prefill (as the mixed-step graphs run it).
2. Decode attention bandwidth at long contexts: bytes of K/V read / time, as a share of the
   device-to-device copy bandwidth measured here (read + write bytes / time); target >= 70%.
"""

from __future__ import annotations

import sys

import torch

from kernels import reference

DTYPE = torch.bfloat16
TOLERANCE = 1.5e-2  # relative norm error in bf16
BLOCK_SIZE = 16
DEVICE = torch.device("cuda")  # a smoke test may point it at the CPU under the interpreter
# (name, num_heads, num_kv_heads, head_dim)
MODEL_SHAPES = [("smollm2-135m", 9, 3, 64), ("llama-8b", 32, 8, 128)]
# (num_seqs, context length) for the bandwidth table
DECODE_SHAPES = [(1, 32768), (8, 16384), (32, 8192), (64, 4096), (128, 2048)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def time_ms(fn, num_iters: int = 20) -> float:
    """Median-free mean of num_iters calls after a warm-up, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / num_iters


def paged_inputs(seq_lens: list[int], num_heads, num_kv_heads, head_dim, q_lens=None):
    """Random bf16 caches holding exactly the sequences' blocks, shuffled across the pool."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    block_ids = torch.randperm(num_blocks, device=DEVICE).int()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=DEVICE)
    first = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = block_ids[first : first + count]
        first += count
    q_lens = q_lens or [1] * len(seq_lens)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    query_start_loc = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).int()
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, query_start_loc, seq_lens_t


# ------------------------------------------------------------------------- correctness


def check_attention(kernels, num_heads, num_kv_heads, head_dim) -> dict[str, float]:
    seq_lens, q_lens = [1, 17, 300, 5000], [1, 17, 100, 700]
    q, k_cache, v_cache, tables, qsl, lens = paged_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim
    )
    scale = head_dim**-0.5
    as_float = (q.float(), k_cache.float(), v_cache.float())
    decode = kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    expected = reference.paged_attention_decode(*as_float, tables, lens, scale)
    errors = {"decode": relative_error(decode, expected)}
    split = kernels.paged_attention_decode(
        q, k_cache, v_cache, tables, lens, scale, partition_size=256
    )
    errors["decode split-K"] = relative_error(split, expected)
    q, k_cache, v_cache, tables, qsl, lens = paged_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, q_lens
    )
    prefill = kernels.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, scale)
    as_float = (q.float(), k_cache.float(), v_cache.float())
    expected = reference.paged_attention_prefill(*as_float, tables, qsl, lens, scale)
    errors["prefill"] = relative_error(prefill, expected)
    return errors


def check_store_kvcache(kernels, num_heads, num_kv_heads, head_dim) -> dict[str, float]:
    num_tokens = 300
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    cache_shape = (2, 40, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(cache_shape, device=DEVICE, dtype=DTYPE)
    slots = torch.randperm(40 * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    slots[::7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(key, value, expected_k, expected_v, slots)
    kernels.store_kvcache(key, value, k_cache, v_cache, slots)
    same = torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    return {"store_kvcache (1 = differs)": float(not same)}


def check_rms_norm(kernels, num_heads, num_kv_heads, head_dim) -> dict[str, float]:
    hidden = num_heads * head_dim
    x, residual = torch.randn(2, 300, hidden, device=DEVICE, dtype=DTYPE)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(DTYPE)
    out, new_residual = kernels.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    return {
        "rms_norm": relative_error(out, expected_out),
        "rms_norm residual": relative_error(new_residual, expected_residual),
    }


def check_rotary(kernels, num_heads, num_kv_heads, head_dim) -> dict[str, float]:
    num_tokens = 300
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    angles = torch.rand(4096, head_dim // 2, device=DEVICE) * 100
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, cos_sin)
    out_q, out_k = kernels.rotary_embedding(positions, q, k, cos_sin)
    return {
        "rotary q": relative_error(out_q, expected_q),
        "rotary k": relative_error(out_k, expected_k),
    }


def check_decode_graph(kernels, num_heads, num_kv_heads, head_dim) -> float:
    """Capture decode in a CUDA graph, replay on new contents of the same buffers."""
    q, k_cache, v_cache, tables, _, lens = paged_inputs(
        [40, 3000, 9], num_heads, num_kv_heads, head_dim
    )
    scale = head_dim**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([1, 2900, 16], device=DEVICE))
    graph.replay()
    expected = reference.paged_attention_decode(
        q.float(), k_cache.float(), v_cache.float(), tables, lens, scale
    )
    return relative_error(out, expected)


def check_mixed_graph(kernels, num_heads, num_kv_heads, head_dim) -> float:
    """A mixed step's attention as runtime.step.cuda_graphs.MixedGraphs captures it: all prefill
    (decodes as one-query chunks) over static buffers padded to 256 tokens and 8 sequence rows,
    the padding tokens owned by a sequence of length 0. Captured on one step's contents,
    replayed on another's (more sequences, fewer tokens); padding must give zeros. Without a
    GPU (a smoke test) the same runs without capture."""
    bucket, num_rows, scale = 256, 8, head_dim**-0.5
    max_lens = [40, 3000, 16, 200, 200]  # the cache holds every sequence either step uses
    _, k_cache, v_cache, tables, _, _ = paged_inputs(max_lens, num_heads, num_kv_heads, head_dim)
    static_tables = torch.zeros(num_rows, tables.shape[1], dtype=torch.int32, device=DEVICE)
    static_tables[: len(max_lens)] = tables
    q = torch.randn(bucket, num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(num_rows, dtype=torch.int32, device=DEVICE)

    def fill(q_lens: list[int], seq_lens: list[int]) -> None:
        q.copy_(torch.randn_like(q))
        qsl.fill_(bucket)  # rows past the step's: the padding tokens', then empty ones
        qsl[: len(q_lens) + 1] = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0)
        lens.zero_()
        lens[: len(seq_lens)] = torch.tensor(seq_lens, device=DEVICE)

    def attend() -> torch.Tensor:
        return kernels.paged_attention_prefill(q, k_cache, v_cache, static_tables, qsl, lens, scale)

    fill([1, 1, 9, 150], [40, 3000, 9, 200])
    replay = capture(attend) if DEVICE.type == "cuda" else attend
    fill([1, 1, 1, 2, 120], [40, 2900, 16, 2, 180])
    out = replay()
    num_tokens, num_seqs = 125, 5
    expected = reference.paged_attention_prefill(
        q[:num_tokens].float(), k_cache.float(), v_cache.float(), static_tables[:num_seqs],
        qsl[: num_seqs + 1], lens[:num_seqs], scale,
    )  # fmt: skip
    if not torch.isfinite(out).all() or out[num_tokens:].any():
        return float("inf")
    return relative_error(out[:num_tokens], expected)


def capture(fn):
    """fn captured in a CUDA graph (after a run that compiles it); returns a replay that
    gives fn's output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def run_checks(kernels) -> bool:
    rows = []
    for name, num_heads, num_kv_heads, head_dim in MODEL_SHAPES:
        shape = (kernels, num_heads, num_kv_heads, head_dim)
        errors = {}
        for check in (check_attention, check_store_kvcache, check_rms_norm, check_rotary):
            errors |= check(*shape)
        if DEVICE.type == "cuda":
            errors["decode in a CUDA graph"] = check_decode_graph(*shape)
        errors["mixed step in a CUDA graph"] = check_mixed_graph(*shape)
        rows += [(name, check, error) for check, error in errors.items()]
    print(f"\n{'shape':14} {'check':30} {'rel. error':>10}  result")
    for name, check, error in rows:
        print(f"{name:14} {check:30} {error:10.2e}  {'ok' if error < TOLERANCE else 'MISMATCH'}")
    return all(error < TOLERANCE for _, _, error in rows)


# ------------------------------------------------------------------------- bandwidth


def copy_bandwidth() -> float:
    """Device-to-device copy: (read + write bytes) / s over a 1 GiB buffer."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src)) / 1e3)


def measure_decode(kernels, model_shape, num_seqs: int, context: int) -> tuple[int, float]:
    """-> (bytes of K/V read, milliseconds) for one decode step over equal contexts."""
    _, num_heads, num_kv_heads, head_dim = model_shape
    inputs = paged_inputs([context] * num_seqs, num_heads, num_kv_heads, head_dim)
    q, k_cache, v_cache, tables, _, lens = inputs
    scale = head_dim**-0.5
    ms = time_ms(lambda: kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale))
    return 2 * num_seqs * context * num_kv_heads * head_dim * DTYPE.itemsize, ms


def decode_bandwidth_table(kernels, copy_bytes_per_s: float) -> float:
    """Prints one row per (model shape, batch); returns the best share of copy bandwidth."""
    print(f"\ndevice-to-device copy: {copy_bytes_per_s / 1e9:.0f} GB/s (read + write)")
    print(
        f"{'shape':14} {'seqs':>5} {'context':>8} {'K/V MB':>8} {'us':>8} {'GB/s':>7} {'share':>6}"
    )
    best = 0.0
    for model_shape in MODEL_SHAPES:
        for num_seqs, context in DECODE_SHAPES:
            kv_bytes, ms = measure_decode(kernels, model_shape, num_seqs, context)
            bandwidth = kv_bytes / (ms / 1e3)
            best = max(best, bandwidth / copy_bytes_per_s)
            print(
                f"{model_shape[0]:14} {num_seqs:5} {context:8} {kv_bytes / 1e6:8.0f} "
                f"{ms * 1e3:8.1f} {bandwidth / 1e9:7.0f} {bandwidth / copy_bytes_per_s:6.0%}"
            )
    return best


def register(sub) -> None:
    p = sub.add_parser("gpu", help="Triton kernels against their references, decode bandwidth")
    p.set_defaults(func=lambda args: main())


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU present: nothing to check (the interpreter tests cover the kernels on CPU)")
        return 0
    from kernels.dispatch import get_kernels

    kernels = get_kernels(torch.device("cuda"))
    assert kernels.name == "triton", "triton is not installed"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ok = run_checks(kernels)
    best_share = decode_bandwidth_table(kernels, copy_bandwidth())
    print(f"\nbest decode share of copy bandwidth: {best_share:.0%} (target >= 70%)")
    print("all checks passed" if ok else "MISMATCH: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

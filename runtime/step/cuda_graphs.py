"""CUDA graphs for the common step shapes: each graph is the model's forward over static input
buffers, padded to a bucket, captured once; a step copies its inputs into the buffers on the
device and replays the graph of the smallest bucket that holds it.

- Decode-only steps (DecodeGraphs): one graph per bucketed batch size; padding rows have slot -1
  and sequence length 0, which the split-K decode kernel skips.
- Mixed steps, prefill chunks and decodes together (MixedGraphs): one graph per token-count
  bucket. Inside the graph every sequence is a prefill chunk (a decode is a one-query chunk, which
  the sync-free prefill kernel serves). Padding: the padded tokens have slot -1 (the KV store
  skips them) and belong to one sequence of length 0 (the kernel gives them zeros), the spare
  sequence rows after it have no queries and length 0; so the prefill kernel's grid comes from
  the bucket alone. Decode-only steps keep the decode graphs
  (split-K is faster on long contexts); a step that fits no bucket runs eagerly.

All graphs share one memory pool, captured largest first. Without capture (CPU tests, with the
Triton kernels interpreted) `run` performs the same padded static-buffer forward eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.models.attention import AttentionMetadata, ForwardContext

MAX_MIXED_TOKENS = 512  # the largest mixed bucket: a bound on capture time and graph memory


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


def token_buckets(max_tokens: int, largest: int = MAX_MIXED_TOKENS) -> list[int]:
    """Token counts of the mixed graphs: 16, 32, ... doubling up to min(max_tokens, largest)."""
    top = min(max_tokens, largest)
    sizes = [16 << i for i in range(top.bit_length())]
    return sorted({s for s in sizes if s <= top} | {top})


def _zeros(*shape, dtype=torch.long, device=None) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=device)


class StepGraphs:
    """The graphs of one kind of step, keyed by bucket. Subclasses own the static buffers, say
    which steps they can run (`can_run`), fill the buffers (`_fill`) and describe the padded
    batch to the attention (`_metadata`)."""

    buckets: list[int]

    def __init__(self, model, kv_cache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # per bucket: hidden [bucket, hidden]
        self.pool = None

    @property
    def is_captured(self) -> bool:
        return bool(self.graphs)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every bucket, largest first, into `pool` (a new one when None); returns the
        pool, for the next set of graphs to share."""
        self.pool = pool
        self._clear()  # capture writes nothing into the real cache
        for bucket in reversed(self.buckets):  # largest first: the pool fits every smaller one
            self._capture_one(bucket)
        torch.cuda.synchronize()
        return self.pool

    def _capture_one(self, bucket: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward_static(bucket)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bucket] = self._forward_static(bucket)
        self.pool = graph.pool()
        self.graphs[bucket] = graph

    def _forward_static(self, bucket: int) -> torch.Tensor:
        """The padded forward: hidden [bucket, hidden] from the static buffers."""
        ctx = ForwardContext(self._metadata(bucket), self.kv_cache.k_caches, self.kv_cache.v_caches)
        return self.model(self.static.input_ids[:bucket], self.static.positions[:bucket], ctx)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """The step in the smallest bucket that holds it; returns hidden [num_tokens, hidden]
        (a view into the graph's output, valid until the next replay)."""
        num_tokens = input_ids.shape[0]
        bucket = self.bucket_for(num_tokens)
        self._fill(input_ids, positions, attn, bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:num_tokens]
        return self._forward_static(bucket)[:num_tokens]  # not captured: the same, eagerly

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    # ---- per kind of step -----------------------------------------------------------------
    static: object

    def can_run(self, attn: AttentionMetadata, num_tokens: int) -> bool:
        raise NotImplementedError

    def _clear(self) -> None:
        raise NotImplementedError

    def _fill(self, input_ids, positions, attn: AttentionMetadata, bucket: int) -> None:
        raise NotImplementedError

    def _metadata(self, bucket: int) -> AttentionMetadata:
        raise NotImplementedError


# ---- decode-only steps --------------------------------------------------------------------------
@dataclass
class StaticInputs:
    input_ids: torch.Tensor  # [max_batch]
    positions: torch.Tensor  # [max_batch]
    slot_mapping: torch.Tensor  # [max_batch]
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [max_batch] int32

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device) -> StaticInputs:
        return cls(
            _zeros(max_batch, device=device),
            _zeros(max_batch, device=device),
            _zeros(max_batch, device=device),
            _zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
            _zeros(max_batch, dtype=torch.int32, device=device),
        )


class DecodeGraphs(StepGraphs):
    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int) -> None:
        super().__init__(model, kv_cache)
        self.buckets = batch_buckets(max_batch)
        self.static = StaticInputs.allocate(
            self.buckets[-1], max_blocks_per_seq, kv_cache.gpu.device
        )
        # prefill_query_start_loc of a step without prefill: [0]
        self.no_prefill = _zeros(1, dtype=torch.int32, device=kv_cache.gpu.device)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def can_run(self, attn: AttentionMetadata, num_tokens: int) -> bool:
        return (
            attn.num_prefill_seqs == 0
            and num_tokens <= self.max_batch
            and attn.decode_block_tables.shape[1] <= self.static.block_tables.shape[1]
        )

    def _clear(self) -> None:
        self.static.slot_mapping.fill_(-1)
        self.static.seq_lens.fill_(0)

    def _fill(self, input_ids, positions, attn: AttentionMetadata, bucket: int) -> None:
        # slice assignments, not copy_: device-to-device, never a host copy
        s, batch = self.static, input_ids.shape[0]
        s.input_ids[:batch] = input_ids
        s.positions[:batch] = positions
        s.slot_mapping[:batch] = attn.slot_mapping
        s.slot_mapping[batch:bucket] = -1
        s.seq_lens[:batch] = attn.decode_seq_lens
        s.seq_lens[batch:bucket] = 0
        width = attn.decode_block_tables.shape[1]
        s.block_tables[:batch, :width] = attn.decode_block_tables

    def _metadata(self, bucket: int) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(
            slot_mapping=s.slot_mapping[:bucket],
            num_decode_tokens=bucket,
            decode_block_tables=s.block_tables[:bucket],
            decode_seq_lens=s.seq_lens[:bucket],
            prefill_block_tables=s.block_tables[:0],
            prefill_query_start_loc=self.no_prefill,
            prefill_seq_lens=s.seq_lens[:0],
        )


# ---- mixed steps (prefill chunks and decodes) ---------------------------------------------------
@dataclass
class MixedStaticInputs:
    input_ids: torch.Tensor  # [max_tokens]
    positions: torch.Tensor  # [max_tokens]
    slot_mapping: torch.Tensor  # [max_tokens], -1 past the step's tokens
    # sequence rows: the step's, then the padding tokens' (length 0), then spare ones
    block_tables: torch.Tensor  # [max_seqs + 1, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_seqs + 2] int32, the bucket past the padding row
    seq_lens: torch.Tensor  # [max_seqs + 1] int32, 0 past the step's sequences
    iota: torch.Tensor  # [max_seqs + 2] int32 0, 1, 2...: the decodes' query_start_loc

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, device):
        num_rows = max_seqs + 1
        return cls(
            _zeros(max_tokens, device=device),
            _zeros(max_tokens, device=device),
            _zeros(max_tokens, device=device),
            _zeros(num_rows, max_blocks, dtype=torch.int32, device=device),
            _zeros(num_rows + 1, dtype=torch.int32, device=device),
            _zeros(num_rows, dtype=torch.int32, device=device),
            torch.arange(num_rows + 1, dtype=torch.int32, device=device),
        )


MAX_GRAPHED_CONTEXT = 4096  # tokens: a mixed step with decodes and a longer sequence runs eagerly


class MixedGraphs(StepGraphs):
    """max_seqs: sequences a mixed step may have. Each has a token, so a bucket of T tokens
    needs at most min(max_seqs, T) sequence rows and one for its padding: its prefill grid has
    no more spare programs than that."""

    def __init__(
        self, model, kv_cache, max_tokens: int, max_seqs: int, max_blocks_per_seq: int
    ) -> None:
        super().__init__(model, kv_cache)
        self.buckets = token_buckets(max_tokens)
        self.max_seqs = min(max_seqs, self.max_tokens)
        self.static = MixedStaticInputs.allocate(
            self.max_tokens, self.max_seqs, max_blocks_per_seq, kv_cache.gpu.device
        )

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def seqs_in(self, bucket: int) -> int:
        """Sequence rows of a bucket's graph, the padding tokens' row included."""
        return min(self.max_seqs, bucket) + 1

    def can_run(self, attn: AttentionMetadata, num_tokens: int) -> bool:
        """Also refused: decodes beside a sequence longer than MAX_GRAPHED_CONTEXT (the table
        width is the step's longest, known on the host). Inside the graph the prefill kernel
        reads a decode's context in one program per kv head; eagerly, the decode kernel splits
        a long context across the GPU."""
        width = attn.prefill_block_tables.shape[1]
        return (
            attn.num_prefill_seqs > 0
            and num_tokens <= self.max_tokens
            and attn.num_decode_tokens + attn.num_prefill_seqs <= self.max_seqs
            and width <= self.static.block_tables.shape[1]
            and (not attn.num_decode_tokens or width * self.block_size <= MAX_GRAPHED_CONTEXT)
        )

    @property
    def block_size(self) -> int:
        return self.kv_cache.gpu.shape[3]

    def _clear(self) -> None:
        self.static.slot_mapping.fill_(-1)
        self.static.seq_lens.fill_(0)
        self.static.query_start_loc.fill_(0)

    def _fill(self, input_ids, positions, attn: AttentionMetadata, bucket: int) -> None:
        """Decodes first (one-query chunks), then the prefill chunks, then the padding tokens'
        sequence and the spare rows; slice assignments only (device-to-device, no host
        sync)."""
        s, num_tokens = self.static, input_ids.shape[0]
        num_decode = attn.num_decode_tokens
        num_seqs = num_decode + attn.num_prefill_seqs
        s.input_ids[:num_tokens] = input_ids
        s.positions[:num_tokens] = positions  # padded ids and positions: stale but valid
        s.slot_mapping[:num_tokens] = attn.slot_mapping
        s.slot_mapping[num_tokens:bucket] = -1
        width = attn.prefill_block_tables.shape[1]
        s.block_tables[:num_decode, :width] = attn.decode_block_tables
        s.block_tables[num_decode:num_seqs, :width] = attn.prefill_block_tables
        s.seq_lens[:num_decode] = attn.decode_seq_lens
        s.seq_lens[num_decode:num_seqs] = attn.prefill_seq_lens
        s.seq_lens[num_seqs:] = 0
        s.query_start_loc[: num_decode + 1] = s.iota[: num_decode + 1]
        s.query_start_loc[num_decode + 1 : num_seqs + 1] = (
            attn.prefill_query_start_loc[1:] + num_decode
        )
        s.query_start_loc[num_seqs + 1 :] = bucket  # tokens [num_tokens, bucket): padding

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """All prefill: the kernel's grid (bucket // BLOCK_Q + seqs_in(bucket)) is fixed."""
        s, num_seqs = self.static, self.seqs_in(bucket)
        return AttentionMetadata(
            slot_mapping=s.slot_mapping[:bucket],
            num_decode_tokens=0,
            decode_block_tables=s.block_tables[:0],
            decode_seq_lens=s.seq_lens[:0],
            prefill_block_tables=s.block_tables[:num_seqs],
            prefill_query_start_loc=s.query_start_loc[: num_seqs + 1],
            prefill_seq_lens=s.seq_lens[:num_seqs],
        )

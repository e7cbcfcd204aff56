"""CUDA graphs for decode-only steps: one graph per bucketed batch size, captured largest first
into one memory pool; a step replays the smallest graph that holds its batch (padding rows have
slot -1 and sequence length 0, which the kernels skip). Prefill and larger batches run eagerly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention import AttentionMetadata, ForwardContext


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


@dataclass
class StaticInputs:
    input_ids: torch.Tensor  # [max_batch]
    positions: torch.Tensor  # [max_batch]
    slot_mapping: torch.Tensor  # [max_batch]
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [max_batch] int32

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device) -> StaticInputs:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            zeros(max_batch),
            zeros(max_batch),
            zeros(max_batch),
            zeros(max_batch, max_blocks, dtype=torch.int32),
            zeros(max_batch, dtype=torch.int32),
        )

    def metadata(self, batch: int) -> AttentionMetadata:
        empty = self.seq_lens[:0]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_seq_lens=self.seq_lens[:batch],
            prefill_block_tables=self.block_tables[:0],
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=empty.device),
            prefill_seq_lens=empty,
        )


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        device = kv_cache.gpu.device
        self.buckets = batch_buckets(max_batch)
        self.static = StaticInputs.allocate(self.buckets[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        self.static.slot_mapping.fill_(-1)  # capture writes nothing into the real cache
        for batch in reversed(self.buckets):  # largest first: the pool fits every smaller one
            self._capture_one(batch)
        torch.cuda.synchronize()

    def _forward_static(self, batch: int, ctx: ForwardContext) -> torch.Tensor:
        return self.model(self.static.input_ids[:batch], self.static.positions[:batch], ctx)

    def _capture_one(self, batch: int) -> None:
        ctx = ForwardContext(
            self.static.metadata(batch), self.kv_cache.k_caches, self.kv_cache.v_caches
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward_static(batch, ctx)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[batch] = self._forward_static(batch, ctx)
        self.pool = graph.pool()
        self.graphs[batch] = graph

    def can_run(self, attn: AttentionMetadata, num_tokens: int) -> bool:
        return (
            bool(self.graphs)
            and attn.num_prefill_seqs == 0
            and num_tokens <= self.max_batch
            and attn.decode_block_tables.shape[1] <= self.static.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """Replays the graph of the smallest bucket >= batch; returns hidden [batch, hidden]."""
        batch = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= batch)
        s = self.static
        s.input_ids[:batch].copy_(input_ids)
        s.positions[:batch].copy_(positions)
        s.slot_mapping[:batch].copy_(attn.slot_mapping)
        s.slot_mapping[batch:bucket].fill_(-1)
        s.seq_lens[:batch].copy_(attn.decode_seq_lens)
        s.seq_lens[batch:bucket].fill_(0)
        width = attn.decode_block_tables.shape[1]
        s.block_tables[:batch, :width].copy_(attn.decode_block_tables)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch]

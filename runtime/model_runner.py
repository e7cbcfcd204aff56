"""Carries out a scheduler step on the model: swap blocks, prepare a flat ragged batch, run the
forward pass, sample. Makes no scheduling decisions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.attention import AttentionBackend, AttentionMetadata, ForwardContext
from runtime.config import EngineConfig
from runtime.kv_cache import KVCache, parse_bytes
from runtime.models.config import ModelConfig, rope_cos_sin_cache
from runtime.models.llama import LlamaForCausalLM, can_pack
from runtime.sampler import Sampler, SamplerOutput
from scheduler.request import Request
from scheduler.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    sample_rows: list[int]  # row of each sampling request's last token in the flat batch
    sample_requests: list[Request]


def load_model(model_dir: Path, config: ModelConfig, dtype, device, backend) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(_read_safetensors(model_dir))
    model.cos_sin_cache = rope_cos_sin_cache(config, config.max_position_embeddings).to(device)
    if can_pack(device, dtype):
        model.pack_linears()
    return model.eval()


def _read_safetensors(model_dir: Path):
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.block_size = config.block_size
        self.model_config = ModelConfig.from_dir(model_dir)
        self.backend = AttentionBackend(self.device, config.block_size)
        self.model = load_model(model_dir, self.model_config, self.dtype, self.device, self.backend)
        self.kv_cache = self._allocate_kv_cache(config)
        self.sampler = Sampler(self.model_config.vocab_size)
        self.decode_graphs = self._capture_graphs(config) if self.device.type == "cuda" else None

    def _capture_graphs(self, config: EngineConfig):
        if config.enforce_eager:
            return None
        from runtime.cuda_graphs import DecodeGraphs

        max_len = config.max_model_len or self.model_config.max_position_embeddings
        graphs = DecodeGraphs(
            self.model, self.kv_cache, min(config.max_num_seqs, 512), -(-max_len // self.block_size)
        )
        graphs.capture()
        return graphs

    @property
    def bytes_per_block(self) -> int:
        mc = self.model_config
        return KVCache.bytes_per_block(
            mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype
        )

    def _allocate_kv_cache(self, config: EngineConfig) -> KVCache:
        mc = self.model_config
        num_blocks = (
            config.num_kv_blocks or parse_bytes(config.kv_cache_memory) // self.bytes_per_block
        )
        num_cpu_blocks = int(config.swap_space * 2**30) // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        return KVCache(
            mc.num_layers,
            num_blocks,
            num_cpu_blocks,
            self.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.gpu.shape[2]

    @property
    def num_cpu_blocks(self) -> int:
        return self.kv_cache.cpu.shape[2]

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, object]]:
        """Returns {request_id: (sampled token, logprobs or None)} for requests that sample."""
        self.kv_cache.swap_out(out.blocks_to_swap_out)
        self.kv_cache.swap_in(out.blocks_to_swap_in)
        if out.is_empty:
            return {}
        inputs = self.prepare_inputs(out.scheduled)
        self.backend.prepare(inputs.attn)
        hidden = self._forward(inputs)
        if not inputs.sample_requests:
            return {}
        rows = torch.tensor(inputs.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        sampled: SamplerOutput = self.sampler.sample(logits, inputs.sample_requests)
        return {
            r.request_id: (token, logprobs)
            for r, token, logprobs in zip(
                inputs.sample_requests, sampled.token_ids, sampled.logprobs
            )
        }

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(inputs.attn, inputs.input_ids.shape[0]):
            return graphs.run(inputs.input_ids, inputs.positions, inputs.attn)
        ctx = ForwardContext(inputs.attn, self.kv_cache.k_caches, self.kv_cache.v_caches)
        return self.model(inputs.input_ids, inputs.positions, ctx)

    def prepare_inputs(self, scheduled: list[tuple[Request, int]]) -> StepInputs:
        decodes = [
            (r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens == r.num_tokens - 1
        ]
        decodes.sort(key=lambda item: item[0].num_computed_tokens)  # similar lengths side by side
        decode_ids = {id(r) for r, _ in decodes}
        prefills = [(r, n) for r, n in scheduled if id(r) not in decode_ids]
        input_ids, positions, slots, sample_rows, sample_requests = [], [], [], [], []
        for request, num_new in decodes + prefills:
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(
                request.all_token_ids[start:end] if num_new > 1 else [_token_at(request, start)]
            )
            positions.extend(range(start, end))
            slots.extend(self._slots(request.block_ids, start, end))
            if end == request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(request)
        attn = self._attention_metadata(decodes, prefills, slots)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attn=attn,
            sample_rows=sample_rows,
            sample_requests=sample_requests,
        )

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _attention_metadata(self, decodes, prefills, slots) -> AttentionMetadata:
        decode_tables, decode_lens = self._block_tables(decodes)
        prefill_tables, prefill_lens = self._block_tables(prefills)
        query_start_loc = [0]
        for _, num_new in prefills:
            query_start_loc.append(query_start_loc[-1] + num_new)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_lens,
            prefill_block_tables=prefill_tables,
            prefill_query_start_loc=torch.tensor(
                query_start_loc, dtype=torch.int32, device=self.device
            ),
            prefill_seq_lens=prefill_lens,
        )

    def _block_tables(self, batch: list[tuple[Request, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        seq_lens = [r.num_computed_tokens + n for r, n in batch]
        max_blocks = max((len(r.block_ids) for r, _ in batch), default=0)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in batch]
        return (
            torch.tensor(tables, dtype=torch.int32, device=self.device).view(
                len(batch), max_blocks
            ),
            torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
        )

    # ---- start-up measurements for the preemption cost model --------------------------------
    def measure_prefill_rate(self, num_tokens: int = 256) -> float:
        """Tokens/s of a prefill on the real model, using a throw-away request on block 0..n."""
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.num_gpu_blocks:
            return 1e4
        request = Request("__warmup__", list(range(1, num_tokens + 1)))
        request.block_ids = list(range(num_blocks))
        out = SchedulerOutput(scheduled=[(request, num_tokens)])
        self.execute(out)  # warm-up
        start = time.perf_counter()
        self.execute(out)
        self.sampler.release(request.request_id)
        return num_tokens / max(time.perf_counter() - start, 1e-9)


def _token_at(request: Request, index: int) -> int:
    num_prompt = request.num_prompt_tokens
    if index < num_prompt:
        return request.prompt_token_ids[index]
    return request.output_token_ids[index - num_prompt]

"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat ragged batch and a paged KV cache.

Reads HF weight names directly; q/k/v and gate/up projections are fused at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from runtime.models.attention import AttentionBackend, ForwardContext
from runtime.models.config import ModelConfig


class Linear(nn.Linear):
    """nn.Linear that, once packed (CPU, float32 or native bfloat16), runs oneDNN on a weight
    reordered once into its blocked layout. Otherwise torch re-packs the weight on every call
    (MKL's sgemm in float32, oneDNN in bfloat16): 1.5-2.5x slower at the few rows of a decode
    step in float32 (measured on the whole model), 1.3-1.6x per projection in bfloat16."""

    packed: torch.Tensor | None = None

    def pack(self, keep_weight: bool = False) -> None:
        self.packed = pack_weight(self.weight)
        if not keep_weight:  # now unused
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed, self.bias)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU float32, or bfloat16 where oneDNN runs it natively (bit-identical to F.linear there,
    1.3-1.6x faster at decode's few rows: measured on an AVX-512 bf16 EPYC)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out_features, in_features] -> an opaque oneDNN tensor for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernels=reference) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(self, positions, x, cos_sin_cache, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.backend.rotary(ctx, positions, q, k, cos_sin_cache)
        i = self.layer_index
        out = self.backend.forward(q, k, v, ctx.k_caches[i], ctx.v_caches[i], ctx.attn, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.kernels)
        self.self_attn = Attention(config, layer_index, backend)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, backend.kernels
        )
        self.mlp = MLP(config)

    def forward(self, positions, x, residual, cos_sin_cache, ctx):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin_cache, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.kernels)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.packed_embedding: torch.Tensor | None = None  # tied lm_head, when packed
        # (hidden, weight) -> ids: argmax over the vocabulary without the logits (native, CPU)
        self.greedy_projection = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        self.backend.prepare_rotary(ctx, positions, self.cos_sin_cache, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.cos_sin_cache, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] -> logits [num_seqs, vocab] float32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_embedding is not None:
            return packed_linear(hidden, self.packed_embedding, None).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] -> [num_seqs] int64, the first index of each row's largest
        logit, as compute_logits(hidden).argmax(-1) but without writing the logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.greedy_projection(hidden, weight)  # weight: [vocab, hidden], row-major

    def pack_linears(self) -> None:
        """After loading, on CPU in float32: every projection and the lm_head run on packed
        weights (the embedding keeps its plain copy for lookups; so does an untied lm_head where
        the greedy projection reads it)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(
                    keep_weight=module is self.lm_head and self.greedy_projection is not None
                )
        if self.lm_head is None:
            self.packed_embedding = pack_weight(self.embed_tokens.weight)

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for hf_name, tensor in weights:
            target = self._target_of(hf_name)
            if target is None:
                continue
            name, offset = target
            param = params[name]
            with torch.no_grad():
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def _target_of(self, hf_name: str) -> tuple[str, int] | None:
        """Map an HF weight name to (our parameter, row offset inside a fused parameter)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        attn = self.layers[0].self_attn
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", attn.q_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", attn.q_size + attn.kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", self.config.intermediate_size),
        }
        for part, (fused_name, offset) in fused.items():
            if f".{part}." in name:
                return name.replace(part, fused_name), offset
        return name, 0

"""What every family's causal LM shares: token embeddings (optionally scaled), a stack of decoder
layers over a flat ragged batch, the final norm, the lm_head (tied or not) with optional logit
softcapping, the fused greedy projection, oneDNN packing, and loading HF weights with q/k/v and
gate/up fused at load. A family supplies its decoder layer (`make_layer`) and its norm kind."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.attention import AttentionBackend, ForwardContext
from runtime.models.config import ModelConfig, rope_cos_sin_cache
from runtime.models.layers import (
    GLOBAL_ROPE,
    LOCAL_ROPE,
    Linear,
    RMSNorm,
    pack_weight,
    packed_linear,
)

# HF projection -> (our fused projection, which part of it: 0 = first)
FUSED_PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class CausalLM(nn.Module):
    norm_unit_offset = False  # Gemma: every RMSNorm weight is stored as w - 1

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_layers))
        self.norm = self.make_norm(config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.register_buffer("local_cos_sin_cache", torch.empty(0), persistent=False)
        self.packed_embedding: torch.Tensor | None = None  # tied lm_head, when packed
        # (hidden, weight) -> ids: argmax over the vocabulary without the logits (native, CPU)
        self.greedy_projection = None

    def make_layer(self, layer_index: int) -> nn.Module:
        raise NotImplementedError

    def make_norm(self, size: int) -> RMSNorm:
        c = self.config
        return RMSNorm(size, c.rms_norm_eps, self.backend.kernels, self.norm_unit_offset)

    def build_rope(self, device) -> None:
        """The rope tables: the full layers' and, where sliding layers have their own, theirs."""
        c, n = self.config, self.config.max_position_embeddings
        self.cos_sin_cache = rope_cos_sin_cache(c, n).to(device)
        if c.has_local_rope:
            self.local_cos_sin_cache = rope_cos_sin_cache(c, n, local=True).to(device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        tables = {GLOBAL_ROPE: self.cos_sin_cache, LOCAL_ROPE: self.local_cos_sin_cache}
        for name, table in tables.items():
            if table.numel():
                self.backend.prepare_rotary(ctx, positions, table, x.dtype, name)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, tables, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] -> logits [num_seqs, vocab] float32."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif self.packed_embedding is not None:
            logits = packed_linear(hidden, self.packed_embedding, None).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] -> [num_seqs] int64, the first index of each row's largest
        logit, as compute_logits(hidden).argmax(-1) but without writing the logits (softcapping
        is monotonic: it keeps the argmax)."""
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
            name, part = target
            param = params[name]
            offset = self._part_offset(name, part)
            with torch.no_grad():
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fold_unit_offset()

    def _target_of(self, hf_name: str) -> tuple[str, int] | None:
        """Map an HF weight name to (our parameter, part of a fused parameter)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        for part, (fused_name, index) in FUSED_PROJECTIONS.items():
            if f".{part}." in name:
                return name.replace(part, fused_name), index
        return name, 0

    def _part_offset(self, name: str, part: int) -> int:
        """Row where part `part` of a fused parameter starts (q, k, v or gate, up)."""
        if part == 0:
            return 0
        if ".mlp." in name:
            return self.config.intermediate_size
        attn = self.layers[0].self_attn
        return attn.q_size + (part - 1) * attn.kv_size

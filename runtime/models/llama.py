"""Llama (Touvron et al. 2023; Llama 3's rope scaling in the config): pre-norm decoder layers,
RMSNorm, grouped-query attention with rope, a SwiGLU MLP. Qwen2 and Mistral are this model with
q/k/v biases (Qwen2) or a sliding window (Mistral): see qwen2.py and mistral.py."""

from __future__ import annotations

from torch import nn

from runtime.models.attention import ForwardContext
from runtime.models.layers import CausalLM, GatedMLP, PagedAttention, StepModule


class LlamaDecoderLayer(StepModule):
    def __init__(self, model: CausalLM, layer_index: int) -> None:
        super().__init__()
        config = model.config
        self.input_layernorm = model.make_norm(config.hidden_size)
        self.self_attn = PagedAttention(config, layer_index, model.backend)
        self.post_attention_layernorm = model.make_norm(config.hidden_size)
        self.mlp = GatedMLP(config, model.backend.kernels)

    def forward(self, positions, x, residual, rope_tables, ctx: ForwardContext):
        """x + residual is the residual stream (residual None before the first layer)."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, rope_tables, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(self, layer_index)

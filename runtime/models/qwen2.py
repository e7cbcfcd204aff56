"""Qwen2 / Qwen2.5 (Qwen team 2024): Llama's decoder with biases on the q, k and v projections
(config.qkv_bias, on by default for this architecture) and a head tied or untied by the config;
layers from max_window_layers on slide where use_sliding_window says so (config.layer_types)."""

from __future__ import annotations

from runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass

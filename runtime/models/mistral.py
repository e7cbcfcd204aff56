"""Mistral 7B (Jiang et al. 2023): Llama's decoder where every layer attends over a sliding
window of the last `sliding_window` keys (config.window_of), through the same paged attention."""

from __future__ import annotations

from runtime.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass

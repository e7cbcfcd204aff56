"""Builds the engine's model from a model source (an HF directory or a GGUF file, see
runtime.models.source): the family of its architecture, its weights, its rope table."""

from __future__ import annotations

import os

import torch
from torch import nn

from kernels import native
from runtime.models.config import ModelConfig, rope_cos_sin_cache
from runtime.models.gguf_file import UnsupportedModelError
from runtime.models.llama import LlamaForCausalLM, can_pack
from runtime.models.source import (  # noqa: F401 (the names callers know this module by)
    ModelNotFoundError,
    ModelSource,
    open_model,
    resolve_model,
    served_model_name,
    served_model_names,
)

# architecture (config.json's "architectures"[0]) -> the family's model class
FAMILIES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def family_of(config: ModelConfig) -> type[nn.Module]:
    if config.architecture not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {config.architecture}; supported: {sorted(FAMILIES)}"
        )
    return FAMILIES[config.architecture]


def load_model(
    model: ModelSource | str | os.PathLike, config: ModelConfig, dtype, device, backend
) -> nn.Module:
    source = open_model(model)
    with torch.device("meta"):
        module = family_of(config)(config, backend)
    module = module.to_empty(device=device).to(dtype)
    module.load_weights(source.weights(dtype))
    module.cos_sin_cache = rope_cos_sin_cache(config, config.max_position_embeddings).to(device)
    module.greedy_projection = native.greedy_projection_for(torch.device(device), dtype)
    if can_pack(device, dtype):
        module.pack_linears()
    return module.eval()

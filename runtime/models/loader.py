"""Builds the engine's model from a model source (an HF directory or a GGUF file, see
runtime.models.source): the family of its architecture (runtime.models.families), its weights,
its rope tables."""

from __future__ import annotations

import os

import torch
from torch import nn

from kernels import native
from runtime.models.config import ModelConfig
from runtime.models.families import model_class_for
from runtime.models.layers import can_pack
from runtime.models.source import (  # noqa: F401 (the names callers know this module by)
    ModelNotFoundError,
    ModelSource,
    open_model,
    resolve_model,
    served_model_name,
    served_model_names,
)


def load_model(
    model: ModelSource | str | os.PathLike, config: ModelConfig, dtype, device, backend
) -> nn.Module:
    source = open_model(model)
    with torch.device("meta"):
        module = model_class_for(config)(config, backend)
    module = module.to_empty(device=device).to(dtype)
    module.load_weights(source.weights(dtype))
    module.build_rope(device)
    module.greedy_projection = native.greedy_projection_for(torch.device(device), dtype)
    if can_pack(device, dtype):
        module.pack_linears()
    return module.eval()

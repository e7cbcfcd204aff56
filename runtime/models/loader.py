"""Builds the engine's model from a model source (an HF directory or a GGUF file, see
runtime.models.source): the family of its architecture (runtime.models.families), its weights,
its rope tables."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from kernels import native
from runtime.models.config import ModelConfig
from runtime.models.families import model_class_for
from runtime.models.gguf_model import quantizable_tensors
from runtime.models.layers import can_pack
from runtime.models.quant import FLOAT_TYPES, quantized_kernel_types, repack_for_gpu
from runtime.models.source import (  # noqa: F401 (the names callers know this module by)
    ModelNotFoundError,
    ModelSource,
    open_model,
    resolve_model,
    served_model_name,
    served_model_names,
)

log = logging.getLogger(__name__)


def load_model(
    model: ModelSource | str | os.PathLike,
    config: ModelConfig,
    dtype,
    device,
    backend,
    quantization: str = "gguf",
) -> nn.Module:
    """quantization "gguf": a GGUF file's projections and embedding stay in the file's blocks
    where a kernel runs their type on the device; "none": every tensor dequantized to `dtype`."""
    source = open_model(model)
    device = torch.device(device)
    with torch.device("meta"):
        module = model_class_for(config)(config, backend)
        kept = module.quantize(_quantizable(source, device, quantization), dtype)
    module = module.to_empty(device=device).to(dtype)
    module.load_weights(source.weights(dtype, kept))
    if device.type == "cuda":
        repack_for_gpu(module)
    module.build_rope(device)
    if not module.output_is_quantized:
        module.greedy_projection = native.greedy_projection_for(device, dtype)
    if can_pack(device, dtype):
        module.pack_linears()
    if device.type == "cpu" and native.native_ops() is not None:
        module.fuse_decode_layers()
    return module.eval()


def _quantizable(source: ModelSource, device: torch.device, quantization: str) -> dict:
    if quantization == "none" or not source.is_gguf:
        return {}
    kernel_types = quantized_kernel_types(device)
    if not kernel_types:
        log.info("no %s kernels for GGUF blocks: weights dequantized at load", device.type)
        return {}
    specs = quantizable_tensors(source.gguf, kernel_types)
    _log_dequantized_types(source, kernel_types)
    return specs


def _log_dequantized_types(source: ModelSource, kernel_types: frozenset) -> None:
    """One line naming the file's quantized types that have no kernel (dequantized at load)."""
    types = {t.tensor_type for t in source.gguf.tensors.values()}
    slow = sorted(t.name for t in types - kernel_types if t not in FLOAT_TYPES)
    if slow:
        log.info("%s: no kernel for %s: dequantized at load", source.path.name, ", ".join(slow))

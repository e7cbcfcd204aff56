"""Pick the kernels for a device: Triton on CUDA (when triton imports); on CPU the torch
references with native RMSNorm, RoPE and KV store where the native kernels are built; else the
references. Triton stays optional: nothing here imports it unless a CUDA device asks."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels import native, reference


@dataclass(frozen=True)
class Kernels:
    name: str  # "triton" or "reference"
    store_kvcache: Callable[..., None]
    paged_attention_decode: Callable[..., torch.Tensor]
    paged_attention_prefill: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # the CPU's: this step's cos/sin rows prepared once, then applied in every layer
    prepare_rotary: Callable[..., reference.RotaryPlan] = reference.prepare_rotary
    rotary_with_plan: Callable[..., tuple[torch.Tensor, torch.Tensor]] = reference.rotary_with_plan
    # Gemma's norm over bfloat16 rows with a float32 weight; None: composed of rms_norm
    rms_norm_in_float32: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = reference.silu_and_mul


REFERENCE_KERNELS = Kernels(
    name="reference",
    store_kvcache=reference.store_kvcache,
    paged_attention_decode=reference.paged_attention_decode,
    paged_attention_prefill=reference.paged_attention_prefill,
    rms_norm=reference.rms_norm,
    rotary_embedding=reference.rotary_embedding,
)


def get_kernels(device: torch.device | str) -> Kernels:
    device = torch.device(device)
    if device.type == "cuda":
        triton_kernels = _triton_kernels()
        if triton_kernels is not None:
            return triton_kernels
    if device.type == "cpu" and native.native_ops() is not None:
        return _native_cpu_kernels()
    return REFERENCE_KERNELS


@functools.cache
def _native_cpu_kernels() -> Kernels:
    """The references, with RMSNorm, RoPE, the KV store and SwiGLU's middle in native ops
    (kernels/cpu/layer_ops.cpp)."""
    from kernels import native_layer_ops as ops

    return replace(
        REFERENCE_KERNELS,
        name="native-cpu",
        store_kvcache=ops.store_kvcache,
        rms_norm=ops.rms_norm,
        rms_norm_in_float32=ops.rms_norm_in_float32,
        prepare_rotary=ops.prepare_rotary,
        rotary_with_plan=ops.rotary_with_plan,
        silu_and_mul=ops.silu_and_mul,
    )


@functools.cache
def _triton_kernels() -> Kernels | None:
    if importlib.util.find_spec("triton") is None:
        return None  # a bug in our kernel modules must not fall back silently, so no try/except
    from kernels import triton_attention, triton_kvcache, triton_norm_rope

    return Kernels(
        name="triton",
        store_kvcache=triton_kvcache.store_kvcache,
        paged_attention_decode=triton_attention.paged_attention_decode,
        paged_attention_prefill=triton_attention.paged_attention_prefill,
        rms_norm=triton_norm_rope.rms_norm,
        rotary_embedding=triton_norm_rope.rotary_embedding,
    )

"""A CPU decode step's Llama-family layers, one native call each (kernels/cpu/decode_layer.cpp):
the same kernels in the same order as the layer's modules, without the interpreter between them.

A layer fits when its projections are all GGUF blocks of a type with a native kernel, its norms
plain RMSNorm and its MLP SwiGLU (Llama, Qwen2, Mistral: `decode_layer`), or when it is Gemma 3's
(four unit-offset norms, q/k norms, a gelu-tanh MLP: `gemma_decode_layer`, GemmaFusedLayer). A
step fits when it is made of decode queries only and its quantized matmuls take a native kernel
(cpu_kernels.native_kernel: integer dots for a few rows, 8-bit or bfloat16 tiles for a full
batch); the fused layer calls that kernel, so it computes bit for bit what the modules would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.native import native_ops
from kernels.native_layer_ops import NATIVE_DTYPES
from runtime.models import cpu_kernels
from runtime.models.attention import ForwardContext
from runtime.models.quant import NATIVE_TYPES, ConcatLinear, QuantizedLinear


def _parts(projection: nn.Module) -> tuple[list[torch.Tensor], list[int]] | None:
    """(blocks, ggml types) of a projection's parts, or None where one is not native GGUF."""
    parts = projection.parts if isinstance(projection, ConcatLinear) else [projection]
    if not all(isinstance(p, QuantizedLinear) and p.ggml_type in NATIVE_TYPES for p in parts):
        return None
    if not all(p.blocks.is_contiguous() for p in parts):
        return None
    return [p.blocks for p in parts], [int(p.ggml_type) for p in parts]


def _plain_layer_dtype(layer: nn.Module) -> torch.dtype | None:
    """The dtype of a Llama-style layer (plain RMSNorms, no q/k norms, a SwiGLU MLP), else None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    if attn is None or getattr(mlp, "act", None) is not F.silu or attn.q_norm is not None:
        return None
    if hasattr(layer, "pre_feedforward_layernorm") or any(n is None for n in norms):
        return None
    dtypes = {n.weight.dtype for n in norms}
    if len(dtypes) > 1 or any(n.unit_offset for n in norms):
        return None
    dtype = dtypes.pop()
    return dtype if dtype in NATIVE_DTYPES else None


def _layer_weights(attn: nn.Module, projections: list, *qkv_bias) -> tuple:
    """The projections' (blocks, types), q/k/v's bias where the op takes one, and the heads: the
    fused ops' arguments between the norms and the step's."""
    (qkv, qkv_types), o, gate_up, down = projections
    return (
        qkv, qkv_types, *qkv_bias, *o, *gate_up, *down,
        attn.num_heads, attn.num_kv_heads, attn.head_dim,
    )  # fmt: skip


class FusedLayer:
    """A decoder layer's weights laid out once for decode_layer's arguments."""

    def __init__(self, layer: nn.Module, projections: list, dtype: torch.dtype) -> None:
        attn = layer.self_attn
        self.attn = attn
        self.dtype = dtype
        bias = attn.qkv_proj.bias
        self.norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        self.eps = layer.input_layernorm.eps
        qkv_bias = None if bias is None else bias.detach().to(dtype)
        self.weights = _layer_weights(attn, projections, qkv_bias)

    @classmethod
    def of(cls, layer: nn.Module) -> FusedLayer | None:
        """The fused form of a layer, or None where it does not fit."""
        gemma = _gemma_layer_dtype(layer)
        dtype = gemma or _plain_layer_dtype(layer)
        if dtype is None:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        projections = [_parts(m) for m in modules]
        if any(p is None for p in projections):
            return None
        if any(getattr(m, "bias", None) is not None for m in modules[1:]):
            return None
        return (GemmaFusedLayer if gemma else cls)(layer, projections, dtype)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, matmul: str
    ):  # fmt: skip
        """matmul: the GGUF kernel's name, from step_matmul."""
        return self._op()(
            x, residual, *self.norms, self.eps, *self.weights, *self._step(ctx, matmul)
        )

    def _op(self):
        return native_ops().decode_layer

    def _step(self, ctx: ForwardContext, matmul: str) -> tuple:
        """The step's arguments after the weights: rope, caches, attention metadata, matmul."""
        attn, meta = self.attn, ctx.attn
        plan, i = ctx.rope[attn.rope], attn.layer_index
        return (
            plan.cos, plan.sin, ctx.k_caches[i], ctx.v_caches[i], meta.slot_mapping,
            meta.decode_block_tables, meta.decode_seq_lens, attn.scale, attn.sliding_window or 0,
            matmul,
        )  # fmt: skip


class GemmaFusedLayer(FusedLayer):
    """Gemma 3's layer for gemma_decode_layer: its four norms and its q/k norms as (1 + w) in
    float32 (RMSNorm.folded_weight), no q/k/v bias."""

    def __init__(self, layer: nn.Module, projections: list, dtype: torch.dtype) -> None:
        attn = layer.self_attn
        self.attn, self.dtype = attn, dtype
        norms = [getattr(layer, name).folded_weight for name in GEMMA_NORMS]
        self.norms = (norms, attn.q_norm.folded_weight, attn.k_norm.folded_weight)
        self.eps = layer.input_layernorm.eps
        self.weights = _layer_weights(attn, projections)  # no q/k/v bias argument

    def _op(self):
        return native_ops().gemma_decode_layer


GEMMA_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)  # fmt: skip


def _gemma_layer_dtype(layer: nn.Module) -> torch.dtype | None:
    """The dtype of a Gemma 3 layer whose norms are folded (1 + w in float32), else None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if (
        attn is None
        or attn.q_norm is None
        or getattr(mlp, "activation", None) != "gelu_pytorch_tanh"
    ):
        return None
    norms = [getattr(layer, name, None) for name in GEMMA_NORMS]
    norms += [attn.q_norm, attn.k_norm]
    if any(n is None or n.folded_weight is None for n in norms):
        return None
    if any(n.folded_weight.dtype != torch.float32 for n in norms):
        return None
    eps = {n.eps for n in norms}
    dtype = layer.input_layernorm.weight.dtype
    return dtype if len(eps) == 1 and dtype in NATIVE_DTYPES else None


def step_matmul(ctx: ForwardContext, x: torch.Tensor, backend, dtype: torch.dtype) -> str | None:
    """The GGUF matmul (a conveyor_cpu op's name) this step's fused layers call, the one their
    modules would take; None where the step does not fit: CPU, decode queries only, a native
    matmul for its row count, the native attention, rope plans and caches in x's dtype."""
    if x.dtype != dtype or backend.native is None or ctx.attn.num_prefill_seqs:
        return None
    kernel = cpu_kernels.native_kernel(native_ops(), x)
    if kernel is None:
        return None
    plans_fit = all(
        p.cos.dtype == p.sin.dtype == dtype and p.cos.is_contiguous() and p.sin.is_contiguous()
        for p in ctx.rope.values()
    )
    cache = ctx.k_caches[0]
    if not (plans_fit and bool(ctx.rope) and cache.dtype == dtype and cache.is_contiguous()):
        return None
    return kernel.__name__

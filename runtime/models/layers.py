"""The layers every family shares, written once: packed linear projections, RMSNorm (plain or
Gemma's (1 + w)), the gated MLP, attention over the paged KV cache (optional q/k bias and q/k
RMSNorm, rope from the layer's own table, the layer's sliding window). The causal LM around a
family's decoder layers is causal_lm.py's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from runtime.models.attention import AttentionBackend, ForwardContext
from runtime.models.config import ModelConfig

GLOBAL_ROPE, LOCAL_ROPE = "global", "local"


class StepModule(nn.Module):
    """A module called in every layer of every step: calling it runs forward directly, without
    nn.Module.__call__'s hook dispatch (a few microseconds a call, ~300 calls a decode step).
    Hooks on these modules do not run: wrap forward instead."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(StepModule, nn.Linear):
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


class RMSNorm(StepModule):
    """x / rms(x) * w. With unit_offset (Gemma) the checkpoint stores w - 1: the loader folds the
    1 in once, in float32 (fold_unit_offset), and the norm runs in float32 before casting back,
    as Gemma's reference does ((1 + w) in bfloat16 would round w away)."""

    def __init__(self, size: int, eps: float, kernels=reference, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels
        self.unit_offset = unit_offset
        self.folded_weight: torch.Tensor | None = None  # [size] float32, 1 + w

    def fold_unit_offset(self) -> None:
        if self.unit_offset:
            self.folded_weight = self.weight.detach().float() + 1.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns (norm(x + residual), x + residual)."""
        if self.folded_weight is None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if x.dtype == torch.float32:
            return self.kernels.rms_norm(x, self.folded_weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        out, _ = self.kernels.rms_norm(x.float(), self.folded_weight, self.eps)
        return out.to(x.dtype), x


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(StepModule):
    """down(act(gate(x)) * up(x)), gate and up fused in one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class PagedAttention(StepModule):
    """Multi-head (grouped-query) attention of one layer over the paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        norm_unit_offset: bool = False,  # q/k norms with Gemma's (1 + w)
    ) -> None:
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
        self.scale = config.attention_scale
        self.sliding_window = config.window_of(layer_index)
        local = config.is_sliding(layer_index) and config.has_local_rope
        self.rope = LOCAL_ROPE if local else GLOBAL_ROPE
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            eps, kernels = config.rms_norm_eps, backend.kernels
            self.q_norm = RMSNorm(self.head_dim, eps, kernels, norm_unit_offset)
            self.k_norm = RMSNorm(self.head_dim, eps, kernels, norm_unit_offset)
        self.backend = backend

    def forward(self, positions, x, rope_tables: dict, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        q, k = self.backend.rotary(ctx, positions, q, k, rope_tables[self.rope], self.rope)
        i = self.layer_index
        out = self.backend.forward(
            q, k, v, ctx.k_caches[i], ctx.v_caches[i], ctx.attn, self.scale,
            sliding_window=self.sliding_window,
        )  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, self.q_size))

"""What every family shares, written once: packed linear projections, RMSNorm (plain or Gemma's
(1 + w)), the gated MLP, attention over the paged KV cache (optional q/k bias and q/k RMSNorm,
rope from the layer's own table, the layer's sliding window), and the causal LM around a
family's decoder layers (`CausalLM`: scaled embeddings, the final norm, the lm_head with optional
softcapping, the fused greedy projection, packing, and loading HF weights with q/k/v and
gate/up fused at load: checkpoint.py). A family supplies its decoder layer (`make_layer`) and
its norm kind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from runtime.models import fused_decode
from runtime.models.attention import AttentionBackend, ForwardContext
from runtime.models.checkpoint import LoadsCheckpoint
from runtime.models.config import ModelConfig, rope_cos_sin_cache
from runtime.models.quant import (
    QuantizedEmbedding,
    QuantizedWeight,
)

GLOBAL_ROPE, LOCAL_ROPE = "global", "local"
RESCORED_LOGITS = 8  # where the output projection rounds x to 8 bits: each row's largest logits
# recomputed from float activations (QuantizedWeight.rescore_largest)


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
        in_float32 = self.kernels.rms_norm_in_float32
        if in_float32 is not None:
            return in_float32(x, self.folded_weight, self.eps, residual)
        return reference.rms_norm_in_float32(
            x, self.folded_weight, self.eps, residual, rms_norm=self.kernels.rms_norm
        )


# A prompt's rows through the MLP on CPU this many at a time: its [rows, 2 * intermediate] middle
# stays under glibc's 32 MiB mmap threshold, where each larger buffer is mapped and faulted in
# again on every call (a 1,024-row prefill of Qwen2.5-0.5B: 40 MB a layer, 30 ms of page faults on
# the engine thread), and in L3 for the activation. Rows are independent here.
MLP_ROWS_AT_ONCE = 256

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(StepModule):
    """down(act(gate(x)) * up(x)), gate and up fused in one projection; SiLU's middle through the
    kernels' silu_and_mul (one native pass on CPU)."""

    def __init__(self, config: ModelConfig, kernels=reference) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation = config.hidden_activation  # its name
        self.act = ACTIVATIONS[config.hidden_activation]
        self.silu_and_mul = kernels.silu_and_mul if self.act is F.silu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.shape[0] <= MLP_ROWS_AT_ONCE:
            return self._rows(x)
        return torch.cat([self._rows(rows) for rows in x.split(MLP_ROWS_AT_ONCE)])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        both = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(both))
        gate, up = both.chunk(2, dim=-1)
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


class CausalLM(LoadsCheckpoint, nn.Module):
    norm_unit_offset = False  # Gemma: every RMSNorm weight is stored as w - 1
    # --quantized-activations auto: 8-bit activations for many rows where they keep the
    # teacher-forced perplexity within 0.5% of float32 (benchmarks/quant_accuracy.py)
    int8_activations_by_default = True

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
        self.quantized_names: frozenset[str] = frozenset()  # parameters loaded as GGUF blocks
        self.fused_layers: list[fused_decode.FusedLayer | None] = []  # fuse_decode_layers

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
        fused, matmul = self._fused_for(ctx, x)
        for layer, fused_layer in zip(self.layers, fused):
            if fused_layer is None:
                x, residual = layer(positions, x, residual, tables, ctx)
            else:
                x, residual = fused_layer(x, residual, ctx, matmul)
        x, _ = self.norm(x, residual)
        return x

    def fuse_decode_layers(self) -> None:
        """After loading, on CPU with the native kernels: the layers that fit run a decode step
        as one native call each (runtime/models/fused_decode.py)."""
        self.fused_layers = [fused_decode.FusedLayer.of(layer) for layer in self.layers]

    def _fused_for(self, ctx: ForwardContext, x: torch.Tensor) -> tuple[list, str | None]:
        """Each layer's fused form where this step may use it, else None; and the GGUF matmul
        the fused layers call."""
        first = next((f for f in self.fused_layers if f is not None), None)
        matmul = (
            None if first is None else fused_decode.step_matmul(ctx, x, self.backend, first.dtype)
        )
        if matmul is None:
            return [None] * len(self.layers), None
        return self.fused_layers, matmul

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] -> logits [num_seqs, vocab] float32."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif isinstance(self.embed_tokens, QuantizedEmbedding):
            logits = self.embed_tokens.matmul(hidden).float()
        elif self.packed_embedding is not None:
            logits = packed_linear(hidden, self.packed_embedding, None).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        if self.output_is_quantized:
            self.output_projection.rescore_largest(hidden, logits, RESCORED_LOGITS)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] -> [num_seqs] int64, the first index of each row's largest
        logit, as compute_logits(hidden).argmax(-1) but without writing the logits (softcapping
        is monotonic: it keeps the argmax)."""
        # the weight: [vocab, hidden], row-major
        return self.greedy_projection(hidden, self.output_projection.weight)

    def pack_linears(self) -> None:
        """After loading, on CPU in float32: every projection and the lm_head run on packed
        weights (the embedding keeps its plain copy for lookups; so does an untied lm_head where
        the greedy projection reads it)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(
                    keep_weight=module is self.lm_head and self.greedy_projection is not None
                )
        if self.lm_head is None and isinstance(self.embed_tokens, nn.Embedding):
            self.packed_embedding = pack_weight(self.embed_tokens.weight)

    def weight_bytes_per_token(self) -> int:
        """Weight bytes a decode step reads at batch 1: every projection and the output
        projection as held (GGUF blocks or floats); the embedding lookup reads a row."""
        itemsize = self.norm.weight.dtype.itemsize
        total = 0
        for module in self.modules():
            if isinstance(module, QuantizedWeight) and module is not self.embed_tokens:
                total += module.weight_nbytes
            elif isinstance(module, Linear):
                total += module.in_features * module.out_features * itemsize
        if self.lm_head is None and isinstance(self.embed_tokens, QuantizedWeight):
            total += self.embed_tokens.weight_nbytes
        elif self.lm_head is None:
            total += self.embed_tokens.weight.numel() * itemsize
        return total

    @property
    def output_projection(self) -> nn.Module:
        """The module whose rows are the vocabulary's: the lm_head, or the tied embedding."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def output_is_quantized(self) -> bool:
        """The lm_head (or the tied embedding) runs on GGUF blocks: no float weight to project."""
        return isinstance(self.output_projection, QuantizedWeight)

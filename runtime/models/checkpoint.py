"""How a checkpoint's tensors land in a CausalLM: HF names mapped onto our fused projections
(q/k/v and gate/up), floats copied into their rows, GGUF blocks kept in quantized modules that
replace the float ones before anything is allocated. Load time only: no step calls in here."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from runtime.models.quant import (
    QuantizedEmbedding,
    QuantizedSpec,
    QuantizedTensor,
    quantized_projection,
)

# HF projection -> (our fused projection, which part of it: 0 = first)
FUSED_PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _num_parts(path: str) -> int:
    """How many HF projections make the fused projection at `path` (q/k/v: 3, gate/up: 2)."""
    fused = [f for f, _ in FUSED_PROJECTIONS.values() if path.endswith(f)]
    return len(fused) or 1


def _quantized_module(path: str, old: nn.Module, parts: dict, dtype) -> nn.Module | None:
    """parts: {part index: (HF name, spec)} of the module at `path`; None: keep it in floats
    (a part of a type without a kernel, say F16, in a fused projection)."""
    if isinstance(old, nn.Embedding):
        ((_, spec),) = parts.values()
        return QuantizedEmbedding(None, *spec, dtype=dtype)
    if len(parts) != _num_parts(path):
        return None
    ordered = [parts[i][1] for i in sorted(parts)]
    return quantized_projection(
        [(spec.ggml_type, spec.out_features) for spec in ordered],
        old.in_features,
        old.bias is not None,
    )


class LoadsCheckpoint:
    """CausalLM's loading (a mixin: it reads the model's config, layers, lm_head and
    quantized_names)."""

    def quantize(self, specs: dict[str, QuantizedSpec], dtype: torch.dtype) -> frozenset[str]:
        """Before the weights are allocated (on the meta device): swap each projection whose
        every part is in specs, and the embedding, for a module over GGUF blocks. Returns the HF
        names now loaded as blocks."""
        groups: dict[str, dict[int, tuple[str, QuantizedSpec]]] = {}
        for hf_name, spec in specs.items():
            target = self._target_of(hf_name)
            if target is not None:
                groups.setdefault(target[0], {})[target[1]] = (hf_name, spec)
        kept: set[str] = set()
        for name, parts in groups.items():
            path = name.removesuffix(".weight")
            module = _quantized_module(path, self.get_submodule(path), parts, dtype)
            if module is not None:
                self.set_submodule(path, module)
                self.quantized_names |= {name}
                kept |= {hf_name for hf_name, _ in parts.values()}
        return frozenset(kept)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for hf_name, tensor in weights:
            target = self._target_of(hf_name)
            if target is None:
                continue
            name, part = target
            if isinstance(tensor, QuantizedTensor):
                self.get_submodule(name.removesuffix(".weight")).load_part(part, tensor)
                loaded.add(name)
                continue
            param = params[name]
            offset = self._part_offset(name, part)
            with torch.no_grad():
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
        missing = (set(params) | self.quantized_names) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
        for module in self.modules():  # the RMSNorms: Gemma's (1 + w) folded into w
            if hasattr(module, "fold_unit_offset"):
                module.fold_unit_offset()

    def _target_of(self, hf_name: str) -> tuple[str, int] | None:
        """Map an HF weight name to (our parameter, part of a fused parameter)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        for part, (fused_name, index) in FUSED_PROJECTIONS.items():
            if f".{part}." in name:
                return name.replace(part, fused_name), index
        return name, 0

    def _part_offset(self, name: str, part: int) -> int:
        """Row where part `part` of a fused parameter starts (q, k, v or gate, up)."""
        if part == 0:
            return 0
        if ".mlp." in name:
            return self.config.intermediate_size
        attn = self.layers[0].self_attn
        return attn.q_size + (part - 1) * attn.kv_size

"""The parts of an HF config.json that the engine's families need (Llama, Mistral, Qwen2,
Gemma 3), read once into one flat ModelConfig; what a family cannot run is refused here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Gemma3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "frequency_factors")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float  # base of full-attention layers
    rope_scaling: dict = field(default_factory=dict)  # of full-attention layers
    eos_token_ids: tuple[int, ...] = ()
    # one of FULL_ATTENTION / SLIDING_ATTENTION per layer; empty: every layer full
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    local_rope_theta: float | None = None  # rope base of sliding layers (Gemma 3's local base)
    query_pre_attn_scalar: float | None = None  # attention scale = its ** -0.5 (else head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_activation: str = "silu"  # of the gated MLP: silu or gelu_pytorch_tanh
    embedding_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden))
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Gemma 3)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        architecture = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = architecture == "Gemma3ForCausalLM"
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        config = cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            qkv_bias=cfg.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            rope_theta=0.0,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            hidden_activation=_activation(cfg, gemma),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )
        _read_rope(config, cfg, gemma)
        _read_windows(config, cfg)
        if gemma:
            _read_gemma3(config, cfg)
        return config

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    def window_of(self, layer: int) -> int | None:
        """Keys a query of `layer` sees (a query at position p sees keys > p - window), or None."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def has_local_rope(self) -> bool:
        """Sliding layers rotate with a rope of their own (base, no scaling)."""
        return self.local_rope_theta is not None and any(
            map(self.is_sliding, range(self.num_layers))
        )

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size


def _activation(cfg: dict, gemma: bool) -> str:
    name = cfg.get("hidden_activation") or cfg.get("hidden_act")
    name = name or ("gelu_pytorch_tanh" if gemma else "silu")
    if name not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"unsupported MLP activation {name!r} (supported: {SUPPORTED_ACTIVATIONS})"
        )
    return name


def _read_rope(config: ModelConfig, cfg: dict, gemma: bool) -> None:
    """HF's two spellings: transformers 5's rope_parameters (for Gemma 3 one dict per layer
    type) and the older rope_theta + rope_scaling (+ Gemma's rope_local_base_freq)."""
    params = dict(cfg.get("rope_parameters") or {})
    nested = FULL_ATTENTION in params or SLIDING_ATTENTION in params
    full = dict(params.get(FULL_ATTENTION) or {}) if nested else params
    if not full:
        full = dict(cfg.get("rope_scaling") or {})
    default_theta = 1_000_000.0 if gemma else 10_000.0
    config.rope_theta = full.get("rope_theta", cfg.get("rope_theta", default_theta))
    config.rope_scaling = full
    local = dict(params.get(SLIDING_ATTENTION) or {}) if nested else {}
    if gemma or local:
        config.local_rope_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    check_rope_type(full)
    if rope_type(local) != "default":
        raise ValueError(f"unsupported rope scaling {rope_type(local)!r} on sliding layers")


def rope_type(scaling: dict) -> str:
    return scaling.get("rope_type") or scaling.get("type") or "default"


def check_rope_type(scaling: dict) -> None:
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )


def _read_windows(config: ModelConfig, cfg: dict) -> None:
    """Which layers slide, as transformers decides it for each architecture."""
    arch, n = config.architecture, config.num_layers
    hf_default = 4096 if arch in ("MistralForCausalLM", "Gemma3ForCausalLM") else None
    window = cfg.get("sliding_window", hf_default)
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window"):
        window = None
    if window is None:
        return
    if arch == "MistralForCausalLM":  # every layer (transformers ignores layer_types here)
        types = [SLIDING_ATTENTION] * n
    elif cfg.get("layer_types"):
        types = list(cfg["layer_types"])
    elif arch == "Qwen2ForCausalLM":
        first = cfg.get("max_window_layers", 28)
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n)]
    elif arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern", 6)
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]
    else:
        return  # Llama: transformers has no sliding layers
    if len(types) != n or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(
            f"layer_types must name {n} layers, each {FULL_ATTENTION} or {SLIDING_ATTENTION}"
        )
    config.layer_types = tuple(types)
    config.sliding_window = int(window)


def _read_gemma3(config: ModelConfig, cfg: dict) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("unsupported: attention logit softcapping (attn_logit_softcapping)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("unsupported: bidirectional attention (use_bidirectional_attention)")
    config.query_pre_attn_scalar = float(cfg.get("query_pre_attn_scalar", 256))
    config.embedding_scale = config.hidden_size**0.5
    config.qk_norm = True


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] with a scaling (default, linear, llama3, or one factor
    per frequency, as a GGUF of Llama 3 carries them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "frequency_factors":  # a GGUF's rope_freqs: each frequency divided by its own
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    check_rope_type(scaling)
    raise AssertionError(kind)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(medium, blended, scaled)


def rope_cos_sin_cache(
    config: ModelConfig, max_positions: int, local: bool = False
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second. local: the
    sliding layers' rope (their own base, unscaled), else the full layers'."""
    if local:
        inv_freq = rope_inv_freq(config.head_dim, config.local_rope_theta, {})
    else:
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()

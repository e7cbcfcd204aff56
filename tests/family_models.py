"""Small random HF models of each family, written as HF directories (config.json, safetensors,
SmolLM2's tokenizer) by transformers itself: the oracle and the engine read the same files."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMALL = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


def write_random_model(path: Path, hf_config, seed: int = 0) -> Path:
    """Weights drawn so that logits spread over a few units (transformers' own init is so small
    that greedy picks between near-ties); norm weights random around their identity."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:  # Gemma stores w - 1 (zeros at init), the others w (ones)
                param.copy_(param + 0.1 * noise)
            elif "embed" in name:
                param.copy_(noise * 0.5)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    copy_tokenizer(path)
    return path


def copy_tokenizer(path: Path) -> None:
    """SmolLM2's tokenizer files (49,152 ids) into `path`."""
    real = default_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (real / name).exists():
            shutil.copy(real / name, path / name)


def mistral_config(**overrides):
    from transformers import MistralConfig

    return MistralConfig(
        **SMALL, num_hidden_layers=2, sliding_window=40, rope_theta=10000.0, **overrides
    )


def gemma3_config(**overrides):
    from transformers import Gemma3TextConfig

    fields = {
        **SMALL,
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "sliding_window": 40,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        **overrides,
    }
    config = Gemma3TextConfig(**fields)
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def qwen2_config(**overrides):
    from transformers import Qwen2Config

    return Qwen2Config(**SMALL, num_hidden_layers=2, tie_word_embeddings=False, **overrides)


def llama3_config(**overrides):
    """Llama 3's rope scaling with a short original context, so that it bends these head_dim 16
    frequencies (at 8k, as in the real models, it would leave most of them alone)."""
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(**SMALL, num_hidden_layers=2, rope_parameters=scaling, **overrides)


def default_tokenizer_dir() -> Path:
    """The default model's tokenizer files: its HF directory, or those built from its GGUF
    where the model loads straight from the file."""
    from runtime.models import loader

    path = loader.resolve_model(None)
    return path if path.is_dir() else loader.open_model(None).tokenizer_dir()

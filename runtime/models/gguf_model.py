"""A GGUF file read as an HF model: its metadata as an HF-style config dict (for
`ModelConfig.from_dict`) and its tensors under HF weight names, in the engine's dtype.

What llama.cpp's converter changed on the way in is undone here: Q and K rows of llama-arch
attention were permuted (interleaved rope pairs), and Gemma's norm weights were stored as 1 + w.
Families and their defaults follow transformers' GGUF loader, the oracle the tests compare with.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from runtime.models.gguf_file import GGUFFile, GGUFTensor, UnsupportedModelError, materialize
from runtime.models.quant import QuantizedSpec, QuantizedTensor

# GGUF architecture -> HF architecture (Mistral's GGUF files say "llama")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every sixth layer global (Gemma3TextConfig's default)
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
END_OF_GENERATION_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>")

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_config(gguf: GGUFFile) -> dict:
    """The file's metadata as an HF config.json dict; refuses what the engine cannot run."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.path.name}: unsupported GGUF architecture {arch!r}; "
            f"supported: {sorted(ARCHITECTURES)} (Mistral as llama)"
        )
    num_heads = int(gguf.arch_value("attention.head_count"))
    hidden = int(gguf.arch_value("embedding_length"))
    config = {
        "architectures": [_hf_architecture(gguf)],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": _vocab_size(gguf),
        "hidden_size": hidden,
        "intermediate_size": int(gguf.arch_value("feed_forward_length")),
        "num_hidden_layers": int(gguf.arch_value("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(gguf.arch_value("attention.head_count_kv", num_heads)),
        "head_dim": int(gguf.arch_value("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(gguf.arch_value("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "rope_theta": float(gguf.arch_value("rope.freq_base", 10_000.0)),
        "rope_scaling": _rope_scaling(gguf),
        "eos_token_id": _eos_token_ids(gguf),
        "bos_token_id": gguf.metadata.get("tokenizer.ggml.bos_token_id"),
    }
    if gguf.arch_value("attention.sliding_window") is not None:
        config["sliding_window"] = int(gguf.arch_value("attention.sliding_window"))
    if arch == "gemma3":
        config.update(_gemma3_fields(gguf, config))
    return config


def _hf_architecture(gguf: GGUFFile) -> str:
    """Mistral's files say llama; as transformers does, the model's name tells them apart (and
    Mistral's HF default window, 4,096 tokens, applies where the file names none)."""
    name = str(gguf.metadata.get("general.name", "")).lower()
    if gguf.architecture == "llama" and "mistral" in name:
        return "MistralForCausalLM"
    return ARCHITECTURES[gguf.architecture]


def _vocab_size(gguf: GGUFFile) -> int:
    if gguf.arch_value("vocab_size") is not None:
        return int(gguf.arch_value("vocab_size"))
    return gguf.tensors["token_embd.weight"].shape[0]


def _rope_scaling(gguf: GGUFFile) -> dict:
    """HF rope_scaling from `{arch}.rope.scaling.*`; refuses what rope_inv_freq cannot do."""
    freqs = gguf.tensors.get("rope_freqs.weight")
    if freqs is not None:  # Llama 3.1's scaling, baked into one factor per rotated pair
        factors = materialize(freqs, torch.float64).flatten().tolist()
        return {"rope_type": "frequency_factors", "factors": factors}
    kind = str(gguf.arch_value("rope.scaling.type", "none"))
    if kind == "none":
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf.arch_value("rope.scaling.factor"))}
    raise UnsupportedModelError(
        f"{gguf.path.name}: unsupported rope type {kind!r} (supported in GGUF: none, linear)"
    )


def _eos_token_ids(gguf: GGUFFile) -> list[int]:
    """The end-of-sequence id, the end-of-turn id where the file names one, then the tokens
    that end a turn or a document in the families' vocabularies (as llama.cpp stops on them;
    their generation_config.json lists them too)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [int(gguf.metadata[k]) for k in keys if gguf.metadata.get(k) is not None]
    tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
    ids += [tokens.index(text) for text in END_OF_GENERATION_TOKENS if text in tokens]
    return list(dict.fromkeys(ids))


def _gemma3_fields(gguf: GGUFFile, config: dict) -> dict:
    """What Gemma 3's GGUF metadata leaves to the family's defaults (as transformers does)."""
    num_layers = config["num_hidden_layers"]
    pattern = GEMMA3_SLIDING_WINDOW_PATTERN
    global_rope = {"rope_type": "default", **config["rope_scaling"]}
    global_rope["rope_theta"] = config["rope_theta"]
    return {
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ],
        "query_pre_attn_scalar": config["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": gguf.arch_value("final_logit_softcapping"),
        "attn_logit_softcapping": gguf.arch_value("attn_logit_softcapping"),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "rope_parameters": {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
        "tie_word_embeddings": True,
    }


def hf_weight_name(gguf_name: str, architecture: str) -> str | None:
    """The HF name of a GGUF tensor (None: a tensor the model does not use)."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    if part == "ffn_norm":  # Gemma's pre-feedforward norm, the others' post-attention norm
        part_name = (
            "pre_feedforward_layernorm"
            if architecture == "gemma3"
            else ("post_attention_layernorm")
        )
    elif part in _LAYER_PARTS:
        part_name = _LAYER_PARTS[part]
    else:
        return None
    return f"model.layers.{layer}.{part_name}.{kind}"


def quantizable_tensors(gguf: GGUFFile, types: frozenset) -> dict[str, QuantizedSpec]:
    """{HF name: (type, out_features, in_features)} of the projections, the embedding and the
    lm_head whose file type is one of `types`: the weights that can stay in their blocks."""
    arch, specs = gguf.architecture, {}
    for tensor in gguf.tensors.values():
        name = hf_weight_name(tensor.name, arch)
        if name and tensor.tensor_type in types and _is_matrix_weight(name):
            out_features, in_features = tensor.shape
            specs[name] = QuantizedSpec(tensor.tensor_type, out_features, in_features)
    return specs


def _is_matrix_weight(hf_name: str) -> bool:
    return hf_name.endswith("_proj.weight") or hf_name in (
        "lm_head.weight",
        "model.embed_tokens.weight",
    )


def hf_weights(
    gguf: GGUFFile, config: dict, dtype: torch.dtype, keep_quantized: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, tensor in `dtype`) for every tensor the model uses, in file order, a few
    dequantized ahead on worker threads (numpy lets go of the GIL); the names in
    `keep_quantized` come as their blocks (QuantizedTensor) instead. The file's pages are
    dropped from this process once all are read."""
    gguf.check_tensor_types()
    arch = gguf.architecture
    named = [(n, t) for t in gguf.tensors.values() if (n := hf_weight_name(t.name, arch))]

    def convert(item: tuple[str, GGUFTensor]) -> tuple[str, torch.Tensor | QuantizedTensor]:
        name, tensor = item
        if name in keep_quantized:
            return name, _blocks_as_hf(tensor, name, arch, config)
        return name, _as_hf(tensor, name, arch, config, dtype)

    yield from bounded_map(convert, named)
    gguf.drop_pages()


def bounded_map(fn, items: list, num_workers: int = min(4, os.cpu_count() or 1)) -> Iterator:
    """fn over items, in order, with at most num_workers + 1 results held at once."""
    with ThreadPoolExecutor(num_workers) as pool:
        pending: deque[Future] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _as_hf(tensor: GGUFTensor, name: str, arch: str, config: dict, dtype) -> torch.Tensor:
    if arch == "gemma3" and name.endswith("norm.weight"):
        return materialize(tensor, torch.float32).sub_(1.0).to(dtype)  # stored as 1 + w
    weight = materialize(tensor, dtype)
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        weight = unpermute_rope_rows(weight, heads)
    return weight


def _blocks_as_hf(tensor: GGUFTensor, name: str, arch: str, config: dict) -> QuantizedTensor:
    """The tensor's blocks, copied out of the mapped file: rows are output features, so
    llama's Q/K rows are unpermuted as whole rows of blocks."""
    blocks = torch.from_numpy(np.array(tensor.data, copy=True))  # [out, row_bytes]
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        blocks = unpermute_rope_rows(blocks, heads)
    return QuantizedTensor(blocks, tensor.tensor_type, tensor.shape[-1])


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: per head, its rows [head_dim] were reordered from
    (2, head_dim / 2) halves (HF's rotate_half) to (head_dim / 2, 2) interleaved pairs.
    weight: [num_heads * head_dim, ...] (a weight or a bias)."""
    rows = weight.shape[0]
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()

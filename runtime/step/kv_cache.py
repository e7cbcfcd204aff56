"""KV cache tensors: a device pool and a CPU swap pool of fixed-size blocks, all layers together."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', 1000000 -> bytes; a bare number under 1024 is GiB."""
    if isinstance(value, int | float):
        return int(value * 2**30) if value < 1024 else int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a size from {value!r} (examples: 2GiB, 512MiB, 1000000)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return parse_bytes(number) if unit == "" else int(number * _UNITS[unit])


AUTO = "auto"
# shares of the memory left after the weights are loaded that `--kv-cache-memory auto` takes: the
# GPU keeps room for activations and CUDA graphs; the CPU for activations, the swap pool, the
# gateway and whatever else runs on the machine
AUTO_SHARE = {"cuda": 0.9, "cpu": 0.5}


def memory_left(device: torch.device) -> int:
    """Bytes free now on `device`: the GPU's free memory; on CPU the kernel's MemAvailable, or the
    cgroup's limit less its usage where that is smaller (a container)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    left = _meminfo_available()
    cgroup = _cgroup_left()
    return left if cgroup is None else min(left, cgroup)


def _meminfo_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _cgroup_left() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except OSError:
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def auto_kv_bytes(device: torch.device, swap_bytes: int) -> int:
    """`--kv-cache-memory auto`: a share of the memory left (the swap pool comes out of it on
    CPU, where both live in the same memory)."""
    left = memory_left(device) - (swap_bytes if device.type == "cpu" else 0)
    return int(max(0, left) * AUTO_SHARE[device.type])


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (2, num_layers, num_gpu_blocks, block_size, num_kv_heads, head_dim)
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        cpu_shape = (2, num_layers, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.cpu = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self.k_caches = list(
            self.gpu[0].unbind(0)
        )  # per layer [num_blocks, block_size, kv_heads, head_dim]
        self.v_caches = list(self.gpu[1].unbind(0))

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (gpu, cpu) block pairs to the CPU pool."""
        if mapping:
            src, dst = _index_pair(mapping, self.gpu.device)
            self.cpu[:, :, dst.cpu()] = self.gpu[:, :, src].to("cpu")  # synchronous: read at once

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (cpu, gpu) block pairs back to the device pool."""
        if mapping:
            src, dst = _index_pair(mapping, self.gpu.device)
            self.gpu[:, :, dst] = self.cpu[:, :, src.cpu()].to(self.gpu.device, non_blocking=True)


def _index_pair(mapping: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = torch.tensor(mapping, dtype=torch.long, device=device)
    return pairs[:, 0], pairs[:, 1]


def measure_copy_bandwidth(cache: KVCache, num_blocks: int = 64) -> float:
    """Bytes/s of a block swap-out, measured on the real pools (0 blocks -> a rough default)."""
    num_blocks = min(num_blocks, cache.gpu.shape[2], cache.cpu.shape[2])
    if num_blocks == 0:
        return 1e10
    mapping = [(i, i) for i in range(num_blocks)]
    cache.swap_out(mapping)  # warm-up
    start = time.perf_counter()
    for _ in range(3):
        cache.swap_out(mapping)
    if cache.gpu.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 3
    return cache.gpu[:, :, :num_blocks].nbytes / max(seconds, 1e-9)

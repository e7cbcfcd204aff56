"""Engine settings: the flags shared by `conveyor generate`, `bench` and `serve`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_supports_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass
class EngineConfig:
    model: str | None = None
    served_model_name: list[str] | None = None  # None: the name derived from `model`
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str = "2GiB"
    swap_space: float = 1.0  # GiB of CPU swap pool
    max_num_seqs: int = 256
    max_batch_tokens: int = 2048
    max_model_len: int | None = None
    scheduling: str = "priority"
    preemption_mode: str = "auto"
    priority_aging: float | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # CUDA: no decode graphs
    seed: int = 0

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            if self.dtype not in DTYPES:
                raise ValueError(f"--dtype must be one of {sorted(DTYPES)} or auto")
            return DTYPES[self.dtype]
        device = self.resolved_device()
        if device.type == "cuda" or cpu_supports_bf16():
            return torch.bfloat16
        return torch.float32

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        group.add_argument(
            "--model", default=None, help="HF model dir or .gguf (default: SmolLM2-135M-Instruct)"
        )
        group.add_argument(
            "--served-model-name",
            nargs="+",
            default=None,
            metavar="NAME",
            help="names /v1/models lists and requests may use (default: from --model)",
        )
        group.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
        group.add_argument("--device", default="auto")
        group.add_argument("--block-size", type=int, default=16)
        group.add_argument("--num-kv-blocks", type=int, default=None)
        group.add_argument("--kv-cache-memory", default="2GiB", help="bytes or e.g. 2GiB")
        group.add_argument("--swap-space", type=float, default=1.0, help="GiB of CPU swap pool")
        group.add_argument("--max-num-seqs", type=int, default=256)
        group.add_argument("--max-batch-tokens", type=int, default=2048)
        group.add_argument("--max-model-len", type=int, default=None)
        group.add_argument(
            "--scheduling", default="priority", choices=["priority", "fcfs", "static"]
        )
        group.add_argument(
            "--preemption-mode", default="auto", choices=["auto", "swap", "recompute"]
        )
        group.add_argument("--priority-aging", type=float, default=None, metavar="SECONDS")
        group.add_argument(
            "--no-prefix-caching", dest="enable_prefix_caching", action="store_false"
        )
        group.add_argument(
            "--enforce-eager", action="store_true", help="CUDA: run decode without graphs"
        )
        group.add_argument("--seed", type=int, default=0)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

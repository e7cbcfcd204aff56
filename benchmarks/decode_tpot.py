"""Batch-1 decode on the engine alone (no HTTP, no gateway imports: runs on a bare GPU machine):
time per output token of one greedy request, the weight bytes a step reads, and their rate as a
share of the device's copy bandwidth, for each weight mode in turn.

    python -m benchmarks.decode_tpot MODEL.gguf --device cuda --modes gguf,none --tokens 128

TPOT is (time for prompt + tokens + 1) - (time for prompt + 1), over tokens, after a warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bound import measure_copy_bandwidth
from runtime.config import EngineConfig
from runtime.engine import Engine
from scheduler.request import SamplingParams

PROMPT = list(range(1000, 1032))  # 32 token ids every vocabulary of interest holds


def measure(model: str, device: str, mode: str, tokens: int, eager: bool) -> dict:
    config = EngineConfig(model=model, device=device, quantization=mode, enforce_eager=eager,
                          num_kv_blocks=4096)  # fmt: skip
    engine = Engine(config)

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        engine.generate([PROMPT], params)
        return time.perf_counter() - start

    seconds(tokens)  # warm-up
    tpot = (seconds(tokens + 1) - seconds(1)) / tokens
    return {"mode": mode, "tpot_s": tpot,
            "weight_bytes": engine.runner.model.weight_bytes_per_token()}  # fmt: skip


def profile(model: str, device: str, mode: str, tokens: int) -> None:
    """Device time per token of each kernel, from an eager run (CUDA graphs hide kernels from the
    profiler; a kernel's own time is the same in a graph)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    config = EngineConfig(model=model, device=device, quantization=mode, enforce_eager=True,
                          num_kv_blocks=4096)  # fmt: skip
    engine = Engine(config)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate([PROMPT], params)  # warm-up
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate([PROMPT], params)
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    print(f"{mode}: device time {total / tokens:8.1f} us a token, by kernel:")
    for e in events[:18]:
        print(f"  {e.device_time_total / tokens:8.1f} us {e.count / tokens:6.1f}x  {e.key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="auto")
    p.add_argument("--modes", default="gguf,none", help="--quantization values, in order")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--profile", action="store_true", help="also each kernel's time a token")
    args = p.parse_args()
    device = EngineConfig(device=args.device).resolved_device()
    copy = measure_copy_bandwidth(device)
    print(f"{device}: copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    for mode in args.modes.split(","):
        r = measure(args.model, args.device, mode, args.tokens, args.enforce_eager)
        rate = r["weight_bytes"] / r["tpot_s"]
        print(f"{mode:5} weights {r['weight_bytes'] / 1e6:7.1f} MB a token  TPOT "
              f"{r['tpot_s'] * 1e3:7.3f} ms  {1 / r['tpot_s']:7.1f} tok/s  "
              f"{rate / 1e9:6.0f} GB/s = {rate / copy:5.1%} of copy")  # fmt: skip
        if args.profile:
            profile(args.model, args.device, mode, args.tokens)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""The physical bound of a run, step by step: a step must read the weights once and the KV of
every token its queries attend to, and must do its FLOPs (2 x parameters per token, plus
attention over the context); it cannot take less than the longer of (bytes read / measured copy
bandwidth) and (FLOPs / measured large-matmul rate). The run's bound is the sum over its steps;
its share of the bound is bound / measured time (1.0 would be the hardware's speed).

Both rates are measured on the engine's device, in its dtype: a device-to-device copy of a large
buffer (read + write bytes per second) and a large square matmul (2048 on CPU, 8192 on CUDA).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

MATMUL_SIZE = {"cpu": 2048, "cuda": 8192}
COPY_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_bandwidth(device: torch.device) -> float:
    """(read + write bytes) / s of a large copy on the device."""
    src = torch.empty(
        COPY_BYTES.get(device.type, COPY_BYTES["cpu"]), dtype=torch.uint8, device=device
    )
    dst = torch.empty_like(src)
    return 2 * src.numel() / best_seconds(lambda: dst.copy_(src), device)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul on the device (the best of a few)."""
    size = MATMUL_SIZE.get(device.type, MATMUL_SIZE["cpu"])
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / best_seconds(lambda: torch.matmul(a, b), device)


@dataclass(frozen=True)
class DeviceRates:
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    @classmethod
    def measure(cls, device: torch.device, dtype: torch.dtype) -> DeviceRates:
        return cls(measure_copy_bandwidth(device), measure_matmul_flops(device, dtype))


@dataclass(frozen=True)
class ModelCosts:
    weight_bytes: int
    kv_bytes_per_token: int  # K and V of one token, all layers
    flops_per_token: int  # 2 x parameters
    attention_flops_per_pair: int  # one query token against one context token, all layers

    @classmethod
    def of(cls, model_config, dtype: torch.dtype, weight_bytes: int | None = None) -> ModelCosts:
        """weight_bytes: what a step reads (CausalLM.weight_bytes_per_token: GGUF blocks where
        they are kept); default every parameter in `dtype`."""
        mc, itemsize = model_config, dtype.itemsize
        return cls(
            weight_bytes=weight_bytes or mc.num_parameters * itemsize,
            kv_bytes_per_token=2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize,
            flops_per_token=2 * mc.num_parameters,
            attention_flops_per_pair=4 * mc.num_layers * mc.num_heads * mc.head_dim,
        )


class StepBound:
    """Records what each step computed (from how far its requests' computed tokens moved); the
    bound is summed afterwards with the best rates measured in the run."""

    def __init__(self, costs: ModelCosts, requests: Sequence) -> None:
        self.costs, self.requests = costs, requests
        self.num_computed = [request.num_computed_tokens for request in requests]
        self.steps: list[tuple[int, int, int]] = []  # (tokens, KV tokens read, query-key pairs)
        self.bookkeeping_s = 0.0

    def observe_step(self) -> None:
        start = time.perf_counter()
        num_tokens = kv_tokens_read = num_pairs = 0
        for index, request in enumerate(self.requests):
            done, before = request.num_computed_tokens, self.num_computed[index]
            self.num_computed[index] = done
            new = done - before if done > before else 0  # a recompute starts again from 0
            if new:
                num_tokens += new
                kv_tokens_read += done
                num_pairs += new * done - new * (new - 1) // 2  # causal: query i sees i + 1
        if num_tokens:
            self.steps.append((num_tokens, kv_tokens_read, num_pairs))
        self.bookkeeping_s += time.perf_counter() - start

    def seconds(self, rates: DeviceRates) -> float:
        return sum(self.step_seconds(step, rates) for step in self.steps)

    def step_seconds(self, step: tuple[int, int, int], rates: DeviceRates) -> float:
        num_tokens, kv_tokens_read, num_pairs = step
        costs = self.costs
        read_bytes = costs.weight_bytes + kv_tokens_read * costs.kv_bytes_per_token
        flops = num_tokens * costs.flops_per_token + num_pairs * costs.attention_flops_per_pair
        return max(read_bytes / rates.copy_bytes_per_s, flops / rates.matmul_flops_per_s)

    def summary(self, rates: DeviceRates, measured_s: float) -> dict:
        bound_s = self.seconds(rates)
        return {
            "bound_seconds": bound_s,
            "measured_seconds": measured_s,
            "share": bound_s / measured_s if measured_s else None,
            "num_steps": len(self.steps),
            "copy_bytes_per_s": rates.copy_bytes_per_s,
            "matmul_flops_per_s": rates.matmul_flops_per_s,
            "weight_bytes": self.costs.weight_bytes,
            "kv_bytes_per_token": self.costs.kv_bytes_per_token,
        }


def best_rates(samples: Sequence[DeviceRates]) -> DeviceRates:
    """The best of each rate over samples taken before, between and after the runs: a sample
    slowed by other load would flatter the share."""
    return DeviceRates(
        max(s.copy_bytes_per_s for s in samples), max(s.matmul_flops_per_s for s in samples)
    )

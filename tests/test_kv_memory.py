"""`--kv-cache-memory auto`: the KV cache sized from the memory left once the weights are loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.step import kv_cache

CPU = torch.device("cpu")


def test_memory_left_on_cpu_is_what_the_kernel_says_is_available():
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert 0 < kv_cache.memory_left(CPU) <= total


def test_auto_takes_its_share_of_the_memory_left_less_the_swap_pool(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(kv_cache, "memory_left", lambda device: 3 * 2**30)
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", kv_cache_memory="auto", swap_space=1.0,
            max_num_seqs=2**20,
        )
    )  # fmt: skip
    runner = engine.runner
    expected = int(2 * 2**30 * kv_cache.AUTO_SHARE["cpu"]) // runner.bytes_per_block
    assert runner.num_gpu_blocks == expected
    assert engine.block_manager.num_gpu_blocks == expected


def test_auto_never_holds_more_than_the_sequences_can_use(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(kv_cache, "memory_left", lambda device: 2**40)
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", kv_cache_memory="auto", max_num_seqs=3,
            max_model_len=100, block_size=16, swap_space=0.01,
        )
    )  # fmt: skip
    assert engine.runner.num_gpu_blocks == 3 * 7  # ceil(100 / 16) blocks for each of 3


@pytest.mark.parametrize("value", ["automatic", "-1GiB", "2 parsecs"])
def test_sizes_it_cannot_read_are_refused(value):
    with pytest.raises(ValueError):
        EngineConfig(model="x", kv_cache_memory=value)

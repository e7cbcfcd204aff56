"""Smoke tests of `conveyor bench offline` and `conveyor bench priority` on a tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.step import NEAR_ZERO, write_random_llama
from gateway.cli import main

# the tests' tiny model (conftest.py), smaller still: benchmarks run it many times
TINY_LLAMA = dict(
    NEAR_ZERO,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    head_dim=8,
    max_position_embeddings=512,
)
SMALL_ENGINE = ["--dtype", "float32", "--kv-cache-memory", "8MiB", "--swap-space", "0.01"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Random-initialised 2-layer Llama with the default model's tokenizer files."""
    return write_random_llama(tmp_path_factory.mktemp("tiny-llama"), TINY_LLAMA)


def run_bench(argv: list[str], result_path: Path) -> dict:
    assert main(["bench", *argv, "--save-result", str(result_path)]) == 0
    return json.loads(result_path.read_text())


def test_bench_offline(tiny_model_dir, tmp_path):
    argv = ["offline", "--model", str(tiny_model_dir), *SMALL_ENGINE, "--num-prompts", "6"]
    argv += ["--max-prompt-len", "40", "--min-output-len", "2", "--max-output-len", "12"]
    result = run_bench([*argv, "--rounds", "3"], tmp_path / "offline.json")

    systems = result["systems"]
    expected = {
        "conveyor_continuous",
        "conveyor_static",
        "conveyor_dynamic",
        "transformers_static",
        "transformers_generate_batch",
    }
    assert set(systems) == expected
    num_output_tokens = result["workload"]["output_tokens"]
    for entry in systems.values():
        assert entry["output_tokens"] == num_output_tokens
        assert entry["output_tokens_per_s"] > 0
    assert systems["conveyor_continuous"]["conveyor_continuous_speedup"] == pytest.approx(1.0)
    assert sum(systems["conveyor_static"]["batch_sizes"]) == 6
    assert sum(systems["conveyor_dynamic"]["batch_sizes"]) == 6
    assert (
        systems["transformers_static"]["batch_sizes"] == systems["conveyor_static"]["batch_sizes"]
    )
    assert 0 < result["roofline"]["fraction"] < 1
    bound = result["physical_bound"]
    assert 0 < bound["bound_seconds"] < bound["measured_seconds"]
    assert bound["share"] == pytest.approx(systems["conveyor_continuous"]["physical_bound_share"])
    assert bound["num_steps"] == systems["conveyor_continuous"]["num_steps"]
    assert "physical_bound_share" not in systems["transformers_static"]
    assert 0 <= result["kv_cache"]["waste_at_peak"] < 1
    assert result["kv_cache"]["peak_allocated_blocks"] > 0
    assert set(result["targets"]["met"]) == set(result["targets"]["target"])
    rounds = result["paired_rounds"]
    assert len(rounds) == 3
    first = rounds[0]
    assert first["conveyor_continuous"] == systems["conveyor_continuous"]["output_tokens_per_s"]
    for entry in rounds:
        ratio = entry["conveyor_continuous"] / entry["transformers_generate_batch"]
        assert entry["ratio"] == pytest.approx(ratio)
    median = sorted(entry["ratio"] for entry in rounds)[1]
    assert result["targets"]["measured"]["vs_transformers_generate_batch"] == median


def test_bench_priority(tiny_model_dir, tmp_path):
    argv = ["priority", "--model", str(tiny_model_dir), *SMALL_ENGINE, "--max-num-seqs", "2"]
    argv += ["--num-batch-requests", "4", "--batch-prompt-len", "8", "--batch-output-len", "24"]
    argv += ["--num-interactive", "3", "--interactive-interval", "0.02"]
    argv += ["--interactive-prompt-len", "4", "--interactive-output-len", "2"]
    argv += ["--num-fairness-requests", "4", "--fairness-prompt-len", "4"]
    argv += ["--fairness-output-len", "4", "--preemption-modes", "swap,recompute"]
    result = run_bench(argv, tmp_path / "priority.json")

    assert result["idle"]["ttft"]["count"] == 3
    assert result["idle"]["ttft"]["p50_s"] > 0
    assert result["batch_alone"]["batch_tokens_per_s"] > 0
    assert set(result["loaded"]) == {"swap", "recompute"}
    for mode, phase in result["loaded"].items():
        assert phase["ttft"]["count"] == 3
        assert phase["ttft"]["p99_s"] >= phase["ttft"]["p50_s"] > 0
        assert phase["preemptions"][mode] > 0, "interactive requests must preempt batch ones"
        assert phase["preempted_time"][mode]["count"] == phase["preemptions"][mode]
        assert phase["ttft_target"]["met"] in (True, False)
    assert result["loaded"]["recompute"]["preemptions"]["swap"] == 0
    assert result["loaded"]["recompute"]["recompute"]["tokens"] > 0
    for pair in ("equal", "two_to_one"):
        fairness = result["fairness"][pair]
        assert all(v > 0 for v in fairness["served_tokens"].values())
        assert fairness["served_ratio"] > 0
    assert result["fairness"]["two_to_one"]["target_ratio"] == 2.0


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32))


def config_class(page_attribute: str | None, takes_num_blocks: bool = True):
    """A stand-in with the shape of one transformers 5.x ContinuousBatchingConfig."""

    class Config:
        def __init__(self, max_batch_tokens=256, num_blocks=None):
            self.max_batch_tokens, self.num_blocks = max_batch_tokens, num_blocks
            if page_attribute:
                setattr(self, page_attribute, 32)

    if not takes_num_blocks:

        class Config(Config):  # noqa: F811
            def __init__(self, max_batch_tokens=256):
                super().__init__(max_batch_tokens)

    return Config


@pytest.mark.parametrize("page_attribute", ["page_size", "block_size"])
def test_generate_batch_is_sized_with_either_spelling_of_the_page(
    monkeypatch, tiny_engine, page_attribute
):
    from transformers.generation import configuration_utils

    from benchmarks.peers import generate_batch_config, hf_num_blocks

    monkeypatch.setattr(
        configuration_utils, "ContinuousBatchingConfig", config_class(page_attribute)
    )
    config, page_size = generate_batch_config(tiny_engine)
    assert page_size == 32
    assert config.num_blocks == hf_num_blocks(tiny_engine, 32)
    assert config.max_batch_tokens == tiny_engine.config.max_batch_tokens


@pytest.mark.parametrize("shape", [(None, True), ("page_size", False)])
def test_a_generate_batch_that_cannot_be_sized_says_why(monkeypatch, tiny_engine, shape):
    from transformers.generation import configuration_utils

    from benchmarks.peers import PeerUnavailable, generate_batch_config

    monkeypatch.setattr(configuration_utils, "ContinuousBatchingConfig", config_class(*shape))
    with pytest.raises(PeerUnavailable, match="cannot be sized like Conveyor's"):
        generate_batch_config(tiny_engine)


def test_bench_offline_reports_a_peer_that_cannot_run_instead_of_crashing(
    monkeypatch, tiny_model_dir, tmp_path
):
    from transformers.generation import configuration_utils

    monkeypatch.setattr(configuration_utils, "ContinuousBatchingConfig", config_class(None))
    argv = ["offline", "--model", str(tiny_model_dir), *SMALL_ENGINE, "--num-prompts", "3"]
    argv += ["--max-prompt-len", "20", "--max-output-len", "4", "--rounds", "2"]
    result = run_bench(argv, tmp_path / "offline.json")
    assert "cannot be sized" in result["unavailable"]["transformers_generate_batch"]
    assert "transformers_generate_batch" not in result["systems"]
    assert result["paired_rounds"] == []
    assert result["targets"]["measured"]["vs_transformers_generate_batch"] is None
    assert result["systems"]["transformers_static"]["output_tokens"] > 0


def test_step_bound_counts_weights_kv_and_causal_attention_per_step():
    from types import SimpleNamespace

    from benchmarks.bound import DeviceRates, ModelCosts, StepBound

    costs = ModelCosts(
        weight_bytes=1000, kv_bytes_per_token=10, flops_per_token=100, attention_flops_per_pair=1
    )
    request = SimpleNamespace(num_computed_tokens=0)
    bound = StepBound(costs, [request])
    request.num_computed_tokens = 4  # a prefill of 4: causal pairs 1 + 2 + 3 + 4
    bound.observe_step()
    bound.observe_step()  # a step that did nothing for it adds nothing
    request.num_computed_tokens = 5  # one decode token attends to 5
    bound.observe_step()
    assert bound.steps == [(4, 4, 10), (1, 5, 5)]
    memory_bound = DeviceRates(copy_bytes_per_s=100.0, matmul_flops_per_s=1e9)
    assert bound.seconds(memory_bound) == pytest.approx((1000 + 40) / 100 + (1000 + 50) / 100)
    compute_bound = DeviceRates(copy_bytes_per_s=1e12, matmul_flops_per_s=10.0)
    assert bound.seconds(compute_bound) == pytest.approx((400 + 10) / 10 + (100 + 5) / 10)

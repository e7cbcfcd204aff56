"""`conveyor bench serve` and `conveyor bench gateway-overhead`: the arithmetic on fake results,
then smoke runs against a real `conveyor serve` process on the tiny random Llama."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random

import pytest
from test_server_support import (
    ENGINE_ARGS,
    ServerProcess,
    create_tenant_with_key,
    server_env,
    serving,
)

from benchmarks.overhead import engine_flags
from benchmarks.serve import TokenTimer, arrival_gaps, issue, synthetic_requests
from benchmarks.serve_metrics import RequestResult, spec_decode_deltas, summarize
from gateway.cli import build_parser, main

SERVING_KEYS = {
    "successful", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
    "median_e2el_ms", "p99_e2el_ms", "input_lens", "output_lens", "ttfts", "itls", "errors",
    "model_id", "num_prompts", "request_rate", "max_concurrency", "endpoint",
}  # fmt: skip


# ---- no server -------------------------------------------------------------------------------
def test_summary_follows_vllm_definitions():
    results = [
        RequestResult(True, 10, 5, ttft=0.1, itl=[0.02] * 4, latency=0.18),
        RequestResult(True, 20, 1, ttft=0.3, itl=[], latency=0.3),
        RequestResult(False, error="HTTP 500"),
    ]
    summary = summarize(results, duration=2.0, percentiles=[50, 99])
    assert (summary["successful"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (30, 6)
    assert summary["request_throughput"] == 1.0 and summary["total_token_throughput"] == 18.0
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["median_tpot_ms"] == pytest.approx(20.0)  # (0.18 - 0.1) / (5 - 1)
    assert summary["p50_itl_ms"] == pytest.approx(20.0)
    assert summary["errors"] == ["", "", "HTTP 500"]


def test_a_stream_without_text_takes_its_end_as_the_first_token():
    result = RequestResult(output_len=1)  # e.g. max_tokens=1 and the token was EOS
    TokenTimer(result).finish()
    assert result.success and result.ttft == result.latency > 0


def test_poisson_gaps_have_the_configured_rate():
    gaps = list(arrival_gaps(20_001, 50.0, 1.0, random.Random(0)))
    assert gaps[0] == 0.0
    assert sum(gaps) / 20_000 == pytest.approx(1 / 50, rel=0.05)
    assert set(arrival_gaps(5, math.inf, 1.0, random.Random(0))) == {0.0}


@pytest.mark.parametrize(("rate", "limit"), [(math.inf, 3), (math.inf, None), (2000.0, 2)])
async def test_issue_sends_each_request_once_within_the_concurrency_limit(rate, limit):
    in_flight, peak, seen = 0, 0, []

    async def send(index: int) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.002)
        in_flight -= 1
        seen.append(index)
        return RequestResult(True, output_len=index)

    results = await issue(12, send, rate, 1.0, limit, random.Random(0))
    assert [r.output_len for r in results] == list(range(12)) and sorted(seen) == list(range(12))
    assert peak <= (limit or 12)


def test_speculation_over_the_run_is_the_counters_difference():
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    series = [f"conveyor:spec_decode_{name}_total" for name in names]
    before = dict(zip(series, (10.0, 40.0, 20.0)))
    after = dict(zip(series, (30.0, 100.0, 60.0)))
    spec = spec_decode_deltas(before, after)["spec_decode"]
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (
        20,
        60,
        40,
    )
    assert spec["acceptance_rate"] == pytest.approx(40 / 60, abs=1e-4)
    assert spec["mean_accepted_length"] == pytest.approx(1 + 40 / 20)
    assert spec_decode_deltas({}, {"conveyor:num_requests_running": 1.0}) == {}


def test_synthetic_prompts_vary_within_the_range():
    requests = synthetic_requests(50, 100, 20, 0.5, seed=1)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.max_tokens <= 30 for r in requests)
    assert all(len(r.prompt.split()) == r.prompt_len for r in requests)
    assert requests == synthetic_requests(50, 100, 20, 0.5, seed=1)


def test_overhead_server_gets_the_same_engine_config():
    from gateway.serve import settings_from_args
    from runtime.config import EngineConfig

    config = EngineConfig(
        model="/m", dtype="float32", num_kv_blocks=64, swap_space=0.5, max_model_len=512,
        priority_aging=2.0, preemption_mode="swap", seed=3,
    )  # fmt: skip
    switches = {  # every on/off flag away from its default
        name: not info.default
        for name, info in EngineConfig.model_fields.items()
        if isinstance(info.default, bool)
    }
    config = config.model_copy(update=switches)
    args = build_parser().parse_args(["serve", *engine_flags(config)])
    assert settings_from_args(args).engine_config() == config


# ---- against a real server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model_dir):
    workdir = tmp_path_factory.mktemp("bench-serve")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    args = ["--model", str(tiny_model_dir), "--dtype", "float32", *ENGINE_ARGS]
    server = ServerProcess(workdir, server_env(database_url, None, workdir), args, database_url)
    with serving(server):
        yield server


@pytest.fixture(scope="module")
def bench_key(tiny_server) -> str:
    return create_tenant_with_key(tiny_server.database_url, "bench", rpm=1_000_000)


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["bench", *argv, "--disable-tqdm"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_bench_serve_streams_completions(tiny_server, bench_key, capsys, tmp_path):
    path = tmp_path / "result.json"
    code, out, err = bench(
        capsys, "serve", "--base-url", tiny_server.base_url, "--api-key", bench_key,
        "--num-prompts", "5", "--random-input-len", "8", "--random-output-len", "4",
        "--ignore-eos", "--save-result", str(path),
    )  # fmt: skip
    assert code == 0, err
    assert "Serving Benchmark Result" in out and "Median TTFT (ms)" in out
    result = json.loads(path.read_text())
    assert set(result) >= SERVING_KEYS
    assert result["successful"] == result["num_prompts"] == 5 and result["failed"] == 0
    assert result["output_lens"] == [4] * 5 and result["total_input_tokens"] == 40
    assert result["model_id"] == tiny_server.args[1].rsplit("/", 1)[-1]
    assert result["weight_bytes_per_token"] > 0  # scraped from the server's /metrics
    assert result["weight_read_gb_s"] > 0 and result["share_of_copy_bandwidth"] > 0
    assert "spec_decode" not in result  # the server does not speculate
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]


@pytest.mark.slow
def test_bench_serve_chat_from_jsonl_at_a_rate(tiny_server, bench_key, capsys, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}]
    lines.append({"prompt": "Once upon a time", "max_tokens": 2})
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path = tmp_path / "result.json"
    code, _, err = bench(
        capsys, "serve", "--base-url", tiny_server.base_url, "--api-key", bench_key,
        "--endpoint", "/v1/chat/completions", "--dataset-path", str(dataset), "--ignore-eos",
        "--num-prompts", "4", "--request-rate", "20", "--max-concurrency", "2",
        "--save-result", str(path),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(path.read_text())
    assert result["successful"] == 4 and result["output_lens"] == [3, 2, 3, 2]
    assert result["max_concurrency"] == 2 and result["request_rate"] == 20.0


@pytest.mark.slow
def test_bench_serve_models_throughput(tiny_server, bench_key, capsys, tmp_path):
    path = tmp_path / "result.json"
    code, out, err = bench(
        capsys, "serve", "--base-url", tiny_server.base_url, "--api-key", bench_key,
        "--endpoint", "/v1/models", "--num-prompts", "300", "--max-concurrency", "8",
        "--save-result", str(path),
    )  # fmt: skip
    assert code == 0, err
    assert "Request throughput (req/s)" in out
    result = json.loads(path.read_text())
    assert result["successful"] == 300 and result["status_codes"] == {"200": 300}
    assert result["request_throughput"] > 0


@pytest.mark.slow
def test_bench_serve_refuses_a_bad_key_with_one_line(tiny_server, capsys):
    for endpoint in ("/v1/completions", "/v1/models"):
        code, _, err = bench(
            capsys, "serve", "--base-url", tiny_server.base_url, "--api-key", "cvy_wrong",
            "--endpoint", endpoint, "--num-prompts", "2",
        )  # fmt: skip
        assert code == 1 and "401" in err and "Traceback" not in err


@pytest.mark.slow
def test_gateway_overhead_runs_both_paths(tiny_model_dir, capsys, tmp_path):
    path = tmp_path / "overhead.json"
    code, out, err = bench(
        capsys, "gateway-overhead", "--model", str(tiny_model_dir), "--dtype", "float32",
        "--num-prompts", "3", "--interval", "0.01", "--random-input-len", "8",
        "--random-output-len", "2", "--ignore-eos", "--kv-cache-memory", "32MiB",
        "--max-model-len", "256", "--save-result", str(path),
    )  # fmt: skip
    assert code == 0, err + out
    assert "Median TTFT overhead (ms)" in out
    result = json.loads(path.read_text())
    assert (result["successful"], result["failed"]) == (3, 0)
    assert result["http"]["median_ttft_ms"] > 0 and result["direct"]["median_ttft_ms"] > 0
    assert isinstance(result["within_budget"], bool)


def test_bench_flags_parse():
    args = build_parser().parse_args(["bench", "serve", "--request-rate", "inf"])
    assert isinstance(args, argparse.Namespace) and math.isinf(args.request_rate)

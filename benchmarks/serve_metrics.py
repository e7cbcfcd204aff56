"""What `conveyor bench serve` reports: the metrics of its requests (TTFT, ITL, TPOT, E2EL) and the
report blocks, in `vllm bench serve`'s names and layout; what a Conveyor server's /metrics adds
(the weight bytes it reads a token, its speculative decoding over the run)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

BLOCK_WIDTH = 50


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    status: int = 0
    error: str = ""


METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def percentiles_of(text: str) -> list[float]:
    return [float(p) for p in text.split(",") if p.strip()]


def latency_stats(name: str, seconds: list[float], percentiles: list[float]) -> dict[str, float]:
    values = np.asarray(seconds or [0.0]) * 1000
    stats = {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(values.std()),
    }
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = float(np.percentile(values, p))
    return stats


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "successful": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name, values in samples.items():
        summary.update(latency_stats(name, values, percentiles))
    summary["input_lens"] = [r.prompt_len for r in results]
    summary["output_lens"] = [r.output_len for r in results]
    summary["ttfts"] = [r.ttft for r in results]
    summary["itls"] = [r.itl for r in results]
    summary["errors"] = [r.error for r in results]
    return summary


def line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label + ':':<40} {value}"


def heading(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^{BLOCK_WIDTH}}"


def serving_report(result: dict[str, Any], percentiles: list[float]) -> str:
    lines = [heading(" Serving Benchmark Result ", "=")]
    lines += [
        line("Successful requests", result["successful"]),
        line("Failed requests", result["failed"]),
        line("Maximum request concurrency", result["max_concurrency"] or "unlimited"),
        line("Request rate configured (RPS)", result["request_rate"]),
        line("Benchmark duration (s)", result["duration"]),
        line("Total input tokens", result["total_input_tokens"]),
        line("Total generated tokens", result["total_output_tokens"]),
        line("Request throughput (req/s)", result["request_throughput"]),
        line("Output token throughput (tok/s)", result["output_throughput"]),
        line("Total Token throughput (tok/s)", result["total_token_throughput"]),
    ]
    if result.get("weight_read_gb_s") is not None:
        lines.append(line("Weight bytes per token", result["weight_bytes_per_token"]))
        lines.append(line("Weight read at median TPOT (GB/s)", result["weight_read_gb_s"]))
    if result.get("share_of_copy_bandwidth") is not None:
        lines.append(line("Share of local copy bandwidth", result["share_of_copy_bandwidth"]))
    if "spec_decode" in result:
        lines.append(line("Draft acceptance rate", result["spec_decode"]["acceptance_rate"]))
        lines.append(line("Mean accepted length", result["spec_decode"]["mean_accepted_length"]))
    for name, title, short in METRICS:
        lines.append(heading(title))
        lines.append(line(f"Mean {short} (ms)", result[f"mean_{name}_ms"]))
        lines.append(line(f"Median {short} (ms)", result[f"median_{name}_ms"]))
        for p in percentiles:
            lines.append(line(f"P{p:g} {short} (ms)", result[f"p{p:g}_{name}_ms"]))
    lines.append("=" * BLOCK_WIDTH)
    return "\n".join(lines)


def throughput_report(result: dict[str, Any], percentiles: list[float]) -> str:
    lines = [heading(" Gateway Throughput Result ", "=")]
    lines += [
        line("Endpoint", f"GET {result['endpoint']}"),
        line("Successful requests", result["successful"]),
        line("Failed requests", result["failed"]),
        line("Maximum request concurrency", result["max_concurrency"] or "unlimited"),
        line("Benchmark duration (s)", result["duration"]),
        line("Request throughput (req/s)", result["request_throughput"]),
        heading("Latency"),
        line("Mean latency (ms)", result["mean_e2el_ms"]),
        line("Median latency (ms)", result["median_e2el_ms"]),
    ]
    lines += [line(f"P{p:g} latency (ms)", result[f"p{p:g}_e2el_ms"]) for p in percentiles]
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(result["status_codes"].items()))
    lines += [line("HTTP status codes", statuses), "=" * BLOCK_WIDTH]
    return "\n".join(lines)


WEIGHT_BYTES_SERIES = "conveyor:model_weight_bytes_per_token"
SPEC_DRAFTS = "conveyor:spec_decode_num_drafts_total"  # runtime/spec/stats.py's counters
SPEC_DRAFT_TOKENS = "conveyor:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "conveyor:spec_decode_num_accepted_tokens_total"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


async def scrape(session, base_url: str) -> dict[str, float]:
    """The unlabelled samples of GET /metrics by name ({} where the server has none: another
    engine, or /metrics closed)."""
    import aiohttp

    try:
        async with session.get(base_url + "/metrics") as response:
            text = await response.text() if response.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    samples = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name and not name.startswith("#") and "{" not in name:
            with contextlib.suppress(ValueError):
                samples[name] = float(value.split()[0])
    return samples


def spec_decode_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Speculative decoding over the run, from Conveyor's spec_decode counters scraped before
    and after it; {} where the server has none (speculation off, or another engine)."""
    names = {"num_drafts": SPEC_DRAFTS, "num_draft_tokens": SPEC_DRAFT_TOKENS,
             "num_accepted_tokens": SPEC_ACCEPTED}  # fmt: skip
    if not all(series in after for series in names.values()):
        return {}
    counts = {key: int(after[series] - before.get(series, 0)) for key, series in names.items()}
    drafts, drafted = counts["num_drafts"], counts["num_draft_tokens"]
    accepted = counts["num_accepted_tokens"]
    return {
        "spec_decode": counts
        | {
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 4) if drafts else 0.0,
        }
    }


def weight_reads(weight_bytes: int | None, result: dict, base_url: str) -> dict[str, Any]:
    """Weight bytes a token and, one step's weights read per median TPOT (a stream's step at
    concurrency 1, without speculation: with drafts a step yields several tokens), their rate;
    as a share of this machine's copy bandwidth where the server is on it (a loopback URL)."""
    tpot_s = result.get("median_tpot_ms", 0) / 1e3
    if not weight_bytes or tpot_s <= 0:
        return {"weight_bytes_per_token": weight_bytes}
    rate = weight_bytes / tpot_s
    facts = {"weight_bytes_per_token": weight_bytes, "weight_read_gb_s": round(rate / 1e9, 2)}
    if urlsplit(base_url).hostname in LOOPBACK:
        import torch

        from benchmarks.bound import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth(torch.device("cpu"))
        facts["local_copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
        facts["share_of_copy_bandwidth"] = round(rate / bandwidth, 3)
    return facts

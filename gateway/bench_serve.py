"""Online benchmarks over HTTP.

`conveyor bench serve`: load on any OpenAI-compatible server, modelled on `vllm bench serve`
(same flags where they exist, the same "Serving Benchmark Result" block and JSON keys, so results
compare). Requests stream (`stream_options.include_usage`); arrivals are Poisson at
`--request-rate` (`inf`: all at once), gated by `--max-concurrency`. Prompts are synthetic
(`--random-input-len` words of plain English, about one token each) or JSONL (`--dataset-path`,
the lines `conveyor generate` reads: "prompt" or "messages", optional "max_tokens"). Token counts
are the server's `usage`; without it, output tokens are counted as content chunks.

    TTFT  request sent -> first chunk carrying text (chat's empty role chunk does not count)
    ITL   gaps between text chunks;  TPOT (E2EL - TTFT) / (output tokens - 1);  E2EL  sent -> end

`conveyor bench serve --endpoint /v1/models`: authenticated `GET /v1/models` from 64 keep-alive
connections (`--max-concurrency`) as fast as the server answers; on Conveyor each one passes
auth and the rate limiter's admit and release scripts in Redis. Reports requests/s and latency.
Both modes exit 1 when any request failed (a 429 counts as failed).

`conveyor bench gateway-overhead [engine flags]`: what the HTTP path adds to TTFT at low load.
It starts `conveyor serve` with the given engine flags on a throwaway database (with
`--redis-url`, real Redis) and loads the same engine in-process, then sends each prompt once
through each path, one request at a time, in random order within each pair. The direct path
times tokenization + `AsyncEngine.submit` to the first output with text; the HTTP path times a
streamed request as above. Reports both median TTFTs and their difference against `--budget-ms`.
`max_tokens` is 1 by default: with more, the next decode step runs while the first chunk travels,
and on a machine with few cores the client then waits for a core, which is not the gateway's cost
(pass `--random-output-len 8 --ignore-eos` to see it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
ENDPOINTS = (COMPLETIONS, CHAT, MODELS)
HTTP_TIMEOUT_S = 6 * 3600
DEFAULT_GET_CONCURRENCY = 64
BLOCK_WIDTH = 50
# Common English words that most BPE vocabularies hold as one token each (with the leading space).
WORD_LIST = (
    "the of and to in is was for on that with as by at from his her they this had are not but"
    " which have one you were all she their there been has when who will more no if out so said"
    " what up its about into than them can only other new some could time these two may then do"
    " first any my now such like our over man me even most made after also did many before must"
    " through back years where much your way well down should because each just those people how"
    " too little state good very make world still own see men work long get here between both"
    " life being under never day same another know while last might us great old year off come"
    " since against go came right used take three house water light music river garden"
)
WORDS = tuple(WORD_LIST.split())


# ==== command line ============================================================================
def register_bench(bench_subparsers) -> None:
    register_serve(bench_subparsers)
    register_overhead(bench_subparsers)


def register_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="online serving benchmark against any OpenAI-compatible server (like vllm bench serve)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument(
        "--endpoint",
        default=COMPLETIONS,
        choices=ENDPOINTS,
        help="/v1/models: GET throughput instead of generation",
    )
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("CONVEYOR_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $CONVEYOR_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", default=None, metavar="PATH", help="write the result JSON")
    add_workload_args(p)
    p.set_defaults(func=cmd_serve)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("prompts and sampling")
    group.add_argument("--dataset-path", default=None, help="JSONL prompts (default: synthetic)")
    group.add_argument("--random-input-len", type=int, default=128, help="words (~tokens)")
    group.add_argument("--random-output-len", type=int, default=128, help="max_tokens")
    group.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths vary by +- this fraction"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    group.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (vLLM/Conveyor extension)"
    )
    group.add_argument("--extra-body", default=None, help="JSON object merged into each request")
    group.add_argument(
        "--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99 (default 99)"
    )


def register_overhead(sub) -> None:
    from runtime.config import EngineConfig

    p = sub.add_parser(
        "gateway-overhead",
        help="median TTFT over HTTP (conveyor serve) vs the same engine called in-process",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-prompts", type=int, default=32, help="prompts; each runs on both paths")
    p.add_argument("--endpoint", default=COMPLETIONS, choices=(COMPLETIONS, CHAT))
    p.add_argument("--interval", type=float, default=0.2, help="idle seconds between requests")
    p.add_argument("--redis-url", default=None, help="the server's Redis (default: fakeredis)")
    p.add_argument("--database-url", default=None, help="default: SQLite in a temporary dir")
    p.add_argument("--budget-ms", type=float, default=2.0, help="allowed median TTFT overhead")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", default=None, metavar="PATH", help="write the result JSON")
    add_workload_args(p)
    EngineConfig.add_cli_args(p)  # its --seed also seeds the prompts
    p.set_defaults(
        func=cmd_overhead,
        random_input_len=64,
        random_output_len=1,
        kv_cache_memory="256MiB",
        swap_space=0.1,
        max_num_seqs=8,
    )


# ==== workload ================================================================================
@dataclass
class BenchRequest:
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 16
    prompt_len: int = 0  # expected prompt tokens (words for synthetic prompts, else 0)


def load_requests(args: argparse.Namespace, seed: int) -> list[BenchRequest]:
    if args.dataset_path:
        requests = jsonl_requests(Path(args.dataset_path), args.random_output_len)
        return [requests[i % len(requests)] for i in range(args.num_prompts)]
    return synthetic_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        seed,
    )


def synthetic_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)

    def vary(length: int) -> int:
        low = max(1, round(length * (1 - range_ratio)))
        return rng.randint(low, max(low, round(length * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        num_words = vary(input_len)
        prompt = " ".join(rng.choice(WORDS) for _ in range(num_words))
        requests.append(
            BenchRequest(prompt=prompt, max_tokens=vary(output_len), prompt_len=num_words)
        )
    return requests


def jsonl_requests(path: Path, default_max_tokens: int) -> list[BenchRequest]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        data = json.loads(line)
        max_tokens = int(data.get("max_tokens") or default_max_tokens)
        if isinstance(data.get("messages"), list):
            requests.append(BenchRequest(messages=data["messages"], max_tokens=max_tokens))
        elif isinstance(data.get("prompt"), str):
            requests.append(BenchRequest(prompt=data["prompt"], max_tokens=max_tokens))
        else:
            raise ValueError(f"{path}:{number}: needs a string 'prompt' or a 'messages' list")
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests


def request_payload(endpoint: str, model: str, request: BenchRequest, args) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT:
        payload["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
    elif request.messages is not None:
        raise ValueError("prompts with 'messages' need --endpoint /v1/chat/completions")
    else:
        payload["prompt"] = request.prompt
    if args.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body(args))
    return payload


def extra_body(args) -> dict[str, Any]:
    if not args.extra_body:
        return {}
    value = json.loads(args.extra_body)
    if not isinstance(value, dict):
        raise ValueError("--extra-body must be a JSON object")
    return value


# ==== one request =============================================================================
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


class TokenTimer:
    """Arrival times of text-bearing chunks: TTFT, ITL, latency."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.start = self.last = time.perf_counter()
        self.num_chunks = 0

    def text_arrived(self) -> None:
        now = time.perf_counter()
        if self.num_chunks == 0:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    def finish(self) -> None:
        result = self.result
        result.latency = time.perf_counter() - self.start
        result.output_len = result.output_len or self.num_chunks
        if self.num_chunks == 0 and result.output_len > 0:  # its only tokens came with the end
            result.ttft = result.latency
        result.success = self.num_chunks > 0 or result.output_len > 0
        if not result.success:
            result.error = result.error or "no text in the response"


def chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_streaming(session, url: str, headers: dict, payload: dict, prompt_len: int):
    """POST one streamed completion and time its chunks."""
    import aiohttp

    result = RequestResult(prompt_len=prompt_len)
    timer = TokenTimer(result)
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for chunk in sse_chunks(response.content):
                read_chunk(chunk, result, timer)
        timer.finish()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        result.success, result.error = False, f"{type(error).__name__}: {error}"
    return result


def read_chunk(chunk: dict[str, Any], result: RequestResult, timer: TokenTimer) -> None:
    if "error" in chunk:
        raise ValueError(f"error in stream: {chunk['error']}")
    if chunk_text(chunk):
        timer.text_arrived()
    usage = chunk.get("usage")
    if usage:
        result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
        result.output_len = usage.get("completion_tokens") or result.output_len


async def sse_chunks(content) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's `data:` lines, up to `[DONE]`."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def send_get(session, url: str, headers: dict) -> RequestResult:
    import aiohttp

    result = RequestResult()
    start = time.perf_counter()
    try:
        async with session.get(url, headers=headers) as response:
            result.status = response.status
            body = await response.read()
        result.latency = time.perf_counter() - start
        result.success = result.status == 200
        if not result.success:
            result.error = f"HTTP {result.status}: {body[:300].decode(errors='replace')}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


# ==== issuing requests ========================================================================
Send = Callable[[int], Awaitable[RequestResult]]


async def issue(
    num: int, send: Send, rate: float, burstiness: float, max_concurrency: int | None, rng,
    progress=None,
) -> list[RequestResult]:  # fmt: skip
    """Send requests 0..num-1: Poisson (gamma) arrivals at `rate`, at most `max_concurrency`
    in flight; results in request order."""
    if math.isinf(rate) and max_concurrency:
        return await issue_closed_loop(num, send, max_concurrency, progress)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(index: int) -> RequestResult:
        async with limit:
            result = await send(index)
        if progress is not None:
            progress.update(1)
        return result

    tasks = []
    for index, delay in enumerate(arrival_gaps(num, rate, burstiness, rng)):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
    return list(await asyncio.gather(*tasks))


async def issue_closed_loop(num: int, send: Send, concurrency: int, progress) -> list:
    """`concurrency` workers taking the next request as soon as theirs is done."""
    results: list[RequestResult | None] = [None] * num
    next_index = iter(range(num))

    async def worker() -> None:
        for index in next_index:
            results[index] = await send(index)
            if progress is not None:
                progress.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, num))))
    return results


def arrival_gaps(num: int, rate: float, burstiness: float, rng) -> Iterable[float]:
    """Seconds to wait before each request: 0 for an infinite rate, else gamma-distributed
    gaps with mean 1/rate (burstiness 1 is a Poisson process)."""
    for index in range(num):
        if math.isinf(rate) or index == 0:
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


# ==== metrics =================================================================================
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


def save_result(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"Result saved to {path}", file=sys.stderr)


def rate_for_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def make_progress(total: int, disabled: bool):
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, dynamic_ncols=True)


# ==== conveyor bench serve ====================================================================
class BenchError(Exception):
    """A benchmark that cannot start (bad flags, unreachable server): one line, exit 1."""


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run_serve(args))
    except (BenchError, ValueError, OSError) as error:
        print(f"conveyor bench serve: error: {error}", file=sys.stderr)
        return 1
    save_result(args.save_result, result)
    return 0 if result["failed"] == 0 else 1


async def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base_url = args.base_url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if args.endpoint == MODELS:
            return await run_models_throughput(session, base_url, headers, args)
        model = args.model or await first_model(session, base_url, headers)
        return await run_generation(session, base_url, headers, model, args)


async def first_model(session, base_url: str, headers: dict) -> str:
    import aiohttp

    url = base_url + MODELS
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                raise BenchError(f"GET {url}: HTTP {response.status} {text}; or pass --model")
            models = (await response.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        raise BenchError(f"GET {url} failed: {error}") from None
    if not models:
        raise BenchError(f"{url} lists no model; pass --model")
    return models[0]["id"]


async def run_generation(session, base_url, headers, model, args) -> dict[str, Any]:
    requests = load_requests(args, args.seed)
    payloads = [request_payload(args.endpoint, model, r, args) for r in requests]
    url = base_url + args.endpoint

    async def send(index: int) -> RequestResult:
        return await send_streaming(
            session, url, headers, payloads[index], requests[index].prompt_len
        )

    print("Starting initial single prompt test run...", file=sys.stderr)
    probe = await send(0)
    if not probe.success:
        raise BenchError(f"initial test request to {url} failed: {probe.error}")
    result = await timed_run(send, args)
    result.update(run_info(args, model, base_url))
    percentiles = percentiles_of(args.metric_percentiles)
    print(serving_report(result, percentiles))
    return result


async def timed_run(send: Send, args, rate: float | None = None, concurrency=None) -> dict:
    rng = random.Random(args.seed)
    rate = args.request_rate if rate is None else rate
    concurrency = args.max_concurrency if concurrency is None else concurrency
    progress = make_progress(args.num_prompts, args.disable_tqdm)
    start = time.perf_counter()
    results = await issue(args.num_prompts, send, rate, args.burstiness, concurrency, rng, progress)
    duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    result = summarize(results, duration, percentiles_of(args.metric_percentiles))
    result["status_codes"] = dict(Counter(r.status for r in results))
    return result


def run_info(args, model: str, base_url: str) -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint == CHAT else "openai",
        "endpoint": args.endpoint,
        "base_url": base_url,
        "model_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": rate_for_json(args.request_rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }


async def run_models_throughput(session, base_url, headers, args) -> dict[str, Any]:
    """Authenticated GETs of /v1/models; without --max-concurrency, 64 at a time. The requests
    go over plain keep-alive connections (`KeepAliveGetPool`) so that the client's own cost
    stays small next to the server's."""
    url = base_url + MODELS
    probe = await send_get(session, url, headers)
    if not probe.success:
        raise BenchError(f"initial GET {url} failed: {probe.error}")
    concurrency = args.max_concurrency or DEFAULT_GET_CONCURRENCY
    pool = KeepAliveGetPool(url, headers)
    try:
        result = await timed_run(lambda index: pool.get(), args, concurrency=concurrency)
    finally:
        pool.close()
    for key in ("input_lens", "output_lens", "ttfts", "itls"):
        result.pop(key)
    result.update(run_info(args, args.model or "", base_url))
    result["max_concurrency"] = concurrency
    print(throughput_report(result, percentiles_of(args.metric_percentiles)))
    return result


CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
CHUNKED = re.compile(rb"\r\ntransfer-encoding:[^\r]*chunked", re.IGNORECASE)


class KeepAliveGet(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection that sends a fixed GET and reads responses with a
    Content-Length: just enough HTTP for a throughput client, at a fraction of aiohttp's cost."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.buffer = b""
        self.header_end = -1
        self.status = 0
        self.body_len = 0
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None
        self.is_open = False

    def connection_made(self, transport) -> None:
        self.transport, self.is_open = transport, True

    def connection_lost(self, error: Exception | None) -> None:
        self.is_open = False
        self.fail(ConnectionError(f"connection closed: {error or 'by the server'}"))

    def fail(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    async def get(self) -> tuple[int, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(self.request)
        return await self.waiter

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.header_end < 0 and not self.read_head():
            return
        end = self.header_end + self.body_len
        if len(self.buffer) >= end and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, self.buffer[self.header_end : end]))
            self.buffer, self.header_end = self.buffer[end:], -1

    def read_head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = self.buffer[:end]
        if CHUNKED.search(head):
            self.fail(ValueError("chunked responses are not supported by this client"))
            self.transport.close()
            return False
        length = CONTENT_LENGTH.search(head)
        self.status = int(head[9:12])
        self.body_len = int(length.group(1)) if length else 0
        self.header_end = end + 4
        return True


class KeepAliveGetPool:
    """Idle `KeepAliveGet` connections to one URL; a request takes one or opens a new one."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parsed = urlsplit(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.ssl = parsed.scheme == "https"
        self.port = parsed.port or (443 if self.ssl else 80)
        path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        lines = [f"GET {path} HTTP/1.1", f"Host: {parsed.netloc}", "Accept: */*"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.request = ("\r\n".join(lines) + "\r\n\r\n").encode()
        self.idle: list[KeepAliveGet] = []
        self.opened: list[KeepAliveGet] = []

    async def connection(self) -> KeepAliveGet:
        while self.idle:
            connection = self.idle.pop()
            if connection.is_open:
                return connection
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(
            lambda: KeepAliveGet(self.request), self.host, self.port, ssl=self.ssl or None
        )
        self.opened.append(connection)
        return connection

    async def get(self) -> RequestResult:
        result = RequestResult()
        start = time.perf_counter()
        try:
            connection = await self.connection()
            result.status, body = await connection.get()
        except (OSError, ValueError) as error:
            result.error = f"{type(error).__name__}: {error}"
            return result
        result.latency = time.perf_counter() - start
        result.success = result.status == 200
        if not result.success:
            result.error = f"HTTP {result.status}: {body[:300].decode(errors='replace')}"
        self.idle.append(connection)
        return result

    def close(self) -> None:
        for connection in self.opened:
            if connection.transport is not None:
                connection.transport.close()


# ==== conveyor bench gateway-overhead =========================================================
def cmd_overhead(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run_overhead(args))
    except (BenchError, ValueError, OSError) as error:
        print(f"conveyor bench gateway-overhead: error: {error}", file=sys.stderr)
        return 1
    save_result(args.save_result, result)
    return 0 if result["failed"] == 0 else 1


async def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.config import EngineConfig

    config = EngineConfig.from_args(args)
    requests = load_requests(args, config.seed)
    with tempfile.TemporaryDirectory(prefix="conveyor-overhead-") as workdir:
        database_url = args.database_url or f"sqlite:///{Path(workdir) / 'conveyor.db'}"
        secret = secrets.token_urlsafe(24)
        api_key = await create_bench_tenant(database_url, secret)
        flags = server_flags(args, config, database_url, secret)
        server = await start_gateway(Path(workdir), flags, api_key, args.startup_timeout)
        try:
            async with in_process_engine(config) as engine:
                pairs = await compare_paths(args, engine, server.base_url, api_key, requests)
        finally:
            server.stop()
    return overhead_result(args, config, pairs)


async def start_gateway(workdir: Path, flags: list[str], api_key: str, timeout_s: float):
    """A ready `conveyor serve`; a new port when another process took the free one first."""
    for attempt in range(3):
        server = GatewayProcess(workdir, flags)
        server.start()
        try:
            await server.wait_ready(api_key, timeout_s)
            return server
        except BenchError:
            server.stop()
            if attempt == 2 or "address already in use" not in server.log_tail().lower():
                raise
    raise AssertionError("unreachable")


async def create_bench_tenant(database_url: str, secret: str) -> str:
    """A tenant with generous limits (so every limit check runs) and its key."""
    from gateway.db import make_async_engine, make_sessionmaker, upgrade
    from gateway.tenants import KeyHasher, TenantCreate, create_key, create_tenant

    await asyncio.to_thread(upgrade, database_url)
    name = f"bench-overhead-{secrets.token_hex(4)}"
    limits = TenantCreate(name=name, rpm=1_000_000, tpm=10**12, max_concurrency=1000)
    engine = make_async_engine(database_url)
    try:
        async with make_sessionmaker(engine).begin() as session:
            tenant = await create_tenant(session, limits)
            _, plaintext = await create_key(session, tenant.id, KeyHasher(secret))
    finally:
        await engine.dispose()
    return plaintext


def server_flags(args, config, database_url: str, secret: str) -> list[str]:
    flags = ["--database-url", database_url, "--key-hash-secret", secret, "--no-demo-tenant"]
    if args.redis_url:
        flags += ["--redis-url", args.redis_url]
    return flags + engine_flags(config)


def engine_flags(config) -> list[str]:
    """`conveyor serve` flags that rebuild `config`, read off EngineConfig's own flags."""
    from runtime.config import EngineConfig

    parser = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_cli_args(parser)
    flags = []
    for action in parser._actions:
        value = getattr(config, action.dest, None)
        if value is None or not action.option_strings:
            continue
        if action.nargs == 0:  # a switch (store_true / store_false): given when it applies
            flags += [action.option_strings[0]] if value == action.const else []
        else:
            flags += [action.option_strings[0], str(value)]
    return flags


@contextlib.asynccontextmanager
async def in_process_engine(config) -> AsyncIterator[Any]:
    from runtime.engine import AsyncEngine, Engine

    engine = AsyncEngine(await asyncio.to_thread(Engine, config))
    engine.start()
    try:
        yield engine
    finally:
        await asyncio.to_thread(engine.stop)


async def compare_paths(args, engine, base_url: str, api_key: str, requests) -> list[tuple]:
    """(http result, direct result) per prompt, one request at a time, order shuffled per pair."""
    import aiohttp

    model = engine.engine.model_name
    headers = {"Authorization": f"Bearer {api_key}"}
    url = base_url + args.endpoint
    rng = random.Random(args.seed)
    progress = make_progress(len(requests), args.disable_tqdm)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def over_http(request: BenchRequest) -> RequestResult:
            payload = request_payload(args.endpoint, model, request, args)
            return await send_streaming(session, url, headers, payload, request.prompt_len)

        async def direct(request: BenchRequest) -> RequestResult:
            return await send_direct(engine, args, request)

        for warmup in requests[:2]:  # first requests pay for connections and lazy setup
            await over_http(warmup)
            await direct(warmup)
        pairs = []
        for request in requests:
            pairs.append(await run_pair(over_http, direct, request, rng, args.interval))
            if progress is not None:
                progress.update(1)
    if progress is not None:
        progress.close()
    return pairs


async def run_pair(over_http, direct, request, rng, interval: float) -> tuple:
    results = {}
    paths = [("http", over_http), ("direct", direct)]
    rng.shuffle(paths)
    for name, send in paths:
        await asyncio.sleep(interval)
        results[name] = await send(request)
    return results["http"], results["direct"]


async def send_direct(engine, args, request: BenchRequest) -> RequestResult:
    """The same prompt through `AsyncEngine.submit`, timed like the HTTP path (tokenization
    included, first output with text)."""
    from scheduler.request import SamplingParams

    result = RequestResult()
    timer = TokenTimer(result)
    tokenizer = engine.tokenizer
    if args.endpoint == CHAT:
        messages = request.messages or [{"role": "user", "content": request.prompt}]
        prompt_ids = tokenizer.apply_chat_template(messages)
    else:
        prompt_ids = tokenizer.encode(request.prompt)
    params = SamplingParams(
        max_tokens=request.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos
    )
    result.prompt_len = len(prompt_ids)
    stream = engine.submit(prompt_ids, params)
    async with contextlib.aclosing(stream):
        async for output in stream:
            if output.new_text:
                timer.text_arrived()
            result.output_len = output.num_output_tokens
    timer.finish()
    return result


def overhead_result(args, config, pairs: list[tuple]) -> dict[str, Any]:
    from runtime.model_loader import served_model_name

    percentiles = percentiles_of(args.metric_percentiles)
    ok = [(h, d) for h, d in pairs if h.success and d.success]
    http_ttft = [h.ttft for h, _ in ok]
    direct_ttft = [d.ttft for _, d in ok]
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model_id": served_model_name(config.model),
        "endpoint": args.endpoint,
        "redis_url": args.redis_url,
        "num_prompts": len(pairs),
        "successful": len(ok),
        "failed": len(pairs) - len(ok),
        "interval_s": args.interval,
        "budget_ms": args.budget_ms,
        "http": latency_stats("ttft", http_ttft, percentiles),
        "direct": latency_stats("ttft", direct_ttft, percentiles),
        "paired_diff": latency_stats(
            "ttft", [h - d for h, d in zip(http_ttft, direct_ttft)], percentiles
        ),
        "errors": [h.error or d.error for h, d in pairs if h.error or d.error],
    }
    overhead = result["http"]["median_ttft_ms"] - result["direct"]["median_ttft_ms"]
    result["median_ttft_overhead_ms"] = overhead
    result["within_budget"] = bool(ok) and overhead <= args.budget_ms
    print(overhead_report(result, percentiles))
    return result


def overhead_report(result: dict[str, Any], percentiles: list[float]) -> str:
    lines = [heading(" Gateway Overhead Result ", "=")]
    lines += [
        line("Endpoint", result["endpoint"]),
        line("Redis", result["redis_url"] or "embedded fakeredis"),
        line("Successful pairs", result["successful"]),
        line("Failed pairs", result["failed"]),
    ]
    for key, title in (
        ("direct", "Engine in-process"),
        ("http", "Over HTTP"),
        ("paired_diff", "HTTP minus in-process, per prompt"),
    ):
        stats = result[key]
        lines.append(heading(f" {title} "))
        lines.append(line("Mean TTFT (ms)", stats["mean_ttft_ms"]))
        lines.append(line("Median TTFT (ms)", stats["median_ttft_ms"]))
        lines += [line(f"P{p:g} TTFT (ms)", stats[f"p{p:g}_ttft_ms"]) for p in percentiles]
    lines.append("-" * BLOCK_WIDTH)
    lines.append(line("Median TTFT overhead (ms)", result["median_ttft_overhead_ms"]))
    verdict = "yes" if result["within_budget"] else "NO"
    lines.append(line(f"Within {result['budget_ms']:g} ms budget", verdict))
    lines.append("=" * BLOCK_WIDTH)
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GatewayProcess:
    """`conveyor serve` in a child process on a free localhost port; output to a log file."""

    def __init__(self, workdir: Path, flags: list[str]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.flags = flags + ["--port", str(self.port)]
        self.flags += ["--audit-spool-path", str(workdir / "audit.spool")]
        self.log_path = workdir / "server.log"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "gateway.cli", "serve", *self.flags]
        repo_root = str(Path(__file__).resolve().parent.parent)
        pythonpath = os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": pythonpath}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def wait_ready(self, api_key: str, timeout_s: float) -> None:
        """Until it answers an authenticated GET /v1/models: only this server knows the key
        (a server of someone else's that got the port first would answer /readyz too)."""
        import aiohttp

        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {api_key}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise BenchError(f"conveyor serve exited early:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.base_url + MODELS, headers=headers) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.3)
        raise BenchError(f"conveyor serve not ready in {timeout_s:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

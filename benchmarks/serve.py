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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.common import save_result
from benchmarks.serve_metrics import (
    WEIGHT_BYTES_SERIES,
    RequestResult,
    percentiles_of,
    scrape,
    serving_report,
    spec_decode_deltas,
    summarize,
    throughput_report,
    weight_reads,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
ENDPOINTS = (COMPLETIONS, CHAT, MODELS)
HTTP_TIMEOUT_S = 6 * 3600
DEFAULT_GET_CONCURRENCY = 64
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
def register(sub) -> None:
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
    # generation: a connection per request (as vllm bench serve's session per request): a kept-alive
    # connection the server has closed fails the next request's write (llama-server's, 16 of 64)
    connector = aiohttp.TCPConnector(limit=0, force_close=args.endpoint != MODELS)
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
    before = await scrape(session, base_url)
    result = await timed_run(send, args)
    after = await scrape(session, base_url)
    result.update(run_info(args, model, base_url))
    result.update(weight_reads(after.get(WEIGHT_BYTES_SERIES), result, base_url))
    result.update(spec_decode_deltas(before, after))
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
    """Authenticated GETs of /v1/models over the session's keep-alive connections; without
    --max-concurrency, 64 at a time."""
    url = base_url + MODELS
    probe = await send_get(session, url, headers)
    if not probe.success:
        raise BenchError(f"initial GET {url} failed: {probe.error}")
    concurrency = args.max_concurrency or DEFAULT_GET_CONCURRENCY
    result = await timed_run(
        lambda index: send_get(session, url, headers), args, concurrency=concurrency
    )
    for key in ("input_lens", "output_lens", "ttfts", "itls"):
        result.pop(key)
    result.update(run_info(args, args.model or "", base_url))
    result["max_concurrency"] = concurrency
    print(throughput_report(result, percentiles_of(args.metric_percentiles)))
    return result

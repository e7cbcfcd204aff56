"""`conveyor bench gateway-overhead [engine flags]`: what the HTTP path adds to TTFT at low load.
It starts `conveyor serve` with the given engine flags on a throwaway database (with
`--redis-url`, real Redis) and loads the same engine in-process, then sends each prompt once
through each path, one request at a time, in random order within each pair. The direct path
times tokenization + `EngineClient.submit` to the first output with text; the HTTP path times a
streamed request as above. Reports both median TTFTs and their difference against `--budget-ms`.
`max_tokens` is 1 by default: with more, the next decode step runs while the first chunk travels,
and on a machine with few cores the client then waits for a core, which is not the gateway's cost
(pass `--random-output-len 8 --ignore-eos` to see it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.common import save_result
from benchmarks.serve import (
    CHAT,
    COMPLETIONS,
    MODELS,
    BenchError,
    BenchRequest,
    TokenTimer,
    add_workload_args,
    load_requests,
    make_progress,
    request_payload,
    send_streaming,
)
from benchmarks.serve_metrics import (
    BLOCK_WIDTH,
    RequestResult,
    heading,
    latency_stats,
    line,
    percentiles_of,
)


def register(sub) -> None:
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
    from gateway.tenancy.keys import KeyHasher, create_key
    from gateway.tenancy.tenants import TenantCreate, create_tenant

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
    # `--flag=value`: a secret may start with "-", which argparse would take for a flag
    flags = [f"--database-url={database_url}", f"--key-hash-secret={secret}", "--no-demo-tenant"]
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
        if isinstance(action, argparse.BooleanOptionalAction):  # --name / --no-name
            flags.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # a switch (store_true / store_false): given when it applies
            flags += [action.option_strings[0]] if value == action.const else []
        else:
            flags.append(f"{action.option_strings[0]}={value}")
    return flags


@contextlib.asynccontextmanager
async def in_process_engine(config) -> AsyncIterator[Any]:
    from runtime.engine_client import EngineClient

    engine = await EngineClient.launch(config)
    try:
        yield engine
    finally:
        await asyncio.to_thread(engine.stop)


async def compare_paths(args, engine, base_url: str, api_key: str, requests) -> list[tuple]:
    """(http result, direct result) per prompt, one request at a time, order shuffled per pair."""
    import aiohttp

    model = engine.info.model_name
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
    """The same prompt through `EngineClient.submit`, timed like the HTTP path (tokenization
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
    from runtime.models.loader import served_model_name

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

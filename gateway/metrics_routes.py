"""`GET /metrics` and the step-rate sampler: `gateway.metrics` wired into the application."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import prometheus_client
from aiohttp import web

from gateway.appkeys import ENGINE_CLIENT, METRICS
from gateway.metrics import STEP_SAMPLE_INTERVAL_S, Metrics


def install(app: web.Application) -> None:
    """A registry for this app, `GET /metrics`, and the step-rate sampler."""
    app[METRICS] = Metrics()
    app.router.add_get("/metrics", metrics_handler)
    app.cleanup_ctx.append(step_rate_ctx)


async def metrics_handler(request: web.Request) -> web.Response:
    client = request.app.get(ENGINE_CLIENT)
    snapshot = None if client is None else await client.snapshot()
    body = request.app[METRICS].render(snapshot, None if client is None else client.info)
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


async def step_rate_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(sample_step_rate(app), name="step-rate-sampler")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def sample_step_rate(app: web.Application) -> None:
    while True:
        client = app.get(ENGINE_CLIENT)
        if client is not None and client.is_running:
            app[METRICS].step_rate.sample((await client.snapshot()).num_steps)
        await asyncio.sleep(STEP_SAMPLE_INTERVAL_S)

"""How `conveyor serve` runs: listen, drain on SIGTERM or SIGINT, then shut down in order.

aiohttp's `web.run_app` closes the listening socket the moment a signal arrives, so a client
(or a load balancer that has not yet seen the pod go unready) gets "connection refused", and
it cuts every handler after its own `shutdown_timeout`. A replica behind a Service should
rather keep answering while it drains. On the first SIGTERM or SIGINT:

1. at once, inside the signal handler: `is_draining` turns true, so `/readyz` answers 503,
   new generation requests get 503 with `Retry-After` (and a `rejected` audit record), and
   every response carries `Connection: close` so that clients reconnect to another replica;
2. the sequences already admitted keep running, streams included, for up to
   `--drain-timeout` seconds;
3. whatever still runs then is aborted in the engine: its stream ends with
   `finish_reason: "abort"`, its unused tokens are refunded and its audit record says
   `aborted`;
4. the listener closes, handlers get `HANDLER_GRACE_S` to return, and the cleanup contexts
   run in reverse order: the engine stops, the audit writer flushes (or spools), Redis and the
   database close. The process exits 0.

A repeated SIGTERM is logged and ignored (the drain is already bounded); a second SIGINT
(Ctrl+C twice) skips the rest of the drain and aborts what runs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from gateway.appkeys import ENGINE_CLIENT, SERVING_STATE
from gateway.errors import JsonErrorAppRunner
from gateway.settings import ServeSettings

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
HANDLER_GRACE_S = 5.0  # after the drain: for aborted streams and refusals to finish writing


class Lifecycle:
    """The shutdown state of one serving process, driven by signals."""

    def __init__(self, app: web.Application, drain_timeout_s: float) -> None:
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self.stop_requested = asyncio.Event()
        self.abort_requested = asyncio.Event()
        self.drain_started_at: float | None = None

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.on_signal, signum)

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if not self.stop_requested.is_set():
            self.begin_draining()
            log.warning(
                "%s: draining (not ready, refusing new requests, in-flight work may run for "
                "up to %.0f s)",
                name,
                self.drain_timeout_s,
            )
            return
        if signum == signal.SIGINT and not self.abort_requested.is_set():
            log.warning("second SIGINT: aborting in-flight requests now")
            self.abort_requested.set()
            return
        left = self.drain_timeout_s - (time.monotonic() - (self.drain_started_at or 0.0))
        log.warning("%s again: already draining (at most %.0f s left)", name, max(left, 0.0))

    def begin_draining(self) -> None:
        self.app[SERVING_STATE].is_draining = True
        self.drain_started_at = time.monotonic()
        self.stop_requested.set()

    @property
    def num_inflight(self) -> int:
        return self.app[SERVING_STATE].num_inflight_sequences

    async def wait_for_inflight(self, timeout_s: float, stop_on_abort: bool) -> bool:
        """True once no admitted sequence is in flight; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.num_inflight > 0:
            if time.monotonic() >= deadline or (stop_on_abort and self.abort_requested.is_set()):
                return False
            await asyncio.sleep(POLL_INTERVAL_S)
        return True

    async def drain(self) -> None:
        """Let admitted work finish for up to the drain timeout, then abort what is left."""
        if self.num_inflight:
            log.warning("waiting for %d in-flight sequences", self.num_inflight)
        if await self.wait_for_inflight(self.drain_timeout_s, stop_on_abort=True):
            log.warning("drained: no request in flight")
            return
        num_aborted = abort_engine_requests(self.app)
        log.warning("drain timeout: aborted %d engine requests", num_aborted)
        if not await self.wait_for_inflight(HANDLER_GRACE_S, stop_on_abort=False):
            log.error("%d sequences still in flight after the abort", self.num_inflight)


def abort_engine_requests(app: web.Application) -> int:
    """Abort every request the engine still streams; each stream ends with reason "abort"."""
    client = app.get(ENGINE_CLIENT)
    return 0 if client is None else client.abort_all()


async def close_connection_while_draining(
    request: web.Request, response: web.StreamResponse
) -> None:
    """`on_response_prepare`: a draining replica sends clients elsewhere for their next call."""
    if request.config_dict[SERVING_STATE].is_draining:
        response.force_close()  # headers are computed before this hook: say it ourselves
        response.headers["Connection"] = "close"


def print_listening(settings: ServeSettings, runner: web.AppRunner) -> None:
    names = sorted(str(site.name) for site in runner.sites)
    print(f"======== Running on {', '.join(names)} ========", flush=True)
    print("(Press CTRL+C to drain and quit; twice to abort in-flight requests)", flush=True)


async def serve(app: web.Application, settings: ServeSettings) -> None:
    """Start the app (model load included), serve until a signal, drain, clean up."""
    lifecycle = Lifecycle(app, settings.drain_timeout)
    lifecycle.install_signal_handlers()  # a signal during the model load stops after it
    runner = JsonErrorAppRunner(
        app,
        handle_signals=False,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=HANDLER_GRACE_S,
    )
    await runner.setup()
    try:
        if not lifecycle.stop_requested.is_set():
            await web.TCPSite(runner, settings.host, settings.port).start()
            print_listening(settings, runner)
            await lifecycle.stop_requested.wait()
        await lifecycle.drain()
    finally:
        await runner.cleanup()
    log.warning("shut down cleanly")


def run(app: web.Application, settings: ServeSettings) -> None:
    asyncio.run(serve(app, settings))

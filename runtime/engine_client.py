"""EngineClient: the one door from asyncio code (the gateway, benchmarks) into the engine.

The engine runs `Engine.step` on its own thread. Callers on an event loop hold an
`EngineClient` and use only this: `submit` (a stream of `RequestOutput`s), `abort`, `snapshot`
(queue, running, KV and preemption state, copied on the engine thread between two steps), the
fixed `info` and the tokenizer. They never read the scheduler's lists or a live `Request`: the
engine thread changes those while they would read.

Hand-offs to the engine thread are typed commands on one queue; the engine thread applies them
between steps, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from runtime.config import EngineConfig
from runtime.engine import Engine, NewRequest, RequestOutput
from runtime.models.loader import served_model_names
from runtime.models.tokenizer import Tokenizer
from runtime.structured.compiler import PreparedGrammar
from scheduler.request import GrammarSpec, Request, SamplingParams

log = logging.getLogger(__name__)

NUM_STEP_TIMES = 100  # the mean step time is over this many steps
IDLE_WAIT_S = 0.5
THREAD_NAME = "conveyor-engine"
NUM_GRAMMAR_THREADS = 2  # compiles run beside the engine thread, never on the event loop

_ids = itertools.count()


# ---- what the gateway may read ------------------------------------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    """Facts fixed when the model is loaded: all the gateway needs to validate a request once,
    on its side, so that the engine can trust what it is given."""

    served_model_names: tuple[str, ...]  # --served-model-name; the first leads
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # the whole device KV cache: a longer prompt can never run
    block_size: int = 16  # tokens per KV block
    weight_bytes_per_token: int = 0  # weight bytes one decode step reads (GGUF blocks as kept)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        blocks = engine.block_manager
        return cls(
            served_model_names=served_model_names(
                engine.config.model, engine.config.served_model_name
            ),
            max_model_len=engine.max_model_len,
            vocab_size=engine.tokenizer.vocab_size,
            kv_capacity_tokens=blocks.num_gpu_blocks * blocks.block_size,
            block_size=blocks.block_size,
            weight_bytes_per_token=engine.runner.model.weight_bytes_per_token(),
        )


@dataclass(frozen=True)
class SequenceSnapshot:
    sequence_id: str
    tenant: str
    priority: int
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_preemptions: int
    arrival_time: float  # the engine's monotonic clock

    @classmethod
    def of(cls, request: Request) -> SequenceSnapshot:
        return cls(
            sequence_id=request.request_id,
            tenant=request.tenant,
            priority=request.priority,
            status=request.status.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_gpu_blocks=len(request.block_ids),
            num_cpu_blocks=len(request.cpu_block_ids),
            num_preemptions=request.num_preemptions,
            arrival_time=request.arrival_time,
        )


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state between two steps, copied on the engine thread."""

    taken_at: float  # monotonic
    running: tuple[SequenceSnapshot, ...]
    waiting: tuple[SequenceSnapshot, ...]
    swapped: tuple[SequenceSnapshot, ...]
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_prefix_queries: int
    num_prefix_hits: int
    num_preemptions: dict[str, int]
    num_steps: int
    mean_step_time_s: float | None
    num_output_tokens: int = 0  # since the engine started
    spec_decode: dict | None = None  # runtime.spec.stats snapshot; None: speculation off

    @property
    def gpu_kv_usage(self) -> float:
        """Fraction of device KV blocks in use, 0..1."""
        return usage(self.num_gpu_blocks, self.num_free_gpu_blocks)

    @property
    def cpu_kv_usage(self) -> float:
        """Fraction of the CPU swap pool in use, 0..1."""
        return usage(self.num_cpu_blocks, self.num_free_cpu_blocks)

    @classmethod
    def of(cls, engine: Engine, step_times: deque[float]) -> EngineSnapshot:
        scheduler, blocks = engine.scheduler, engine.block_manager
        running, waiting, swapped = (
            tuple(SequenceSnapshot.of(r) for r in line)
            for line in (scheduler.running, scheduler.waiting, scheduler.swapped)
        )
        return cls(
            taken_at=time.monotonic(),
            running=running,
            waiting=waiting,
            swapped=swapped,
            num_gpu_blocks=blocks.num_gpu_blocks,
            num_free_gpu_blocks=blocks.num_free_gpu_blocks,
            num_cpu_blocks=blocks.num_cpu_blocks,
            num_free_cpu_blocks=blocks.num_free_cpu_blocks,
            num_prefix_queries=blocks.num_prefix_queries,
            num_prefix_hits=blocks.num_prefix_hits,
            num_preemptions=dict(scheduler.num_preemptions),
            num_steps=engine.num_steps,
            mean_step_time_s=sum(step_times) / len(step_times) if step_times else None,
            num_output_tokens=engine.num_output_tokens,
            spec_decode=engine.speculator.stats.snapshot() if engine.speculator else None,
        )


def usage(num_blocks: int, num_free: int) -> float:
    return (num_blocks - num_free) / num_blocks if num_blocks else 0.0


# ---- commands to the engine thread --------------------------------------------------------------
@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class TakeSnapshot:
    loop: asyncio.AbstractEventLoop
    reply: asyncio.Future = field(compare=False)


Command = NewRequest | AbortRequest | TakeSnapshot


class EngineClient:
    """Runs Engine.step on a dedicated thread; the event loop never runs model code."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.info = EngineInfo.of(engine)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._step_times: deque[float] = deque(maxlen=NUM_STEP_TIMES)
        self._grammar_pool = ThreadPoolExecutor(
            NUM_GRAMMAR_THREADS, thread_name_prefix="conveyor-grammar"
        )

    @classmethod
    async def launch(cls, config: EngineConfig) -> EngineClient:
        """An engine built on the thread that then steps it, started. A model loaded on one
        thread and stepped on another ran its decode steps 1.4-1.7x slower (2-core CPU, OpenMP:
        the loading thread's team of workers stays beside the stepping thread's)."""
        loop = asyncio.get_running_loop()
        launched: asyncio.Future[EngineClient] = loop.create_future()

        def build_then_step() -> None:
            try:
                client = cls(Engine(config))
            except BaseException as error:
                loop.call_soon_threadsafe(_fail, launched, error)
                return
            client._thread = threading.current_thread()
            loop.call_soon_threadsafe(_resolve, launched, client)
            client._loop()

        threading.Thread(target=build_then_step, name=THREAD_NAME, daemon=True).start()
        return await launched

    # ---- the event loop's side --------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def tokenizer(self) -> Tokenizer:
        """Thread-safe: encoding and decoding keep no state between calls."""
        return self._engine.tokenizer

    async def prepare_grammar(
        self, spec: GrammarSpec, max_size_bytes: int | None = None
    ) -> PreparedGrammar:
        """The spec's compiled grammar (cached by the spec's hash), compiled on a worker thread:
        neither the event loop nor an engine step waits for it. Raises GrammarError for an
        invalid or unsupported schema, or one whose compiled size passes max_size_bytes."""
        loop = asyncio.get_running_loop()
        structured = self._engine.structured
        return await loop.run_in_executor(
            self._grammar_pool, structured.prepare, spec, max_size_bytes
        )

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, **fields
    ) -> AsyncIterator[RequestOutput]:
        """The stream of outputs of NewRequest(prompt_token_ids, params, **fields); closing it
        before it finishes aborts the request.

        Nothing is validated here, on the event loop: callers check a request against `info`
        first (the gateway does, once); what the engine still refuses (`Engine.add` checks on
        its own thread) ends the stream with a RequestError."""
        new = NewRequest(list(prompt_token_ids), params, **fields)
        if new.request_id is None:
            new = replace(new, request_id=f"req-{next(_ids)}")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[new.request_id] = (asyncio.get_running_loop(), stream)
        self._send(new)
        return self._iterate(new.request_id, stream)

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def abort_all(self) -> int:
        """Abort every request with an open stream (each ends with reason "abort"); how many."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    async def snapshot(self) -> EngineSnapshot:
        """The engine's state, taken on its thread before its next step."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._send(TakeSnapshot(loop, reply))
        return await reply

    def _send(self, command: Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    async def _iterate(
        self, request_id: str, stream: asyncio.Queue
    ) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.abort(request_id)

    # ---- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self._engine.has_unfinished():
                self._sleep(IDLE_WAIT_S)
                continue
            delay = self._engine.seconds_until_runnable()
            if delay > 0:
                self._sleep(delay)
                continue
            start = time.perf_counter()
            try:
                outputs = self._engine.step()
            except Exception as e:  # a bug must not hang every client: fail them and go on
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self._step_times.append(time.perf_counter() - start)
            for output in outputs:
                self._deliver(output)
        self._apply_commands()  # answer snapshots still waiting

    def _sleep(self, timeout_s: float) -> None:
        """Until a command arrives or the timeout passes."""
        self._wakeup.wait(timeout=timeout_s)
        self._wakeup.clear()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, NewRequest):
                self._add(command)
            elif isinstance(command, AbortRequest):
                output = self._engine.abort(command.request_id)
                if output is not None:
                    self._deliver(output)
            else:
                self._answer(command)

    def _add(self, new: NewRequest) -> None:
        if new.request_id not in self._streams:  # the client left before the engine saw it
            return
        try:
            self._engine.add(new)
        except Exception as e:
            self._deliver_to(new.request_id, e)

    def _answer(self, take: TakeSnapshot) -> None:
        snapshot = EngineSnapshot.of(self._engine, self._step_times)
        with contextlib.suppress(RuntimeError):  # RuntimeError: its event loop is closed
            take.loop.call_soon_threadsafe(_resolve, take.reply, snapshot)

    def _deliver(self, output: RequestOutput) -> None:
        self._deliver_to(output.request_id, output)
        if output.finished:  # the stream holds its queue; the table entry is no longer needed
            self._streams.pop(output.request_id, None)

    def _deliver_to(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # its event loop is closed
            self._streams.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._engine.scheduler.requests):
            self._engine.abort(request_id)
            self._deliver_to(request_id, RuntimeError(f"engine failure: {error}"))


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)

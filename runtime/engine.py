"""Engine: the synchronous step loop (schedule -> run -> update -> detokenize).
AsyncEngine: the same loop on its own thread; asyncio callers submit and stream outputs."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.config import EngineConfig
from runtime.kv_cache import measure_copy_bandwidth
from runtime.model_loader import resolve_model, served_model_name
from runtime.model_runner import ModelRunner
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import PreemptionCostModel, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot take; `code` matches OpenAI's error codes where one exists."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)  # new since the last output
    request: Request | None = None


_ids = itertools.count()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.model_name = served_model_name(config.model)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.runner = ModelRunner(config, self.model_dir)
        mc = self.runner.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        self.block_manager = BlockManager(
            self.runner.num_gpu_blocks,
            config.block_size,
            self.runner.num_cpu_blocks,
            config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self._scheduler_config(), self.block_manager, self._measure_costs()
        )
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_events_sent: dict[str, int] = {}
        self.num_steps = 0

    def reset_scheduler(self, **config_changes) -> None:
        """A fresh scheduler and block manager (empty prefix cache) on the loaded model, with
        some scheduler settings changed, e.g. policy="static"; only while nothing runs."""
        if self.has_unfinished():
            raise RuntimeError("reset_scheduler needs an idle engine")
        old = self.block_manager
        self.block_manager = BlockManager(
            old.num_gpu_blocks, old.block_size, old.num_cpu_blocks, old.enable_prefix_caching
        )
        config = replace(self.scheduler.config, **config_changes)
        self.scheduler = Scheduler(config, self.block_manager, self.scheduler.cost_model)

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            max_num_seqs=c.max_num_seqs,
            max_batch_tokens=c.max_batch_tokens,
            max_model_len=self.max_model_len,
            policy=c.scheduling,
            preemption_mode=c.preemption_mode,
            priority_aging_s=c.priority_aging,
        )

    def _measure_costs(self) -> PreemptionCostModel:
        return PreemptionCostModel(
            bytes_per_block=self.runner.bytes_per_block,
            copy_bytes_per_s=measure_copy_bandwidth(self.runner.kv_cache),
            prefill_tokens_per_s=self.runner.measure_prefill_rate(),
        )

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            params.validate(self.runner.model_config.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), code="invalid_value") from e
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestError("the prompt is empty", code="invalid_value", param="prompt")
        vocab_size = self.runner.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt_token_ids):
            raise RequestError(
                f"prompt token ids must be integers in [0, {vocab_size})",
                code="invalid_value",
                param="prompt",
            )
        if num_prompt >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens.",
                code="context_length_exceeded",
                param="messages",
            )
        needed = self.block_manager.num_blocks_for(num_prompt + 1)
        if needed > self.block_manager.num_gpu_blocks:
            raise RequestError(
                f"the prompt needs {needed} KV blocks but the whole KV cache has "
                f"{self.block_manager.num_gpu_blocks}",
                code="context_length_exceeded",
                param="prompt",
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "default",
        weight: float = 1.0,
        stop_params: dict | None = None,
    ) -> Request:
        params = params or SamplingParams()
        self.validate(prompt_token_ids, params)
        request = Request(
            request_id=request_id or f"req-{next(_ids)}",
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            priority=priority,
            tenant=tenant,
            weight=weight,
            eos_token_ids=self.eos_token_ids,
        )
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop=params.stop
        )
        self.num_events_sent[request.request_id] = 0
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        request.finish_reason = "abort"
        return self._finish_output(request, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        self.num_steps += 1
        tokens = {rid: token for rid, (token, _) in sampled.items()}
        advanced = self.scheduler.update_from_output(out, tokens)
        outputs = [self._output_for(r, sampled[r.request_id][1]) for r in advanced]
        outputs += self._event_only_outputs(out, {o.request_id for o in outputs})
        return outputs

    def _output_for(self, request: Request, logprobs) -> RequestOutput:
        token_id = request.output_token_ids[-1]
        detok = self.detokenizers[request.request_id]
        text = detok.add_tokens([token_id])
        if detok.stop_hit is not None and not request.is_finished:
            request.stop_reason = detok.stop_hit
            self.scheduler.finish_with_event(request, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished and detok.stop_hit is None:
            text += detok.flush()
        request.output_text += text
        lp = [logprobs] if logprobs is not None else []
        if request.is_finished:
            return self._finish_output(request, [token_id], text, lp)
        return self._make_output(request, [token_id], text, lp)

    def _event_only_outputs(self, out, done: set[str]) -> list[RequestOutput]:
        """Requests preempted this step get an output carrying their new events."""
        return [self._make_output(r, [], "") for r in out.preempted if r.request_id not in done]

    def _make_output(self, request: Request, token_ids, text, logprobs=()) -> RequestOutput:
        sent = self.num_events_sent.get(request.request_id, 0)
        self.num_events_sent[request.request_id] = len(request.events)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_prefix_tokens,
            logprobs=list(logprobs),
            events=request.events[sent:],
            request=request,
        )

    def _finish_output(self, request: Request, token_ids, text, logprobs=()) -> RequestOutput:
        output = self._make_output(request, token_ids, text, logprobs)
        self.detokenizers.pop(request.request_id, None)
        self.num_events_sent.pop(request.request_id, None)
        self.runner.sampler.release(request.request_id)
        return output

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        """Run prompts to completion (tests, offline use); returns the finished requests in order."""
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, param_list)]
        while self.has_unfinished():
            self.step()
        return requests


class AsyncEngine:
    """Runs Engine.step on a dedicated thread; the event loop never runs model code."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.wakeup = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="conveyor-engine", daemon=True)
        self.step_times: list[float] = []

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "default",
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """Validates now (raises RequestError) and returns the request's stream of outputs."""
        self.engine.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(_ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = (asyncio.get_running_loop(), stream)
        self.commands.put(("add", (prompt_token_ids, params, request_id, priority, tenant, weight)))
        self.wakeup.set()
        return self._iterate(request_id, stream)

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
            if self.streams.pop(request_id, None) is not None:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))
        self.wakeup.set()

    # ---- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self.wakeup.wait(timeout=0.5)
                self.wakeup.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not hang every client: fail them and go on
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self.step_times.append(time.perf_counter() - start)
            del self.step_times[:-100]
            for output in outputs:
                self._deliver(output)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                output = self.engine.abort(payload)
                if output is not None:
                    self._deliver(output)

    def _add(self, prompt_token_ids, params, request_id, priority, tenant, weight) -> None:
        if request_id not in self.streams:  # the client left before the engine saw it
            return
        try:
            self.engine.add_request(prompt_token_ids, params, request_id, priority, tenant, weight)
        except Exception as e:
            self._deliver_to(request_id, e)

    def _deliver(self, output: RequestOutput) -> None:
        self._deliver_to(output.request_id, output)
        if output.finished:  # the stream holds its queue; the table entry is no longer needed
            self.streams.pop(output.request_id, None)

    def _deliver_to(self, request_id: str, item) -> None:
        target = self.streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # its event loop is closed
            self.streams.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort(request_id)
            self._deliver_to(request_id, RuntimeError(f"engine failure: {error}"))

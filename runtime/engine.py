"""Engine: the synchronous step loop (schedule -> run -> update -> detokenize). Asyncio callers
reach it through `runtime.engine_client.EngineClient`, which runs it on its own thread.

With async output (as vLLM's async output processing) a step's outputs are built during the
next step's forward pass: `step()` schedules and launches step N, then detokenizes step N-1 and
builds its outputs while the device works, then waits for step N's tokens.

With async scheduling (on CUDA by default; vLLM's async scheduling, SGLang's overlap scheduler)
the host runs a whole step ahead: `step()` schedules and launches step N while step N-1 is still
on the device, then waits for step N-1's tokens, appends them and builds its outputs. Step N's
decodes read step N-1's tokens on the device (the scheduler counts them as pending), so the
device never waits for the host between steps. A step whose requests' next step needs their
tokens on the host (penalties over the output, a grammar's next mask) lands before the next one
is scheduled.

Either way, a request that a stop string, an end-of-sequence token or its grammar stops was
already scheduled in the step after; that token is computed and dropped, so the outputs are the
same as in the synchronous loop (a length limit is known ahead and schedules nothing extra).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.config import EngineConfig
from runtime.models.loader import open_model
from runtime.models.tokenizer import IncrementalDetokenizer
from runtime.step.kv_cache import measure_copy_bandwidth
from runtime.step.model_runner import LaunchedStep, ModelRunner
from runtime.structured.compiler import PreparedGrammar
from runtime.structured.outputs import StructuredOutputs
from runtime.structured.schema_rules import GrammarError
from scheduler.block_manager import BlockManager
from scheduler.config import PreemptionCostModel, SchedulerConfig
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot take; `code` matches OpenAI's error codes where one exists."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(slots=True)
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
    arrival_time: float = 0.0  # the engine's monotonic clock
    first_scheduled_time: float | None = None


_ids = itertools.count()


@dataclass
class StepResult:
    """A step whose tokens are known but whose outputs are not built yet."""

    out: SchedulerOutput
    sampled: dict[str, tuple[int, Any]]  # request id -> (token, logprobs or None)
    advanced: list[Request]  # requests that got a token, in step order


@dataclass
class InFlight:
    """A launched step whose tokens have not reached the host (async scheduling)."""

    out: SchedulerOutput
    launched: LaunchedStep


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = open_model(config.model)  # an HF directory or a GGUF file
        self.model_name = self.source.name
        self.tokenizer = self.source.load_tokenizer()
        self.runner = ModelRunner(config, self.source)
        mc = self.runner.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        self.structured = StructuredOutputs(
            self.tokenizer.hf_tokenizer, mc.vocab_size, self.eos_token_ids, self.runner.device
        )
        self.runner.grammar_masks = self.structured.masks
        if self.runner.device.type == "cuda":
            self.structured.masks.warm_up(mc.vocab_size)  # not on the first constrained request
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
        self.async_scheduling = config.resolved_async_scheduling()
        self.async_output = config.resolved_async_output() and not self.async_scheduling
        self.unbuilt: StepResult | None = None  # async output: the last step, outputs to build
        self.in_flight: InFlight | None = None  # async scheduling: launched, tokens not landed

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
            batch_window_s=c.batch_window,
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
        grammar: PreparedGrammar | None = None,
    ) -> Request:
        """grammar: the compiled grammar of params.grammar (EngineClient.prepare_grammar); a
        constrained request without one is compiled here, on the caller's thread."""
        params = params or SamplingParams()
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(_ids)}"
        if params.grammar is not None:
            self._admit_grammar(request_id, params, grammar)
        request = Request(
            request_id=request_id,
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

    def _admit_grammar(self, request_id: str, params: SamplingParams, grammar) -> None:
        try:
            self.structured.admit(request_id, params.grammar, grammar)
        except GrammarError as e:
            raise RequestError(str(e), code=e.code, param=e.param or "response_format") from e

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        request.finish_reason = "abort"
        return self._finish_output(request, [], "")

    def has_unfinished(self) -> bool:
        return self._holds_a_step() or self.scheduler.has_unfinished()

    def _holds_a_step(self) -> bool:
        return self.unbuilt is not None or self.in_flight is not None

    def seconds_until_runnable(self) -> float:
        """How long a step would do nothing (dynamic batching waiting for its batch)."""
        return 0.0 if self._holds_a_step() else self.scheduler.seconds_until_runnable()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns its outputs, or with async output or async scheduling the
        previous step's."""
        if self.async_scheduling:
            return self._step_ahead()
        out = self.scheduler.schedule()
        launched = self._launch(out)
        unbuilt, self.unbuilt = self.unbuilt, None
        outputs = self._build_outputs(unbuilt) if unbuilt else []  # while the device runs
        result = self._land(out, launched)
        if self.async_output:
            self.unbuilt = result if result.advanced or out.preempted else None
            return outputs
        return outputs + self._build_outputs(result)

    def _step_ahead(self) -> list[RequestOutput]:
        """Async scheduling: launch step N, then land step N-1 while the device runs step N."""
        outputs = []
        if self.in_flight is not None and self.in_flight.launched.needs_host_tokens:
            outputs = self._land_in_flight()
        out = self.scheduler.schedule()
        previous = self.in_flight
        launched = self._launch(out, previous.launched if previous is not None else None)
        self.in_flight = InFlight(out, launched)
        if previous is not None:
            outputs += self._build_outputs(self._land(previous.out, previous.launched))
        if not launched.has_samples:  # nothing to wait for: land it now
            outputs += self._land_in_flight()
        return outputs

    def _land_in_flight(self) -> list[RequestOutput]:
        in_flight, self.in_flight = self.in_flight, None
        return self._build_outputs(self._land(in_flight.out, in_flight.launched))

    def _launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        launched = self.runner.launch(out, previous)
        self.scheduler.mark_launched(out)
        return launched

    def _land(self, out: SchedulerOutput, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and hand them to the scheduler and the grammars."""
        sampled = self.runner.collect(launched)
        self.num_steps += launched.host is not None  # a step with nothing to run is no step
        tokens = {rid: token for rid, (token, _) in sampled.items()}
        advanced = self.scheduler.update_from_output(out, tokens)
        for request in self.structured.advance(advanced):  # its grammar is complete
            self.scheduler.finish_with_event(request, RequestStatus.FINISHED_STOPPED)
        return StepResult(out, sampled, advanced)

    def _build_outputs(self, result: StepResult) -> list[RequestOutput]:
        outputs = [
            self._output_for(r, *result.sampled[r.request_id])
            for r in result.advanced
            if r.status is not RequestStatus.FINISHED_ABORTED  # aborted since: last output sent
        ]
        return outputs + self._event_only_outputs(result.out, {o.request_id for o in outputs})

    def _output_for(self, request: Request, token_id: int, logprobs) -> RequestOutput:
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
        return [
            self._make_output(r, [], "")
            for r in out.preempted
            if r.request_id not in done and r.status is not RequestStatus.FINISHED_ABORTED
        ]

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
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
        )

    def _finish_output(self, request: Request, token_ids, text, logprobs=()) -> RequestOutput:
        output = self._make_output(request, token_ids, text, logprobs)
        self.detokenizers.pop(request.request_id, None)
        self.num_events_sent.pop(request.request_id, None)
        self.runner.sampler.release(request.request_id)
        self.structured.release(request.request_id)
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

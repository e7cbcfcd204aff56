"""Engine: the synchronous step loop (schedule -> launch -> land -> build outputs). Asyncio
callers reach it through `runtime.engine_client.EngineClient`, which runs it on its own thread.

One pipeline serves the three step modes. Each `step()` schedules and launches one step, then
lands (waits for the sampled tokens, appends them, advances grammars) and builds the outputs
(detokenize, stop strings) of the steps in the pipeline that are old enough:
- plain: a step lands and is built at once (both lags 0);
- async output (vLLM's async output processing; output lag 1): a step lands at once but its
  outputs are built during the next step's forward pass;
- async scheduling (on CUDA by default; vLLM's async scheduling, SGLang's overlap scheduler;
  land lag 1): step N is scheduled and launched while step N-1 is still on the device, then N-1
  lands and is built. Step N's decodes read N-1's tokens on the device (the scheduler counts
  them as pending), so the device never waits for the host between steps. A step whose requests'
  next step needs their tokens on the host (penalties over the output, a grammar's next mask)
  lands before the next one is scheduled; a step with nothing to sample lands at once.

Either way, a request that a stop string, an end-of-sequence token or its grammar stops was
already scheduled in the step after; that token is computed and dropped, so the outputs are the
same as in the synchronous loop (a length limit is known ahead and schedules nothing extra).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.config import EngineConfig
from runtime.models.loader import open_model
from runtime.models.tokenizer import IncrementalDetokenizer
from runtime.spec.runs import detokenize_run
from runtime.spec.speculator import make_speculator
from runtime.step.kv_cache import measure_copy_bandwidth
from runtime.step.model_runner import LaunchedStep, ModelRunner
from runtime.structured.compiler import PreparedGrammar
from runtime.structured.outputs import StructuredOutputs
from runtime.structured.schema_rules import GrammarError
from scheduler.block_manager import BlockManager
from scheduler.config import PreemptionCostModel, SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot take; `code` matches OpenAI's error codes where one exists."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


def prompt_error(
    prompt: list[int], vocab_size: int, max_len: int, num_output: int, param: str
) -> RequestError | None:
    """What is wrong with a prompt that asks for num_output tokens where contexts hold max_len
    tokens (the model's length, or the whole KV cache if smaller); None if nothing. The engine
    and the HTTP API both ask here."""
    if not prompt:
        return RequestError("The prompt is empty.", param=param)
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        return RequestError(f"Token ids must be integers in [0, {vocab_size}).", param=param)
    if len(prompt) + num_output > max_len:
        return RequestError(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {len(prompt) + num_output} tokens ({len(prompt)} in the prompt, "
            f"{num_output} for the completion). Please reduce the prompt or max_tokens.",
            code="context_length_exceeded",
            param=param,
        )
    return None


@dataclass(frozen=True)
class NewRequest:
    """What a caller asks the engine to run (the gateway through EngineClient.submit)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None = None  # None: the engine names it
    priority: int = 0  # lower = more urgent
    tenant: str = "default"
    weight: float = 1.0  # the tenant's fair-share weight
    # the compiled grammar of params.grammar (EngineClient.prepare_grammar); a constrained
    # request without one is compiled on the thread that adds it
    grammar: PreparedGrammar | None = None


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


@dataclass(slots=True)
class OutputState:
    """The engine's own state of a live request: its detokenizer and the events sent so far."""

    detokenizer: IncrementalDetokenizer
    num_events_sent: int = 0


@dataclass
class StepResult:
    """A step whose tokens are known but whose outputs are not built yet."""

    sampled: dict[str, tuple[list[int], list[Any]]]  # request id -> (tokens, logprobs or None)
    advanced: list[tuple[Request, int]]  # requests that got tokens, how many kept, in order


@dataclass
class PipelineStep:
    """A launched step: landed once its tokens reached the host, then built into outputs."""

    out: SchedulerOutput
    launched: LaunchedStep
    result: StepResult | None = None  # set when it lands
    launched_at: float = 0.0  # time.perf_counter() when its launch began


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
        self.runner.use_grammar_masks(self.structured.masks)
        if self.runner.device.type == "cuda":
            self.structured.masks.warm_up(mc.vocab_size)  # not on the first constrained request
        self.block_manager = BlockManager(
            self.runner.num_gpu_blocks,
            config.block_size,
            self.runner.num_cpu_blocks,
            config.enable_prefix_caching,
        )
        self.speculator = make_speculator(config, self.runner, self.tokenizer)  # None: off
        self.scheduler = Scheduler(
            self._scheduler_config(),
            self.block_manager,
            self._measure_costs(),
            drafter=self.speculator,
        )
        self.outputs: dict[str, OutputState] = {}  # request id -> what its outputs carried
        self.num_steps = 0
        self.num_output_tokens = 0  # kept output tokens of every request, since the start
        self.async_scheduling = config.resolved_async_scheduling()
        self.async_output = config.resolved_async_output() and not self.async_scheduling
        self.pipeline: deque[PipelineStep] = deque()  # oldest first

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
        old_scheduler = self.scheduler
        self.scheduler = Scheduler(
            config, self.block_manager, old_scheduler.cost_model, drafter=self.speculator
        )
        self.scheduler.left_ids += old_scheduler.left_ids  # rows the next step still releases

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
        kv_capacity = self.block_manager.num_gpu_blocks * self.block_manager.block_size
        error = prompt_error(
            prompt_token_ids,
            self.runner.model_config.vocab_size,
            min(self.max_model_len, kv_capacity),
            num_output=1,
            param="prompt",
        )
        if error is not None:
            raise error

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None, **fields
    ) -> Request:
        """add(NewRequest(prompt_token_ids, params, **fields)): tests and offline use."""
        return self.add(NewRequest(prompt_token_ids, params or SamplingParams(), **fields))

    def add(self, new: NewRequest) -> Request:
        params = new.params
        self.validate(new.prompt_token_ids, params)
        request_id = new.request_id or f"req-{next(_ids)}"
        if params.grammar is not None:
            self._admit_grammar(request_id, params, new.grammar)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=params,
            priority=new.priority,
            tenant=new.tenant,
            weight=new.weight,
            eos_token_ids=self.eos_token_ids,
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop)
        self.outputs[request.request_id] = OutputState(detokenizer)
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

    @property
    def land_lag(self) -> int:
        """How many steps are launched after a step before it lands."""
        return int(self.async_scheduling)

    @property
    def output_lag(self) -> int:
        """How many steps are launched after a step lands before its outputs are built."""
        return int(self.async_output and not self.async_scheduling)

    def has_unfinished(self) -> bool:
        return bool(self.pipeline) or self.scheduler.has_unfinished()

    def seconds_until_runnable(self) -> float:
        """How long a step would do nothing (dynamic batching waiting for its batch)."""
        return 0.0 if self.pipeline else self.scheduler.seconds_until_runnable()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; returns the outputs of the steps that were built."""
        outputs = self._advance(needed_on_host=True)
        out = self.scheduler.schedule()
        newest = self.pipeline[-1] if self.pipeline else None
        previous = newest.launched if newest is not None and newest.result is None else None
        launched_at = time.perf_counter()
        launched = self.runner.launch(out, previous)
        self.scheduler.mark_launched(out)
        self.pipeline.append(PipelineStep(out, launched, launched_at=launched_at))
        return outputs + self._advance()

    def _advance(self, needed_on_host: bool = False) -> list[RequestOutput]:
        """Land and build the steps old enough for it, oldest first. needed_on_host: before a
        schedule, land only the steps whose tokens the next step needs on the host."""
        outputs = []
        for age, step in zip(range(len(self.pipeline) - 1, -1, -1), list(self.pipeline)):
            if step.result is None:
                if not self._should_land(step, age, needed_on_host):
                    continue
                step.result = self._land(step.out, step.launched)
                if self.speculator is not None:
                    self.speculator.observe_step(step.out, step.launched, step.launched_at)
            has_outputs = step.result.advanced or step.out.preempted
            if age >= self.output_lag or not has_outputs:
                outputs += self._build_outputs(step.out, step.result)
                self.pipeline.remove(step)
        return outputs

    def _should_land(self, step: PipelineStep, age: int, needed_on_host: bool) -> bool:
        if needed_on_host:
            return step.launched.needs_host_tokens
        return age >= self.land_lag or not step.launched.has_samples

    def _land(self, out: SchedulerOutput, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and hand them to the scheduler and the grammars."""
        sampled = self.runner.collect(launched)
        self.num_steps += launched.host is not None  # a step with nothing to run is no step
        tokens = {rid: token_ids for rid, (token_ids, _) in sampled.items()}
        advanced = self.scheduler.update_from_output(out, tokens)
        self.num_output_tokens += sum(num_kept for _, num_kept in advanced)
        if launched.host is not None and launched.host.has_grammar:
            for request in self.structured.advance(advanced):  # its grammar is complete
                self.scheduler.finish_with_event(request, RequestStatus.FINISHED_STOPPED)
        return StepResult(sampled, advanced)

    def _build_outputs(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        outputs = [
            self._output_for(r, num_kept, *result.sampled[r.request_id])
            for r, num_kept in result.advanced
            if r.status is not RequestStatus.FINISHED_ABORTED  # aborted since: last output sent
        ]
        return outputs + self._event_only_outputs(out, {o.request_id for o in outputs})

    def _output_for(
        self, request: Request, num_kept: int, token_ids: list[int], logprobs: list
    ) -> RequestOutput:
        """The output of the tokens a request kept from a step (a stop ends the run early)."""
        token_ids = token_ids[:num_kept]
        logprobs = [lp for lp in logprobs[:num_kept] if lp is not None]
        detok = self.outputs[request.request_id].detokenizer
        if len(token_ids) > 1 and detok.stop:  # an accepted run of drafts: a stop may cut it
            text, token_ids = detokenize_run(request, detok, token_ids)
        else:
            text = detok.add_tokens(token_ids)
        if detok.stop_hit is not None and not request.is_finished:
            request.stop_reason = detok.stop_hit
            self.scheduler.finish_with_event(request, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished and detok.stop_hit is None:
            text += detok.flush()
        request.output_text += text
        if request.is_finished:
            return self._finish_output(request, token_ids, text, logprobs)
        return self._make_output(request, token_ids, text, logprobs)

    def _event_only_outputs(self, out, done: set[str]) -> list[RequestOutput]:
        """Requests preempted this step get an output carrying their new events."""
        return [
            self._make_output(r, [], "")
            for r in out.preempted
            if r.request_id not in done and r.status is not RequestStatus.FINISHED_ABORTED
        ]

    def _make_output(self, request: Request, token_ids, text, logprobs=()) -> RequestOutput:
        state = self.outputs.get(request.request_id)
        sent = state.num_events_sent if state is not None else 0
        if state is not None:
            state.num_events_sent = len(request.events)
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
        """The request's last output; the engine's state of it goes (the runner's goes when the
        next step's SchedulerOutput lists it as finished)."""
        if self.speculator is not None:
            self.speculator.finish(request)
        output = self._make_output(request, token_ids, text, logprobs)
        self.outputs.pop(request.request_id, None)
        if request.sampling_params.grammar is not None:
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

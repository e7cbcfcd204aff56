"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE),
`GET /v1/models`.

One HTTP request becomes a `Plan` (prompts as token ids, one SamplingParams per choice, the
tenant's effective priority), is admitted (engine capacity, then the tenant's Redis limits with
prompt + max_tokens reserved), runs as `len(prompts) * n` engine requests whose outputs are
merged, and is rendered by a `CompletionFormat` or `ChatFormat`. Leaving the handler in any way
(finished, client gone, error) closes the engine streams, which aborts what still runs, refunds
the unused token reservation and writes the audit record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.appkeys import (
    AUDIT,
    ENGINE,
    METRICS,
    PRINCIPAL,
    RATE_LIMITER,
    RECEIVED,
    REQUEST_ID,
    SERVING_STATE,
    SETTINGS,
    Principal,
)
from gateway.errors import (
    APIError,
    bad_request,
    from_validation_error,
    model_not_found,
    overloaded,
)
from gateway.ratelimit import Admission, TenantLimits
from scheduler.request import SamplingParams

log = logging.getLogger(__name__)

MAX_N = 8
MAX_PROMPTS = 32
MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N
LONG_PROMPT_CHARS = 8192  # tokenize longer prompts on a thread
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/completions", create_completion)
    router.add_post("/v1/chat/completions", create_chat_completion)
    router.add_get("/v1/models", list_models)
    router.add_get("/v1/models/{model}", retrieve_model)
    router.add_get("/v1/requests/{request_id}", get_own_request)
    router.add_get("/v1/openapi.json", openapi_document)


async def get_own_request(request: web.Request) -> web.Response:
    from gateway.admin_requests import own_request

    return await own_request(request)


async def openapi_document(request: web.Request) -> web.Response:
    from gateway.openapi import openai_document

    return web.json_response(openai_document())


# ==== request bodies ==========================================================================
class StrictBody(BaseModel):
    """Validated from JSON in strict mode: no "1" for 1, no "true" for true. Unknown fields are
    ignored, as OpenAI's own SDK may send newer ones."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(StrictBody):
    include_usage: bool = False


class SamplingFields(StrictBody):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    priority: int | None = Field(None, ge=-1_000_000, le=1_000_000)

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop")
        if not all(stops):
            raise bad_request("stop sequences must not be empty", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):
            return {"role": role, "content": "\n".join(part.text for part in self.content)}
        return {"role": role, "content": self.content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


async def read_body(request: web.Request, body_type: type[StrictBody]) -> Any:
    raw = await request.read()  # over --max-body-bytes: aiohttp raises 413
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as error:
        raise from_validation_error(error) from None


# ==== the plan: what to run for one HTTP request ===============================================
@dataclass
class Plan:
    request_id: str
    model: str
    principal: Principal
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice: choice i answers prompts[i // n]
    n: int
    requested_priority: int | None
    priority: int
    received_at: float = field(default_factory=time.time)
    received_mono: float = field(default_factory=time.monotonic)  # the engine's event clock

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def sequence_id(self, choice: int) -> str:
        """The engine request id of one choice."""
        return f"{self.request_id}-{choice}"

    def mono_to_wall(self, mono: float | None) -> float | None:
        return None if mono is None else self.received_at + (mono - self.received_mono)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def num_reserved_output_tokens(self) -> int:
        return sum(params.max_tokens for params in self.params)

    def prompt_of(self, choice_index: int) -> list[int]:
        return self.prompts[choice_index // self.n]


def effective_priority(requested: int | None, tenant: Any) -> int:
    """Lower is more urgent; a tenant may not be more urgent than its `max_priority`."""
    priority = tenant.default_priority if requested is None else requested
    return max(priority, tenant.max_priority)


def sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, choice: int
) -> SamplingParams:
    defaults = SamplingParams()

    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=given(body.temperature, defaults.temperature),
        top_p=given(body.top_p, defaults.top_p),
        top_k=given(body.top_k, defaults.top_k),
        min_p=given(body.min_p, defaults.min_p),
        seed=None if body.seed is None else body.seed + choice,
        presence_penalty=given(body.presence_penalty, defaults.presence_penalty),
        frequency_penalty=given(body.frequency_penalty, defaults.frequency_penalty),
        repetition_penalty=given(body.repetition_penalty, defaults.repetition_penalty),
        stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def check_model(request: web.Request, model: str) -> None:
    if model != request.app[ENGINE].engine.model_name:
        raise model_not_found(model)


def check_prompt_fits(engine, prompt: list[int], max_tokens: int | None, param: str) -> None:
    """The prompt's ids are in the vocabulary, and prompt + max_tokens fits the context."""
    vocab_size = engine.tokenizer.vocab_size
    if not prompt:
        raise bad_request("The prompt is empty.", param=param)
    if any(not 0 <= token_id < vocab_size for token_id in prompt):
        raise bad_request(f"Token ids must be in [0, {vocab_size}).", param=param)
    max_model_len = engine.engine.max_model_len
    num_output = max_tokens or 1  # no max_tokens: whatever fits, at least one token
    if len(prompt) + num_output > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt) + num_output} tokens ({len(prompt)} in the prompt, "
            f"{num_output} for the completion). Please reduce the prompt or max_tokens.",
            param=param,
            code="context_length_exceeded",
        )


def validate_with_engine(engine, prompt: list[int], params: SamplingParams, param: str) -> None:
    from runtime.engine import RequestError

    try:
        engine.engine.validate(prompt, params)
    except RequestError as error:
        raise bad_request(str(error), param=error.param or param, code=error.code) from None


def make_plan(
    request: web.Request,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: list[int],
    logprobs: int | None,
    param: str,
) -> Plan:
    principal = request[PRINCIPAL]
    params = [
        sampling_params(body, max_tokens[choice // body.n], logprobs, choice % body.n)
        for choice in range(len(prompts) * body.n)
    ]
    engine = request.app[ENGINE]
    for prompt, choice_params in zip(prompts, params[:: body.n]):
        validate_with_engine(engine, prompt, choice_params, param)
    received_at, received_mono = request.get(RECEIVED) or (time.time(), time.monotonic())
    return Plan(
        request_id=request[REQUEST_ID],
        model=body.model,
        principal=principal,
        prompts=prompts,
        params=params,
        n=body.n,
        requested_priority=body.priority,
        priority=effective_priority(body.priority, principal.tenant),
        received_at=received_at,
        received_mono=received_mono,
    )


# ---- prompts ---------------------------------------------------------------------------------
async def tokenize(engine, text: str) -> list[int]:
    if len(text) > LONG_PROMPT_CHARS:
        return await asyncio.to_thread(engine.tokenizer.encode, text)
    return engine.tokenizer.encode(text)


async def completion_prompts(engine, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [await tokenize(engine, prompt)]
    if not prompt:
        raise bad_request("The prompt is empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
    if isinstance(prompt[0], str):
        return [await tokenize(engine, text) for text in prompt]
    return [list(ids) for ids in prompt]


async def chat_prompt(engine, body: ChatCompletionRequest) -> list[int]:
    messages = [message.as_template_message() for message in body.messages]
    try:
        return await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages)
    except ValueError as error:
        raise bad_request(str(error), param="messages") from None


def reject_unsupported_completion_fields(body: CompletionRequest) -> None:
    if body.echo:
        raise bad_request("'echo' is not supported.", param="echo")
    if body.suffix:
        raise bad_request("'suffix' is not supported.", param="suffix")


async def plan_completion(request: web.Request, body: CompletionRequest) -> Plan:
    reject_unsupported_completion_fields(body)
    check_model(request, body.model)
    engine = request.app[ENGINE]
    prompts = await completion_prompts(engine, body)
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    for prompt in prompts:
        check_prompt_fits(engine, prompt, max_tokens, "prompt")
    return make_plan(request, body, prompts, [max_tokens] * len(prompts), body.logprobs, "prompt")


async def plan_chat(request: web.Request, body: ChatCompletionRequest) -> Plan:
    check_model(request, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    engine = request.app[ENGINE]
    prompt = await chat_prompt(engine, body)
    requested_max = body.max_completion_tokens or body.max_tokens
    check_prompt_fits(engine, prompt, requested_max, "messages")
    max_tokens = requested_max or engine.engine.max_model_len - len(prompt)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return make_plan(request, body, [prompt], [max_tokens], logprobs, "messages")


# ==== admission, accounting and audit =========================================================
@dataclass
class Tracker:
    """What one admitted HTTP request has used so far, for the refund and the audit record."""

    plan: Plan
    limits: TenantLimits
    admission: Admission
    num_output_tokens: dict[int, int] = field(default_factory=dict)  # per choice
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    first_token_at: float | None = None
    first_scheduled_at: float | None = None
    first_scheduled_mono: float | None = None
    queue_time_s: float | None = None
    status: str = "finished"
    error: str | None = None
    cancelled: bool = False  # by an operator (POST /admin/requests/{id}/cancel)
    keep_events: bool = True  # False when audit is off
    last_token_mono: dict[int, float] = field(default_factory=dict)  # per choice
    inter_token_s: list[float] = field(default_factory=list)  # gaps between a choice's tokens

    def __post_init__(self) -> None:
        self.events.append({"kind": "received", "time": self.plan.received_mono})
        admitted = {"kind": "admitted", "time": time.monotonic()}
        admitted["reserved_tokens"] = self.admission.reserved_tokens
        if self.admission.degraded:
            admitted["rate_limits_unchecked"] = True  # Redis unreachable, failing open
        self.events.append(admitted)

    def observe(self, choice: int, output) -> None:
        self.num_output_tokens[choice] = output.num_output_tokens
        if output.new_token_ids:
            self._note_token(choice)
        if output.finished:
            self.finish_reasons[choice] = output.finish_reason
            if output.finish_reason == "abort":  # e.g. the drain timeout of a shutdown
                self.status = "aborted"
        if self.keep_events:
            self.events += [{**event.to_dict(), "choice": choice} for event in output.events]
        self._note_scheduling(output.request)

    def _note_token(self, choice: int) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = self.plan.mono_to_wall(now)
            self.events.append({"kind": "first_token", "time": now})
        last = self.last_token_mono.get(choice)
        if last is not None:
            self.inter_token_s.append(now - last)
        self.last_token_mono[choice] = now

    def _note_scheduling(self, engine_request) -> None:
        """The earliest first scheduling of any choice (clock: the engine's monotonic one)."""
        if engine_request is None or engine_request.first_scheduled_time is None:
            return
        scheduled = engine_request.first_scheduled_time
        if self.first_scheduled_mono is not None and scheduled >= self.first_scheduled_mono:
            return
        self.first_scheduled_mono = scheduled
        self.queue_time_s = scheduled - engine_request.arrival_time
        self.first_scheduled_at = self.plan.mono_to_wall(scheduled)

    def cancel(self, engine) -> None:
        """Abort every choice in the engine; the response ends with finish_reason "abort"."""
        self.cancelled = True
        self.events.append({"kind": "cancelled", "time": time.monotonic()})
        for choice in range(self.plan.num_choices):
            engine.abort(self.plan.sequence_id(choice))

    def preempted_time_s(self, end: float) -> float:
        """Seconds the choices spent preempted (preempted -> resumed, or -> `end`), summed."""
        total, since = 0.0, {}
        for event in sorted(self.events, key=lambda e: e["time"]):
            choice = event.get("choice")
            if event["kind"] == "preempted":
                since[choice] = event["time"]
            elif event["kind"] in ("resumed", "finished", "aborted") and choice in since:
                total += event["time"] - since.pop(choice)
        return total + sum(end - start for start in since.values())

    @property
    def total_output_tokens(self) -> int:
        return sum(self.num_output_tokens.values())

    @property
    def used_tokens(self) -> int:
        return self.plan.num_prompt_tokens + self.total_output_tokens

    def finish_reason(self) -> str | None:
        reasons = set(self.finish_reasons.values())
        return reasons.pop() if len(reasons) == 1 else ("mixed" if reasons else None)


def tenant_limits(tenant: Any) -> TenantLimits:
    return TenantLimits(
        tenant=tenant.name,
        rpm=tenant.rpm,
        tpm=tenant.tpm,
        max_concurrency=tenant.max_concurrency,
        daily_token_quota=tenant.daily_token_quota,
        monthly_token_quota=tenant.monthly_token_quota,
    )


REFUSAL_TYPES = {
    "rate_limit_requests": "requests",
    "concurrency": "requests",
    "rate_limit_tokens": "tokens",
    "daily_quota": "insufficient_quota",
    "monthly_quota": "insufficient_quota",
    "unavailable": "server_error",
}


def refusal_error(admission: Admission) -> APIError:
    return APIError(
        admission.http_status,
        admission.message,
        type=REFUSAL_TYPES.get(admission.reason or "", "requests"),
        code=admission.code,
        headers=admission.headers(),
    )


def check_capacity(app: web.Application, num_sequences: int) -> None:
    """503 while draining or when the engine's line is already full."""
    state, settings = app[SERVING_STATE], app[SETTINGS]
    if state.is_draining:
        raise overloaded("The server is shutting down; retry on another replica.", 1.0)
    capacity = settings.max_num_seqs + settings.max_waiting_requests
    if state.num_inflight_sequences + num_sequences > capacity:
        raise overloaded(
            f"The server is overloaded ({state.num_inflight_sequences} sequences in flight). "
            "Please retry shortly.",
            1.0,
        )


@contextlib.contextmanager
def holding_capacity(app: web.Application, plan: Plan) -> Iterator[None]:
    """Count the plan's sequences as in flight (503 when they do not fit) until it ends."""
    try:
        check_capacity(app, plan.num_choices)
    except APIError as error:
        reason = "draining" if app[SERVING_STATE].is_draining else "overloaded"
        record_refusal(app, plan, reason, error)
        raise
    state = app[SERVING_STATE]
    state.num_inflight_sequences += plan.num_choices
    try:
        yield
    finally:
        state.num_inflight_sequences -= plan.num_choices


async def admit_or_refuse(app: web.Application, plan: Plan, limits: TenantLimits) -> Admission:
    """Reserve prompt + max tokens (and a concurrency lease) under the tenant's limits."""
    admission = await app[RATE_LIMITER].admit(
        limits, plan.request_id, plan.num_prompt_tokens, plan.num_reserved_output_tokens
    )
    if not admission.allowed:
        error = refusal_error(admission)
        record_refusal(app, plan, admission.reason, error)
        raise error
    return admission


@contextlib.asynccontextmanager
async def admitted(request: web.Request, plan: Plan) -> AsyncIterator[Tracker]:
    """Capacity and rate limits first; on the way out, refund, release and audit."""
    app = request.app
    with holding_capacity(app, plan):
        limits = tenant_limits(plan.principal.tenant)
        tracker = Tracker(plan, limits, await admit_or_refuse(app, plan, limits))
        tracker.keep_events = app.get(AUDIT) is not None
        renewal = start_lease_renewal(app, limits, plan.request_id)
        app[SERVING_STATE].inflight[plan.request_id] = tracker
        try:
            yield tracker
        except asyncio.CancelledError:
            tracker.status = "aborted"
            raise
        except Exception as error:
            tracker.status, tracker.error = "error", f"{type(error).__name__}: {error}"
            raise
        finally:
            app[SERVING_STATE].inflight.pop(plan.request_id, None)
            if renewal is not None:
                renewal.cancel()
            await asyncio.shield(settle(app, tracker))


def start_lease_renewal(
    app: web.Application, limits: TenantLimits, request_id: str
) -> asyncio.Task | None:
    """Concurrency leases expire (so a dead replica's leases vanish): renew while running."""
    if limits.max_concurrency is None:
        return None
    return asyncio.create_task(renew_lease(app[RATE_LIMITER], limits, request_id))


async def renew_lease(limiter, limits: TenantLimits, request_id: str) -> None:
    while True:
        await asyncio.sleep(limiter.lease_ttl_s / 3)
        await limiter.renew(limits, request_id)


async def settle(app: web.Application, tracker: Tracker) -> None:
    """Refund the unused reservation and write the audit record."""
    reserved = tracker.admission.reserved_tokens
    await app[RATE_LIMITER].complete(
        tracker.limits, tracker.plan.request_id, reserved, tracker.used_tokens
    )
    if tracker.cancelled:
        tracker.status = "cancelled"
    tracker.events.append({"kind": "completed", "time": time.monotonic(), "status": tracker.status})
    app[METRICS].observe_finished(tracker)
    submit_audit(app, finished_record(tracker), tracker.events)


def record_refusal(app: web.Application, plan: Plan, reason: str | None, error: APIError) -> None:
    """Audit record (with its `received` and `refused` events) and metrics of a refusal."""
    events = [
        {"kind": "received", "time": plan.received_mono},
        {"kind": "refused", "time": time.monotonic(), "reason": reason, "status": error.status},
    ]
    app[METRICS].observe_refused(plan.principal.tenant.name, reason or "unknown")
    submit_audit(app, refused_record(plan, reason, error), events)


@contextlib.asynccontextmanager
async def auditing_invalid_requests(request: web.Request) -> AsyncIterator[None]:
    """Note when the handler started; a request refused while it is read and planned (bad
    JSON, unknown model, prompt too long, ...) gets a `rejected` audit record, reason
    `validation`."""
    request[RECEIVED] = (time.time(), time.monotonic())
    try:
        yield
    except (APIError, web.HTTPException) as error:
        if 400 <= error.status < 500:
            record_invalid_request(request, error)
        raise


def record_invalid_request(request: web.Request, error: APIError | web.HTTPException) -> None:
    received_at, received_mono = request[RECEIVED]
    principal = request[PRINCIPAL]
    message = error.message if isinstance(error, APIError) else error.reason
    record = {
        "id": request[REQUEST_ID],
        "tenant_id": getattr(principal.tenant, "id", None),
        "key_id": principal.key_id,
        "received_at": received_at,
        "finished_at": time.time(),
        "status": "rejected",
        "refusal_reason": "validation",
        "error": message,
        "completion_tokens": 0,
    }
    events = [
        {"kind": "received", "time": received_mono},
        {"kind": "refused", "time": time.monotonic(), "reason": "validation"},
    ]
    submit_audit(request.app, record, events)


def base_record(plan: Plan) -> dict[str, Any]:
    return {
        "id": plan.request_id,
        "tenant_id": getattr(plan.principal.tenant, "id", None),
        "key_id": plan.principal.key_id,
        "model": plan.model,
        "requested_priority": plan.requested_priority,
        "effective_priority": plan.priority,
        "received_at": plan.received_at,
        "prompt_tokens": plan.num_prompt_tokens,
    }


def refused_record(plan: Plan, reason: str | None, error: APIError) -> dict[str, Any]:
    return {
        **base_record(plan),
        "status": "rejected",
        "refusal_reason": reason,
        "error": error.message,
        "finished_at": time.time(),
        "completion_tokens": 0,
    }


def finished_record(tracker: Tracker) -> dict[str, Any]:
    preemptions = [e.get("mode") for e in tracker.events if e.get("kind") == "preempted"]
    return {
        **base_record(tracker.plan),
        "status": tracker.status,
        "finish_reason": tracker.finish_reason(),
        "completion_tokens": tracker.total_output_tokens,
        "first_scheduled_at": tracker.first_scheduled_at,
        "first_token_at": tracker.first_token_at,
        "finished_at": time.time(),
        "queue_time_s": tracker.queue_time_s,
        "preempted_time_s": tracker.preempted_time_s(time.monotonic()),
        "num_preemptions_swap": preemptions.count("swap"),
        "num_preemptions_recompute": preemptions.count("recompute"),
        "error": tracker.error,
    }


def submit_audit(app: web.Application, record: dict[str, Any], events=()) -> None:
    writer = app.get(AUDIT)
    if writer is None:  # --no-audit
        return
    try:
        writer.submit(record, events)
    except Exception:  # the audit log must never fail a request
        log.warning("could not queue the audit record of %s", record.get("id"), exc_info=True)


# ==== running ==================================================================================
def submit_choice(engine, plan: Plan, choice: int) -> AsyncIterator:
    tenant = plan.principal.tenant
    return engine.submit(
        plan.prompt_of(choice),
        plan.params[choice],
        request_id=plan.sequence_id(choice),
        priority=plan.priority,
        tenant=tenant.name,
        weight=tenant.weight,
    )


async def generate(engine, plan: Plan) -> AsyncIterator[tuple[int, Any]]:
    """(choice, output) from every engine request of the plan as they come.

    Each engine request is submitted right where its stream is consumed, so closing this
    generator (or cancelling the task that drives it) always closes every submitted stream,
    which aborts its engine request and frees its KV blocks.
    """
    if plan.num_choices == 1:
        stream = submit_choice(engine, plan, 0)
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [
        asyncio.create_task(pump(engine, plan, choice, queue)) for choice in range(plan.num_choices)
    ]
    try:
        num_open = plan.num_choices
        while num_open:
            choice, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                num_open -= 1
                continue
            yield choice, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def pump(engine, plan: Plan, choice: int, queue: asyncio.Queue) -> None:
    """Feed one engine request's outputs into the shared queue; None marks its end."""
    try:
        stream = submit_choice(engine, plan, choice)
        async with contextlib.aclosing(stream):
            async for output in stream:
                queue.put_nowait((choice, output))
    except Exception as error:
        queue.put_nowait((choice, error))
        return
    queue.put_nowait((choice, None))


# ==== rendering ================================================================================
@dataclass
class ChoiceState:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    num_text_chars_sent: int = 0  # for completions' text_offset while streaming

    def add(self, output) -> None:
        self.text += output.new_text
        self.token_ids += output.new_token_ids
        self.logprobs += output.logprobs
        if output.finished:
            self.finish_reason = output.finish_reason


def usage_body(plan: Plan, choices: list[ChoiceState], num_cached: int) -> dict[str, Any]:
    completion_tokens = sum(len(choice.token_ids) for choice in choices)
    return {
        "prompt_tokens": plan.num_prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": plan.num_prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


class TokenText:
    """Strings and bytes of single tokens for logprobs, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.cache[token_id] = text
        return text


class CompletionFormat:
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, token_text: TokenText, with_logprobs: bool) -> None:
        self.token_text = token_text
        self.with_logprobs = with_logprobs

    def logprobs(self, items: list[Any], text_offset: int) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        tokens = [self.token_text(item.token_id) for item in items]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [{self.token_text(tid): lp for tid, lp in item.top} for item in items],
            "text_offset": offsets,
        }

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        return {
            "index": state.index,
            "text": state.text,
            "logprobs": self.logprobs(state.logprobs, 0),
            "finish_reason": state.finish_reason,
        }

    def first_deltas(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def deltas(self, state: ChoiceState, output) -> list[dict[str, Any]]:
        if not (output.new_text or output.logprobs or output.finished):
            return []
        logprobs = self.logprobs(output.logprobs, state.num_text_chars_sent)
        if logprobs:
            state.num_text_chars_sent += sum(len(token) for token in logprobs["tokens"])
        delta = {
            "index": state.index,
            "text": output.new_text,
            "logprobs": logprobs,
            "finish_reason": output.finish_reason if output.finished else None,
        }
        return [delta]


class ChatFormat:
    object_name = "chat.completion"
    id_prefix = "chatcmpl-"

    def __init__(self, token_text: TokenText, with_logprobs: bool) -> None:
        self.token_text = token_text
        self.with_logprobs = with_logprobs

    def token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def logprobs(self, items: list[Any]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        content = [
            {
                **self.token_entry(item.token_id, item.logprob),
                "top_logprobs": [self.token_entry(tid, lp) for tid, lp in item.top],
            }
            for item in items
        ]
        return {"content": content, "refusal": None}

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        message = {"role": "assistant", "content": state.text, "refusal": None}
        return {
            "index": state.index,
            "message": message,
            "logprobs": self.logprobs(state.logprobs),
            "finish_reason": state.finish_reason,
        }

    def first_deltas(self, num_choices: int) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            for i in range(num_choices)
        ]

    def deltas(self, state: ChoiceState, output) -> list[dict[str, Any]]:
        deltas = []
        if output.new_text or (self.with_logprobs and output.logprobs):
            deltas.append(
                {
                    "index": state.index,
                    "delta": {"content": output.new_text},
                    "logprobs": self.logprobs(output.logprobs),
                    "finish_reason": None,
                }
            )
        if output.finished:
            deltas.append(
                {
                    "index": state.index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": output.finish_reason,
                }
            )
        return deltas


Format = CompletionFormat | ChatFormat


def envelope(plan: Plan, fmt: Format, created: int, chunk: bool) -> dict[str, Any]:
    object_name = fmt.object_name + (".chunk" if chunk else "")
    if chunk and fmt.object_name == "text_completion":
        object_name = "text_completion"
    return {
        "id": fmt.id_prefix + plan.request_id,
        "object": object_name,
        "created": created,
        "model": plan.model,
        "system_fingerprint": None,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def response_headers(tracker: Tracker) -> dict[str, str]:
    headers = tracker.admission.headers()
    headers["x-conveyor-priority"] = str(tracker.plan.priority)
    return headers


# ==== handlers =================================================================================
async def create_completion(request: web.Request) -> web.StreamResponse:
    async with auditing_invalid_requests(request):
        body = await read_body(request, CompletionRequest)
        plan = await plan_completion(request, body)
    fmt = CompletionFormat(TokenText(request.app[ENGINE].tokenizer), body.logprobs is not None)
    return await run(request, plan, fmt, body)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    async with auditing_invalid_requests(request):
        body = await read_body(request, ChatCompletionRequest)
        plan = await plan_chat(request, body)
    fmt = ChatFormat(TokenText(request.app[ENGINE].tokenizer), body.logprobs)
    return await run(request, plan, fmt, body)


async def run(
    request: web.Request, plan: Plan, fmt: Format, body: SamplingFields
) -> web.StreamResponse:
    engine = request.app[ENGINE]
    async with admitted(request, plan) as tracker:
        outputs = generate(engine, plan)
        if body.stream:
            return await stream_response(request, plan, fmt, tracker, outputs, body)
        return await full_response(plan, fmt, tracker, outputs)


async def full_response(
    plan: Plan, fmt: Format, tracker: Tracker, outputs: AsyncIterator
) -> web.Response:
    choices = [ChoiceState(i) for i in range(plan.num_choices)]
    num_cached = 0
    async with contextlib.aclosing(outputs):
        async for choice, output in outputs:
            tracker.observe(choice, output)
            choices[choice].add(output)
            num_cached = max(num_cached, output.num_cached_tokens)
    body = {
        **envelope(plan, fmt, int(plan.received_at), chunk=False),
        "choices": [fmt.choice(state) for state in choices],
        "usage": usage_body(plan, choices, num_cached),
    }
    return web.json_response(body, headers=response_headers(tracker))


async def stream_response(
    request: web.Request,
    plan: Plan,
    fmt: Format,
    tracker: Tracker,
    outputs: AsyncIterator,
    body: SamplingFields,
) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, **response_headers(tracker)})
    try:
        await response.prepare(request)
        await write_events(response, plan, fmt, tracker, outputs, body.include_usage())
    except ConnectionResetError:  # the client left: closing the streams aborted the requests
        tracker.status = "aborted"
        return response
    except Exception as error:  # headers are gone: report in-band, as OpenAI does
        log.exception("stream of %s failed", plan.request_id)
        tracker.status, tracker.error = "error", f"{type(error).__name__}: {error}"
        await write_quietly(response, sse(stream_error_body()))
    await write_quietly(response, sse("[DONE]"))
    return response


async def write_events(
    response: web.StreamResponse,
    plan: Plan,
    fmt: Format,
    tracker: Tracker,
    outputs: AsyncIterator,
    include_usage: bool,
) -> None:
    created = int(plan.received_at)
    head = envelope(plan, fmt, created, chunk=True)
    if include_usage:
        head["usage"] = None
    choices = [ChoiceState(i) for i in range(plan.num_choices)]
    for delta in fmt.first_deltas(plan.num_choices):
        await response.write(sse({**head, "choices": [delta]}))
    num_cached = 0
    async with contextlib.aclosing(outputs):
        async for choice, output in outputs:
            tracker.observe(choice, output)
            choices[choice].add(output)
            num_cached = max(num_cached, output.num_cached_tokens)
            for delta in fmt.deltas(choices[choice], output):
                await response.write(sse({**head, "choices": [delta]}))
    if include_usage:
        usage = usage_body(plan, choices, num_cached)
        await response.write(sse({**head, "choices": [], "usage": usage}))


def stream_error_body() -> dict[str, Any]:
    return {
        "error": {
            "message": "The server had an error while generating this response.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


async def write_quietly(response: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionResetError):
        await response.write(data)


# ---- models -----------------------------------------------------------------------------------
def model_card(request: web.Request) -> dict[str, Any]:
    engine = request.app[ENGINE].engine
    return {
        "id": engine.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "conveyor",
        "max_model_len": engine.max_model_len,
    }


async def rate_limit_only(request: web.Request) -> dict[str, str]:
    """Count a request that generates nothing against the tenant's request rate."""
    principal, request_id = request[PRINCIPAL], request[REQUEST_ID]
    limits = tenant_limits(principal.tenant)
    limiter = request.app[RATE_LIMITER]
    admission = await limiter.admit(limits, request_id, 0, 0)
    if not admission.allowed:
        raise refusal_error(admission)
    await limiter.complete(limits, request_id, 0, 0)  # drops the lease and the reservation
    return admission.headers()


async def list_models(request: web.Request) -> web.Response:
    headers = await rate_limit_only(request)
    body = {"object": "list", "data": [model_card(request)]}
    return web.json_response(body, headers=headers)


async def retrieve_model(request: web.Request) -> web.Response:
    headers = await rate_limit_only(request)
    model = request.match_info["model"]
    check_model(request, model)
    return web.json_response(model_card(request), headers=headers)

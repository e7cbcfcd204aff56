"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE),
`GET /v1/models`, `GET /v1/requests/{id}` and `GET /v1/openapi.json`.

One HTTP request becomes a `Plan` (planning.py), is admitted (tracking.py), runs as
`len(prompts) * n` engine requests whose outputs are merged (generation.py), and is rendered by
a `CompletionFormat` or `ChatFormat` (rendering.py). Leaving the handler in any way (finished,
client gone, error) closes the engine streams, which aborts what still runs, refunds the unused
token reservation and writes the audit record.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from gateway.appkeys import (
    ENGINE_CLIENT,
    PRINCIPAL,
    RATE_LIMITER,
    REQUEST_ID,
)
from gateway.audit.records import auditing_invalid_requests
from gateway.audit.routes import REQUEST_ID_SCHEMA, RequestDetailOut, own_request
from gateway.openai.generation import generate
from gateway.openai.inference_gateway import FAIRNESS_ID_HEADER
from gateway.openai.planning import Plan, check_model, plan_chat, plan_completion
from gateway.openai.rendering import (
    SSE_HEADERS,
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    Format,
    TokenText,
    envelope,
    full_body,
    response_headers,
    sse,
    stream_error_body,
    usage_of,
)
from gateway.openai.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelCard,
    ModelList,
)
from gateway.openai.schemas import (
    OUTPUT_TOKENS_MARK,
    TOKEN_ID_MARK,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    read_body,
)
from gateway.openai.tracking import Tracker, admitted
from gateway.openapi import (
    BEARER_KEY,
    DRAINING_ERRORS,
    KEY_ERRORS,
    RATE_LIMIT_ERRORS,
    RATE_LIMIT_HEADERS,
    Route,
    build_document,
    header,
)
from gateway.tenancy.admission import refusal_error, request_limits
from gateway.tenancy.scopes import can_use_model
from runtime.engine_client import EngineInfo

log = logging.getLogger(__name__)

PREFIX = "/v1"


OWN_REQUEST_LINK = {
    "GetRequestRecord": {
        "operationId": "get_own_request",
        "parameters": {"request_id": "$response.body#/id"},
        "description": "The request's audit record: the body `id` finds it",
    }
}
NOT_FOUND = {404: "the model (or the request) does not exist"}
GATEWAY_HEADER_ERRORS = {
    403: "x-llm-d-inference-fairness-id names another tenant, or x-llm-d-inference-objective "
    "runs above the tenant's max_priority"
}
GENERATES = {
    **KEY_ERRORS,
    **GATEWAY_HEADER_ERRORS,
    **NOT_FOUND,
    **RATE_LIMIT_ERRORS,
    **DRAINING_ERRORS,
}
COUNTED = {**KEY_ERRORS, **RATE_LIMIT_ERRORS, 503: "the key store is unreachable"}
PRIORITY_HEADER = {
    "x-conveyor-priority": header("the priority it ran at", "integer"),
    FAIRNESS_ID_HEADER: header("the fairness id it was counted under: the tenant's name"),
}


def openai_routes() -> list[Route]:
    """Every `/v1` route, relative to `/v1`: the router and the document both read this table."""
    return [
        Route("POST", "/completions", create_completion, "Create a completion",
              body=CompletionRequest, responses={200: Completion}, streams=Completion,
              errors=GENERATES, headers={**RATE_LIMIT_HEADERS, **PRIORITY_HEADER},
              links=OWN_REQUEST_LINK),
        Route("POST", "/chat/completions", create_chat_completion, "Create a chat completion",
              body=ChatCompletionRequest, responses={200: ChatCompletion},
              streams=ChatCompletionChunk, errors=GENERATES,
              headers={**RATE_LIMIT_HEADERS, **PRIORITY_HEADER}, links=OWN_REQUEST_LINK),
        Route("GET", "/models", list_models, "List models", responses={200: ModelList},
              errors=COUNTED, headers=RATE_LIMIT_HEADERS),
        Route("GET", "/models/{model}", retrieve_model, "Retrieve a model",
              responses={200: ModelCard}, errors={**COUNTED, **NOT_FOUND},
              headers=RATE_LIMIT_HEADERS),
        Route("GET", "/requests/{request_id}", own_request,
              "One of your requests: its audit record, events and the explanation of its delays",
              responses={200: RequestDetailOut}, path_schemas={"request_id": REQUEST_ID_SCHEMA},
              errors={**KEY_ERRORS, **NOT_FOUND, 503: "the key store is unreachable"}),
    ]  # fmt: skip


def add_routes(router: web.UrlDispatcher) -> None:
    for route in openai_routes():
        router.add_route(route.method, PREFIX + route.path, route.handler)
    router.add_get(PREFIX + "/openapi.json", openapi_document)


@functools.cache
def openai_document(info: EngineInfo) -> dict[str, Any]:
    """The document with the loaded model's facts: `model` an enum of the names this server
    answers to, token ids below the vocabulary size, output tokens within the context."""
    document = build_document("Conveyor OpenAI-compatible API", PREFIX, openai_routes(), BEARER_KEY)
    model = {"type": "string", "enum": list(info.served_model_names), "title": "Model"}
    schemas = document["components"]["schemas"]
    for body in (CompletionRequest, ChatCompletionRequest):
        schemas[body.__name__]["properties"]["model"] = model
    (parameter,) = document["paths"][PREFIX + "/models/{model}"]["get"]["parameters"]
    parameter["schema"] = model
    fill_marks(
        document,
        {
            TOKEN_ID_MARK: info.vocab_size - 1,
            OUTPUT_TOKENS_MARK: min(info.max_model_len, info.kv_capacity_tokens) - 1,
        },
    )
    return document


def fill_marks(node: Any, maximum_of: dict[str, int]) -> None:
    """Every schema carrying one of the marks gets its `maximum`, and loses the mark."""
    if isinstance(node, list):
        for item in node:
            fill_marks(item, maximum_of)
    if not isinstance(node, dict):
        return
    for mark, maximum in maximum_of.items():
        if node.pop(mark, None):
            node["maximum"] = maximum
    for value in node.values():
        fill_marks(value, maximum_of)


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(openai_document(request.app[ENGINE_CLIENT].info))


async def create_completion(request: web.Request) -> web.StreamResponse:
    async with auditing_invalid_requests(request):
        body = await read_body(request, CompletionRequest)
        plan = await plan_completion(request, body)
    fmt = CompletionFormat(
        TokenText(request.app[ENGINE_CLIENT].tokenizer), body.logprobs is not None
    )
    return await run(request, plan, fmt, body)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    async with auditing_invalid_requests(request):
        body = await read_body(request, ChatCompletionRequest)
        plan = await plan_chat(request, body)
    token_text = TokenText(request.app[ENGINE_CLIENT].tokenizer)
    fmt = ChatFormat(token_text, body.logprobs, calls_tools=plan.calls_tools)
    return await run(request, plan, fmt, body)


async def run(
    request: web.Request, plan: Plan, fmt: Format, body: SamplingFields
) -> web.StreamResponse:
    engine = request.app[ENGINE_CLIENT]
    async with admitted(request, plan) as tracker:
        outputs = generate(engine, plan)
        if body.stream:
            return await stream_response(request, plan, fmt, tracker, outputs, body)
        return await full_response(plan, fmt, tracker, outputs)


async def full_response(
    plan: Plan, fmt: Format, tracker: Tracker, outputs: AsyncIterator
) -> web.Response:
    gathered = Gathered(plan.num_choices)
    async with contextlib.aclosing(gather(outputs, tracker, gathered)) as items:
        async for _ in items:
            pass
    body = full_body(plan, fmt, gathered.choices, gathered.num_cached)
    return json_model(body, headers=response_headers(tracker))


class Gathered:
    """What a response's outputs add up to so far: each choice and the cached prompt tokens."""

    def __init__(self, num_choices: int) -> None:
        self.choices = [ChoiceState(i) for i in range(num_choices)]
        self.num_cached = 0


async def gather(
    outputs: AsyncIterator, tracker: Tracker, gathered: Gathered
) -> AsyncIterator[tuple[ChoiceState, Any]]:
    """The one loop over a response's engine outputs, streamed or not: each is tracked and
    added to its choice, then yielded with that choice. Closing it closes the outputs (which
    aborts the requests still running)."""
    async with contextlib.aclosing(outputs):
        async for choice, output in outputs:
            tracker.observe(choice, output)
            state = gathered.choices[choice]
            state.add(output)
            gathered.num_cached = max(gathered.num_cached, output.num_cached_tokens)
            yield state, output


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
    for delta in fmt.first_deltas(plan.num_choices):
        await response.write(sse(fmt.chunk_model(**head, choices=[delta])))
    gathered = Gathered(plan.num_choices)
    async with contextlib.aclosing(gather(outputs, tracker, gathered)) as items:
        async for state, output in items:
            for delta in fmt.deltas(state, output):
                await response.write(sse(fmt.chunk_model(**head, choices=[delta])))
    if include_usage:
        usage = usage_of(plan, gathered.choices, gathered.num_cached)
        await response.write(sse(fmt.chunk_model(**{**head, "usage": usage}, choices=[])))


async def write_quietly(response: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionResetError):
        await response.write(data)


# ---- models -----------------------------------------------------------------------------------
def model_cards(request: web.Request) -> list[ModelCard]:
    """One card per served name (`--served-model-name`) the key may use, all the same model."""
    info = request.app[ENGINE_CLIENT].info
    key = request[PRINCIPAL].key
    return [
        ModelCard(
            id=name,
            object="model",
            created=0,
            owned_by="conveyor",
            max_model_len=info.max_model_len,
        )
        for name in info.served_model_names
        if can_use_model(key, name)
    ]


async def rate_limit_only(request: web.Request) -> dict[str, str]:
    """Count a request that generates nothing against the tenant's request rate."""
    principal, request_id = request[PRINCIPAL], request[REQUEST_ID]
    limits = request_limits(principal)
    limiter = request.app[RATE_LIMITER]
    admission = await limiter.admit(limits, request_id, 0, 0)
    if not admission.allowed:
        raise refusal_error(admission)
    await limiter.complete(limits, request_id, 0, 0)  # drops the lease and the reservation
    return admission.headers()


async def list_models(request: web.Request) -> web.Response:
    headers = await rate_limit_only(request)
    return json_model(ModelList(object="list", data=model_cards(request)), headers=headers)


async def retrieve_model(request: web.Request) -> web.Response:
    headers = await rate_limit_only(request)
    model = request.match_info["model"]
    check_model(request, model)
    card = next(card for card in model_cards(request) if card.id == model)
    return json_model(card, headers=headers)


def json_model(body: BaseModel, status: int = 200, headers: dict[str, str] | None = None):
    """A response body built from its pydantic model, the one the document publishes."""
    return web.Response(
        body=body.model_dump_json(), status=status, headers=headers, content_type="application/json"
    )

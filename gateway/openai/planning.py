"""The plan of one HTTP request: its prompts as token ids (tokenized once, checked once against
the vocabulary, the context and the KV cache, on the gateway side only), one SamplingParams per
choice (checked once against the engine's bounds), and the tenant's effective
priority.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.appkeys import (
    ENGINE_CLIENT,
    PRINCIPAL,
    RECEIVED,
    REQUEST_ID,
    SETTINGS,
    Principal,
)
from gateway.audit.ids import sequence_id
from gateway.errors import (
    bad_request,
    model_not_found,
)
from gateway.openai.inference_gateway import requested_priority
from gateway.openai.schemas import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from gateway.openai.structured import (
    GrammarPlan,
    grammar_spec,
    prepare,
    template_messages,
    template_tools,
    tool_choice,
)
from gateway.tenancy.scopes import check_model_scope
from runtime.engine import prompt_error
from runtime.engine_client import EngineInfo
from scheduler.request import GrammarSpec, SamplingParams, SamplingParamsError

LONG_PROMPT_CHARS = 8192  # tokenize longer prompts on a thread


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint


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
    grammar: GrammarPlan | None = None  # constrained decoding (response_format, tools)

    @property
    def calls_tools(self) -> bool:
        return self.grammar is not None and self.grammar.source == "tools"

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def sequence_id(self, choice: int) -> str:
        """The engine request id of one choice."""
        return sequence_id(self.request_id, choice)

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
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    grammar: GrammarSpec | None = None,
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
        grammar=grammar,
    )


def check_model(request: web.Request, model: str) -> None:
    if model not in request.app[ENGINE_CLIENT].info.served_model_names:
        raise model_not_found(model)
    check_model_scope(request[PRINCIPAL].key, model)


def check_prompt_fits(
    info: EngineInfo, prompt: list[int], max_tokens: int | None, param: str
) -> None:
    """The prompt's ids are in the vocabulary, and prompt + max_tokens fits the context and the
    KV cache: everything the engine would refuse, checked once, with its fixed facts."""
    num_output = max_tokens or 1  # no max_tokens: whatever fits, at least one token
    max_len = min(info.max_model_len, info.kv_capacity_tokens)
    error = prompt_error(prompt, info.vocab_size, max_len, num_output, param)
    if error is not None:
        raise bad_request(str(error), param=param, code=error.code)


def check_sampling(info: EngineInfo, params: SamplingParams) -> None:
    try:
        params.validate(info.vocab_size)
    except SamplingParamsError as error:
        raise bad_request(str(error), param=error.param, code="invalid_value") from None


async def make_plan(
    request: web.Request,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: list[int],
    logprobs: int | None,
    param: str,
    choice: str | None = None,
) -> Plan:
    """choice: the chat body's tool_choice, decided once (None for completions)."""
    principal = request[PRINCIPAL]
    objectives = request.app[SETTINGS].inference_objectives
    requested = requested_priority(request, body.priority, objectives, principal.tenant)
    spec, source = grammar_spec(body, choice) or (None, None)
    params = [
        sampling_params(body, max_tokens[choice // body.n], logprobs, choice % body.n, spec)
        for choice in range(len(prompts) * body.n)
    ]
    check_sampling(request.app[ENGINE_CLIENT].info, params[0])  # choices differ in seed only
    grammar = None if spec is None else await prepare(request, spec, source)
    received_at, received_mono = request.get(RECEIVED) or (time.time(), time.monotonic())
    return Plan(
        request_id=request[REQUEST_ID],
        model=body.model,
        principal=principal,
        prompts=prompts,
        params=params,
        n=body.n,
        requested_priority=requested,
        priority=effective_priority(requested, principal.tenant),
        received_at=received_at,
        received_mono=received_mono,
        grammar=grammar,
    )


# ---- prompts ---------------------------------------------------------------------------------
async def tokenize(engine, text: str) -> list[int]:
    """A text that comes to no tokens at all (e.g. a lone control character) starts a new
    document, as OpenAI's completions do without a prompt: from the end-of-text token."""
    if len(text) > LONG_PROMPT_CHARS:
        token_ids = await asyncio.to_thread(engine.tokenizer.encode, text)
    else:
        token_ids = engine.tokenizer.encode(text)
    return token_ids or document_start(engine.tokenizer)


def document_start(tokenizer) -> list[int]:
    hf = tokenizer.hf_tokenizer
    for token_id in (hf.bos_token_id, *tokenizer.eos_token_ids):
        if token_id is not None:
            return [token_id]
    return [0]


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


async def chat_prompt(engine, body: ChatCompletionRequest, choice: str | None) -> list[int]:
    if not engine.tokenizer.has_chat_template:
        raise bad_request(
            f"The model {engine.info.model_name!r} has no chat template (a base model): "
            "use /v1/completions.",
            param="model",
            code="model_has_no_chat_template",
        )
    own_tools = engine.tokenizer.template_renders_tools  # Qwen's: its own "# Tools" section
    messages = template_messages(body, choice, own_tools)
    tools = template_tools(body, choice) if own_tools else None
    try:
        return await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages, True, tools)
    except ValueError as error:
        raise bad_request(str(error), param="messages") from None


async def plan_completion(request: web.Request, body: CompletionRequest) -> Plan:
    check_model(request, body.model)
    engine = request.app[ENGINE_CLIENT]
    prompts = await completion_prompts(engine, body)
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    for prompt in prompts:
        check_prompt_fits(engine.info, prompt, max_tokens, "prompt")
    max_tokens_list = [max_tokens] * len(prompts)
    return await make_plan(request, body, prompts, max_tokens_list, body.logprobs, "prompt")


async def plan_chat(request: web.Request, body: ChatCompletionRequest) -> Plan:
    check_model(request, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    engine = request.app[ENGINE_CLIENT]
    choice = tool_choice(body)
    prompt = await chat_prompt(engine, body, choice)
    requested_max = body.max_completion_tokens or body.max_tokens
    check_prompt_fits(engine.info, prompt, requested_max, "messages")
    max_tokens = requested_max or engine.info.max_model_len - len(prompt)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await make_plan(request, body, [prompt], [max_tokens], logprobs, "messages", choice)

"""The OpenAI request bodies as pydantic models: what `/v1/completions` and `/v1/chat/completions`
accept, with the bounds the validators and the published document share.

A field is either applied or refused, never ignored: bodies forbid fields they do not declare
(OpenAI's own answer to an unknown argument), and fields OpenAI defines that this server does
not implement (tools, structured outputs, audio, ...) get a 400 that names them. Fields declared
here but accepted only with the value that changes nothing (`echo: false`, an empty
`logit_bias`, `response_format: {"type": "text"}`) say so in the document as well.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from gateway.errors import (
    APIError,
    bad_request,
    deepest_problem,
    field_path,
    from_validation_error,
)
from gateway.jsonbody import read_model
from scheduler.request import MAX_N, SAMPLING_BOUNDS

MAX_STOP_SEQUENCES = 16


MAX_PROMPTS = 32


# Facts of the loaded model, filled into the published document where these markers stand.
TOKEN_ID_MARK = "x-token-id"  # maximum: the vocabulary size - 1
OUTPUT_TOKENS_MARK = "x-output-tokens"  # maximum: the context length - 1 (a prompt takes one)
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N


# Fields OpenAI defines that this server does not implement: refused with a 400 naming them.
UNSUPPORTED_FIELDS = frozenset({
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
    "modalities", "prediction", "web_search_options", "store", "metadata", "service_tier",
    "reasoning_effort", "verbosity", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "include_obfuscation", "name", "tool_calls", "tool_call_id", "refusal",
})  # fmt: skip


# Fields accepted only with the value that changes nothing; any other value is refused.
ONLY_NEUTRAL_VALUES = {
    "echo": "'echo' is not supported: it must be false.",
    "suffix": "'suffix' is not supported: it must be empty.",
    "best_of": "'best_of' other than 1 is not supported.",
    "logit_bias": "'logit_bias' is not supported: it must be empty.",
    "response_format": "Only 'response_format': {'type': 'text'} is supported; structured "
    "outputs (json_object, json_schema) are not.",
}


def exactly_bool(value: Any) -> Any:
    """`Literal[False]` alone would take 0 (0 == False)."""
    if not isinstance(value, bool):
        raise ValueError("Input should be a valid boolean")
    return value


def sampling_field(name: str, default: Any = None, **extra: Any) -> Any:
    """A pydantic field whose range is the engine's own (`scheduler.request.SAMPLING_BOUNDS`)."""
    return Field(default, **SAMPLING_BOUNDS[name].field_constraints(), **extra)


def output_tokens_field() -> Any:
    return sampling_field("max_tokens", json_schema_extra={OUTPUT_TOKENS_MARK: True})


# ==== request bodies ==========================================================================
class StrictBody(BaseModel):
    """Validated from JSON in strict mode: no "1" for 1, no "true" for true, no NaN; a field
    that is not declared is refused, never ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictBody):
    include_usage: bool = False


class ResponseFormatText(StrictBody):
    type: Literal["text"]


class SamplingFields(StrictBody):
    model: str
    max_tokens: int | None = output_tokens_field()
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    n: int = sampling_field("n", 1)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = sampling_field("presence_penalty")
    frequency_penalty: float | None = sampling_field("frequency_penalty")
    logit_bias: dict[str, int] | None = Field(
        None, max_length=0, description="not supported: only an empty object is accepted"
    )
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM names)
    top_k: int | None = sampling_field("top_k")
    min_p: float | None = sampling_field("min_p")
    repetition_penalty: float | None = sampling_field("repetition_penalty")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    priority: int | None = Field(None, ge=-1_000_000, le=1_000_000)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description="text, texts, token ids, or lists of token ids; with max_tokens "
              "within the context length (else 400 context_length_exceeded)")  # fmt: skip
    logprobs: int | None = sampling_field("logprobs")
    echo: Annotated[Literal[False], BeforeValidator(exactly_bool)] = Field(
        False, description="not supported: only false is accepted"
    )
    suffix: str | None = Field(None, max_length=0, description="not supported: only empty")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    """Tools are not supported, so neither are `tool` messages nor `tool_calls`."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(union_mode="left_to_right")

    def as_template_message(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):
            return {"role": role, "content": "\n".join(part.text for part in self.content)}
        return {"role": role, "content": self.content}


TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class ChatCompletionRequest(SamplingFields):
    """`top_logprobs` needs `logprobs: true` (said in the schema as if/then)."""

    model_config = ConfigDict(json_schema_extra=TOP_LOGPROBS_NEED_LOGPROBS)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = output_tokens_field()
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("logprobs")
    response_format: ResponseFormatText | None = Field(
        None, description="only {'type': 'text'}: structured outputs are not supported"
    )


# ==== reading a body ============================================================================
async def read_body(request: web.Request, body_type: type[StrictBody]) -> Any:
    return await read_model(request, body_type, body_error)


def body_error(error: ValidationError) -> APIError:
    """The most specific problem; a field we refuse is named as such."""
    problem = deepest_problem(error)
    location = field_path(problem["loc"])
    if problem["type"] == "extra_forbidden":
        return refused_field(location.rpartition(".")[2], location)
    top = problem["loc"][0] if problem["loc"] else None
    if top in ONLY_NEUTRAL_VALUES:
        return bad_request(ONLY_NEUTRAL_VALUES[top], param=top, code="unsupported_value")
    return from_validation_error(error)


def refused_field(field_name: str, location: str) -> APIError:
    if field_name in UNSUPPORTED_FIELDS:
        message = f"Unsupported parameter: '{location}' is not supported by this server."
        return bad_request(message, param=location, code="unsupported_parameter")
    message = f"Unrecognized request argument supplied: {location}"
    return bad_request(message, param=location, code="unknown_parameter")

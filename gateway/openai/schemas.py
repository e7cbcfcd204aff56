"""The OpenAI request bodies as pydantic models: what `/v1/completions` and `/v1/chat/completions`
accept, with the bounds the validators and the published document share.

A field is either applied or refused, never ignored: bodies forbid fields they do not declare
(OpenAI's own answer to an unknown argument), and fields OpenAI defines that this server does
not implement (audio, web search, ...) get a 400 that names them. Fields declared here but
accepted only with the value that changes nothing (`echo: false`, an empty `logit_bias`) say so
in the document as well. Structured outputs (`response_format`) and tool calls (`tools`,
`tool_choice`, `role: "tool"` messages) are grammar-constrained (runtime.structured).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from aiohttp import web
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
)

from gateway.errors import (
    APIError,
    bad_request,
    deepest_problem,
    field_path,
    from_validation_error,
)
from gateway.jsonbody import read_model
from runtime.structured.tool_format import render_tool_call
from scheduler.request import MAX_N, SAMPLING_BOUNDS

MAX_STOP_SEQUENCES = 16


MAX_PROMPTS = 32
MAX_TOOLS = 64


# Facts of the loaded model, filled into the published document where these markers stand.
TOKEN_ID_MARK = "x-token-id"  # maximum: the vocabulary size - 1
OUTPUT_TOKENS_MARK = "x-output-tokens"  # maximum: the context length - 1 (a prompt takes one)
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N


# Fields OpenAI defines that this server does not implement: refused with a 400 naming them.
UNSUPPORTED_FIELDS = frozenset({
    "functions", "function_call", "audio",
    "modalities", "prediction", "web_search_options", "store", "metadata", "service_tier",
    "reasoning_effort", "verbosity", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "include_obfuscation", "name", "refusal",
})  # fmt: skip


# Fields accepted only with the value that changes nothing; any other value is refused.
ONLY_NEUTRAL_VALUES = {
    "echo": "'echo' is not supported: it must be false.",
    "suffix": "'suffix' is not supported: it must be empty.",
    "best_of": "'best_of' other than 1 is not supported.",
    "logit_bias": "'logit_bias' is not supported: it must be empty.",
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


class ResponseFormatJSONObject(StrictBody):
    """Any JSON object."""

    type: Literal["json_object"]


class JSONSchemaFormat(StrictBody):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None,
        alias="schema",
        description="a JSON schema (default: any JSON object); a keyword the grammar cannot "
        "enforce, an invalid schema or one whose compiled grammar passes the tenant's "
        "max_grammar_bytes is a 400 naming response_format.json_schema.schema",
    )
    strict: bool | None = None


class ResponseFormatJSONSchema(StrictBody):
    """An answer valid against `json_schema.schema`."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    Union[ResponseFormatText, ResponseFormatJSONObject, ResponseFormatJSONSchema],  # noqa: UP007
    Field(discriminator="type"),
]


# A constrained answer ends with the end-of-sequence token: no ignore_eos with a grammar, and
# one grammar per request (tools in play leave response_format at text). Said as if/then.
JSON_FORMAT_GIVEN = {
    "properties": {
        "response_format": {
            "type": "object",
            "properties": {"type": {"enum": ["json_object", "json_schema"]}},
            "required": ["type"],
        }
    },
    "required": ["response_format"],
}
KEEPS_EOS = {"properties": {"ignore_eos": {"const": False}}}
FORMAT_NEEDS_EOS = {"if": JSON_FORMAT_GIVEN, "then": KEEPS_EOS}
TOOLS_IN_PLAY = {
    "properties": {
        "tools": {"type": "array", "minItems": 1},
        "tool_choice": {"not": {"const": "none"}},
    },
    "required": ["tools"],
}
TEXT_FORMAT_ONLY = {
    "properties": {
        "ignore_eos": {"const": False},
        "response_format": {
            "anyOf": [
                {"type": "null"},
                {"type": "object", "properties": {"type": {"const": "text"}}},
            ]
        },
    }
}
TOOLS_NEED_EOS_AND_TEXT = {"if": TOOLS_IN_PLAY, "then": TEXT_FORMAT_ONLY}


class SamplingFields(StrictBody):
    model_config = ConfigDict(json_schema_extra=FORMAT_NEEDS_EOS)

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
    response_format: ResponseFormat | None = Field(
        None, description="text (default), json_object or json_schema: grammar-constrained"
    )

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


def joined_text(content: str | list[TextPart] | None) -> str:
    if isinstance(content, list):
        return "\n".join(part.text for part in content)
    return content or ""


Content = str | list[TextPart]


class InstructionMessage(StrictBody):
    role: Literal["system", "developer", "user"]
    content: Content = Field(union_mode="left_to_right")

    def as_template_message(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": joined_text(self.content)}


class FunctionCall(StrictBody):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class MessageToolCall(StrictBody):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantTurn(StrictBody):
    """An earlier answer: text, tool calls, or both."""

    role: Literal["assistant"]
    content: Content | None = Field(None, union_mode="left_to_right")
    tool_calls: list[MessageToolCall] | None = None

    def as_template_message(self) -> dict[str, str]:
        calls = "".join(
            render_tool_call(call.function.name, call.function.arguments)
            for call in self.tool_calls or []
        )
        return {"role": "assistant", "content": joined_text(self.content) + calls}


class ToolMessage(StrictBody):
    """A tool's result, for the call `tool_call_id`."""

    role: Literal["tool"]
    content: Content = Field(union_mode="left_to_right")
    tool_call_id: str

    def as_template_message(self) -> dict[str, str]:
        return {"role": "tool", "content": joined_text(self.content)}


MESSAGE_CLASSES = {"assistant": "AssistantTurn", "tool": "ToolMessage"}


def message_class(value: Any) -> str | None:
    """The message class by role (capitalised, so error locations skip it as a union tag)."""
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    if not isinstance(role, str):
        return None
    return MESSAGE_CLASSES.get(role, "InstructionMessage")


ChatMessage = Annotated[
    Union[  # noqa: UP007
        Annotated[InstructionMessage, Tag("InstructionMessage")],
        Annotated[AssistantTurn, Tag("AssistantTurn")],
        Annotated[ToolMessage, Tag("ToolMessage")],
    ],
    Discriminator(message_class),
]


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON schema of the arguments (default: no arguments)"
    )
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class ChatCompletionRequest(SamplingFields):
    """`top_logprobs` needs `logprobs: true` (said in the schema as if/then)."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [TOP_LOGPROBS_NEED_LOGPROBS, FORMAT_NEEDS_EOS, TOOLS_NEED_EOS_AND_TEXT]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = output_tokens_field()
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("logprobs")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(
        None,
        description="none, auto (default with tools), required, or a named function, which "
        "must be among tools (else a 400 naming tool_choice)",
    )
    parallel_tool_calls: bool | None = None


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

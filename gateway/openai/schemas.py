"""The OpenAI request bodies as pydantic models: what `/v1/completions` and `/v1/chat/completions`
accept, with the bounds the validators and the published document share.
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import (
    bad_request,
    from_validation_error,
)

MAX_N = 8


MAX_STOP_SEQUENCES = 16


MAX_LOGPROBS = 20


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N


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

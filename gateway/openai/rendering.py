"""OpenAI response bodies and SSE chunks from engine outputs (completions and chat, logprobs,
usage, rate-limit headers), built as the pydantic models of `responses` that the published
document declares: one set of shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from gateway.audit.ids import CHAT_COMPLETION_ID_PREFIX, COMPLETION_ID_PREFIX
from gateway.openai.inference_gateway import fairness_headers
from gateway.openai.planning import Plan
from gateway.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from gateway.openai.tool_rendering import ToolDeltas, tool_finish_reason, tool_message
from gateway.openai.tracking import Tracker
from gateway.openapi import ErrorBody, ErrorDetail

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


# ==== rendering ================================================================================
@dataclass
class ChoiceState:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    num_text_chars_sent: int = 0  # for completions' text_offset while streaming
    tools: ToolDeltas | None = None  # a streamed answer that may call tools

    def add(self, output) -> None:
        self.text += output.new_text
        self.token_ids += output.new_token_ids
        self.logprobs += output.logprobs
        if output.finished:
            self.finish_reason = output.finish_reason


def usage_of(plan: Plan, choices: list[ChoiceState], num_cached: int) -> Usage:
    completion_tokens = sum(len(choice.token_ids) for choice in choices)
    return Usage(
        prompt_tokens=plan.num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=plan.num_prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


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
    id_prefix = COMPLETION_ID_PREFIX
    body_model = chunk_model = Completion

    def __init__(self, token_text: TokenText, with_logprobs: bool) -> None:
        self.token_text = token_text
        self.with_logprobs = with_logprobs

    def logprobs(self, items: list[Any], text_offset: int) -> CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        tokens = [self.token_text(item.token_id) for item in items]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[item.logprob for item in items],
            top_logprobs=[{self.token_text(tid): lp for tid, lp in item.top} for item in items],
            text_offset=offsets,
        )

    def choice(self, state: ChoiceState) -> CompletionChoice:
        return CompletionChoice(
            index=state.index,
            text=state.text,
            logprobs=self.logprobs(state.logprobs, 0),
            finish_reason=state.finish_reason,
        )

    def first_deltas(self, num_choices: int) -> list[CompletionChoice]:
        return []

    def deltas(self, state: ChoiceState, output) -> list[CompletionChoice]:
        if not (output.new_text or output.logprobs or output.finished):
            return []
        logprobs = self.logprobs(output.logprobs, state.num_text_chars_sent)
        if logprobs:
            state.num_text_chars_sent += sum(len(token) for token in logprobs.tokens)
        delta = CompletionChoice(
            index=state.index,
            text=output.new_text,
            logprobs=logprobs,
            finish_reason=output.finish_reason if output.finished else None,
        )
        return [delta]


class ChatFormat:
    object_name = "chat.completion"
    id_prefix = CHAT_COMPLETION_ID_PREFIX
    body_model, chunk_model = ChatCompletion, ChatCompletionChunk

    def __init__(self, token_text: TokenText, with_logprobs: bool, calls_tools: bool = False):
        self.token_text = token_text
        self.with_logprobs = with_logprobs
        self.calls_tools = calls_tools

    def top_entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def logprobs(self, items: list[Any]) -> ChatLogprobs | None:
        if not self.with_logprobs:
            return None
        content = [
            TokenLogprob(
                **dict(self.top_entry(item.token_id, item.logprob)),
                top_logprobs=[self.top_entry(tid, lp) for tid, lp in item.top],
            )
            for item in items
        ]
        return ChatLogprobs(content=content, refusal=None)

    def choice(self, state: ChoiceState) -> ChatChoice:
        message, num_calls = AssistantMessage(role="assistant", content=state.text), 0
        if self.calls_tools:
            message, num_calls = tool_message(state.text)
        return ChatChoice(
            index=state.index,
            message=message,
            logprobs=self.logprobs(state.logprobs),
            finish_reason=tool_finish_reason(state.finish_reason, num_calls),
        )

    def first_deltas(self, num_choices: int) -> list[ChatChunkChoice]:
        role = ChatDelta(role="assistant", content="")
        return [
            ChatChunkChoice(index=i, delta=role, logprobs=None, finish_reason=None)
            for i in range(num_choices)
        ]

    def deltas(self, state: ChoiceState, output) -> list[ChatChunkChoice]:
        if self.calls_tools:
            return self.tool_deltas(state, output)
        deltas = []
        if output.new_text or (self.with_logprobs and output.logprobs):
            deltas.append(
                ChatChunkChoice(
                    index=state.index,
                    delta=ChatDelta(content=output.new_text),
                    logprobs=self.logprobs(output.logprobs),
                    finish_reason=None,
                )
            )
        if output.finished:
            deltas.append(
                ChatChunkChoice(
                    index=state.index,
                    delta=ChatDelta(),
                    logprobs=None,
                    finish_reason=output.finish_reason,
                )
            )
        return deltas

    def tool_deltas(self, state: ChoiceState, output) -> list[ChatChunkChoice]:
        """Content and tool-call deltas; the logprobs ride on the step's first chunk."""
        state.tools = state.tools or ToolDeltas()
        deltas = state.tools.deltas(state.index, output.new_text, output.finished)
        if self.with_logprobs and output.logprobs:
            if not deltas:
                deltas = [self.empty_chunk(state.index)]
            deltas[0].logprobs = self.logprobs(output.logprobs)
        if output.finished:
            reason = tool_finish_reason(output.finish_reason, state.tools.num_calls)
            deltas.append(self.empty_chunk(state.index, reason))
        return deltas

    @staticmethod
    def empty_chunk(index: int, finish_reason: str | None = None) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=index, delta=ChatDelta(), logprobs=None, finish_reason=finish_reason
        )


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


def full_body(
    plan: Plan, fmt: Format, choices: list[ChoiceState], num_cached: int
) -> Completion | ChatCompletion:
    return fmt.body_model(
        **envelope(plan, fmt, int(plan.received_at), chunk=False),
        choices=[fmt.choice(state) for state in choices],
        usage=usage_of(plan, choices, num_cached),
    )


def sse(data: BaseModel | str) -> bytes:
    """One server-sent event; a model as its fields were set (a chat delta only says what
    changed), `[DONE]` as it is."""
    text = data if isinstance(data, str) else data.model_dump_json(exclude_unset=True)
    return f"data: {text}\n\n".encode()


def response_headers(tracker: Tracker) -> dict[str, str]:
    headers = tracker.admission.headers()
    headers["x-conveyor-priority"] = str(tracker.plan.priority)
    return {**headers, **fairness_headers(tracker.plan.principal.tenant)}


def stream_error_body() -> ErrorBody:
    detail = ErrorDetail(
        message="The server had an error while generating this response.",
        type="server_error",
        param=None,
        code=None,
    )
    return ErrorBody(error=detail)

"""Tool calls in chat answers: the model's text parsed into `message.tool_calls` (ids
`call_...`, arguments as JSON text) with `finish_reason: "tool_calls"`, and, when streaming,
into deltas as OpenAI sends them: content text, then per call a first delta with its id, type
and name, then argument fragments that concatenate to the arguments."""

from __future__ import annotations

import secrets

from gateway.openai.responses import (
    AssistantMessage,
    ChatChunkChoice,
    ChatDelta,
    FunctionCallOut,
    FunctionDelta,
    ToolCallDeltaOut,
    ToolCallOut,
)
from runtime.structured.tool_parser import ToolCallDelta, ToolCallStream, parse_tool_calls


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_finish_reason(reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and reason == "stop" else reason


def tool_message(text: str) -> tuple[AssistantMessage, int]:
    """(the message, its number of calls) of a whole answer."""
    content, calls = parse_tool_calls(text)
    tool_calls = [
        ToolCallOut(
            id=new_call_id(),
            type="function",
            function=FunctionCallOut(name=c.name, arguments=c.arguments),
        )
        for c in calls
    ]
    message = AssistantMessage(
        role="assistant",
        content=None if tool_calls and not content.strip() else content,
        tool_calls=tool_calls or None,
    )
    return message, len(tool_calls)


class ToolDeltas:
    """One streamed choice's parser and the ids of its calls."""

    def __init__(self) -> None:
        self.stream = ToolCallStream()
        self.call_ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def deltas(self, index: int, new_text: str, finished: bool) -> list[ChatChunkChoice]:
        pieces = self.stream.feed(new_text) + (self.stream.finish() if finished else [])
        pieces = [p for p in pieces if not self.is_separator(p)]
        return [
            ChatChunkChoice(index=index, delta=self.delta(p), logprobs=None, finish_reason=None)
            for p in pieces
        ]

    def is_separator(self, piece: ToolCallDelta) -> bool:
        """Whitespace between or after calls is no content."""
        return piece.index is None and self.num_calls > 0 and not piece.content.strip()

    def delta(self, piece: ToolCallDelta) -> ChatDelta:
        if piece.index is None:
            return ChatDelta(content=piece.content)
        if piece.name is not None:
            self.call_ids.append(new_call_id())
            call = ToolCallDeltaOut(
                index=piece.index,
                id=self.call_ids[piece.index],
                type="function",
                function=FunctionDelta(name=piece.name, arguments=""),
            )
        else:
            call = ToolCallDeltaOut(
                index=piece.index, function=FunctionDelta(arguments=piece.arguments)
            )
        return ChatDelta(tool_calls=[call])

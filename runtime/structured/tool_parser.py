"""Reading tool calls back out of the model's text (the format of `tool_format`), as a stream:
text before a call is content, then each call yields its name once and its arguments in
fragments that concatenate to the exact JSON the model wrote. The full answer's parse is the
same stream fed at once."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from runtime.structured.tool_format import CALL_END, TRIGGER

ARGUMENTS_KEY = re.compile(r'^\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCallDelta:
    """A piece of the answer: content text, or the start (name) or arguments of call `index`."""

    index: int | None = None  # None: content
    name: str | None = None
    arguments: str = ""
    content: str = ""


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallStream:
    """Feed text as it is generated; get the deltas that are certain so far."""

    state: str = "text"  # text -> header -> arguments -> text ...
    buffer: str = ""
    num_calls: int = 0
    calls: list[ParsedToolCall] = field(default_factory=list)
    content: str = ""

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.buffer += text
        deltas: list[ToolCallDelta] = []
        while True:
            step = {"text": self._text, "header": self._header, "arguments": self._arguments}
            delta, progressed = step[self.state]()
            if delta is not None:
                deltas.append(delta)
            if not progressed:
                return deltas

    def finish(self) -> list[ToolCallDelta]:
        """At the end: whatever was held back (a cut call keeps its partial arguments)."""
        rest, self.buffer = self.buffer, ""
        if not rest or self.state == "header":
            return []
        if self.state == "arguments":
            self.calls[-1].arguments += rest
            return [ToolCallDelta(index=self.num_calls - 1, arguments=rest)]
        self.content += rest
        return [ToolCallDelta(content=rest)]

    def _text(self) -> tuple[ToolCallDelta | None, bool]:
        start = self.buffer.find(TRIGGER)
        if start >= 0:
            before, self.buffer = self.buffer[:start], self.buffer[start + len(TRIGGER) :]
            self.state = "header"
            return self._content(before), True
        held = held_back(self.buffer, TRIGGER)
        emitted, self.buffer = (
            self.buffer[: len(self.buffer) - held],
            self.buffer[len(self.buffer) - held :],
        )
        return self._content(emitted), False

    def _content(self, text: str) -> ToolCallDelta | None:
        if not text:
            return None
        self.content += text
        return ToolCallDelta(content=text)

    def _header(self) -> tuple[ToolCallDelta | None, bool]:
        match = ARGUMENTS_KEY.match(self.buffer)
        if match is None:
            return None, False
        name = json.loads(match.group(1))
        self.buffer = self.buffer[match.end() :]
        self.calls.append(ParsedToolCall(name, ""))
        self.num_calls += 1
        self.state = "arguments"
        return ToolCallDelta(index=self.num_calls - 1, name=name), True

    def _arguments(self) -> tuple[ToolCallDelta | None, bool]:
        end = self.buffer.find(CALL_END)
        if end >= 0:
            fragment, self.buffer = self.buffer[:end], self.buffer[end + len(CALL_END) :]
            self.state = "text"
            return self._argument_delta(fragment), True
        held = held_back(self.buffer, CALL_END)
        cut = len(self.buffer) - held
        fragment, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return self._argument_delta(fragment), False

    def _argument_delta(self, fragment: str) -> ToolCallDelta | None:
        if not fragment:
            return None
        self.calls[-1].arguments += fragment
        return ToolCallDelta(index=self.num_calls - 1, arguments=fragment)


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of text that is the start of marker (it may still come)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(content, calls) of a whole answer."""
    stream = ToolCallStream()
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls

"""How tool calls look in the model's text, the one format that the prompt teaches, the grammar
enforces and the parser reads (Hermes style, as Qwen and many open models write it):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar is an xgrammar structural tag: one tag per function whose begin fixes the name and
whose content is the function's parameters schema. `auto` allows text and tool calls (the
trigger `<tool_call>` starts one), `required` and a named function force calls only (at least
one, from the first token, separated by newlines), and without parallel tool calls the answer
ends after the first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runtime.structured.schema_rules import GrammarError, check_schema
from scheduler.request import GrammarSpec

TRIGGER = "<tool_call>"
CALL_END = "}\n</tool_call>"  # the arguments' object, then the outer object's brace
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_ARGUMENT_WHITESPACE = 1  # a small model left free would pad with newlines until max_tokens


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def as_prompt_json(self) -> str:
        described = {"name": self.name, "description": self.description or ""}
        return json.dumps({**described, "parameters": self.parameters})


def call_begin(name: str) -> str:
    """The text before a call's arguments: everything the grammar fixes once the name is chosen."""
    return f'{TRIGGER}\n{{"name": {json.dumps(name)}, "arguments": '


def render_tool_call(name: str, arguments: str) -> str:
    """An earlier call, as the model would have written it (assistant messages in a history)."""
    return f"{call_begin(name)}{arguments}{CALL_END}"


def check_tools(functions: list[ToolFunction]) -> None:
    for i, function in enumerate(functions):
        where = f"tools.{i}.function.parameters"
        try:
            check_schema(function.parameters, where)
        except GrammarError as error:
            raise GrammarError(str(error), where, error.code) from None


def tool_call_spec(
    functions: list[ToolFunction], choice: str, parallel: bool = True
) -> GrammarSpec:
    """choice: "auto", "required", or the name of the one function to call."""
    check_tools(functions)
    forced = choice != "auto"
    chosen = (
        functions if choice in ("auto", "required") else [f for f in functions if f.name == choice]
    )
    tags = [
        {
            "type": "tag",
            "begin": call_begin(f.name),
            "content": {
                "type": "json_schema",
                "json_schema": f.parameters,
                "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE,
            },
            "end": CALL_END,
        }
        for f in chosen
    ]
    if not tags:
        raise GrammarError(f"no function named '{choice}' in tools", "tool_choice")
    one_call = not parallel or choice not in ("auto", "required")
    if forced:  # calls only, one after the other: no text before, between or after them
        tag_format = {"type": "tags_with_separator", "tags": tags, "separator": "\n"}
    else:
        tag_format = {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags}
    tag_format |= {"at_least_one": forced, "stop_after_first": one_call}
    structural_tag = {"type": "structural_tag", "format": tag_format}
    return GrammarSpec("structural_tag", json.dumps(structural_tag, sort_keys=True))


def tools_system_prompt(functions: list[ToolFunction]) -> str:
    """The system section that describes the tools, for templates that do not render them."""
    listed = "\n".join(f.as_prompt_json() for f in functions)
    return (
        "You may call one or more functions to assist with the user query. The functions:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, answer with its name and JSON arguments in this exact format:\n"
        f'{TRIGGER}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n'
        "</tool_call>"
    )


def with_tools_prompt(messages: list[dict], functions: list[ToolFunction]) -> list[dict]:
    """The messages with the tools described in the (first) system message."""
    section = tools_system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{section}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]

"""OpenAI-style `response_format`, `tools` and `tool_choice` as plain JSON (a line of
`conveyor generate`) -> the GrammarSpec and the messages with the tools described; the HTTP API
reads the same fields through its pydantic models (gateway/openai/structured.py)."""

from __future__ import annotations

import json
from typing import Any

from runtime.structured.schema_rules import GrammarError
from runtime.structured.tool_format import (
    EMPTY_PARAMETERS,
    ToolFunction,
    render_tool_call,
    tool_call_spec,
    with_tools_prompt,
)
from scheduler.request import GrammarSpec


def tool_functions(tools: Any) -> list[ToolFunction]:
    if not isinstance(tools, list):
        raise GrammarError("tools must be a list", "tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise GrammarError(f"tools[{i}] needs a function with a name", f"tools.{i}.function")
        parameters = function.get("parameters")
        functions.append(
            ToolFunction(
                function["name"],
                function.get("description"),
                EMPTY_PARAMETERS if parameters is None else parameters,
            )
        )
    return functions


def tool_choice_name(data: dict) -> str | None:
    """ "auto", "required" or a function's name while tools are in play; None otherwise."""
    choice = data.get("tool_choice", "auto")
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name")
    if not data.get("tools") or choice == "none":
        return None
    if not isinstance(choice, str):
        raise GrammarError("tool_choice must be none, auto, required or a named function")
    return choice


def grammar_of(data: dict) -> GrammarSpec | None:
    choice = tool_choice_name(data)
    if choice is not None:
        parallel = data.get("parallel_tool_calls", True) is not False
        return tool_call_spec(tool_functions(data["tools"]), choice, parallel)
    response_format = data.get("response_format") or {"type": "text"}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is None:
            return GrammarSpec("json_object")
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))
    if kind != "text":
        raise GrammarError("response_format type must be text, json_object or json_schema")
    return None


def template_messages(data: dict) -> list[dict]:
    """The line's messages for the chat template: earlier tool calls written as the model
    writes them, and the tools described in the system message while they are in play."""
    messages = [_template_message(m) for m in data["messages"]]
    if tool_choice_name(data) is None:
        return messages
    return with_tools_prompt(messages, tool_functions(data["tools"]))


def _template_message(message: Any) -> Any:
    if not isinstance(message, dict) or not message.get("tool_calls"):
        return message
    calls = "".join(
        render_tool_call(call["function"]["name"], call["function"]["arguments"])
        for call in message["tool_calls"]
    )
    return {"role": message["role"], "content": (message.get("content") or "") + calls}

"""A request's grammar: `response_format` (json_object, json_schema) or `tools` with
`tool_choice` become a GrammarSpec, compiled (or found in the cache) by the engine client on a
worker thread before admission; the tools are described to the model in the prompt. A schema
the grammar cannot enforce, an invalid one, one whose compiled grammar passes the tenant's
`max_grammar_bytes`, and a named `tool_choice` not among `tools` are 400s naming the field.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.appkeys import ENGINE_CLIENT, METRICS, PRINCIPAL
from gateway.errors import bad_request
from gateway.openai.schemas import ChatCompletionRequest, SamplingFields
from runtime.structured.compiler import PreparedGrammar
from runtime.structured.schema_rules import GrammarError
from runtime.structured.tool_format import (
    EMPTY_PARAMETERS,
    ToolFunction,
    tool_call_spec,
    with_tools_prompt,
)
from scheduler.request import GrammarSpec

SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass
class GrammarPlan:
    """What a constrained request runs under, and what its preparation cost (for the audit)."""

    spec: GrammarSpec
    prepared: PreparedGrammar
    source: str  # "json_object", "json_schema" or "tools"
    prepared_at: float  # monotonic
    wall_s: float  # waiting for it, compile and hand-off included

    def event(self) -> dict[str, Any]:
        return {
            "kind": "grammar_prepared",
            "time": self.prepared_at,
            "grammar": self.source,
            "compile_ms": round(self.prepared.compile_s * 1000, 3),
            "cache_hit": self.prepared.cache_hit,
            "size_bytes": self.prepared.size_bytes,
        }


def tool_functions(body: ChatCompletionRequest) -> list[ToolFunction]:
    return [
        ToolFunction(
            t.function.name,
            t.function.description,
            EMPTY_PARAMETERS if t.function.parameters is None else t.function.parameters,
        )
        for t in body.tools or []
    ]


def tool_choice(body: SamplingFields) -> str | None:
    """ "auto", "required" or a function's name while tools are in play; None otherwise."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    choice = body.tool_choice
    name = None if choice is None or isinstance(choice, str) else choice.function.name
    if not body.tools:
        if choice in (None, "none", "auto"):
            return None
        raise bad_request(
            f"tool_choice '{name or choice}' needs tools to choose from.", param="tool_choice"
        )
    if choice == "none":
        return None
    if name is not None and name not in {t.function.name for t in body.tools}:
        raise bad_request(f"tool_choice names '{name}', which is not among tools.", "tool_choice")
    return name or choice or "auto"


def grammar_spec(body: SamplingFields, choice: str | None) -> tuple[GrammarSpec, str] | None:
    """(spec, source) of the body's constraint, or None for free text; choice: the body's
    `tool_choice(body)`, decided once per request."""
    response_format = body.response_format
    if choice is not None:
        if response_format is not None and response_format.type != "text":
            message = "response_format must be text while tools are in play."
            raise bad_request(message, param="response_format")
        parallel = body.parallel_tool_calls is not False
        return _tools_spec(body, choice, parallel), "tools"
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_object"), "json_object"
    schema = response_format.json_schema.schema_
    if schema is None:
        return GrammarSpec("json_object"), "json_schema"
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True)), "json_schema"


def _tools_spec(body: ChatCompletionRequest, choice: str, parallel: bool) -> GrammarSpec:
    try:
        return tool_call_spec(tool_functions(body), choice, parallel)
    except GrammarError as error:
        raise bad_request(str(error), param=error.param or "tools", code=error.code) from None


def template_messages(
    body: ChatCompletionRequest, choice: str | None, template_renders_tools: bool = False
) -> list[dict[str, str]]:
    """The messages for the chat template, the tools described in the system message when
    they are in play and the template has no place for them (SmolLM2's, like many); a template
    that renders tools itself (Qwen's) gets them from `template_tools`."""
    messages = [message.as_template_message() for message in body.messages]
    if choice is None or template_renders_tools:
        return messages
    return with_tools_prompt(messages, tool_functions(body))


def template_tools(body: ChatCompletionRequest, choice: str | None) -> list[dict[str, Any]] | None:
    """The tools in play, as chat templates take them (OpenAI's shape); None when none are."""
    if choice is None:
        return None
    return [
        {"type": "function", "function": {"name": f.name, "description": f.description or "",
                                          "parameters": f.parameters}}
        for f in tool_functions(body)
    ]  # fmt: skip


async def prepare(request: web.Request, spec: GrammarSpec, source: str) -> GrammarPlan:
    """The grammar compiled (or from the cache), off the event loop; 400 when it cannot."""
    cap = getattr(request[PRINCIPAL].tenant, "max_grammar_bytes", None)
    start = time.monotonic()
    try:
        prepared = await request.app[ENGINE_CLIENT].prepare_grammar(spec, cap)
    except GrammarError as error:
        param = error.param or (SCHEMA_PARAM if source == "json_schema" else "tools")
        if source == "json_object":
            param = "response_format"
        raise bad_request(str(error), param=param, code=error.code) from None
    request.app[METRICS].observe_grammar(source, prepared.compile_s, prepared.cache_hit)
    now = time.monotonic()
    return GrammarPlan(spec, prepared, source, now, now - start)

"""Offline generation: JSONL requests in, JSONL results out (in input order), with a progress bar.

An input line may carry "arrival_time" (seconds after the start): it is submitted then, so a
preemption scenario can be replayed from a file. "response_format", "tools", "tool_choice" and
"parallel_tool_calls" constrain the answer as in the HTTP API; a line with tools in play gets
"tool_calls" (name and JSON arguments) in its result."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from runtime.engine import Engine, RequestError
from runtime.structured.requests import grammar_of, template_messages, tool_choice_name
from runtime.structured.tool_parser import parse_tool_calls
from scheduler.request import Request, SamplingParams

PARAM_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "logprobs",
)


@dataclass
class OfflineItem:
    index: int
    id: str
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    priority: int = 0
    tenant: str = "default"
    arrival_time: float = 0.0
    calls_tools: bool = False
    error: str | None = None
    result: dict[str, Any] | None = None


def parse_line(engine: Engine, index: int, line: str) -> OfflineItem:
    item = OfflineItem(index=index, id=f"line-{index + 1}")
    try:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("each line must be a JSON object")
        item.id = str(data.get("id", item.id))
        item.prompt_token_ids = _prompt_ids(engine, data)
        item.params = _sampling_params(data)
        item.calls_tools = "messages" in data and tool_choice_name(data) is not None
        item.priority = int(data.get("priority", 0))
        item.tenant = str(data.get("tenant", "default"))
        item.arrival_time = float(data.get("arrival_time", 0.0))
        engine.validate(item.prompt_token_ids, item.params)
    except (ValueError, TypeError, KeyError, RequestError) as e:
        item.error = f"line {index + 1}: {e}"
    return item


def _prompt_ids(engine: Engine, data: dict) -> list[int]:
    if "messages" in data:
        return engine.tokenizer.apply_chat_template(template_messages(data))
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError("needs a string 'prompt' or a 'messages' list")
    return engine.tokenizer.encode(prompt)


def _sampling_params(data: dict) -> SamplingParams:
    kwargs = {k: data[k] for k in PARAM_FIELDS if k in data and data[k] is not None}
    if "messages" not in data and data.get("tools"):
        raise ValueError("tools need 'messages'")
    params = SamplingParams(**kwargs, grammar=grammar_of(data))
    params.validate()
    return params


def run_offline(
    engine: Engine, lines: list[str], with_events: bool = False, progress: bool = True
) -> list[dict]:
    items = [parse_line(engine, i, line) for i, line in enumerate(lines) if line.strip()]
    pending = sorted((it for it in items if it.error is None), key=lambda it: it.arrival_time)
    by_request: dict[str, tuple[OfflineItem, Request]] = {}  # the engine runs on this thread
    start = time.monotonic()
    bar = tqdm(total=len(pending), disable=not progress, unit="req", desc="generate")
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_time <= time.monotonic() - start:
            _submit(engine, pending.pop(0), by_request)
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, pending[0].arrival_time - (time.monotonic() - start))))
            continue
        for output in engine.step():
            if output.finished:
                item, request = by_request[output.request_id]
                item.result = _result(item, request, start, with_events)
                bar.update(1)
    bar.close()
    return [_line_out(it) for it in items]


def _submit(engine: Engine, item: OfflineItem, by_request: dict) -> None:
    request_id = f"{item.index}:{item.id}"
    try:
        request = engine.add_request(
            item.prompt_token_ids,
            item.params,
            request_id=request_id,
            priority=item.priority,
            tenant=item.tenant,
        )
        by_request[request_id] = (item, request)
    except RequestError as e:
        item.error = f"line {item.index + 1}: {e}"


def _result(item: OfflineItem, request, start: float, with_events: bool) -> dict:
    result = {
        "id": item.id,
        "text": request.output_text,
        "token_ids": list(request.output_token_ids),
        "finish_reason": request.finish_reason,
        "prompt_tokens": request.num_prompt_tokens,
        "completion_tokens": request.num_output_tokens,
    }
    if item.calls_tools:
        content, calls = parse_tool_calls(request.output_text)
        result["text"] = content
        result["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
        if calls and request.finish_reason == "stop":
            result["finish_reason"] = "tool_calls"
    if with_events:
        result["events"] = [
            {**e.to_dict(), "time": round(e.time - start, 6)} for e in request.events
        ]
    return result


def _line_out(item: OfflineItem) -> dict:
    if item.error is not None:
        return {"id": item.id, "error": item.error}
    return item.result

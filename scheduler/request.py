"""The one mutable truth about a request: what was asked, where it stands, what it produced.

The scheduler writes scheduling state; the runtime reads it and appends sampled tokens.
No torch here: the scheduler must stay a pure-Python state machine.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap-out: its KV blocks live in the CPU pool
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        self.is_finished = value.startswith("finished")  # a plain attribute: read per request


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message and `param` name the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"'{param}' {message}")
        self.param = param


@dataclass(frozen=True)
class Bound:
    """The range of one sampling parameter: [low, high], either end open or absent. The one
    declaration that `SamplingParams.validate` and the HTTP API's pydantic fields both read."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if value != value:  # NaN
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"must be in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"

    def field_constraints(self) -> dict[str, float]:
        """pydantic `Field` keywords: ge/gt, le/lt."""
        constraints = {}
        if self.low is not None:
            constraints["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            constraints["lt" if self.high_open else "le"] = self.high
        return constraints


GRAMMAR_KINDS = ("json_object", "json_schema", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: any JSON object, a JSON schema, or an xgrammar
    structural tag (tool calls), as JSON text. Compiled and matched by `runtime.structured`."""

    kind: str
    text: str = ""  # the schema or structural tag as JSON; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise SamplingParamsError("grammar", f"kind must be one of {', '.join(GRAMMAR_KINDS)}")


MAX_N = 8
MAX_LOGPROBS = 20
SAMPLING_BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1),
    "temperature": Bound(0.0, 2.0),
    "top_p": Bound(0.0, 1.0, low_open=True),
    "top_k": Bound(-1),  # -1 or 0: off
    "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, 10.0, low_open=True),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "n": Bound(1, MAX_N),
}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; 0 = only the chosen one
    n: int = 1
    grammar: GrammarSpec | None = None  # constrained decoding (structured outputs, tool calls)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not bound.contains(value):
                raise SamplingParamsError(name, bound.describe())
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop", "must be non-empty strings")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"must be token ids below {vocab_size}")
        if self.grammar is not None:
            self._validate_grammar()

    def _validate_grammar(self) -> None:
        """A constrained answer ends where its grammar says, with an end-of-sequence token."""
        if not isinstance(self.grammar, GrammarSpec):
            raise SamplingParamsError("grammar", "must be a GrammarSpec")
        if self.ignore_eos:
            raise SamplingParamsError(
                "ignore_eos",
                "cannot be true with a response_format or tools: a constrained "
                "answer ends with the end-of-sequence token",
            )


_request_counter = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower = more urgent
    tenant: str = "default"
    weight: float = 1.0  # tenant fair-share weight
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or queued to be)
    num_pending_tokens: int = 0  # sampled by a launched step, not yet seen by the host
    num_cached_prefix_tokens: int = 0  # prefix-cache hits at the last admission
    block_ids: list[int] = field(default_factory=list)  # GPU block table
    block_hashes: list[int] = field(default_factory=list)  # hash chain of its full blocks
    cpu_block_ids: list[int] = field(default_factory=list)  # while swapped
    num_preemptions: int = 0
    # what the runner's batch holds of it, as the scheduler told it (SchedulerOutput)
    has_row: bool = False
    num_told_tokens: int = 0
    num_told_blocks: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    events: list[Any] = field(default_factory=list)
    seq: int = field(default_factory=lambda: next(_request_counter))  # FIFO tie-breaker
    output_text: str = ""
    first_scheduled_time: float | None = None
    preempted_mode: str | None = None  # "swap" or "recompute" while preempted
    admitted_priority: int | None = None  # effective (aged) priority when last admitted
    wait_reason: str | None = None  # last recorded reason it could not be scheduled
    # speculative decoding: drafts verified for it, and how many were accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

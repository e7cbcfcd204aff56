"""One step's `SchedulerOutput`: what the scheduler decided and what the runner must apply.

The scheduler tells, the runner applies: besides the tokens scheduled for each request, the
output lists the rows that join the persistent batch (new requests, and requests resumed after
a preemption, with all their tokens and blocks), the tokens and blocks appended to the rows the
batch already holds, and the requests that left it (finished or aborted, preempted). The runner
never compares its rows with the live requests to find out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request, SamplingParams


@dataclass(slots=True)
class NewRow:
    """A request joining the batch: everything its row holds, copied."""

    request_id: str
    token_ids: list[int]  # prompt and output tokens known to the host
    num_prompt_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams


@dataclass(slots=True)
class RowAppend:
    """What a row already in the batch gained since the step that last scheduled it."""

    request_id: str
    token_ids: list[int]  # output tokens appended since (not the pending one: it is on the device)
    block_ids: list[int]  # blocks allocated since
    first_block: int  # the row's table column of block_ids[0] (fewer than it holds after a trim)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num tokens)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    preempted: list[Request] = field(default_factory=list)
    budget: int = 0
    # what the runner's batch applies, in this order: leave, join, append
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since
    new_rows: list[NewRow] = field(default_factory=list)
    appends: list[RowAppend] = field(default_factory=list)
    # speculative decoding: a steady decode's drafts, verified as extra query positions
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def new_row(request: Request) -> NewRow:
    return NewRow(
        request.request_id,
        request.all_token_ids,
        request.num_prompt_tokens,
        list(request.block_ids),
        request.sampling_params,
    )

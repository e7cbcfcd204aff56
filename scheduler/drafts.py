"""Speculative drafts in a step: after every normal token is scheduled, the steady decodes may
get drafts, extra query positions verified in the same forward pass.

Drafts take only what is left: the step's token budget after the normal tokens, and blocks that
are free (a draft never preempts anyone). Their KV slots are allocated like a prefill chunk's,
but only blocks full of known tokens are ever hashed into the prefix cache, so a draft never
enters it. When the step lands, a row keeps the KV of its accepted drafts (they are its next
tokens) and the blocks wholly past its tokens go back (`BlockManager.trim`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scheduler.block_manager import BlockManager
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus


class Drafter(Protocol):
    """What proposes drafts (runtime/spec): it chooses each row's k and fills the drafts."""

    def propose(
        self,
        rows: Sequence[Request],
        max_ks: Sequence[int],
        num_rows: int,
        num_tokens: int,
        token_budget_left: int,
    ) -> list[list[int]]:
        """rows: steady decodes; max_ks: the most drafts each may take; num_rows, num_tokens:
        the step as scheduled without drafts. -> drafts per row (empty: none)."""
        ...


def schedule_drafts(
    out: SchedulerOutput, drafter: Drafter, block_manager: BlockManager, max_model_len: int
) -> None:
    rows = [r for r, num_new in out.scheduled if num_new == 1 and is_steady_decode(r)]
    if not rows or out.budget <= 0:
        return
    max_ks = [max_drafts(r, max_model_len) for r in rows]
    drafts = drafter.propose(rows, max_ks, len(out.scheduled), out.num_scheduled_tokens, out.budget)
    for request, draft, max_k in zip(rows, drafts, max_ks):
        room = min(max_k, out.budget, slots_left(request, block_manager))
        draft = list(draft[:room])
        if draft and block_manager.allocate(request, 1 + len(draft)):
            out.draft_token_ids[request.request_id] = draft
            out.budget -= len(draft)


def is_steady_decode(request: Request) -> bool:
    """Running, one token to compute (its last), none in flight: drafts can follow it."""
    return (
        request.status is RequestStatus.RUNNING
        and request.num_pending_tokens == 0
        and request.num_computed_tokens == request.num_tokens - 1
    )


def max_drafts(request: Request, max_model_len: int) -> int:
    """A row with k drafts appends up to k + 1 tokens: stay within max_tokens and the length."""
    params = request.sampling_params
    return max(
        0,
        min(
            params.max_tokens - request.num_output_tokens - 1,
            max_model_len - request.num_tokens - 1,
        ),
    )


def slots_left(request: Request, block_manager: BlockManager) -> int:
    """Draft positions the request's blocks and the free blocks hold after its next token."""
    num_slots = (
        len(request.block_ids) + block_manager.num_free_gpu_blocks
    ) * block_manager.block_size
    return max(0, num_slots - request.num_computed_tokens - 1)


def land_drafts(request: Request, num_new_tokens: int, block_manager: BlockManager) -> None:
    """A drafted row landed with num_new_tokens (its accepted drafts and one more): the accepted
    drafts' KV is in the cache; blocks past its tokens go back, and its row is told again from
    the first block it lost."""
    request.num_computed_tokens += num_new_tokens - 1
    if request.is_finished:
        return
    block_manager.trim(request, request.num_tokens)
    request.num_told_blocks = min(request.num_told_blocks, len(request.block_ids))

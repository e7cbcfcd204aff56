"""Drafts from a draft model: per row, catch up on the tokens its draft cache lacks, then k - 1
greedy decode steps, batched across the rows that draft.

A row's draft cache holds the KV of `num_computed` tokens: its true tokens, then `tail`, the
drafts it fed itself last time, not verified yet. On the next call the tail is matched against
the row's tokens; what the target rejected is rolled back by counting fewer tokens as computed,
and the catch-up writes the true ones over them. The catch-up's last position gives the first
draft, so a row with k drafts costs its catch-up and k - 1 one-token steps. The catch-ups of a
call share a token budget (the engine's --max-batch-tokens), as prefill chunks do: a row with a
long prompt to catch up on takes it in chunks over several steps, without drafts until done. A
new row starts from the longest prefix the draft cache holds (draft_model.py), and every full
block of true tokens it writes is registered there. With --draft-prompt-lookup a row whose last
tokens occurred before takes the k tokens that followed them instead (no forward pass); its
draft cache catches up the next time the model drafts for it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.spec.draft_model import Chunk, DraftModel
from runtime.spec.policy import NO_DRAFT_WORK, DraftCost, DraftWork
from runtime.spec.proposer import NgramConfig, NgramProposer, TokenHistories
from scheduler.block_pool import chain_hashes
from scheduler.request import Request

STEADY_CATCH_UP = 2  # tokens a row catches up on after a verify (see _observe_cost)
DRAFT_LOOKUP_MIN_NGRAM = 3  # --draft-prompt-lookup: the shortest match that replaces the model


@dataclass
class DraftRow:
    """What a row's draft cache holds: num_computed tokens, the last len(tail) of them drafts;
    the hashes of its first full blocks of true tokens, registered in the cache."""

    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    tail: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    # with a vocabulary subset: the ids of its tokens outside it, from its first num_scanned
    rare_ids: set[int] = field(default_factory=set)
    num_scanned: int = 0

    def num_valid(self, token_ids: list[int]) -> int:
        """Tokens of the row's history whose KV the cache holds (the tail's accepted drafts)."""
        base = self.num_computed - len(self.tail)
        num_matched = 0
        for drafted, true in zip(self.tail, token_ids[base:]):
            if drafted != true:
                break
            num_matched += 1
        return base + num_matched

    def catch_up_start(self, token_ids: list[int]) -> int:
        """Where the next catch-up starts: past the valid tokens, and never past the last token
        (it is always fed: it gives the first draft)."""
        return min(self.num_valid(token_ids), len(token_ids) - 1)


@dataclass(slots=True)
class RowPlan:
    """A row's work in this call: catch up on token_ids[start:end], then k drafts (k = 0: a
    chunk of a long catch-up, no drafts yet)."""

    row: DraftRow
    token_ids: list[int]
    start: int
    end: int
    k: int


class DraftModelProposer:
    def __init__(
        self,
        draft: DraftModel,
        num_speculative_tokens: int,
        cost: DraftCost | None = None,
        max_catch_up_tokens: int = 2048,
        lookup: NgramProposer | None = None,
    ) -> None:
        self.draft = draft
        self.num_speculative_tokens = num_speculative_tokens
        self.max_catch_up_tokens = max_catch_up_tokens
        self.cost = cost if cost is not None else DraftCost()
        self.rows: dict[str, DraftRow] = {}  # request id -> its draft cache
        self.lookup = lookup  # prompt lookup tried first (--draft-prompt-lookup)
        # the model alone: whether a row's text repeats (DraftWork.repeats), a match as short as
        # the lookup's (with the lookup, such a row takes its drafts and no model pass)
        self.repeat_matcher = None
        if lookup is None:
            config = NgramConfig(
                DRAFT_LOOKUP_MIN_NGRAM, DRAFT_LOOKUP_MIN_NGRAM, num_speculative_tokens
            )
            self.repeat_matcher = NgramProposer(config)
        shortest = lookup.config.ngram_min if lookup is not None else DRAFT_LOOKUP_MIN_NGRAM
        self.histories = TokenHistories(shortest)  # the rows' tokens, for the lookup

    def propose_rows(
        self, requests: Sequence[Request], ks: Sequence[int], probing: Sequence[bool] = ()
    ) -> list[list[int]]:
        """requests[i] wants up to ks[i] drafts. -> drafts per row (empty: k = 0, or no room in
        the draft cache or the draft model's length). A probe drafts as any row (the policy
        prices a draft model's probes)."""
        drafts = [self._looked_up(request, k) for request, k in zip(requests, ks)]
        pending = [i for i, draft in enumerate(drafts) if draft is None]
        if pending:
            modelled = self._propose_with_model(
                [requests[i] for i in pending], [ks[i] for i in pending]
            )
            for i, draft in zip(pending, modelled):
                drafts[i] = draft
        return drafts

    def draft_work(self, request: Request) -> DraftWork:
        """No forward pass where prompt lookup would serve the row's drafts. Otherwise the
        model's, and first the tokens the row's draft cache must compute beyond the one or two a
        steady step's rows catch up on: what a row back after steps at k = 0 costs more; none
        for a row without a cache yet (its prompt: a one-off, mostly in the prefix cache).
        Whether the row's last tokens occurred before (without the lookup: the model drafts)."""
        if self._looked_up(request, 1) is not None:
            return NO_DRAFT_WORK
        repeats = self._repeats(request)
        row = self.rows.get(request.request_id)
        if row is None:
            return DraftWork(by_model=True, repeats=repeats)
        token_ids = request.all_token_ids
        behind = len(token_ids) - row.catch_up_start(token_ids)
        catch_up = max(behind - STEADY_CATCH_UP, 0)
        return DraftWork(by_model=True, catch_up_tokens=catch_up, repeats=repeats)

    def _repeats(self, request: Request) -> bool:
        matcher = self.repeat_matcher
        return matcher is not None and matcher.match(self.histories.of(request)).start >= 0

    def _looked_up(self, request: Request, k: int) -> list[int] | None:
        """The k tokens that followed an earlier occurrence of the row's last tokens, or None."""
        if self.lookup is None or k <= 0:
            return None
        found = self.lookup.propose_one(self.histories.of(request), k)
        return found if len(found) == k else None

    def _propose_with_model(
        self, requests: Sequence[Request], ks: Sequence[int]
    ) -> list[list[int]]:
        started = time.perf_counter()
        plans, budget = [], self.max_catch_up_tokens
        for request, k in zip(requests, ks):
            plan = self._plan(request, k, budget)
            plans.append(plan)
            if plan is not None:
                budget -= plan.end - plan.start
        active = sorted((p for p in plans if p is not None), key=lambda p: -p.k)
        if not active:
            return [[] for _ in requests]
        drafts = [draft[: plan.k] for plan, draft in zip(active, self._run(active))]
        for plan, draft in zip(active, drafts):
            plan.row.num_computed = plan.end + max(plan.k - 1, 0)
            plan.row.tail = draft[: plan.k - 1]
            self._register(plan)
        self._observe_cost(active, time.perf_counter() - started)
        by_plan = {id(plan): draft for plan, draft in zip(active, drafts)}
        return [by_plan.get(id(plan), []) for plan in plans]

    def _plan(self, request: Request, k: int, budget: int) -> RowPlan | None:
        token_ids = request.all_token_ids
        k = min(k, self.num_speculative_tokens, self.draft.max_len - len(token_ids) + 1)
        if k <= 0 or budget <= 0:
            return None
        row = self.rows.get(request.request_id) or self._new_row(request.request_id, token_ids)
        start = row.catch_up_start(token_ids)
        end = min(len(token_ids), start + budget)
        if end < len(token_ids):
            k = 0  # a chunk of a long catch-up
        num_slots = end + max(k - 1, 0)  # the catch-up, then k - 1 drafts fed back
        if not self._grow(row, -(-num_slots // self.draft.block_size)):
            return None
        return RowPlan(row, token_ids, start, end, k)

    def _new_row(self, request_id: str, token_ids: list[int]) -> DraftRow:
        """A row starting from the longest cached prefix of its tokens (its last token left to
        compute: it gives the first draft)."""
        row = self.rows[request_id] = DraftRow()
        if self.draft.prefix_caching:
            num_full = (len(token_ids) - 1) // self.draft.block_size
            chain_hashes(
                token_ids, self.draft.block_size, num_full * self.draft.block_size, row.block_hashes
            )
            for block_id in self.draft.pool.lookup(row.block_hashes):
                self.draft.pool.touch(block_id)
                row.block_ids.append(block_id)
            row.num_computed = len(row.block_ids) * self.draft.block_size
        return row

    def _grow(self, row: DraftRow, num_blocks: int) -> bool:
        """Extend the row's blocks to num_blocks; False (and nothing taken) when too few are
        free."""
        missing = num_blocks - len(row.block_ids)
        if missing > self.draft.pool.num_free_blocks:
            return False
        row.block_ids.extend(self.draft.pool.take() for _ in range(missing))
        return True

    def _register(self, plan: RowPlan) -> None:
        """The full blocks of the row's true tokens (those before its drafts) into the cache."""
        if not self.draft.prefix_caching:
            return
        row, block_size = plan.row, self.draft.block_size
        chain_hashes(plan.token_ids, block_size, plan.end, row.block_hashes)
        first = plan.start // block_size  # those before: registered by an earlier call
        for i in range(first, plan.end // block_size):
            self.draft.pool.register(row.block_ids[i], row.block_hashes[i])

    def _run(self, plans: list[RowPlan]) -> list[list[int]]:
        """plans: sorted by k, largest first, so the rows of each decode step are a prefix."""
        device = self.draft.device
        seen = self._seen(plans)
        catch_up = [t for p in plans for t in p.token_ids[p.start : p.end]]
        chunks = [Chunk(p.row.block_ids, p.start, p.end - p.start) for p in plans]
        tokens = self.draft.greedy_next(torch.tensor(catch_up, device=device), chunks, seen)
        steps = [tokens]  # [num_rows_drafting_j] per draft position j, on the device
        for j in range(1, plans[0].k):
            num_rows = sum(p.k > j for p in plans)
            chunks = [Chunk(p.row.block_ids, len(p.token_ids) + j - 1, 1) for p in plans[:num_rows]]
            tokens = self.draft.greedy_next(tokens[:num_rows], chunks, seen)
            steps.append(tokens)
        flat = torch.cat(steps).tolist()  # the one copy back
        drafts: list[list[int]] = [[] for _ in plans]
        offset = 0
        for step in steps:
            for row in range(step.shape[0]):
                drafts[row].append(flat[offset + row])
            offset += step.shape[0]
        return drafts

    def _seen(self, plans: list[RowPlan]) -> set[int] | None:
        """With a vocabulary subset: the rows' tokens outside it (each row's scanned once)."""
        vocabulary = self.draft.vocabulary
        if vocabulary is None:
            return None
        seen: set[int] = set()
        for plan in plans:
            row = plan.row
            row.rare_ids |= vocabulary.rare_ids(plan.token_ids[row.num_scanned :])
            row.num_scanned = len(plan.token_ids)
            seen |= row.rare_ids
        return seen

    def _observe_cost(self, plans: list[RowPlan], seconds: float) -> None:
        """A draft's price from steady steps only: each row catching up on at most the two tokens
        a verify leaves (its last accepted draft, not fed back, and the bonus token). A new row's
        first few tokens past the cached prefix, or a row back from steps without drafts, are a
        forward pass over several tokens: the first such one measured (6 tokens of Qwen 0.5B, 30
        ms against a steady 14) held the draft pair at k = 0 for a whole request. Those calls
        price a catch-up token instead: their seconds beyond their drafts' price."""
        num_drafts = sum(p.k for p in plans)
        beyond_steady = sum(p.end - p.start for p in plans) - STEADY_CATCH_UP * len(plans)
        if beyond_steady <= 0:
            self.cost.observe(num_drafts, seconds)
        else:
            drafts_seconds = num_drafts * self.cost.seconds_per_token
            self.cost.observe_catch_up(beyond_steady, seconds - drafts_seconds)

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: its draft blocks go back."""
        self.histories.release(request_id)
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.draft.pool.free(row.block_ids)

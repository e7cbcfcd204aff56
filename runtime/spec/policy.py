"""The "never a loss" policy: each step, choose every row's k (0 included) to maximise goodput,
the expected tokens per second (SmartSpec, arXiv 2406.14066), from each request's measured
acceptance and the engine's measured step cost, under the token budget left after every normal
token is scheduled.

Acceptance: per request, a moving average of the per-draft acceptance rate a (accepted drafts
over drafts tried until the first rejection). With k drafts a row yields in expectation
1 + a + a^2 + ... + a^k tokens, so the j-th draft adds a^j. A draft model's drafts, once a
request has evidence of its own, are planned with a less one standard error
(AcceptanceTracker.planned_rate): where such a draft barely pays for itself (on a CPU its draft
token and verify row cost 0.98 of a plain step) a few early acceptances are no evidence that it
will, and a text whose opening the draft guessed and whose rest it did not cost chat 2-5%
(docs/benchmarks.md, 2026-11-27, afternoon).

Step cost: each step shape's measured seconds, and a line fitted to them where a shape was not
measured (step_cost.StepCostModel). Adding drafts adds tokens only (rows are scheduled anyway),
so the policy adds drafts one at a time where a^j is largest for what it costs, and takes the
number that gave the best goodput within the budget. A full batch (no budget) or a costly token
means k = 0; k = 0 everywhere is no speculation at all. A request takes one draft more than it
has had accepted (AcceptanceTracker.probe_cap): probing costs one verified token, and k grows as
drafts land; two or more rows in a row accepted in full, 3 drafts between them, forget the
failures before them (an answer's preamble missed, its body copies), so k ramps up at once.
A row whose acceptance rate is below `min_acceptance` gets k = 0 whatever the fit says: the
cost model sees only the forward pass, not the proposer's and the verifier's host time, and
its token slope is noisy near zero. A row left at k = 0 relaxes toward the engine's
rate (the slower, the more a failed probe costs: a draft model's more than prompt lookup's),
and after `probe_interval` such steps in a row gets one single-draft probe, so that no
rate stays where it does not pay for want of new evidence. No forced probe is made where even
num_speculative_tokens drafts, all accepted, would not pay (a full batch): its evidence has no use.

A draft model's own forward passes cost time the target's step does not show: `DraftCost`
measures its seconds per drafted token, and each draft the model makes is charged that on top of
the step's predicted cost, so k is chosen from expected tokens / (target step + draft); a row
whose drafts prompt lookup serves (--draft-prompt-lookup) is not (`DraftWork`, per row from the
proposer). A row's first model draft is also charged its catch-up: the tokens its draft cache
lacks beyond a steady step's (a row back after steps at k = 0 catches up on all of them), at the
measured seconds per catch-up token. The forced probes pay it unpriced: without them an engine
whose cost fit first said k = 0 stayed there (docs/benchmarks.md, 2026-11-27). Prompt lookup
looks every row up before the policy chooses (a dict read in its n-gram index): a row whose
history has no match gets k = 0 and no probe, one with a match at most the tokens after it
(`DraftWork.most_drafts`), and a forced probe only a long match (`DraftWork.may_probe`). Priced
instead as a lookup per drafting row over the request's match rate, chat's rows without a match
probed on 124 steps of 126 and prompt lookup ran 0.93x (docs/benchmarks.md, 2026-11-29).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from runtime.spec.acceptance import AcceptanceTracker, decayed
from runtime.spec.step_cost import StepCostModel

FIRST_DRAFT_MARGIN = 0.05  # a row's first draft: planned at its rate less this (_best_drafts)


class DraftCost:
    """Measured seconds of the draft model per drafted token, a moving average over steady
    steps; and apart, per token of a catch-up beyond a steady step's (a prompt, a row back after
    steps without drafts), from the calls that had one."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self._drafts = (0.0, 0.0)  # (seconds, drafted tokens), decayed
        self._catch_ups = (0.0, 0.0)  # (seconds, tokens caught up beyond steady), decayed

    def observe(self, num_draft_tokens: int, seconds: float) -> None:
        if num_draft_tokens > 0:
            self._drafts = decayed(self._drafts, self.decay, seconds, num_draft_tokens)

    def observe_catch_up(self, num_tokens: int, seconds: float) -> None:
        """A call whose rows caught up on num_tokens more than steady steps do, in seconds more
        than its drafts cost."""
        if num_tokens > 0:
            self._catch_ups = decayed(self._catch_ups, self.decay, max(seconds, 0.0), num_tokens)

    @property
    def seconds_per_token(self) -> float:
        seconds, tokens = self._drafts
        return seconds / tokens if tokens else 0.0

    @property
    def seconds_per_catch_up_token(self) -> float:
        """Until measured, a drafted token's: a catch-up token is a token of forward pass too."""
        seconds, tokens = self._catch_ups
        return seconds / tokens if tokens else self.seconds_per_token


@dataclass(frozen=True)
class DraftWork:
    """What a row's drafts cost its proposer and how many it has: a forward pass of the draft
    model per draft (by_model), and first the tokens its draft cache lacks beyond a steady
    step's (a row back after steps at k = 0 catches up on all of them). Prompt lookup: neither;
    most_drafts, the tokens after its match (0: none; None: a model's, as many as asked), and
    may_probe, whether a forced probe would draft (its match is long enough). repeats: the row's
    last tokens occurred earlier in its text (it copies), so a draft model's drafts are planned
    at the mean rate, not the cautious one (AcceptanceTracker.planned_rate)."""

    by_model: bool
    catch_up_tokens: int = 0
    repeats: bool = False
    most_drafts: int | None = None
    may_probe: bool = True


class RowPrice(NamedTuple):
    """A row's drafts as the policy prices them (SpeculationPolicy._pricer)."""

    per_draft: float  # the proposer's seconds per draft
    first_draft: float  # and on top for the first
    cautious: bool  # planned at the cautious rate
    most_drafts: int  # the most the proposer has
    may_probe: bool


NO_DRAFT_WORK = DraftWork(by_model=False)


@dataclass(frozen=True)
class RowCandidate:
    request_id: str
    max_k: int  # the most drafts this row may take (num_speculative_tokens, max_tokens left)


class SpeculationPolicy:
    def __init__(
        self,
        num_speculative_tokens: int,
        cost: StepCostModel,
        acceptance: AcceptanceTracker,
        min_acceptance: float = 0.2,
        draft_cost: DraftCost | None = None,
    ):
        self.num_speculative_tokens = num_speculative_tokens
        self.min_acceptance = min_acceptance
        self.cost = cost
        self.acceptance = acceptance
        self.draft_cost = draft_cost  # None: drafts cost the proposer nothing (prompt lookup)
        self.probes: set[int] = set()  # the last choose()'s forced single-draft probes (rows)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(request_id, num_drafted, num_accepted)

    def choose(
        self,
        rows: Sequence[RowCandidate],
        num_rows: int,
        num_tokens: int,
        token_budget_left: int,
        work: Callable[[int], DraftWork] | None = None,
    ) -> list[int]:
        """rows: the decoding rows that may speculate; num_rows, num_tokens: the step as
        scheduled without drafts; work(i): what row i's drafts cost the proposer and how many it
        has (asked only of rows that may draft or probe; None: a model drafts every row, from a
        steady cache).
        -> k per row, maximising expected tokens per second."""
        ks = [0] * len(rows)
        if not rows or token_budget_left <= 0 or not self.cost.is_fitted:
            return ks
        caps = [min(self._cap(row), self.acceptance.probe_cap(row.request_id)) for row in rows]
        price = self._pricer(work)  # asked only of rows that may draft or probe
        drafts = []
        for i, row in enumerate(rows):
            rate = self.acceptance.rate(row.request_id)
            if not caps[i] or rate < self.min_acceptance or not price(i).most_drafts:
                continue
            caps[i] = min(caps[i], price(i).most_drafts)
            planned = self.acceptance.planned_rate(row.request_id, cautious=price(i).cautious)
            drafts.append((i, caps[i], max(rate - FIRST_DRAFT_MARGIN, planned), planned))
        taken = self._best_drafts(drafts, price, num_rows, num_tokens, token_budget_left)
        for i in taken:
            ks[i] += 1
        self._force_probes(rows, ks, price, num_rows, num_tokens, token_budget_left - len(taken))
        return ks

    def _force_probes(
        self,
        rows: Sequence[RowCandidate],
        ks: list[int],
        price: Callable[[int], RowPrice],
        num_rows: int,
        num_tokens: int,
        token_budget_left: int,
    ) -> None:
        """Each row left at k = 0 relaxes (AcceptanceTracker.relax); those it says to probe get
        one draft where drafts could pay at all and the proposer has a probe for the row."""
        probe_cost = self._probe_cost(num_rows, num_tokens)
        worth_probing = None
        self.probes = set()
        for i, row in enumerate(rows):
            if ks[i] or not self.acceptance.relax(row.request_id, probe_cost):
                continue
            if token_budget_left <= 0 or not self._cap(row) or not price(i).may_probe:
                continue
            if worth_probing is None:
                worth_probing = self._drafts_could_pay(num_rows, num_tokens)
            if worth_probing:
                ks[i], token_budget_left = 1, token_budget_left - 1
                self.probes.add(i)

    def _best_drafts(
        self,
        drafts: list[tuple[int, int, float, float]],
        price: Callable[[int], RowPrice],
        num_rows: int,
        num_tokens: int,
        token_budget_left: int,
    ) -> list[int]:
        """drafts: (row, most drafts, its first draft's rate, its planned rate) of each row that
        may draft. -> the rows of the drafts taken, a row once per draft. A row's first draft is
        planned at its rate less FIRST_DRAFT_MARGIN (or the planned rate, if higher), the others
        at the planned rate: one draft costs little
        if it fails (a draft model's token and a verify row, 0.77 of a plain step on a Zen 5),
        and without it a request whose planned rate is cautious gathers no evidence (a copy's
        first request on a Zen 5 stayed at k = 0 after three drafts accepted: 0.92, planned at
        0.81). The margin keeps a draft that only breaks even at the rate from being made.

        Drafts are taken one at a time, the best value first (expected gain a^j over what it
        adds: a verify token and the proposer's seconds), and the best prefix of that order
        wins, not the first whose next draft lowers the goodput: a CPU step costs the same for
        5 to 8 tokens, so 7 drafts can pay where 2 do not (Qwen2.5-Coder-1.5B at one stream, its
        draft model's tokens included: 1 draft, 2 tokens in 53 ms; 2 drafts, 3 in 82; 7 drafts,
        8 in 156). The search stops where even free drafts could not beat the best."""
        if not drafts:
            return []
        token_seconds = max(self.cost.coefficients()[2], 1e-6)
        ks = dict.fromkeys((i for i, *_ in drafts), 0)
        caps = {i: cap for i, cap, *_ in drafts}
        rates = {i: rate for i, *_, rate in drafts}

        def entry(i: int, gain: float) -> tuple[float, int, float, float]:
            row = price(i)
            added = row.per_draft + (row.first_draft if ks[i] == 0 else 0.0)
            return -gain / (token_seconds + added), i, gain, added

        heap = [entry(i, first) for i, _, first, _ in drafts]
        heapq.heapify(heap)
        remaining = sum(
            first * (1.0 + geometric_tail(rate, cap - 1)) for _, cap, first, rate in drafts
        )
        expected = float(num_rows)  # each scheduled row yields one token without drafts
        seconds = self.cost.predict(num_rows, num_tokens)
        best, best_len = expected / seconds, 0
        taken: list[int] = []
        drafting = 0.0  # the proposer's seconds for the drafts taken
        while heap and len(taken) < token_budget_left and (expected + remaining) / seconds > best:
            _, i, gain, added = heapq.heappop(heap)
            ks[i] += 1
            taken.append(i)
            expected, remaining, drafting = expected + gain, remaining - gain, drafting + added
            seconds = self.cost.predict(num_rows, num_tokens + len(taken)) + drafting
            if expected / seconds > best:
                best, best_len = expected / seconds, len(taken)
            if ks[i] < caps[i]:
                heapq.heappush(heap, entry(i, gain * rates[i]))
        return taken[:best_len]

    def _drafts_could_pay(self, num_rows: int, num_tokens: int) -> bool:
        """Whether num_speculative_tokens drafts, every one accepted, would raise the step's
        goodput: where even they would not (a full batch, whose drafts cost a draft model's
        forward passes), a probe's evidence cannot be used, and forced probes are not made. The
        16 first probes of a 16-stream chat cost the draft pair 4% of its time (a 240-token
        catch-up of the draft model, 0.4 s in 10), where drafts at 16 streams never pay. Priced
        on the fitted line: the measured shapes' block beyond the most measured is assumed flat,
        so that a k is tried, and 16 streams made their 16 probes again (0.97x)."""
        k = self.num_speculative_tokens
        per_draft = self.draft_cost.seconds_per_token if self.draft_cost is not None else 0.0
        plain = num_rows / max(self.cost.fitted(num_rows, num_tokens), 1e-9)
        seconds = self.cost.fitted(num_rows, num_tokens + k) + k * per_draft
        return (num_rows + k) / max(seconds, 1e-9) > plain

    def _pricer(self, work: Callable[[int], DraftWork] | None) -> Callable[[int], RowPrice]:
        """Row i -> its RowPrice: a draft model's measured seconds per draft and per catch-up
        token, where the row's drafts need its forward passes, cautious for a draft model's
        drafts on text that does not repeat itself; and how many drafts the proposer has.
        Without work: a model drafts every row, from a steady cache, or (no draft model) drafts
        cost nothing."""
        per_draft = self.draft_cost.seconds_per_token if self.draft_cost is not None else 0.0
        most = self.num_speculative_tokens
        if work is None:
            by_model = self.draft_cost is not None
            steady = RowPrice(per_draft, 0.0, by_model, most, True)
            return lambda i: steady
        per_catch_up = (
            self.draft_cost.seconds_per_catch_up_token if self.draft_cost is not None else 0.0
        )
        priced: dict[int, RowPrice] = {}

        def price(i: int) -> RowPrice:
            if i not in priced:
                row = work(i)
                by_model = row.by_model and self.draft_cost is not None
                priced[i] = RowPrice(
                    per_draft if by_model else 0.0,
                    row.catch_up_tokens * per_catch_up if by_model else 0.0,
                    by_model and not row.repeats,
                    most if row.most_drafts is None else row.most_drafts,
                    row.may_probe,
                )
            return priced[i]

        return price

    def _cap(self, row: RowCandidate) -> int:
        return min(self.num_speculative_tokens, row.max_k)

    def _probe_cost(self, num_rows: int, num_tokens: int) -> float:
        """What one draft more adds to the step, as a share of the step."""
        per_draft = self.draft_cost.seconds_per_token if self.draft_cost is not None else 0.0
        step = self.cost.predict(num_rows, num_tokens)
        return (self.cost.predict(num_rows, num_tokens + 1) + per_draft - step) / max(step, 1e-9)


class FixedK(SpeculationPolicy):
    """Every row that may speculate gets k drafts (capped by its max_k), whatever the budget
    beyond them and the measured costs: tests and experiments, not serving."""

    def __init__(self, k: int):
        super().__init__(k, StepCostModel(), AcceptanceTracker())

    def choose(
        self,
        rows: Sequence[RowCandidate],
        num_rows: int,
        num_tokens: int,
        token_budget_left: int,
        work: Callable[[int], DraftWork] | None = None,
    ) -> list[int]:
        return [self._cap(row) for row in rows]


def geometric_tail(rate: float, count: int) -> float:
    """rate + rate^2 + ... + rate^count: what count drafts at this rate yield in expectation."""
    total, gain = 0.0, 1.0
    for _ in range(count):
        gain *= rate
        total += gain
    return total

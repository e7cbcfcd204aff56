"""The engine's speculation: the scheduler's drafter (each steady decode's k from the policy,
its drafts from the proposer: prompt lookup or a draft model) and what the engine feeds back
after each step (the measured step cost, each verified row's acceptance, preemptions, the
counters)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from runtime.spec.acceptance import AcceptanceTracker
from runtime.spec.draft_model import load_draft_model
from runtime.spec.draft_proposer import DRAFT_LOOKUP_MIN_NGRAM, DraftModelProposer
from runtime.spec.policy import (
    DraftCost,
    DraftWork,
    RowCandidate,
    SpeculationPolicy,
)
from runtime.spec.proposer import (
    Match,
    NgramConfig,
    NgramProposer,
    TokenHistories,
    TokenHistory,
    drafts_after,
)
from runtime.spec.stats import SpecDecodeStats
from runtime.spec.step_cost import StepCostModel
from scheduler.output import SchedulerOutput
from scheduler.request import Request, SamplingParams

PROBE_MIN_NGRAM = 4  # prompt lookup: the shortest match a forced probe drafts after (SmolLM2's
# drafts after a match of one token were accepted 7-22 times in 100, two 75-87, four 96-97)
PROMPT_LOOKUP_PROBE_INTERVAL = 8  # prompt lookup: steps at k = 0 between a row's forced probes


def can_speculate(params: SamplingParams) -> bool:
    """Rows the verifier serves: no penalties (they depend on the tokens before each position),
    no logprobs, no grammar (not advanced per draft position yet)."""
    return (
        params.grammar is None
        and params.logprobs is None
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
        and params.repetition_penalty == 1
    )


class Proposer(Protocol):
    """Fills each row's drafts once the policy chose its k."""

    def propose_rows(
        self, requests: Sequence[Request], ks: Sequence[int], probing: Sequence[bool] = ()
    ) -> list[list[int]]:
        """requests[i] may take up to ks[i] >= 1 drafts -> drafts per row (empty: none).
        probing[i]: the row's draft is the policy's forced probe (not chosen from its rate)."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: what the proposer keeps of it goes."""
        ...

    def draft_work(self, request: Request) -> DraftWork:
        """What the row's drafts would cost: a draft model's forward passes, and its cache's
        catch-up beyond a steady step's (behind after steps without drafts)."""
        ...


class PromptLookup:
    """The n-gram proposer over requests: each row's tokens and their n-gram index kept between
    steps, each row looked up once a step (draft_work, then propose_rows). A forced probe drafts
    only after a match of PROBE_MIN_NGRAM tokens or more: it probes a row whose rate says k = 0
    (its first rows, or failures), and a short match is no evidence that the text now copies (a
    copy's first probe, on its preamble's two-token match, failed, and at 16 streams no request
    drafted again before it ended). A row without a match has no drafts and no probe."""

    def __init__(self, config: NgramConfig) -> None:
        self.ngram = NgramProposer(config, extend_to=PROBE_MIN_NGRAM)
        self.histories = TokenHistories(config.ngram_min)
        self._matches: dict[str, tuple[TokenHistory, int, Match]] = {}  # id -> (history, its
        # length, its match) as last looked up

    def propose_rows(
        self, requests: Sequence[Request], ks: Sequence[int], probing: Sequence[bool] = ()
    ) -> list[list[int]]:
        probing = probing or [False] * len(requests)
        cap = self.ngram.config.num_speculative_tokens
        drafts = []
        for request, k, probe in zip(requests, ks, probing):
            history, match = self._looked_up(request)
            short = probe and match.length < PROBE_MIN_NGRAM
            drafts.append([] if short else drafts_after(history, match, min(k, cap)))
        return drafts

    def draft_work(self, request: Request) -> DraftWork:
        history, match = self._looked_up(request)
        if match.start < 0:
            return NO_LOOKUP_MATCH
        return DraftWork(
            by_model=False,
            most_drafts=len(history) - match.start,
            may_probe=match.length >= PROBE_MIN_NGRAM,
        )

    def _looked_up(self, request: Request) -> tuple[TokenHistory, Match]:
        history = self.histories.of(request)
        known = self._matches.get(request.request_id)
        if known is None or known[0] is not history or known[1] != len(history):
            known = (history, len(history), self.ngram.match(history))
            self._matches[request.request_id] = known
        return history, known[2]

    def release(self, request_id: str) -> None:
        self.histories.release(request_id)
        self._matches.pop(request_id, None)


NO_LOOKUP_MATCH = DraftWork(by_model=False, most_drafts=0, may_probe=False)


class Speculator:
    def __init__(
        self,
        num_speculative_tokens: int,
        proposer: Proposer,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.proposer = proposer
        self.policy = policy or SpeculationPolicy(
            num_speculative_tokens, default_step_cost(), AcceptanceTracker()
        )
        self.stats = SpecDecodeStats(num_speculative_tokens)
        self.num_rows_per_k: dict[int, int] = {}  # the policy's choices, k = 0 included

    # ---- the scheduler's drafter --------------------------------------------------------------
    def propose(
        self,
        rows: Sequence[Request],
        max_ks: Sequence[int],
        num_rows: int,
        num_tokens: int,
        token_budget_left: int,
    ) -> list[list[int]]:
        eligible = [i for i, r in enumerate(rows) if can_speculate(r.sampling_params)]
        candidates = [RowCandidate(rows[i].request_id, max_ks[i]) for i in eligible]
        ks = self.policy.choose(
            candidates, num_rows, num_tokens, token_budget_left,
            work=lambda c: self.proposer.draft_work(rows[eligible[c]]),
        )  # fmt: skip
        drafts: list[list[int]] = [[] for _ in rows]
        for k in ks:
            self.num_rows_per_k[k] = self.num_rows_per_k.get(k, 0) + 1
        drafting = [(c, k) for c, k in enumerate(ks) if k > 0]  # c: the candidate's index
        if drafting:
            requests = [rows[eligible[c]] for c, _ in drafting]
            probing = [c in self.policy.probes for c, _ in drafting]
            proposed = self.proposer.propose_rows(requests, [k for _, k in drafting], probing)
            for (c, _), draft in zip(drafting, proposed):
                drafts[eligible[c]] = draft
        return drafts

    # ---- fed back by the engine ---------------------------------------------------------------
    def observe_step(self, out: SchedulerOutput, launched, launched_at: float) -> None:
        """A landed step (launched: runtime.step.model_runner.LaunchedStep, launched at
        time.perf_counter() launched_at): its measured cost and its rows' acceptance."""
        verified = launched.verified or {}
        for request in out.preempted:  # its draft state goes with its KV (resumed: caught up)
            self.proposer.release(request.request_id)
        if launched.host is not None and is_decode_only(out):
            num_tokens = out.num_scheduled_tokens + sum(map(len, out.draft_token_ids.values()))
            seconds = time.perf_counter() - launched_at
            self.policy.cost.observe(len(out.scheduled), num_tokens, seconds)
        for request, _ in out.scheduled:
            row = verified.get(request.request_id)
            if row is not None:
                self.observe_row(request, row.num_drafts, row.num_accepted)

    def observe_row(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.policy.observe(request.request_id, num_drafts, num_accepted)
        self.stats.record(num_drafts, num_accepted)
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted

    def reset_stats(self) -> None:
        """Benchmarks: count from here (the Prometheus counters never go back)."""
        self.stats = SpecDecodeStats(self.num_speculative_tokens)
        self.num_rows_per_k = {}

    def summary(self) -> dict:
        """What `bench offline` reports: acceptance, mean accepted length, the k chosen."""
        return {
            "acceptance_rate": self.stats.acceptance_rate,
            "mean_accepted_length": self.stats.mean_accepted_length,
            "num_drafts": self.stats.num_drafts,
            "num_draft_tokens": self.stats.num_draft_tokens,
            "num_accepted_tokens": self.stats.num_accepted_tokens,
            "num_rows_per_k": dict(sorted(self.num_rows_per_k.items())),
        }

    def finish(self, request: Request) -> None:
        """A request's last output: its acceptance is forgotten, and its audit trail's last
        event (finished or aborted) carries its drafted and accepted token counts."""
        self.policy.acceptance.release(request.request_id)
        self.proposer.release(request.request_id)
        if request.num_draft_tokens and request.events:
            request.events[-1].data.update(
                num_draft_tokens=request.num_draft_tokens,
                num_accepted_tokens=request.num_accepted_tokens,
            )


def default_step_cost() -> StepCostModel:
    return StepCostModel(keep_drafted_apart=True)


def is_decode_only(out: SchedulerOutput) -> bool:
    """Every row one new token (drafts aside): the steps drafts ride on. A prefill chunk's
    thousands of tokens priced the next token of a decode far too cheap (its cost is a matmul's,
    a decode's is the weights read)."""
    return out.num_scheduled_tokens == len(out.scheduled)


def make_speculator(config, target=None, tokenizer=None) -> Speculator | None:
    """config: runtime.config.EngineConfig. None when speculation is off. target: the engine's
    runtime.step.model_runner.ModelRunner and tokenizer: its Tokenizer (a draft model needs
    them: its device, dtype, cache size and tokenizer must match)."""
    if config.speculative == "off":
        return None
    k = config.num_speculative_tokens
    if config.speculative == "ngram":
        lookup = PromptLookup(NgramConfig(config.ngram_min, config.ngram_max, k))
        tracker = AcceptanceTracker(probe_interval=PROMPT_LOOKUP_PROBE_INTERVAL)
        return Speculator(k, lookup, SpeculationPolicy(k, default_step_cost(), tracker))
    if config.speculative == "draft":
        cost = DraftCost()
        policy = SpeculationPolicy(k, default_step_cost(), AcceptanceTracker(), draft_cost=cost)
        draft = load_draft_model(config, target, tokenizer)
        lookup = None
        if config.draft_prompt_lookup:
            longest = max(DRAFT_LOOKUP_MIN_NGRAM, config.ngram_max)
            lookup = NgramProposer(NgramConfig(DRAFT_LOOKUP_MIN_NGRAM, longest, k))
        proposer = DraftModelProposer(
            draft, k, cost, max_catch_up_tokens=config.max_batch_tokens, lookup=lookup
        )
        return Speculator(k, proposer, policy)
    raise NotImplementedError(f"--speculative {config.speculative} is not served yet")

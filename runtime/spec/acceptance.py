"""Each request's measured acceptance of drafts: the per-draft rate the policy (policy.py) plans
its k with, how many drafts it may probe with, and when a row left at k = 0 probes again."""

from __future__ import annotations

import math

PROMPT_LOOKUP_PROBE_COST = 0.33  # a failed single-draft probe, in plain steps (SmolLM2, 2 cores)
STREAK_ACCEPTED = 3  # drafts the latest full rows (two or more, one of them two drafts or more)
# must have accepted to forget older failures (a copy ramp's k = 1 then 2; single drafts accepted
# by chance, however many in a row: not)


class AcceptanceTracker:
    """Per request, a moving average of the per-draft acceptance rate. A request without evidence
    starts from the engine's: every request's drafts, in a slower moving average (`prior` until
    there is any). Under a workload that copies little (chat) a new request probes once and
    stops; under one that copies much it starts drafting at once."""

    def __init__(
        self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9,
        engine_decay: float = 0.95, relax_decay: float = 0.97, probe_interval: int = 64,
    ):  # fmt: skip
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        # engine_decay: the engine's memory is a few dozen drafted rows, so that it follows a
        # change of workload (copy, then chat) within as many; relax_decay: a row at k = 0
        # forgets its own failures over a few dozen steps, its probes failing at most that often
        self.engine_decay, self.relax_decay = engine_decay, relax_decay
        self.probe_interval = probe_interval
        self._trials: dict[str, tuple[float, float]] = {}  # request id -> (accepted, tried)
        self._waited: dict[str, int] = {}  # request id -> steps at k = 0 since its last probe
        self._streak: dict[str, tuple[int, int]] = {}  # request id -> (drafts accepted, rows)
        # of its latest fully accepted rows in a row
        self._engine_trials = (0.0, 0.0)  # every request's, decayed by engine_decay

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verified row: its drafts were tried up to and including the first rejection."""
        if num_drafted == 0:
            return
        num_tried = num_accepted + (num_accepted < num_drafted)
        self._waited.pop(request_id, None)
        trials = self._trials.get(request_id, (0.0, 0.0))
        self._trials[request_id] = decayed(trials, self.decay, num_accepted, num_tried)
        self._forget_before_a_change(request_id, num_accepted, num_tried)
        self._engine_trials = decayed(
            self._engine_trials, self.engine_decay, num_accepted, num_tried
        )

    def _forget_before_a_change(self, request_id: str, accepted: int, tried: int) -> None:
        """Two or more fully accepted rows in a row with STREAK_ACCEPTED drafts (one row of many
        accepted drafts is a burst, which chat has too): the text turned to copying
        (an answer's preamble missed, then its body copies), so the failures before them are
        forgotten and k ramps up at once instead of over the ten steps the moving average would
        take. Not a run of single drafts: a chat request drafting one token a step at a rate of
        one half lands three in a row every eighth run, and each time its rate went to 0.9 and its
        drafts on with it (35 of 59 steps drafting, 0.98x, docs/benchmarks.md 2026-11-28)."""
        if accepted < tried:
            self._streak.pop(request_id, None)
            return
        streak = self._streak.get(request_id, (0, 0))
        streak = (streak[0] + accepted, streak[1] + 1)
        self._streak[request_id] = streak
        grew = streak[0] > streak[1]  # some row of the streak had two drafts or more
        if streak[1] >= 2 and streak[0] >= STREAK_ACCEPTED and grew:  # keep the accepted only
            accepted_so_far = max(self._trials[request_id][0], streak[0])
            self._trials[request_id] = (accepted_so_far, accepted_so_far)

    @property
    def engine_rate(self) -> float:
        """The starting rate of a request without evidence of its own."""
        return toward(self._engine_trials, self.prior, self.prior_weight)

    def rate(self, request_id: str) -> float:
        return toward(self._trials.get(request_id, (0.0, 0.0)), self.engine_rate, self.prior_weight)

    def cautious_rate(self, request_id: str) -> float:
        """rate() less one standard error of it (a Beta posterior's, over the request's decayed
        drafts and the prior's weight)."""
        rate = self.rate(request_id)
        evidence = self._trials.get(request_id, (0.0, 0.0))[1] + self.prior_weight
        return max(0.0, rate - math.sqrt(rate * (1.0 - rate) / (evidence + 1.0)))

    def planned_rate(self, request_id: str, cautious: bool) -> float:
        """The rate the policy plans a request's drafts with: rate(), but cautious_rate() where
        asked (a draft model's drafts on text that does not repeat itself) once the request has
        evidence of its own. Such a draft (a draft token and its verify row: 0.98 of
        Qwen2.5-Coder-1.5B's step on a CPU) pays only where nearly every draft is accepted, and a
        few acceptances (a story's stock opening) are no evidence of that. Its first probe (one
        draft, probe_cap) explores at the mean. Text whose last tokens occurred before is being
        copied, and the draft model copies too: planned at the mean (a copy's first request,
        cautious at 0.81 after three drafts accepted, stayed at k = 0 for 64 steps on an AVX2
        build). Prompt lookup's drafts cost a verify row each, a third of SmolLM2's step: planned
        at the mean, so that a request probes from a low engine rate and ramps up as its drafts
        land (SmolLM2's json after a copy workload whose drafts failed: 1.70x at the mean, 0.99x
        cautious)."""
        if cautious and request_id in self._trials:
            return self.cautious_rate(request_id)
        return self.rate(request_id)

    def probe_cap(self, request_id: str) -> int:
        """The most drafts the request may take now: one more than its own accepted drafts
        (decayed). A request probes with one draft and grows k only as drafts land, so a chat
        request under a copying engine's prior pays single tokens for its failed probes, not k."""
        return 1 + int(self._trials.get(request_id, (0.0, 0.0))[0])

    def relax(self, request_id: str, probe_cost: float = PROMPT_LOOKUP_PROBE_COST) -> bool:
        """A row the policy gave k = 0: old evidence fades, so the rate drifts back to the
        engine's and, where the engine's drafts pay, a request whose text turned copy-heavy gets
        probed again. True on every `probe_interval`-th such step in a row: then the row gets a
        single-draft probe whatever its rate, so that no rate stays where it does not pay for
        want of evidence (an engine whose first probes all failed observes nothing new
        otherwise). One verified token in probe_interval steps is under 1% of them. A request
        without a verified draft of its own probes at once (prompt lookup: until it has a
        match): from an engine rate under the step's price, a request that copies would
        otherwise wait probe_interval steps, longer than many requests last (SmolLM2's json
        after a copy workload's failed probes: 0.99x without a probe of its own, 2.00x with)."""
        decay = self._relax_decay_for(probe_cost)
        trials = self._trials.get(request_id, (0.0, 0.0))
        if trials[1]:
            self._trials[request_id] = decayed(trials, decay)
        waited = self._waited.get(request_id, 0) + 1
        self._waited[request_id] = waited % self.probe_interval
        return waited == self.probe_interval or request_id not in self._trials

    def _relax_decay_for(self, probe_cost: float) -> float:
        """relax_decay where a failed single-draft probe costs what prompt lookup's does (a third
        of a step); slower where probes cost more (a draft model's: its draft token and the
        verify row, three quarters of a step), so that re-probing costs as much of the time."""
        scale = max(1.0, probe_cost / PROMPT_LOOKUP_PROBE_COST)
        return 1.0 - (1.0 - self.relax_decay) / scale

    def release(self, request_id: str) -> None:
        self._trials.pop(request_id, None)
        self._waited.pop(request_id, None)
        self._streak.pop(request_id, None)


def decayed(
    trials: tuple[float, float], decay: float, accepted: int = 0, tried: int = 0
) -> tuple[float, float]:
    """(accepted, tried) after one more observation: the old evidence weighs `decay`."""
    return decay * trials[0] + accepted, decay * trials[1] + tried


def toward(trials: tuple[float, float], prior: float, weight: float) -> float:
    """The rate of (successes, trials), pulled toward prior as if by `weight` trials at it."""
    return (trials[0] + prior * weight) / (trials[1] + weight)

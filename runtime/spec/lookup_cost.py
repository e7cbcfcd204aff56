"""What prompt lookup's drafts cost the host. A row the policy gives k >= 1 is looked up whether
or not its history matches: the lookup's seconds are paid on every such row, its drafts (and their
verify rows) only where it matched. Priced per row that drafts, a lookup costs its seconds over the
request's match rate, charged to the row's first draft (policy.DraftWork.first_draft_seconds).

On chat a request's lookups matched on 1 row in 8 to 10 (SmolLM2, ngram_min 2) and their drafts
were accepted 1 time in 7: the policy drafted on 40-55 of 126 steps at a rate near its break-even
(a verify row, a third of a step), and the lookups' and verify rows' seconds it did not price made
prompt lookup 2-4% slower than no speculation (docs/benchmarks.md, 2026-11-28 and 2026-11-29). On
copy every lookup matches and the price is the lookup's 50-80 µs, under 1% of a step."""

from __future__ import annotations

from runtime.spec.acceptance import decayed, toward

MIN_MATCH_RATE = 0.02  # a request's match rate is floored here: one lookup is priced at 50 at most


class LookupCost:
    """Per request, a moving average of how often its lookups matched, starting from the engine's
    (every request's, decayed slower; `prior` until there is any); and the seconds a lookup takes,
    a moving average over proposer calls. Only the lookups the policy asked for count toward a
    match rate: its forced probes look for a longer match."""

    def __init__(
        self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9,
        engine_decay: float = 0.95, seconds_decay: float = 0.9,
    ):  # fmt: skip
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.engine_decay, self.seconds_decay = engine_decay, seconds_decay
        self._matches: dict[str, tuple[float, float]] = {}  # request id -> (matched, looked up)
        self._engine_matches = (0.0, 0.0)
        self._seconds = (0.0, 0.0)  # (seconds, lookups), decayed

    def observe(self, matched: dict[str, bool], num_lookups: int, seconds: float) -> None:
        """One proposer call: num_lookups rows looked up in seconds; matched: whether each of the
        policy's own (not a probe's) found a match, by request id."""
        if num_lookups:
            self._seconds = decayed(self._seconds, self.seconds_decay, seconds, num_lookups)
        for request_id, found in matched.items():
            trials = self._matches.get(request_id, (0.0, 0.0))
            self._matches[request_id] = decayed(trials, self.decay, found, 1)
            self._engine_matches = decayed(self._engine_matches, self.engine_decay, found, 1)

    @property
    def seconds_per_lookup(self) -> float:
        seconds, lookups = self._seconds
        return seconds / lookups if lookups else 0.0

    def match_rate(self, request_id: str) -> float:
        engine = toward(self._engine_matches, self.prior, self.prior_weight)
        return toward(self._matches.get(request_id, (0.0, 0.0)), engine, self.prior_weight)

    def seconds_per_drafting_row(self, request_id: str) -> float:
        """The lookups' seconds a row that drafts costs: one lookup over its match rate."""
        return self.seconds_per_lookup / max(self.match_rate(request_id), MIN_MATCH_RATE)

    def release(self, request_id: str) -> None:
        self._matches.pop(request_id, None)

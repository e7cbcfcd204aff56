"""The never-a-loss policy: k = 0 when acceptance is low or the batch is full, larger k when
acceptance is high and a token costs little next to a step; plus the stats counters."""

import pytest

from runtime.spec.acceptance import AcceptanceTracker
from runtime.spec.policy import (
    DraftCost,
    DraftWork,
    RowCandidate,
    SpeculationPolicy,
)
from runtime.spec.proposer import NgramConfig
from runtime.spec.speculator import PromptLookup, Speculator
from runtime.spec.stats import NUM_ACCEPTED_TOKENS_PER_POS, NUM_DRAFTS, SpecDecodeStats
from runtime.spec.step_cost import StepCostModel
from scheduler.request import Request


def fitted_cost(step_seconds, per_token_seconds):
    """A cost model fed measured steps of t = step_seconds + per_token_seconds * tokens."""
    cost = StepCostModel()
    for rows, tokens in [(1, 1), (2, 2), (4, 4), (4, 40), (8, 8), (8, 100), (16, 16), (1, 64)]:
        cost.observe(rows, tokens, step_seconds + per_token_seconds * tokens)
    return cost


def policy_with(rate, cost, k=5):
    tracker = AcceptanceTracker()
    policy = SpeculationPolicy(k, cost, tracker)
    for _ in range(30):  # a request whose drafts are accepted at `rate` per draft
        accepted = round(rate * 4)
        policy.observe("r", 4, accepted)
    return policy


def test_the_cost_model_recovers_a_linear_step_cost():
    cost = fitted_cost(0.02, 0.001)
    assert cost.predict(4, 10) == pytest.approx(0.03, rel=1e-6)


def test_the_acceptance_rate_follows_what_is_measured():
    tracker = AcceptanceTracker(prior=0.5)
    assert tracker.rate("new") == 0.5
    for _ in range(30):
        tracker.observe("good", 4, 4)
        tracker.observe("bad", 4, 0)
    assert tracker.rate("good") > 0.9
    assert tracker.rate("bad") < 0.2  # below the policy's min_acceptance, whatever the prior


def test_high_acceptance_and_a_flat_step_cost_give_the_largest_k():
    policy = policy_with(1.0, fitted_cost(0.02, 0.00001))
    assert policy.choose(
        [RowCandidate("r", 10)], num_rows=1, num_tokens=1, token_budget_left=100
    ) == [5]


def test_low_acceptance_gives_k_zero():
    policy = policy_with(0.0, fitted_cost(0.02, 0.00001))
    assert policy.choose(
        [RowCandidate("r", 10)], num_rows=1, num_tokens=1, token_budget_left=100
    ) == [0]


def test_a_request_left_at_k_zero_is_probed_again_where_the_engines_drafts_pay():
    policy = policy_with(0.0, fitted_cost(0.02, 0.00001))
    for _ in range(30):  # the other requests' drafts are all accepted
        policy.observe("copying", 4, 4)
    row, chosen = RowCandidate("r", 10), []
    for _ in range(40):
        chosen.append(policy.choose([row], num_rows=1, num_tokens=1, token_budget_left=100)[0])
    assert chosen[0] == 0 and max(chosen) > 0


def test_where_no_requests_drafts_pay_a_new_request_probes_once():
    """Its own evidence decides, not the engine's: one single-draft probe, then nothing while
    its drafts fail (as those of "r", every one rejected)."""
    policy = policy_with(0.0, fitted_cost(0.02, 0.00001))
    rows = [RowCandidate("r", 10), RowCandidate("new", 10)]
    assert policy.choose(rows, num_rows=2, num_tokens=2, token_budget_left=100) == [0, 1]
    policy.observe("new", 1, 0)
    for _ in range(40):
        assert policy.choose(rows, num_rows=2, num_tokens=2, token_budget_left=100) == [0, 0]


def test_new_requests_start_from_the_engines_acceptance():
    tracker = AcceptanceTracker(prior=0.5)
    assert tracker.rate("new") == tracker.engine_rate == 0.5
    for _ in range(50):
        tracker.observe("chat", 4, 0)
    assert tracker.rate("new") < 0.1 and tracker.rate("new") == tracker.engine_rate
    for _ in range(500):
        tracker.observe("copy", 4, 4)
    assert tracker.rate("another") > 0.9


def test_a_costly_token_gives_k_zero_even_with_good_acceptance():
    # each extra token costs as much as a whole one-token step: drafting cannot pay (a draft
    # sure to be accepted would: first drafts accepted 3 times in 4)
    policy = SpeculationPolicy(5, fitted_cost(0.001, 0.01), AcceptanceTracker())
    for accepted in (3, 3, 3, 0) * 8:
        policy.observe("r", 4, accepted)
    assert policy.choose(
        [RowCandidate("r", 10)], num_rows=8, num_tokens=8, token_budget_left=100
    ) == [0]


def test_a_full_batch_gives_k_zero():
    policy = policy_with(1.0, fitted_cost(0.02, 0.00001))
    assert policy.choose(
        [RowCandidate("r", 10)], num_rows=64, num_tokens=64, token_budget_left=0
    ) == [0]


def test_the_budget_left_bounds_the_drafts_and_goes_to_the_best_rows():
    tracker = AcceptanceTracker()
    for accepted in (4, 0) * 15:
        tracker.observe("good", 4, 4)
        tracker.observe("fair", 4, accepted)  # rows accepted in full or not at all
    policy = SpeculationPolicy(5, fitted_cost(0.02, 0.00001), tracker)
    rows = [RowCandidate("fair", 10), RowCandidate("good", 10)]
    ks = policy.choose(rows, num_rows=2, num_tokens=2, token_budget_left=4)
    assert sum(ks) == 4 and ks[1] == 4


def test_a_row_near_its_max_tokens_gets_no_more_drafts_than_it_can_use():
    policy = policy_with(1.0, fitted_cost(0.02, 0.00001))
    assert policy.choose(
        [RowCandidate("r", 2)], num_rows=1, num_tokens=1, token_budget_left=100
    ) == [2]


def draft_cost(seconds_per_token: float) -> DraftCost:
    cost = DraftCost()
    for _ in range(5):
        cost.observe(4, 4 * seconds_per_token)
    return cost


def test_the_draft_models_cost_is_a_moving_average_per_drafted_token():
    cost = draft_cost(0.005)
    assert cost.seconds_per_token == pytest.approx(0.005)
    cost.observe(0, 1.0)  # no drafts: nothing learned
    assert cost.seconds_per_token == pytest.approx(0.005)
    for _ in range(60):
        cost.observe(2, 0.002)
    assert cost.seconds_per_token == pytest.approx(0.001, rel=0.01)


@pytest.mark.parametrize(
    "seconds_per_draft, expected_k",
    [(0.0, 5), (0.002, 4), (0.006, 2), (0.03, 0)],
)
def test_the_draft_models_cost_lowers_k(seconds_per_draft, expected_k):
    """A 20 ms step, acceptance 0.75: the j-th draft's gain 0.75^j must pay for its seconds."""
    policy = policy_with(0.75, fitted_cost(0.02, 0.00001))
    policy.draft_cost = draft_cost(seconds_per_draft)
    rows = [RowCandidate("r", 10)]
    assert policy.choose(rows, num_rows=1, num_tokens=1, token_budget_left=100) == [expected_k]


def test_a_long_run_of_plain_decodes_does_not_erase_what_a_draft_token_costs():
    """Plain decodes alone leave the token slope unknown (rows = tokens); kept apart, the steps
    with drafts still tell it, and a cheap draft model still pays at the prior acceptance."""
    forgetful, keeping = StepCostModel(), StepCostModel(keep_drafted_apart=True)
    for cost in (forgetful, keeping):
        for tokens in (2, 4, 6) * 4:  # a flat step: 20 ms whatever its tokens
            cost.observe(1, tokens, 0.02)
        for _ in range(300):
            cost.observe(1, 1, 0.02)
    assert keeping.fitted(1, 6) == pytest.approx(0.02, rel=1e-3)
    assert forgetful.fitted(1, 6) > 0.05  # the line alone, without the measured shapes
    policy = SpeculationPolicy(
        5, keeping, AcceptanceTracker(prior=0.5), draft_cost=draft_cost(0.004)
    )
    assert policy.choose([RowCandidate("new", 10)], 1, 1, token_budget_left=100)[0] > 0


def test_no_speculation_before_the_cost_model_has_measurements():
    policy = SpeculationPolicy(5, StepCostModel(), AcceptanceTracker(prior=0.9))
    assert policy.choose(
        [RowCandidate("r", 10)], num_rows=1, num_tokens=1, token_budget_left=100
    ) == [0]


def test_stats_count_drafts_and_accepted_tokens_per_position():
    stats = SpecDecodeStats(num_speculative_tokens=3)
    stats.record(3, 2)
    stats.record(2, 0)
    stats.record(0, 0)  # k = 0: not a draft
    snapshot = stats.snapshot()
    assert snapshot[NUM_DRAFTS] == 2
    assert snapshot[NUM_ACCEPTED_TOKENS_PER_POS] == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(2 / 5)
    assert stats.mean_accepted_length == pytest.approx(2.0)
    assert stats.num_drafts_per_k == {3: 1, 2: 1}


def test_a_request_probes_with_one_draft_and_grows_k_as_its_drafts_land():
    """However high the acceptance it starts from (here the engine's, after a copying request),
    a request's first probe is one draft; each accepted draft lets it take one more, up to k."""
    policy = SpeculationPolicy(5, fitted_cost(0.02, 0.00001), AcceptanceTracker(prior=0.9))
    rows = [RowCandidate("r", 10)]
    ks = []
    for accepted in (1, 2, 3):  # own accepted 1, then 3 (two full rows: failures none to drop)
        ks.append(policy.choose(rows, 1, 1, token_budget_left=100)[0])
        policy.observe("r", ks[-1], accepted)
    ks.append(policy.choose(rows, 1, 1, token_budget_left=100)[0])
    assert ks == [1, 2, 4, 5]
    assert policy.acceptance.rate("chat") > 0.8
    assert policy.choose([RowCandidate("chat", 10)], 1, 1, token_budget_left=100) == [1]


def test_an_engine_whose_first_probes_failed_probes_again_later():
    """Every row's first probe rejected puts every rate under min_acceptance: nothing drafts, so
    nothing new is observed. After probe_interval steps at k = 0 a row gets one single draft."""
    tracker = AcceptanceTracker(probe_interval=64)
    policy = SpeculationPolicy(5, fitted_cost(0.02, 0.00001), tracker)
    names = [f"r{i}" for i in range(4)]
    for name in names:
        policy.observe(name, 1, 0)
    rows = [RowCandidate(name, 10) for name in names]
    chosen = [policy.choose(rows, 4, 4, token_budget_left=100) for _ in range(130)]
    probes = [step for step, ks in enumerate(chosen) if any(ks)]
    assert probes == [63, 127] and all(chosen[s] == [1, 1, 1, 1] for s in probes)


def test_fully_accepted_rows_forget_the_failures_before_them():
    """An answer's preamble misses (its single-draft probes rejected), then its body copies: rows
    accepted in full with 3 drafts between them (k = 1, then 2) drop the earlier failures, so k
    ramps up within two steps instead of the ten the moving average would take; single drafts
    accepted by chance (three in a row at chat's rate of 0.5 is an eighth of the time) do not."""
    policy = SpeculationPolicy(5, fitted_cost(0.02, 0.00001), AcceptanceTracker(prior=0.9))
    for _ in range(6):
        policy.observe("r", 1, 0)
    low = policy.acceptance.rate("r")
    for _ in range(3):
        policy.observe("r", 1, 1)
    assert policy.acceptance.rate("r") < 0.5 and low < 0.3  # still the old failures
    policy.observe("r", 2, 2)
    reset = policy.acceptance.rate("r")
    assert reset > 0.6 and policy.acceptance.probe_cap("r") == 6  # the streak: 5 accepted
    assert policy.choose([RowCandidate("r", 10)], 1, 1, token_budget_left=100) == [5]
    policy.observe("r", 5, 0)  # a rejection ends the streak: the next rows count afresh
    policy.observe("r", 1, 1)
    assert policy.acceptance.rate("r") < reset - 0.05


def test_a_costly_probe_relaxes_a_rows_failures_more_slowly():
    """Re-probing a row left at k = 0 costs about the same share of the time whatever a probe
    costs: a draft model's probe (three quarters of a step) waits longer than prompt lookup's."""
    waits = []
    for probe_cost in (0.33, 0.75):
        tracker = AcceptanceTracker(prior=0.9)
        tracker.observe("other", 10, 10)  # a copying engine
        tracker.observe("r", 1, 0)
        steps = 0
        while tracker.rate("r") < 0.75:
            tracker.relax("r", probe_cost)
            steps += 1
        waits.append(steps)
    assert waits[1] > 2 * waits[0] > 0


def test_a_catch_up_token_has_its_own_measured_price():
    cost = draft_cost(0.005)
    assert cost.seconds_per_catch_up_token == pytest.approx(0.005)  # until measured: a draft's
    for _ in range(40):
        cost.observe_catch_up(10, 0.01)
    assert cost.seconds_per_catch_up_token == pytest.approx(0.001, rel=0.01)
    assert cost.seconds_per_token == pytest.approx(0.005)
    cost.observe_catch_up(0, 1.0)  # nothing caught up beyond steady: nothing learned
    assert cost.seconds_per_catch_up_token == pytest.approx(0.001, rel=0.01)


def catch_up_policy(rate: float, seconds_per_catch_up: float) -> SpeculationPolicy:
    """A 20 ms step, a 2 ms draft token, a catch-up token at the given price."""
    policy = SpeculationPolicy(
        5, fitted_cost(0.02, 0.00001), AcceptanceTracker(), draft_cost=draft_cost(0.002)
    )
    for _ in range(30):
        policy.observe("r", 4, round(rate * 4))
    for _ in range(40):
        policy.draft_cost.observe_catch_up(10, 10 * seconds_per_catch_up)
    return policy


def test_a_rows_catch_up_is_priced_into_its_first_draft():
    """A row back after steps at k = 0 pays its draft cache's catch-up before its first draft:
    a short one still pays at acceptance 0.75, a long one does not, and a row behind it in the
    queue with nothing to catch up on still drafts."""
    policy = catch_up_policy(0.75, 0.001)
    for name in ("behind", "steady"):
        for _ in range(30):
            policy.observe(name, 4, 3)
    rows = [RowCandidate("behind", 10), RowCandidate("steady", 10)]
    ahead = {"behind": 0, "steady": 0}

    def choose():
        def work(i):
            return DraftWork(by_model=True, catch_up_tokens=ahead[rows[i].request_id])

        return policy.choose(rows, 2, 2, 100, work=work)

    k = choose()[1]
    assert k > 0 and choose() == [k, k]
    ahead["behind"] = 3  # 3 ms: still pays
    assert choose()[0] > 0
    ahead["behind"] = 200  # 200 ms, ten steps
    assert choose()[0] == 0 and choose()[1] > 0


def costly_draft_policy() -> SpeculationPolicy:
    """A draft model on a CPU (Qwen2.5-Coder 0.5B for the 1.5B, 2 cores): a 25 ms step, a draft
    token 14.5 ms and its verify row 10 ms, so that a draft pays only where it is accepted 98
    times in 100."""
    return SpeculationPolicy(
        5, fitted_cost(0.015, 0.01), AcceptanceTracker(), draft_cost=draft_cost(0.0145)
    )


def test_a_draft_that_barely_pays_waits_for_evidence_of_its_own():
    """A new request starts from a copying engine's rate, 0.98, and probes with one draft; but
    two acceptances are no evidence that its drafts clear 0.98 (a story's stock opening is
    accepted, then its text is not); a long run of full acceptances is."""
    policy = costly_draft_policy()
    for _ in range(60):
        policy.observe("copying", 5, 5)
    assert policy.acceptance.rate("new") > 0.95
    assert policy.choose([RowCandidate("new", 10)], 1, 1, token_budget_left=100) == [1]  # probe
    for _ in range(2):
        policy.observe("opening", 1, 1)
    assert policy.choose([RowCandidate("opening", 10)], 1, 1, token_budget_left=100) == [0]
    for _ in range(30):
        policy.observe("copy", 5, 5)
    assert policy.choose([RowCandidate("copy", 10)], 1, 1, token_budget_left=100)[0] > 0


def test_a_row_whose_text_repeats_is_planned_at_its_mean_rate():
    """Two acceptances leave a barely paying model draft at k = 0 (planned at the cautious
    rate), unless the row's last tokens occurred before: a copy, which the draft model copies
    too (a copy's first request stayed at k = 0 for 64 steps on an AVX2 build)."""
    policy = costly_draft_policy()
    for _ in range(60):
        policy.observe("copying", 5, 5)
    for _ in range(2):
        policy.observe("opening", 1, 1)
    row = [RowCandidate("opening", 10)]

    def choose(repeats: bool) -> int:
        work = DraftWork(by_model=True, repeats=repeats)
        return policy.choose(row, 1, 1, token_budget_left=100, work=lambda i: work)[0]

    assert choose(repeats=False) == 0
    assert choose(repeats=True) > 0


def test_prompt_lookups_drafts_are_planned_at_the_mean():
    """A draft with no forward pass costs its verify row alone (here a sixth of a step): a
    request probes from a low engine rate and again after a failure, where the cautious rate
    would not (SmolLM2's json after a copy workload whose drafts failed: 1.70x with the probes,
    0.99x without)."""
    policy = SpeculationPolicy(5, fitted_cost(0.02, 0.004), AcceptanceTracker())
    for accepted in (1, 0, 0):
        policy.observe("other", 1, accepted)
    assert policy.acceptance.cautious_rate("new") < 0.15 < policy.acceptance.rate("new") < 0.5
    assert policy.choose([RowCandidate("new", 10)], 1, 1, token_budget_left=100) == [1]
    policy.observe("new", 1, 0)
    assert policy.choose([RowCandidate("new", 10)], 1, 1, token_budget_left=100) == [1]


def test_rows_that_prompt_lookup_serves_are_not_charged_the_draft_models_cost():
    """--draft-prompt-lookup: a row whose drafts lookup serves costs the verify row alone, so it
    drafts where a row the model would serve, accepted as often, does not."""
    policy = costly_draft_policy()
    for name in ("looked up", "modelled"):
        for _ in range(30):
            policy.observe(name, 4, 3)
    rows = [RowCandidate("looked up", 10), RowCandidate("modelled", 10)]
    ks = policy.choose(rows, 2, 2, 100, work=lambda i: DraftWork(by_model=i == 1))
    assert ks[0] > 0 and ks[1] == 0


def test_an_engine_that_never_verified_a_draft_probes_at_once():
    """Before any evidence the cautious rate pays for no draft; the first rows probe at once
    rather than after probe_interval steps, and then the evidence decides."""
    policy = SpeculationPolicy(5, fitted_cost(0.02, 0.005), AcceptanceTracker(probe_interval=64))
    rows = [RowCandidate("a", 10), RowCandidate("b", 10)]
    assert policy.choose(rows, 2, 2, token_budget_left=100) == [1, 1]
    policy.observe("a", 1, 0)
    policy.observe("b", 1, 0)
    assert policy.choose(rows, 2, 2, token_budget_left=100) == [0, 0]


def test_no_forced_probe_where_even_accepted_drafts_would_not_pay():
    """A draft model's new requests probe at once at one stream; in a batch of 16, where 7
    drafts all accepted would still lower the goodput (each costs a draft forward pass), they
    do not, and probe once the batch has drained."""
    draft_cost = DraftCost()
    draft_cost.observe(1, 0.015)
    policy = SpeculationPolicy(
        7, fitted_cost(0.02, 0.005), AcceptanceTracker(), draft_cost=draft_cost
    )
    crowd = [RowCandidate(f"r{i}", 10) for i in range(16)]
    assert policy.choose(crowd, 16, 16, token_budget_left=100) == [0] * 16
    assert policy.choose(crowd[:1], 1, 1, token_budget_left=100) == [1]
    # drafts batched over 16 rows cost less a token; on the line 7 still do not pay, though the
    # measured 16-token step, assumed flat to 24 tokens, would say they do
    draft_cost.observe(100, 0.3)
    assert draft_cost.seconds_per_token < 0.0045
    crowd = [RowCandidate(f"s{i}", 10) for i in range(16)]
    assert policy.choose(crowd, 16, 16, token_budget_left=100) == [0] * 16


def test_the_speculator_hands_the_policys_probes_to_prompt_lookup():
    """Rows whose drafts all failed get k = 0, then a forced probe: prompt lookup probes only
    after a long match (the row "long"), not after two tokens (the row "short"), nor a row
    whose history has no match at all, a new request ("fresh") included."""
    policy = SpeculationPolicy(8, fitted_cost(0.02, 0.00001), AcceptanceTracker(probe_interval=1))
    for _ in range(30):
        policy.observe("short", 4, 0)
        policy.observe("long", 4, 0)
    speculator = Speculator(8, PromptLookup(NgramConfig(2, 32, 8)), policy)
    short = Request("short", [1, 2, 3, 40, 41, 42, 9, 2, 3])
    long = Request("long", [5, 6, 7, 8, 50, 51, 52, 9, 5, 6, 7, 8])
    fresh = Request("fresh", [5, 6, 7, 8, 9, 10])
    assert speculator.propose([short, long, fresh], [8, 8, 8], 3, 3, 100) == [[], [50], []]
    assert policy.probes == {1}


def test_prompt_lookup_offers_only_the_drafts_its_match_has():
    """Looked up before the policy chooses: no match, k = 0 (a new request's rate, the engine
    prior's 0.5, would draft); a match near the history's end, at most the tokens after it."""
    policy = SpeculationPolicy(8, fitted_cost(0.02, 0.00001), AcceptanceTracker())
    speculator = Speculator(8, PromptLookup(NgramConfig(2, 32, 8)), policy)
    for _ in range(30):
        policy.observe("near_end", 2, 2)
        policy.observe("no_match", 2, 2)
    near_end = Request("near_end", [1, 2, 3, 4, 5, 6, 7, 9, 9, 9])  # [9, 9] then one 9 more
    no_match = Request("no_match", [1, 2, 3, 4, 5, 6, 7, 8])
    drafts = speculator.propose([near_end, no_match], [8, 8], 2, 2, 100)
    assert drafts == [[9], []]
    assert speculator.num_rows_per_k == {1: 1, 0: 1}


def test_the_cost_model_returns_measured_shapes_and_interpolates_between_them():
    """A CPU step flat from 5 to 8 tokens (one lane block) is no line: each measured (rows,
    tokens) keeps its own seconds, token counts between two measured ones interpolate; beyond
    the most measured the seconds stay up to 8 tokens, then follow the line's slope; below the
    fewest, the line's slope from there."""
    cost = StepCostModel()
    for _ in range(3):
        for tokens, seconds in [(1, 0.030), (2, 0.041), (4, 0.070), (8, 0.072)]:
            cost.observe(1, tokens, seconds)
    assert cost.predict(1, 8) == pytest.approx(0.072)
    assert cost.predict(1, 6) == pytest.approx(0.071)
    assert cost.predict(1, 8) < cost.fitted(1, 8)
    slope = cost.fitted(1, 12) - cost.fitted(1, 8)
    assert slope > 0 and cost.predict(1, 12) == pytest.approx(0.072 + slope)
    for _ in range(3):
        cost.observe(5, 3, 0.06)
    assert cost.predict(5, 8) == pytest.approx(0.06)  # flat to 8 tokens beyond the measured
    assert cost.predict(5, 10) == pytest.approx(0.06 + cost.fitted(5, 10) - cost.fitted(5, 8))
    for _ in range(3):
        cost.observe(3, 6, 0.05)
    assert cost.predict(3, 4) == pytest.approx(0.05 - (cost.fitted(3, 6) - cost.fitted(3, 4)))
    assert cost.predict(2, 2) == pytest.approx(cost.fitted(2, 2))  # no shape of 2 rows measured


def test_a_slow_step_now_and_then_does_not_lift_its_shape():
    """A shared host now and then takes twice a step's time. A plain step's average lifted by one
    such step made drafts look cheaper than plain decoding until plain steps were measured again,
    which the policy, drafting, no longer did; the median of the last measures ignores it."""
    cost = StepCostModel()
    for seconds in (0.047, 0.048, 0.047, 0.120, 0.048):
        cost.observe(1, 1, seconds)
    assert cost.predict(1, 1) == pytest.approx(0.048)
    for seconds in (0.047, 0.110, 0.115, 0.120, 0.118):  # the host slowed down: it follows
        cost.observe(1, 1, seconds)
    assert cost.predict(1, 1) == pytest.approx(0.115)


def test_a_shape_not_measured_for_a_window_of_steps_is_forgotten():
    cost = StepCostModel(window=16)
    cost.observe(1, 8, 0.5)  # an outlier: a k that never pays again is never chosen again
    for _ in range(32):
        cost.observe(1, 1, 0.03)
        cost.observe(1, 4, 0.07)
    assert cost.predict(1, 8) < 0.2


def test_drafts_are_priced_at_the_measured_steps_not_the_line():
    """Qwen2.5-Coder-1.5B's steps on a Zen 5 at one stream, and its draft model's 12 ms a draft:
    the step is flat from 4 to 8 tokens, which the line (a slope of 8 ms a token) misses. At a
    planned rate of 0.97 seven drafts pay most; priced on the line, five did."""
    cost = StepCostModel()
    measured = [(1, 0.030)] * 8 + [(2, 0.041), (3, 0.058)] * 2 + [(4, 0.070)] * 3 + [(8, 0.072)]
    for tokens, seconds in measured:
        cost.observe(1, tokens, seconds)
    policy = SpeculationPolicy(7, cost, AcceptanceTracker(), draft_cost=draft_cost(0.012))
    for accepted in (7, 7, 6) * 10:
        policy.observe("copy", 7, accepted)
    assert policy.choose([RowCandidate("copy", 100)], 1, 1, token_budget_left=100) == [7]


def test_the_best_number_of_drafts_wins_not_the_first_whose_next_draft_does_not_pay():
    """One draft pays a little (2 tokens in 53 ms against 1 in 30), a second does not (3 in 82),
    seven pay most (8 in 156): a search that stopped at the first draft that lowers the goodput
    would keep one."""
    cost = StepCostModel()
    for _ in range(3):
        for tokens, seconds in [(1, 0.030), (2, 0.041), (3, 0.058), (4, 0.070), (8, 0.072)]:
            cost.observe(1, tokens, seconds)
    policy = SpeculationPolicy(7, cost, AcceptanceTracker(), draft_cost=draft_cost(0.012))
    for _ in range(10):
        policy.observe("copy", 7, 7)
    assert policy.choose([RowCandidate("copy", 100)], 1, 1, token_budget_left=100) == [7]


def test_a_lane_block_beyond_the_measured_steps_is_tried():
    """Only 1-3 tokens measured (30, 41, 57 ms): the line from there puts 8 tokens near 100 ms
    and seven drafts would never be tried, nor their step measured. Assumed flat to the end of
    the lane block, a row whose drafts land is given them once, and the measure decides."""
    cost = StepCostModel()
    measured = [(1, 0.030)] * 8 + [(2, 0.041), (3, 0.057)] * 3
    for tokens, seconds in measured:
        cost.observe(1, tokens, seconds)
    assert cost.fitted(1, 8) > 0.09
    policy = SpeculationPolicy(7, cost, AcceptanceTracker(), draft_cost=draft_cost(0.012))
    for accepted in (7, 7, 6) * 10:
        policy.observe("copy", 7, accepted)
    assert policy.choose([RowCandidate("copy", 100)], 1, 1, token_budget_left=100) == [7]
    for _ in range(3):
        cost.observe(1, 8, 0.2)  # 8 tokens measured dear: k = 7 no longer pays
    assert policy.choose([RowCandidate("copy", 100)], 1, 1, token_budget_left=100)[0] < 7

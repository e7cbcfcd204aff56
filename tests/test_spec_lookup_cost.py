"""Prompt lookup's lookups priced: a request whose lookups rarely match pays a lookup's seconds
many times for each row that drafts, and the policy charges that to the row's first draft."""

import pytest

from runtime.spec.acceptance import AcceptanceTracker
from runtime.spec.lookup_cost import MIN_MATCH_RATE, LookupCost
from runtime.spec.policy import DraftWork, RowCandidate, SpeculationPolicy
from runtime.spec.proposer import NgramConfig
from runtime.spec.speculator import PromptLookup
from runtime.spec.step_cost import StepCostModel
from scheduler.request import Request


def test_a_requests_match_rate_follows_its_lookups_from_the_engines():
    cost = LookupCost(prior=0.5)
    assert cost.match_rate("new") == 0.5
    for _ in range(30):
        cost.observe({"copies": True, "chats": False}, 2, 0.0002)
    assert cost.match_rate("copies") > 0.9
    assert cost.match_rate("chats") < 0.15
    assert cost.seconds_per_lookup == pytest.approx(0.0001)
    # a new request starts from the engine's rate: half its lookups matched
    assert 0.4 < cost.match_rate("new") < 0.6
    cost.release("chats")
    assert cost.match_rate("chats") == cost.match_rate("new")


def test_a_drafting_row_costs_one_lookup_over_the_match_rate():
    cost = LookupCost()
    for _ in range(200):
        cost.observe({"never": False}, 1, 0.001)
    assert cost.match_rate("never") < MIN_MATCH_RATE
    assert cost.seconds_per_drafting_row("never") == pytest.approx(0.001 / MIN_MATCH_RATE)


def test_prompt_lookup_measures_its_lookups_but_not_its_probes_match_rate():
    lookup = PromptLookup(NgramConfig(2, 32, 8))
    copies = Request("copies", [5, 6, 7, 8, 50, 51, 52, 9, 5, 6, 7, 8])
    chats = Request("chats", [1, 2, 3, 4, 10, 11, 12, 13])
    for _ in range(20):
        lookup.propose_rows([copies, chats], [2, 2])
    assert lookup.cost.match_rate("chats") < 0.3 < 0.9 < lookup.cost.match_rate("copies")
    assert lookup.cost.seconds_per_lookup > 0
    before = lookup.cost.match_rate("probed")
    probed = Request("probed", [1, 2, 3, 9, 1, 2, 3])
    lookup.propose_rows([probed], [1], probing=[True])  # a 3-token match: no probe draft
    assert lookup.cost.match_rate("probed") == before
    work = lookup.draft_work(chats)
    assert not work.by_model
    assert work.first_draft_seconds > lookup.draft_work(copies).first_draft_seconds
    lookup.release("chats")
    assert lookup.cost.match_rate("chats") == lookup.cost.match_rate("new")


def test_lookups_that_rarely_match_price_a_rows_drafts_out():
    """Two requests whose drafts are accepted alike (one in two, against a verify token of a
    quarter of a step): the one whose lookups match drafts; the one whose lookups match once in
    50 pays 50 lookups' seconds for each row that drafts, and is left at k = 0."""
    cost = StepCostModel()
    for rows, tokens in [(1, 1), (2, 2), (4, 4), (4, 40), (8, 8), (8, 100), (16, 16), (1, 64)]:
        cost.observe(rows, tokens, 0.009 + 0.003 * tokens)  # a plain 1-row step: 12 ms
    policy = SpeculationPolicy(8, cost, AcceptanceTracker())
    for name in ("matches", "rarely"):
        for _ in range(30):
            policy.observe(name, 2, 1)
    seconds = {"matches": 0.0001, "rarely": 0.0001 / MIN_MATCH_RATE}  # 5 ms: 0.4 of a step

    def choose(request_id: str, priced: bool = True) -> int:
        work = DraftWork(by_model=False, first_draft_seconds=seconds[request_id] * priced)
        return policy.choose([RowCandidate(request_id, 10)], 1, 1, 100, work=lambda i: work)[0]

    assert choose("matches") >= 1
    assert choose("rarely") == 0
    assert choose("rarely", priced=False) >= 1  # the lookups' price is what left it at 0

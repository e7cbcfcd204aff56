"""The n-gram prompt-lookup proposer on crafted histories."""

import numpy as np
import pytest

from runtime.spec.policy import DraftWork
from runtime.spec.proposer import (
    FEW_CANDIDATES,
    NgramConfig,
    NgramProposer,
    TokenHistories,
    TokenHistory,
)
from runtime.spec.speculator import PROBE_MIN_NGRAM, PromptLookup
from scheduler.request import Request


def propose(history, k, ngram_min=1, ngram_max=3, cap=5):
    proposer = NgramProposer(NgramConfig(ngram_min, ngram_max, cap))
    return proposer.propose([TokenHistory(ngram_min, history)], [k])[0]


def test_the_tokens_after_the_matched_ngram_are_proposed():
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], k=3) == [4, 5, 9]


def test_no_match_proposes_nothing():
    assert propose([1, 2, 3, 4, 5], k=3) == []


def test_the_longest_ngram_wins_over_a_more_recent_shorter_one():
    # suffix [7, 8, 3]: a 3-gram match at position 0, only the 1-gram "3" later at position 5
    history = [7, 8, 3, 10, 11, 3, 20, 21, 7, 8, 3]
    assert propose(history, k=2) == [10, 11]


def test_among_equally_long_matches_the_most_recent_wins():
    history = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose(history, k=1, ngram_min=2, ngram_max=2) == [2]


def test_ngram_min_rejects_shorter_matches():
    history = [1, 2, 4, 5, 9, 2]  # only the 1-gram [2] matches
    assert propose(history, k=2, ngram_min=1) == [4, 5]
    assert propose(history, k=2, ngram_min=2) == []


def test_ngram_max_bounds_the_match_length():
    # with ngram_max = 1 only the last token counts: the most recent "3" is at position 5
    history = [7, 8, 3, 10, 11, 3, 20, 21, 7, 8, 3]
    assert propose(history, k=2, ngram_max=1) == [20, 21]


def test_k_is_capped_by_the_request_and_by_num_speculative_tokens():
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose(history, k=2) == [3, 4]
    assert propose(history, k=10, cap=4) == [3, 4, 5, 6]
    assert propose(history, k=0) == []


def test_a_draft_stops_at_the_end_of_the_history():
    assert propose([4, 4], k=5) == [4]


def test_a_batch_gets_one_draft_per_row():
    proposer = NgramProposer(NgramConfig(1, 3, 4))
    histories = [TokenHistory(1, h) for h in ([1, 2, 3, 1], [9, 8], [5, 6, 5])]
    assert proposer.propose(histories, [2, 2, 0]) == [[2, 3], [], []]


@pytest.mark.parametrize("ngram_max", [2, 4, 32])
@pytest.mark.parametrize("seed", range(4))
def test_a_long_history_matches_like_a_python_scan(seed, ngram_max):
    rng = np.random.default_rng(seed)
    # random tokens, then copies of earlier spans with a token changed here and there: ties of
    # many tokens between places, as a copied text has
    history = list(rng.integers(0, 20, size=1000))
    for _ in range(40):
        start, length = int(rng.integers(0, len(history) - 50)), int(rng.integers(5, 50))
        span = history[start : start + length]
        span[int(rng.integers(0, length))] = int(rng.integers(0, 20))
        history += span
    proposer = NgramProposer(NgramConfig(2, ngram_max, 5))
    for key_length in (1, 2):  # the index keyed on the shortest match, or shorter
        got = proposer.propose_one(TokenHistory(key_length, history), 5)
        assert got == slow_lookup(history, 2, ngram_max, 5)


def test_the_default_ngram_max_finds_the_place_being_copied():
    # two list items share the 4-gram [1, 2, 3, 4]; the output copies the first one (its
    # [10, 11, 12] came before the 4-gram), so the second, more recent, would propose 60
    source = [10, 11, 12, 1, 2, 3, 4, 50, 51, 20, 21, 22, 1, 2, 3, 4, 60, 61]
    proposer = NgramProposer(NgramConfig())
    copying = source + [7, 10, 11, 12, 1, 2, 3, 4]
    assert proposer.propose_one(TokenHistory(2, copying), 2) == [50, 51]
    assert propose(copying, k=2, ngram_min=2, ngram_max=4) == [60, 61]


def slow_lookup(history, n_min, n_max, k):
    for n in range(n_max, n_min - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


@pytest.mark.parametrize("bad", [(0, 2, 3), (3, 2, 3), (1, 2, 0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        NgramConfig(*bad)


def test_token_histories_follow_a_request_as_its_output_grows_and_goes_back():
    request = Request("r", [5, 6, 7])
    histories = TokenHistories(2)

    def assert_follows(request):
        history = histories.of(request)
        tokens = request.prompt_token_ids + request.output_token_ids
        assert history.tokens == tokens and history.array().tolist() == tokens
        assert history.earlier_ends() == [
            end for end in range(1, len(tokens) - 1) if tokens[end - 1 : end + 1] == tokens[-2:]
        ]

    first = histories.of(request)  # the prompt alone
    for token in range(40):  # grown in place, past each buffer's capacity
        request.output_token_ids.append(token % 7)
        assert_follows(request)
        assert histories.of(request) is first
    del request.output_token_ids[-10:]  # fewer tokens: rebuilt
    assert_follows(request)
    request.output_token_ids[-1] = 99  # its last token changed: rebuilt
    request.output_token_ids.append(100)
    assert_follows(request)
    histories.release("r")
    assert histories.of(Request("r", [1, 2])).tokens == [1, 2]


def test_a_forced_probe_drafts_only_after_a_long_match():
    """The policy's forced probes (a row whose rate says k = 0) need PROBE_MIN_NGRAM matched
    tokens: a short match is no evidence that the text copies; chosen drafts keep ngram_min."""
    lookup = PromptLookup(NgramConfig(2, 32, 8))
    short = Request("short", [1, 2, 3, 40, 41, 42, 9, 2, 3])  # the last 2 tokens matched
    tail = [5, 6, 7, 8][:PROBE_MIN_NGRAM]
    long = Request("long", [*tail, 50, 51, 52, 9, *tail])  # the last PROBE_MIN_NGRAM matched
    assert lookup.propose_rows([short, long], [2, 2]) == [[40, 41], [50, 51]]
    assert lookup.propose_rows([short, long], [1, 1], probing=[True, True]) == [[], [50]]


@pytest.mark.parametrize("vocabulary", [1, 2, 3])
def test_many_candidates_are_narrowed_like_few(vocabulary):
    """A model repeating itself makes every position a candidate: past FEW_CANDIDATES they are
    narrowed in numpy, to the same place a Python scan finds."""
    rng = np.random.default_rng(vocabulary)
    history = [int(t) for t in rng.integers(0, vocabulary, size=400)]
    history += history[100:180]
    for n_max in (3, 32):
        proposer = NgramProposer(NgramConfig(2, n_max, 6))
        tokens = TokenHistory(1, history)
        assert len(tokens.earlier_ends()) > FEW_CANDIDATES
        assert proposer.propose_one(tokens, 6) == slow_lookup(history, 2, n_max, 6)


def test_a_match_is_measured_up_to_extend_to():
    """One lookup serves a chosen draft (ngram_min) and a forced probe (a longer match): the
    place is ngram_min's, the length measured on up to extend_to."""
    history = [3, 1, 7, 8, 40, 41, 9, 3, 1, 7, 8]  # the last 4 tokens matched at 0..3
    proposer = NgramProposer(NgramConfig(2, 32, 4), extend_to=4)
    match = proposer.match(TokenHistory(2, history))
    assert (match.start, match.length) == (4, 4)
    short = NgramProposer(NgramConfig(2, 2, 4), extend_to=3).match(TokenHistory(2, history))
    assert (short.start, short.length) == (4, 3)
    assert NgramProposer(NgramConfig(2, 32, 4)).match(TokenHistory(2, [1, 2, 3])).start == -1


def test_prompt_lookup_tells_the_policy_what_each_row_has():
    lookup = PromptLookup(NgramConfig(2, 32, 8))
    assert lookup.draft_work(Request("none", [1, 2, 3, 4])) == DraftWork(
        by_model=False, most_drafts=0, may_probe=False
    )
    short = lookup.draft_work(Request("short", [1, 2, 3, 40, 41, 42, 9, 2, 3]))
    assert (short.most_drafts, short.may_probe) == (6, False)
    long = lookup.draft_work(Request("long", [5, 6, 7, 8, 50, 51, 52, 9, 5, 6, 7, 8]))
    assert (long.most_drafts, long.may_probe) == (8, True)

"""The n-gram prompt-lookup proposer on crafted histories."""

import numpy as np
import pytest

from runtime.spec.proposer import NgramConfig, NgramProposer, TokenHistories, history_of
from runtime.spec.speculator import PROBE_MIN_NGRAM, PromptLookup
from scheduler.request import Request


def propose(history, k, ngram_min=1, ngram_max=3, cap=5):
    proposer = NgramProposer(NgramConfig(ngram_min, ngram_max, cap))
    return proposer.propose([np.array(history)], [k])[0].tolist()


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
    histories = [np.array([1, 2, 3, 1]), np.array([9, 8]), np.array([5, 6, 5])]
    drafts = proposer.propose(histories, [2, 2, 0])
    assert [d.tolist() for d in drafts] == [[2, 3], [], []]


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
    got = proposer.propose_one(np.array(history), 5).tolist()
    assert got == slow_lookup(history, 2, ngram_max, 5)


def test_the_default_ngram_max_finds_the_place_being_copied():
    # two list items share the 4-gram [1, 2, 3, 4]; the output copies the first one (its
    # [10, 11, 12] came before the 4-gram), so the second, more recent, would propose 60
    source = [10, 11, 12, 1, 2, 3, 4, 50, 51, 20, 21, 22, 1, 2, 3, 4, 60, 61]
    proposer = NgramProposer(NgramConfig())
    copying = np.array(source + [7, 10, 11, 12, 1, 2, 3, 4])
    assert proposer.propose_one(copying, 2).tolist() == [50, 51]
    assert propose(copying.tolist(), k=2, ngram_min=2, ngram_max=4) == [60, 61]


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
    histories = TokenHistories()
    for token in range(40):  # grown in place, past each buffer's capacity
        request.output_token_ids.append(token)
        assert histories.of(request).tolist() == history_of(request).tolist()
    del request.output_token_ids[-10:]  # fewer tokens: rebuilt
    assert histories.of(request).tolist() == history_of(request).tolist()
    request.output_token_ids[-1] = 99  # its last token changed: rebuilt
    request.output_token_ids.append(100)
    assert histories.of(request).tolist() == history_of(request).tolist()
    histories.release("r")
    assert histories.of(Request("r", [1, 2])).tolist() == [1, 2]


def test_a_forced_probe_drafts_only_after_a_long_match():
    """The policy's forced probes (a row whose rate says k = 0) need PROBE_MIN_NGRAM matched
    tokens: a short match is no evidence that the text copies; chosen drafts keep ngram_min."""
    lookup = PromptLookup(NgramConfig(2, 32, 8))
    short = Request("short", [1, 2, 3, 40, 41, 42, 9, 2, 3])  # the last 2 tokens matched
    tail = [5, 6, 7, 8][:PROBE_MIN_NGRAM]
    long = Request("long", [*tail, 50, 51, 52, 9, *tail])  # the last PROBE_MIN_NGRAM matched
    assert lookup.propose_rows([short, long], [2, 2]) == [[40, 41], [50, 51]]
    assert lookup.propose_rows([short, long], [1, 1], probing=[True, True]) == [[], [50]]

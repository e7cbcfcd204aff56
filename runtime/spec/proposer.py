"""N-gram prompt lookup: propose the tokens that followed the most recent earlier occurrence of
the longest suffix n-gram of a row's history (ngram_max down to ngram_min). No second model.

A long ngram_max (32) chooses the place being copied: text that repeats its structure (a JSON
list's items, code's similar lines) has many places after the same 4 tokens, and the most recent
is often the output's own previous item, where the place whose match runs furthest back is the
one the model copies (SmolLM2's json, offline, every position drafting 8: 6.1 tokens accepted a
row with ngram_max 32, 4.4 with 4).

Each request's history keeps where each of its n-grams of the shortest length looked up ended
(TokenHistory), grown with its output: the candidates are one dict read, and a history whose
last tokens occurred nowhere before (most steps of a chat) costs no scan. Each step back keeps
the candidates that still match, until one is left (or none): in Python for a few, in numpy
for many (a model repeating itself: every position a candidate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FEW_CANDIDATES = 64  # more: narrowed in numpy


@dataclass(frozen=True)
class NgramConfig:
    ngram_min: int = 2  # --ngram-min
    ngram_max: int = 32  # --ngram-max
    num_speculative_tokens: int = 5  # --num-speculative-tokens: the largest k

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )


@dataclass(frozen=True)
class Match:
    """Where the draft begins (the position after the matched n-gram; -1: no match) and how
    many tokens matched (at least ngram_min, up to the proposer's extend_to or further)."""

    start: int
    length: int


NO_MATCH = Match(-1, 0)


class TokenHistory:
    """One request's tokens, prompt then output, and where each of its key_length-grams ends
    (ascending positions). A numpy copy of the tokens is grown on demand, for many candidates."""

    __slots__ = ("_array", "_ends", "_in_array", "key_length", "tokens")

    def __init__(self, key_length: int, tokens: Sequence[int] = ()):
        self.key_length = key_length
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._array = np.empty(0, dtype=np.int64)  # its first _in_array are the tokens'
        self._in_array = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        first, n = len(self.tokens), self.key_length
        self.tokens.extend(int(t) for t in tokens)
        all_tokens, ends = self.tokens, self._ends
        for end in range(max(first, n - 1), len(all_tokens)):
            ends.setdefault(tuple(all_tokens[end - n + 1 : end + 1]), []).append(end)

    def earlier_ends(self) -> list[int]:
        """The positions before the last whose key_length-gram is the history's last one."""
        n = self.key_length
        if len(self.tokens) <= n:
            return []
        return self._ends[tuple(self.tokens[-n:])][:-1]  # its last entry: the last position

    def array(self) -> np.ndarray:
        length, done = len(self.tokens), self._in_array
        if self._array.shape[0] < length:
            grown = np.empty(2 * length, dtype=np.int64)
            grown[:done] = self._array[:done]
            self._array = grown
        self._array[done:length] = self.tokens[done:]
        self._in_array = length
        return self._array[:length]

    def __len__(self) -> int:
        return len(self.tokens)


class TokenHistories:
    """Each request's TokenHistory, grown as its output grows (rebuilt from the request's lists
    every step, a history took 25-37 µs a row at 2,000 tokens and 95-110 µs at 8,000, and
    scanning it for the last token as long again). A request whose last kept token no longer
    matches (its output went back) is rebuilt."""

    def __init__(self, key_length: int) -> None:
        self.key_length = key_length
        self._rows: dict[str, TokenHistory] = {}

    def of(self, request) -> TokenHistory:
        history = self._rows.get(request.request_id)
        length = len(history) if history is not None else 0
        if history is None or not self._still_holds(request, history, length):
            history = TokenHistory(
                self.key_length, request.prompt_token_ids + request.output_token_ids
            )
            self._rows[request.request_id] = history
        elif request.num_tokens > length:
            num_prompt = len(request.prompt_token_ids)
            history.extend(request.output_token_ids[length - num_prompt :])
        return history

    @staticmethod
    def _still_holds(request, history: TokenHistory, length: int) -> bool:
        """The request still has the history's tokens: as many or more, its last one the same
        (a history is never shorter than its prompt)."""
        num_prompt = len(request.prompt_token_ids)
        if not num_prompt <= length <= request.num_tokens:
            return False
        at = length - 1 - num_prompt
        last = request.output_token_ids[at] if at >= 0 else request.prompt_token_ids[-1]
        return history.tokens[length - 1] == last

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)


class NgramProposer:
    """extend_to: a match found is measured up to this many tokens even where ngram_min already
    chose its place (the policy's forced probes need a longer one: PromptLookup)."""

    def __init__(self, config: NgramConfig, extend_to: int = 0):
        self.config = config
        self.extend_to = extend_to

    def propose(self, histories: Sequence[TokenHistory], ks: Sequence[int]) -> list[list[int]]:
        """histories[i]: row i's tokens (prompt + output); ks[i]: its chosen k. -> per row up to
        min(k, num_speculative_tokens) draft ids (empty: no match or k = 0)."""
        assert len(histories) == len(ks)
        cap = self.config.num_speculative_tokens
        return [self.propose_one(h, min(k, cap)) for h, k in zip(histories, ks)]

    def propose_one(self, history: TokenHistory, k: int) -> list[int]:
        return drafts_after(history, self.match(history), k) if k > 0 else []

    def match(self, history: TokenHistory) -> Match:
        """The most recent of the longest matches of the history's suffix (up to ngram_max)."""
        n_min = self.config.ngram_min
        assert history.key_length <= n_min, "the history's index is keyed on longer n-grams"
        ends = history.earlier_ends()
        if not ends:
            return NO_MATCH
        narrow = narrow_few if len(ends) <= FEW_CANDIDATES else narrow_many
        end, matched = narrow(history, ends, history.key_length, n_min, self.config.ngram_max)
        if matched < n_min:
            return NO_MATCH
        tokens, last = history.tokens, len(history) - 1
        while matched < self.extend_to and end >= matched:
            if tokens[end - matched] != tokens[last - matched]:
                break
            matched += 1
        return Match(end + 1, matched)


def narrow_few(
    history: TokenHistory, ends: list[int], matched: int, n_min: int, n_max: int
) -> tuple[int, int]:
    """ends: the candidate positions matching the last `matched` tokens. -> (the end of the
    most recent of the longest matches, its length), stepping back while more than one is left
    or the match is shorter than n_min."""
    tokens, last = history.tokens, len(history) - 1
    for back in range(matched, n_max):
        if len(ends) <= 1 and matched >= n_min:
            break
        want = tokens[last - back]
        kept = [end for end in ends if end >= back and tokens[end - back] == want]
        if not kept:
            break
        matched, ends = back + 1, kept
    return ends[-1], matched


def narrow_many(
    history: TokenHistory, ends: list[int], matched: int, n_min: int, n_max: int
) -> tuple[int, int]:
    """narrow_few in numpy."""
    tokens, last = history.array(), len(history) - 1
    best = np.asarray(ends, dtype=np.int64)
    for back in range(matched, n_max):
        if best.size <= 1 and matched >= n_min:
            break
        kept = best[best >= back]
        kept = kept[tokens[kept - back] == tokens[last - back]]
        if kept.size == 0:
            break
        matched, best = back + 1, kept
    return int(best[-1]), matched


def drafts_after(history: TokenHistory, match: Match, k: int) -> list[int]:
    """The k tokens after a match (fewer at the history's end; none without a match)."""
    return history.tokens[match.start : match.start + k] if match.start >= 0 else []

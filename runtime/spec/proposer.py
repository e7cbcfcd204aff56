"""N-gram prompt lookup: propose the tokens that followed the most recent earlier occurrence of
the longest suffix n-gram of a row's history (ngram_max down to ngram_min). No second model.

A long ngram_max (32) chooses the place being copied: text that repeats its structure (a JSON
list's items, code's similar lines) has many places after the same 4 tokens, and the most recent
is often the output's own previous item, where the place whose match runs furthest back is the
one the model copies (SmolLM2's json, offline, every position drafting 8: 6.1 tokens accepted a
row with ngram_max 32, 4.4 with 4).

One pass per row in numpy: the positions holding the last token are the only candidates; each
step back keeps those that still match, until one is left (or none). Cost is one comparison
over the history plus a few small compares, microseconds at thousands of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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


def history_of(request) -> np.ndarray:
    """A request's (scheduler.request.Request) tokens, prompt then output, as int64 ids."""
    return np.array(request.prompt_token_ids + request.output_token_ids, dtype=np.int64)


class TokenHistories:
    """Each request's tokens as one int64 array, grown as its output grows: rebuilt from the
    lists every step (history_of) it took 25-37 µs a row at 2,000 tokens and 95-110 µs at 8,000,
    where the match itself takes 2-3 µs. A request whose last kept token no longer matches (its
    output went back) is rebuilt."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[np.ndarray, int]] = {}  # id -> (buffer, tokens in it)

    def of(self, request) -> np.ndarray:
        buffer, length = self._rows.get(request.request_id, (None, 0))
        total, num_prompt = request.num_tokens, len(request.prompt_token_ids)
        if (
            buffer is None
            or not num_prompt < length <= total
            or not self._still_holds(request, buffer, length)
        ):
            buffer, length = history_of(request), total
        if total > length:
            if total > buffer.shape[0]:
                buffer = np.concatenate([buffer[:length], np.empty(total, dtype=np.int64)])
            buffer[length:total] = request.output_token_ids[length - num_prompt :]
        self._rows[request.request_id] = (buffer, total)
        return buffer[:total]

    @staticmethod
    def _still_holds(request, buffer: np.ndarray, length: int) -> bool:
        """The last token kept is still the request's at that place."""
        return (
            buffer[length - 1]
            == request.output_token_ids[length - 1 - len(request.prompt_token_ids)]
        )

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)


class NgramProposer:
    def __init__(self, config: NgramConfig):
        self.config = config

    def propose(self, histories: Sequence[np.ndarray], ks: Sequence[int]) -> list[np.ndarray]:
        """histories[i]: row i's token ids (prompt + output) as int array; ks[i]: its chosen k.
        -> per row up to min(k, num_speculative_tokens) draft ids (empty: no match or k = 0)."""
        assert len(histories) == len(ks)
        cap = self.config.num_speculative_tokens
        return [self.propose_one(h, min(k, cap)) for h, k in zip(histories, ks)]

    def propose_one(self, history: np.ndarray, k: int) -> np.ndarray:
        history = np.asarray(history)
        start = self.match_start(history) if k > 0 else -1
        if start < 0:
            return history[:0]
        return history[start : start + k]

    def match_start(self, history: np.ndarray) -> int:
        """Where the draft begins (the position after the matched n-gram), or -1: no match."""
        n_min, n_max = self.config.ngram_min, self.config.ngram_max
        last = history.shape[0] - 1
        if last < n_min:
            return -1
        # candidate ends j < last with history[j] == the last token, kept while they match
        ends = np.flatnonzero(history[:last] == history[last])
        matched, best = 1, ends
        for back in range(1, n_max):
            if best.size <= 1 and matched >= n_min:
                break  # one place left, long enough: matching further changes nothing
            ends = ends[ends >= back]
            ends = ends[history[ends - back] == history[last - back]]
            if ends.size == 0:
                break
            matched, best = back + 1, ends
        if best.size == 0 or matched < n_min:
            return -1
        return int(best[-1]) + 1  # the most recent of the longest matches

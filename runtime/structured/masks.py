"""The token bitmasks of a step's constrained rows: filled on a worker thread while the forward
pass runs, copied to the device in one non-blocking copy from pinned memory (CUDA), and applied
to those rows' logits before any other processing. Unconstrained rows take no part: a step with
no constrained row does no mask work at all, and a mixed batch stays one batch.

A row's bitmask is vocab_size / 32 int32 words, bit t set when token t may come next; columns
past the tokenizer's vocabulary (a model's padded logits) are never allowed.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from runtime.structured.matchers import GrammarMatchers


@dataclass
class GrammarMask:
    """The constrained rows of one step's logits and their allowed tokens, on the device."""

    bitmask: torch.Tensor  # [num_constrained, vocab_words] int32
    rows: torch.Tensor  # [num_constrained] int32 rows of the logits
    covers_all: bool  # every row constrained, in order: no gather

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [num_rows, vocab] float32; disallowed tokens -> -inf, in place when it can."""
        if self.covers_all:
            xgr.apply_token_bitmask_inplace(logits, self.bitmask)
            return logits
        rows = self.rows.long()
        constrained = logits.index_select(0, rows)  # [num_constrained, vocab]
        xgr.apply_token_bitmask_inplace(constrained, self.bitmask)
        return logits.index_copy(0, rows, constrained)


class PendingMask:
    """A mask being filled on the worker thread; `result` waits for it and moves it across."""

    def __init__(self, future: Future, device: torch.device) -> None:
        self.future, self.device = future, device

    def result(self) -> GrammarMask:
        host, num_constrained, covers_all = self.future.result()
        moved = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        words = (host.numel() - num_constrained) // num_constrained
        bitmask = moved[: num_constrained * words].view(num_constrained, words)
        return GrammarMask(bitmask, moved[num_constrained * words :], covers_all)


class MaskBuilder:
    def __init__(self, matchers: GrammarMatchers, vocab_size: int, device: torch.device) -> None:
        self.matchers = matchers
        self.num_words = xgr.get_bitmask_shape(1, vocab_size)[1]
        self.device = device
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-grammar-masks")

    def start(self, request_ids: list[str]) -> PendingMask | None:
        """Start filling the masks of the constrained rows among the step's sampling rows."""
        if not self.matchers:
            return None
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self.matchers]
        if not rows:
            return None
        matchers = [self.matchers.get(request_ids[i]) for i in rows]
        covers_all = len(rows) == len(request_ids)
        return PendingMask(self.executor.submit(self.fill, matchers, rows, covers_all), self.device)

    def fill(self, matchers: list, rows: list[int], covers_all: bool):
        """-> (host buffer: the bitmask [num_rows * words] then the rows, its row count, ...)."""
        num_rows, words = len(rows), self.num_words
        host = torch.empty(num_rows * words + num_rows, dtype=torch.int32, pin_memory=self.pin)
        bitmask = host[: num_rows * words].view(num_rows, words)
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        for i, row in enumerate(rows):  # a few ints, written in place (no new tensor)
            host[num_rows * words + i] = row
        return host, num_rows, covers_all

    @property
    def pin(self) -> bool:
        return self.device.type == "cuda"

    def warm_up(self, vocab_size: int) -> None:
        """Apply an all-allowed mask once to every row and to a row subset, so that the
        device's mask kernel (compiled by xgrammar on first use on CUDA) is ready before the
        first constrained request."""
        logits = torch.zeros(2, vocab_size, device=self.device)
        allowed = torch.full((2, self.num_words), -1, dtype=torch.int32, device=self.device)
        rows = torch.arange(2, dtype=torch.int32, device=self.device)
        GrammarMask(allowed, rows, covers_all=True).apply(logits)
        logits = GrammarMask(allowed[:1], rows[1:], covers_all=False).apply(logits)
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("the grammar mask kernel disallowed tokens of an all-ones mask")

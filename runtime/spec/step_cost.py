"""What a step costs: measured seconds by (rows, tokens), which the speculation policy (policy.py)
prices its drafts with."""

from __future__ import annotations

import bisect
import statistics
from collections import deque

import numpy as np

REFIT_EVERY = 8  # observations between least-squares fits (a fit every step was 3% of SmolLM2's)
SHAPE_SAMPLES = 5  # a shape's seconds: the median of its last this many measures
TOKEN_BLOCK = 8  # a step's tokens up to which it is assumed flat beyond the most measured (the
# 8-bit GEMM's ymm lanes take 1 to 8 rows alike)
MAX_SHAPES_PER_ROWS = 64  # token counts remembered per row count (more: interpolated)


class StepCostModel:
    """Measured seconds per step: a linear function of (rows, tokens), refit on demand every
    REFIT_EVERY observations, corrected by the steps measured at the same row count.

    A CPU step is no linear function of its tokens: the matmul kernel changes with the row count
    and costs the same for every row count within a lane block, so Qwen2.5-Coder-1.5B's step read
    30, 41, 58, 70 and 72 ms at 1, 2, 3, 4 and 8 tokens of one row (Zen 5). Fitted, the line put
    8 tokens at 90 ms and k = 7 never paid. So each (rows, tokens) keeps its measured seconds,
    which predict() returns; between two measured token counts of the same rows it interpolates.
    A shape's seconds are the median of its last SHAPE_SAMPLES measures, not a moving average: on
    a shared host a step now and then takes twice its time, and a plain step's average lifted by
    one such step stayed high while the policy, finding plain steps dear, drafted and measured no
    more of them (a trace read 54-68 ms for plain steps of 47-48 ms, and drafts at k = 1 looked
    10-17% better than they were). Beyond the most measured it assumes the same seconds up to
    TOKEN_BLOCK tokens, then the line's slope, or the line where that is less: extrapolated
    along the line from 3 tokens (57 ms), 8 read 110 ms and k = 7 was never tried, so never
    measured; assumed flat, it is tried once and its measure (72 ms) stands from then on. Not
    past 8 tokens: 16 streams' 16-token step assumed flat to 24 made a batch of first drafts look
    free. And never above the line: anchored at 4 streams' measured 8-token step, 4 rows of 7
    drafts were priced out where the line (the previous rule) had them pay (1.41x against
    1.74x). An entry not measured for `window` steps is dropped (the context grew; a slow
    step's outlier is tried again)."""

    def __init__(self, window: int = 256, min_samples: int = 8, keep_drafted_apart: bool = False):
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        # keep_drafted_apart: steps with drafts in their own window, so that a long run of plain
        # decodes (one token a row: rows and tokens collinear) cannot make the fit forget what a
        # draft token costs (the engine keeps them apart: prompt lookup without a match and a
        # draft model that probes only where drafts pay both leave long runs of plain decodes)
        self.drafted: deque[tuple[int, int, float]] | None = (
            deque(maxlen=window) if keep_drafted_apart else None
        )
        self.window = window
        self._coefficients: tuple[float, float, float] | None = None
        self._since_fit = 0
        self._num_observed = 0
        self._shapes: dict[int, dict[int, MeasuredShape]] = {}  # rows -> {tokens: its measures}
        self._measured_tokens: dict[int, list[int]] = {}  # rows -> its shapes' tokens, sorted

    def observe(self, num_rows: int, num_tokens: int, seconds: float) -> None:
        has_drafts = self.drafted is not None and num_tokens > num_rows
        (self.drafted if has_drafts else self.samples).append((num_rows, num_tokens, seconds))
        self._since_fit += 1
        self._num_observed += 1
        self._remember(num_rows, num_tokens, seconds)
        if self._num_observed % self.window == 0:
            self._forget_stale_shapes()

    def _remember(self, num_rows: int, num_tokens: int, seconds: float) -> None:
        shapes = self._shapes.setdefault(num_rows, {})
        shape = shapes.get(num_tokens)
        if shape is None:
            if len(shapes) >= MAX_SHAPES_PER_ROWS:
                return
            shape = shapes[num_tokens] = MeasuredShape()
            bisect.insort(self._measured_tokens.setdefault(num_rows, []), num_tokens)
        shape.add(seconds, self._num_observed)

    def _forget_stale_shapes(self) -> None:
        oldest = self._num_observed - self.window
        for num_rows, shapes in list(self._shapes.items()):
            kept = {t: shape for t, shape in shapes.items() if shape.last_observed > oldest}
            if kept:
                self._shapes[num_rows], self._measured_tokens[num_rows] = kept, sorted(kept)
            else:
                del self._shapes[num_rows], self._measured_tokens[num_rows]

    @property
    def is_fitted(self) -> bool:
        return len(self.samples) + len(self.drafted or ()) >= self.min_samples

    def coefficients(self) -> tuple[float, float, float]:
        """-> (c0, c_rows, c_tokens), none negative (a cost never falls as work grows); Python
        floats, since predict() runs a few times a step."""
        if self._coefficients is None or self._since_fit >= REFIT_EVERY:
            measured = [*self.samples, *(self.drafted or ())]
            data = np.array(measured, dtype=np.float64)  # [num_samples, 3]
            design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
            fit, *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
            c0, c_rows, c_tokens = np.maximum(fit, 0.0).tolist()
            self._coefficients, self._since_fit = (c0, c_rows, c_tokens), 0
        return self._coefficients

    def fitted(self, num_rows: int, num_tokens: int) -> float:
        """The line's seconds, without the measured shapes."""
        c0, c_rows, c_tokens = self.coefficients()
        return c0 + c_rows * num_rows + c_tokens * num_tokens

    def predict(self, num_rows: int, num_tokens: int) -> float:
        shapes = self._shapes.get(num_rows)
        if not shapes:
            return self.fitted(num_rows, num_tokens)
        exact = shapes.get(num_tokens)
        if exact is not None:
            return exact.seconds
        tokens = self._measured_tokens[num_rows]
        at = bisect.bisect_left(tokens, num_tokens)
        if 0 < at < len(tokens):  # between two measured token counts
            below, above = tokens[at - 1], tokens[at]
            share = (num_tokens - below) / (above - below)
            return (1.0 - share) * shapes[below].seconds + share * shapes[above].seconds
        if at == 0:  # below the fewest measured: the line's slope from there
            slope = self.fitted(num_rows, num_tokens) - self.fitted(num_rows, tokens[0])
            return max(shapes[tokens[0]].seconds + slope, 0.0)
        most = tokens[-1]  # beyond the most measured: flat to TOKEN_BLOCK tokens, then its slope,
        flat_to = max(most, TOKEN_BLOCK)  # or the line itself where that is less
        beyond = self.fitted(num_rows, max(num_tokens, flat_to)) - self.fitted(num_rows, flat_to)
        return min(shapes[most].seconds + beyond, self.fitted(num_rows, num_tokens))


class MeasuredShape:
    """One (rows, tokens) step shape: its last SHAPE_SAMPLES measured seconds, their median
    (`seconds`, kept current: predict() reads it a few times a step) and the observation that
    last measured it."""

    __slots__ = ("last_observed", "measures", "seconds")

    def __init__(self):
        self.measures: deque[float] = deque(maxlen=SHAPE_SAMPLES)
        self.seconds = 0.0
        self.last_observed = 0

    def add(self, seconds: float, observation: int) -> None:
        self.measures.append(seconds)
        self.seconds = statistics.median(self.measures)
        self.last_observed = observation

"""The draft model's greedy token over part of the vocabulary (FR-Spec, arXiv 2502.14856): its
output projection reads only the rows of the `size` lowest token ids and of the tokens the
drafting rows have seen (their prompts and outputs: what a copy copies). A byte-level BPE
vocabulary numbers its tokens in merge order, so the low ids are the frequent ones: of
Qwen2.5-Coder-0.5B's greedy outputs, ids under 32768 were 92% of a code copy's tokens and 98.5%
of a JSON edit's and a story's; the copy's others were in its prompt. Qwen's output projection
(151936 x 896, Q8_0, 145 MB) is read at every draft token; its first 32768 rows are 31 MB.

A draft outside the subset is only a draft the target rejects: the target verifies over its whole
vocabulary, so the output is what it would be without speculation. CPU, GGUF heads: the rows are
a view of the head's blocks (no copy), the seen ones gathered per change of the set.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from runtime.models.quant import QuantizedWeight


class DraftVocabulary:
    def __init__(self, head: QuantizedWeight, size: int) -> None:
        self.size = size
        self.head = head
        self.frequent = QuantizedWeight(head.blocks[:size], head.ggml_type, size, head.in_features)
        self._seen_ids: tuple[int, ...] = ()
        self._seen: QuantizedWeight | None = None

    @classmethod
    def of(cls, model, size: int) -> DraftVocabulary | None:
        """The subset for the model's output projection, or None where it would not help: size 0,
        a vocabulary no larger, a head that is not GGUF blocks on the CPU (floats, GPU planes)."""
        head = model.output_projection
        usable = isinstance(head, QuantizedWeight) and head.blocks.device.type == "cpu"
        if not usable or not 0 < size < head.out_features:
            return None
        return cls(head, size)

    def rare_ids(self, token_ids: Iterable[int]) -> set[int]:
        """The ids among token_ids that the frequent rows lack."""
        return {t for t in token_ids if t >= self.size}

    def greedy(self, hidden: torch.Tensor, seen: set[int]) -> torch.Tensor:
        """hidden [rows, in] -> [rows] int64: per row the id of the largest logit among the
        frequent ids and `seen` (the lower id where two are equal, as argmax)."""
        values, ids = self.frequent.matmul(hidden).max(dim=-1)  # [rows]
        part = self._seen_part(seen)
        if part is None:
            return ids
        seen_values, seen_index = part.matmul(hidden).max(dim=-1)
        seen_ids = torch.tensor(self._seen_ids, dtype=torch.int64)[seen_index]
        return torch.where(seen_values > values, seen_ids, ids)

    def _seen_part(self, seen: set[int]) -> QuantizedWeight | None:
        """The head's rows of the seen ids, gathered again only when the set changes."""
        ids = tuple(sorted(seen))
        if ids != self._seen_ids:
            self._seen_ids, self._seen = ids, None
            if ids:
                rows = self.head.blocks[torch.tensor(ids, dtype=torch.int64)]
                self._seen = QuantizedWeight(
                    rows, self.head.ggml_type, len(ids), self.head.in_features
                )
        return self._seen

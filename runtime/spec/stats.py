"""Speculative decoding counters, named as vLLM's spec_decode metrics under `conveyor:`.

The engine calls `record` once per verified row; the Prometheus exporter reads `snapshot`. As
Prometheus counters, each name is exposed with `_total` appended; the per-position counter has a
`position` label (0 = the first draft)."""

from __future__ import annotations

from dataclasses import dataclass, field

NUM_DRAFTS = "conveyor:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "conveyor:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "conveyor:spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "conveyor:spec_decode_num_accepted_tokens_per_pos"
METRIC_NAMES = (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, NUM_ACCEPTED_TOKENS_PER_POS)


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # rows verified with k >= 1
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_k: dict[int, int] = field(default_factory=dict)  # distribution of chosen k

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One row's verification: k drafts, the first num_accepted of them accepted."""
        assert 0 <= num_accepted <= num_draft_tokens <= self.num_speculative_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1
        self.num_drafts_per_k[num_draft_tokens] = self.num_drafts_per_k.get(num_draft_tokens, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified row, the bonus token included (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> dict[str, int | list[int]]:
        return {
            NUM_DRAFTS: self.num_drafts,
            NUM_DRAFT_TOKENS: self.num_draft_tokens,
            NUM_ACCEPTED_TOKENS: self.num_accepted_tokens,
            NUM_ACCEPTED_TOKENS_PER_POS: list(self.num_accepted_tokens_per_pos),
        }

"""What the scheduler is told: its settings (policy, preemption mode, limits) and the preemption
cost model the runtime measures."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("priority", "fcfs", "static", "dynamic")


# request-level batching: a batch runs to completion before the line is looked at again
BATCH_POLICIES = ("static", "dynamic")


PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_batch_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "priority"
    preemption_mode: str = "auto"
    priority_aging_s: float | None = None
    batch_window_s: float = 0.05  # dynamic: the oldest waiting request waits at most this long

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, not {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}")
        if self.max_num_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_num_seqs and max_batch_tokens must be positive")
        if self.batch_window_s < 0:
            raise ValueError("batch_window_s must not be negative")


@dataclass
class PreemptionCostModel:
    """Numbers measured by the runtime at start-up; the scheduler compares seconds."""

    bytes_per_block: int = 0
    copy_bytes_per_s: float = 1e10
    prefill_tokens_per_s: float = 1e4

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s  # out and back in

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

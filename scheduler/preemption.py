"""Preemption: how a victim gives its KV blocks back, swapped out to the CPU pool or freed to be
recomputed later (forced by config, or chosen by comparing the measured costs), and the facts
of it recorded on the victim. The scheduler chooses the victim and moves it between its lines."""

from __future__ import annotations

from scheduler import events as ev
from scheduler.block_manager import BlockManager
from scheduler.config import PreemptionCostModel, SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus


class Preemption:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, cost_model: PreemptionCostModel
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.cost_model = cost_model
        self.num_preemptions = {"swap": 0, "recompute": 0}

    def choose_mode(self, victim: Request) -> str:
        bm = self.block_manager
        mode = self.config.preemption_mode
        if mode == "recompute" or not bm.can_swap_out(victim) or not victim.block_ids:
            return "recompute"
        if mode == "swap":
            return "swap"
        swap_cost = self.cost_model.swap_seconds(len(victim.block_ids))
        recompute_cost = self.cost_model.recompute_seconds(victim.num_computed_tokens)
        return "swap" if swap_cost < recompute_cost else "recompute"

    def preempt(self, victim: Request, by: Request, out: SchedulerOutput, now: float) -> str:
        """Take the victim's blocks back and record why; returns the mode. The victim's row
        leaves the runner's batch (it rejoins whole when it resumes)."""
        mode = self.choose_mode(victim)
        num_blocks = len(victim.block_ids)
        if mode == "swap":
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
        else:
            self.block_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        victim.preempted_mode = mode
        victim.wait_reason = None
        victim.has_row = False
        self.num_preemptions[mode] += 1
        out.preempted.append(victim)
        ev.emit(
            victim,
            ev.PREEMPTED,
            now,
            mode=mode,
            by=by.request_id,
            by_tenant=by.tenant,
            by_priority=by.priority,
            num_blocks=num_blocks,
        )
        return mode

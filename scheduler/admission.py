"""Admitting the line (waiting and swapped requests, in line order) into a step: a running slot,
KV blocks (prefix-cache hits first), a swap-in, preempting strictly less urgent running requests
when the line's head cannot otherwise get in, and the wait recorded for everyone left behind.

`LineAdmission` is a part of `Scheduler` (it reads and writes the scheduler's lines); it lives
apart because a steady decode step never runs it.
"""

from __future__ import annotations

from scheduler import events as ev
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus


class LineAdmission:
    def _schedule_line(self, out: SchedulerOutput, now: float) -> None:
        line = sorted(self.waiting + self.swapped, key=lambda r: self.order.line_key(r, now))
        for index in range(len(line)):
            request = line[index]
            if out.budget == 0:
                for behind in line[index:]:
                    self._record_wait(
                        behind,
                        ev.WAITING_FOR_BUDGET,
                        now,
                        max_batch_tokens=self.config.max_batch_tokens,
                        num_scheduled=len(out.scheduled),
                    )
                return
            blocker = self._preempted_ahead_of(request, out, now)
            if blocker is None and self._admit(request, out, now):
                # the admitted tenant was just charged: the others may now come first
                line[index + 1 :] = sorted(
                    line[index + 1 :], key=lambda r: self.order.line_key(r, now)
                )
                continue
            blocker = blocker or request
            for behind in line[index + (blocker is request) :]:
                self._record_wait(
                    behind,
                    ev.WAITING_BEHIND,
                    now,
                    by=blocker.request_id,
                    by_tenant=blocker.tenant,
                    by_priority=blocker.priority,
                )
            return

    def _preempted_ahead_of(
        self, request: Request, out: SchedulerOutput, now: float
    ) -> Request | None:
        """A request preempted this step keeps its place: nobody behind it gets in now."""
        key = self.order.line_key(request, now)
        return next((r for r in out.preempted if self.order.line_key(r, now) <= key), None)

    def _admit(self, request: Request, out: SchedulerOutput, now: float) -> bool:
        if not self._make_room_for_slot(request, out, now):
            self._record_wait(request, ev.WAITING_FOR_SLOT, now, num_running=len(self.running))
            return False
        if request.status is RequestStatus.SWAPPED:
            return self._swap_in(request, out, now)
        if (
            self.block_manager.num_blocks_for(request.num_tokens)
            > self.block_manager.num_gpu_blocks
        ):
            self._finish_out_of_cache(request, now)  # a recomputed request that outgrew the cache
            return True
        cached = self.block_manager.find_cached_blocks(request)
        num_cached_tokens = len(cached) * self.block_manager.block_size
        num_new = min(request.num_tokens - num_cached_tokens, out.budget)
        request.num_computed_tokens = num_cached_tokens
        if not self._make_room_for_blocks(request, num_new, cached, out, now):
            request.num_computed_tokens = 0
            return False
        self.block_manager.allocate(request, num_new, cached)
        self.block_manager.num_prefix_queries += request.num_tokens
        self.block_manager.num_prefix_hits += num_cached_tokens
        request.num_cached_prefix_tokens = num_cached_tokens
        self.waiting.remove(request)
        self._start_running(request, now)
        self._add_to_step(out, request, num_new, now)
        return True

    def _swap_in(self, request: Request, out: SchedulerOutput, now: float) -> bool:
        num_new = min(request.num_tokens - request.num_computed_tokens, out.budget)
        extra = self.block_manager.num_blocks_for(request.num_computed_tokens + num_new)
        extra -= len(request.cpu_block_ids)
        if not self._make_room_for_blocks(
            request, num_new, [], out, now, held=len(request.cpu_block_ids) + extra
        ):
            return False
        num_blocks = len(request.cpu_block_ids)
        out.blocks_to_swap_in.extend(self.block_manager.swap_in(request))
        self.block_manager.allocate(request, num_new)
        ev.emit(request, ev.SWAPPED_IN, now, num_blocks=num_blocks)
        self.swapped.remove(request)
        self._start_running(request, now)
        self._add_to_step(out, request, num_new, now)
        return True

    def _make_room_for_slot(self, request: Request, out: SchedulerOutput, now: float) -> bool:
        while len(self.running) >= self.config.max_num_seqs:
            if not self._preempt_less_urgent(request, out, now):
                return False
        return True

    def _make_room_for_blocks(
        self, request, num_new, cached, out, now, held: int | None = None
    ) -> bool:
        bm = self.block_manager
        while not self._fits(request, num_new, cached, held):
            if not self._preempt_less_urgent(request, out, now):
                needed = (
                    held
                    if held is not None
                    else bm.num_blocks_needed(request, num_new, len(cached))
                )
                self._record_wait(
                    request,
                    ev.WAITING_FOR_KV,
                    now,
                    blocks_needed=needed,
                    blocks_free=bm.num_free_gpu_blocks,
                )
                return False
        return True

    def _fits(self, request: Request, num_new: int, cached: list[int], held: int | None) -> bool:
        if held is not None:
            return held <= self.block_manager.num_free_gpu_blocks
        return self.block_manager.can_allocate(request, num_new, cached)

    def _preempt_less_urgent(self, request: Request, out: SchedulerOutput, now: float) -> bool:
        if not self.running:
            return False
        victim = max(self.running, key=lambda r: self.order.urgency(r, now))
        if not self.order.more_urgent(request, victim, now):
            return False
        self._unschedule(out, victim)
        self._preempt(victim, by=request, out=out, now=now)
        return True

    def _unschedule(self, out: SchedulerOutput, victim: Request) -> None:
        for i, (request, num_tokens) in enumerate(out.scheduled):
            if request is victim:
                del out.scheduled[i]
                out.budget += num_tokens
                self.order.charge(victim, -num_tokens)
                return

"""Token-level continuous batching with priorities, tenant fair share and preemption.

Each step hands out a token budget: running requests first (most urgent first; a decode is one
token, a prefill a chunk), then the waiting line (recompute-preempted and new requests) and the
swapped requests, merged in one order: priority, then the tenant's weighted service, then arrival.
A more urgent request that cannot get a running slot or KV blocks preempts strictly less urgent
running requests; a running request that cannot grow preempts the least urgent one, maybe itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from scheduler import events as ev
from scheduler.block_manager import BlockManager
from scheduler.config import BATCH_POLICIES, PreemptionCostModel, SchedulerConfig, SchedulerOutput
from scheduler.ordering import LineOrder
from scheduler.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        cost_model: PreemptionCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.cost_model = cost_model or PreemptionCostModel()
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.order = LineOrder(config)
        self.num_preemptions = {"swap": 0, "recompute": 0}

    # ---- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.order.start_fair_share(request.tenant, (r.tenant for r in self.requests.values()))
        now = self.clock()
        key = self.order.line_key(request, now)
        ahead = [r for r in self.waiting + self.swapped if self.order.line_key(r, now) < key]
        self.requests[request.request_id] = request
        self.waiting.append(request)
        ev.emit(
            request,
            ev.QUEUED,
            now,
            position=len(ahead),
            num_ahead=len(ahead),
            num_running=len(self.running),
            ahead_tenants=sorted({r.tenant for r in ahead}),
            ahead_priorities=sorted({r.priority for r in ahead}),
        )
        if self.config.policy in BATCH_POLICIES and not self.can_admit(now):
            ev.emit(
                request,
                ev.WAITING_FOR_BATCH,
                now,
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                batch_size=self.config.max_num_seqs,
                window_s=self.config.batch_window_s,
            )

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        ev.emit(request, ev.ABORTED, self.clock(), status=request.status.value)
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        self.block_manager.free(request)
        request.status = status
        self.requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(budget=self.config.max_batch_tokens)
        self._schedule_running(out, now)
        if self.can_admit(now):
            self._schedule_line(out, now)
        return out

    def can_admit(self, now: float) -> bool:
        """Continuous policies admit every step. A static or dynamic batch runs to completion
        first; a dynamic batch then starts once `max_num_seqs` requests wait or the oldest has
        waited `batch_window_s`."""
        if self.config.policy not in BATCH_POLICIES:
            return True
        if self.running:
            return False
        if self.config.policy == "static" or self.swapped:
            return True
        return self.seconds_until_batch(now) == 0.0

    def seconds_until_batch(self, now: float) -> float:
        """Dynamic batching: how long until the waiting line forms a batch (0: it does now)."""
        if not self.waiting or len(self.waiting) >= self.config.max_num_seqs:
            return 0.0
        oldest = min(request.arrival_time for request in self.waiting)
        return max(0.0, oldest + self.config.batch_window_s - now)

    def seconds_until_runnable(self) -> float:
        """How long the engine may sleep before a step could do anything (0: step now)."""
        if self.config.policy != "dynamic" or self.running or self.swapped:
            return 0.0
        return self.seconds_until_batch(self.clock())

    def _schedule_running(self, out: SchedulerOutput, now: float) -> None:
        for request in sorted(self.running, key=lambda r: self.order.urgency(r, now)):
            if request.status is not RequestStatus.RUNNING or out.budget == 0:
                continue
            if self._ends_with_pending_token(request):
                continue  # its last token is on its way: it finishes when that lands
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, out.budget)
            if self._exceeds_cache(request, num_new):
                self._finish_out_of_cache(request, now)
                continue
            while not self.block_manager.allocate(request, num_new):
                victim = self._least_urgent_unscheduled(out, now)
                self._preempt(victim, by=request, out=out, now=now)
                if victim is request:
                    break
            else:
                self._add_to_step(out, request, num_new, now)

    def _ends_with_pending_token(self, request: Request) -> bool:
        """Async scheduling: the token in flight is the request's last by length."""
        pending = request.num_pending_tokens
        return pending > 0 and self._reaches_length(request, num_ahead=pending)

    def _reaches_length(self, request: Request, num_ahead: int = 0) -> bool:
        """At max_tokens or the model's length, counting num_ahead tokens not appended yet."""
        return (
            request.num_output_tokens + num_ahead >= request.sampling_params.max_tokens
            or request.num_tokens + num_ahead >= self.config.max_model_len
        )

    def _exceeds_cache(self, request: Request, num_new: int) -> bool:
        bm = self.block_manager
        return bm.num_blocks_for(request.num_computed_tokens + num_new) > bm.num_gpu_blocks

    def _finish_out_of_cache(self, request: Request, now: float) -> None:
        """The whole KV cache cannot hold the request's next token: it ends as if at max length."""
        bm = self.block_manager
        needed = bm.num_blocks_for(request.num_tokens)
        self._record_wait(
            request, ev.WAITING_FOR_KV, now, blocks_needed=needed, blocks_free=bm.num_gpu_blocks
        )
        self.finish_with_event(request, RequestStatus.FINISHED_LENGTH)

    def _least_urgent_unscheduled(self, out: SchedulerOutput, now: float) -> Request:
        scheduled = {id(r) for r, _ in out.scheduled}
        candidates = [r for r in self.running if id(r) not in scheduled]
        return max(candidates, key=lambda r: self.order.urgency(r, now))

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

    # ---- preemption -------------------------------------------------------------------------
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

    def _preempt(self, victim: Request, by: Request, out: SchedulerOutput, now: float) -> None:
        mode = self.choose_mode(victim)
        num_blocks = len(victim.block_ids)
        self.running.remove(victim)
        if mode == "swap":
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            self.block_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self.waiting.append(victim)
        victim.num_preemptions += 1
        victim.preempted_mode = mode
        victim.wait_reason = None
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

    # ---- bookkeeping ------------------------------------------------------------------------
    def _start_running(self, request: Request, now: float) -> None:
        if request.preempted_mode == "recompute":
            ev.emit(
                request,
                ev.RECOMPUTE_STARTED,
                now,
                num_tokens=request.num_tokens,
                num_cached_tokens=request.num_computed_tokens,
            )
        if request.preempted_mode is not None:
            ev.emit(request, ev.RESUMED, now, mode=request.preempted_mode)
        request.admitted_priority = self.order.effective_priority(request, now)
        request.preempted_mode = None
        request.wait_reason = None
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _add_to_step(
        self, out: SchedulerOutput, request: Request, num_new: int, now: float
    ) -> None:
        out.scheduled.append((request, num_new))
        out.budget -= num_new
        # charged now, not after the step, so that the rest of this step's line sees it
        self.order.charge(request, num_new)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            ev.emit(
                request,
                ev.SCHEDULED,
                now,
                num_tokens=num_new,
                queue_time=now - request.arrival_time,
                num_cached_tokens=request.num_cached_prefix_tokens,
            )

    def _record_wait(self, request: Request, kind: str, now: float, **facts) -> None:
        if request.wait_reason == kind:
            return
        request.wait_reason = kind
        ev.emit(request, kind, now, **facts)

    # ---- after the model ran ----------------------------------------------------------------
    def mark_launched(self, out: SchedulerOutput) -> None:
        """The step is queued on the device: its tokens count as computed, and each request
        whose tokens it reaches the end of has one token pending until update_from_output."""
        for request, num_tokens in out.scheduled:
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens == request.num_tokens_with_pending:
                request.num_pending_tokens += 1

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """A launched step's tokens have landed: append them, finish on a stop condition.
        Returns the requests that got a new token, in step order."""
        advanced = []
        for request, _ in out.scheduled:
            if request.is_finished:
                continue  # aborted (or stopped by an earlier step) while the step ran
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue
            request.num_pending_tokens -= 1
            request.output_token_ids.append(token_id)
            advanced.append(request)
            status = self.check_stop(request, token_id)
            if status is not None:
                self.finish_with_event(request, status)
        return advanced

    def check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if self._reaches_length(request):
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_with_event(self, request: Request, status: RequestStatus) -> None:
        self.finish(request, status)
        request.finish_reason = {"finished_stopped": "stop", "finished_length": "length"}.get(
            status.value, "abort"
        )
        ev.emit(
            request,
            ev.FINISHED,
            self.clock(),
            reason=request.finish_reason,
            num_output_tokens=request.num_output_tokens,
        )

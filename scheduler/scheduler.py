"""Token-level continuous batching with priorities, tenant fair share and preemption.

Who goes first (`LineOrder`): a request's effective (aged) priority, its tenant's weighted
service (fair share between tenants), then arrival.

Each step hands out a token budget: running requests first (most urgent first; a decode is one
token, a prefill a chunk), then the waiting line (recompute-preempted and new requests) and the
swapped requests, merged in one order: priority, then the tenant's weighted service, then arrival.
A more urgent request that cannot get a running slot or KV blocks preempts strictly less urgent
running requests; a running request that cannot grow preempts the least urgent one, maybe itself.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable

from scheduler import events as ev
from scheduler.admission import LineAdmission
from scheduler.block_manager import BlockManager
from scheduler.config import BATCH_POLICIES, PreemptionCostModel, SchedulerConfig
from scheduler.drafts import Drafter, land_drafts, schedule_drafts
from scheduler.output import RowAppend, SchedulerOutput, new_row
from scheduler.preemption import Preemption
from scheduler.request import Request, RequestStatus


class LineOrder:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.tenant_service: dict[str, float] = defaultdict(float)  # weighted tokens served

    @property
    def by_priority(self) -> bool:
        return self.config.policy == "priority"

    def effective_priority(self, request: Request, now: float) -> int:
        """With aging, a waiting request gains a level per `priority_aging_s` since it arrived;
        a running one keeps the level it was admitted at."""
        aging = self.config.priority_aging_s
        if not aging or not self.by_priority:
            return request.priority
        if request.status is RequestStatus.RUNNING and request.admitted_priority is not None:
            return request.admitted_priority
        return request.priority - int((now - request.arrival_time) / aging)

    def urgency(self, request: Request, now: float) -> tuple:
        """Smaller is more urgent; the largest is the first preemption victim."""
        if self.by_priority:
            return (self.effective_priority(request, now), request.arrival_time, request.seq)
        return (request.arrival_time, request.seq)

    def line_key(self, request: Request, now: float) -> tuple:
        if not self.by_priority:
            return (request.arrival_time, request.seq)
        service = self.tenant_service[request.tenant]
        return (self.effective_priority(request, now), service, request.arrival_time, request.seq)

    def more_urgent(self, request: Request, than: Request, now: float) -> bool:
        if not self.by_priority:
            return False
        return self.effective_priority(request, now) < self.effective_priority(than, now)

    def start_fair_share(self, tenant: str, active_tenants: Iterable[str]) -> None:
        """A tenant new to the line starts at the current minimum, so it cannot bank credit."""
        if tenant in self.tenant_service:
            return
        service = self.tenant_service
        floor = min((service[t] for t in set(active_tenants) if t in service), default=0.0)
        service[tenant] = floor

    def charge(self, request: Request, num_tokens: int) -> None:
        """Count tokens handed to the request (negative: handed back) against its tenant."""
        self.tenant_service[request.tenant] += num_tokens / request.weight


class Scheduler(LineAdmission):
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        cost_model: PreemptionCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.preemption = Preemption(config, block_manager, cost_model or PreemptionCostModel())
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.order = LineOrder(config)
        self.left_ids: list[str] = []  # requests whose rows left the batch since the last step
        self.drafter = drafter  # speculative decoding's proposer; None: off

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
        if request.has_row:
            request.has_row = False
            self.left_ids.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(budget=self.config.max_batch_tokens)
        self._schedule_running(out, now)
        if (self.waiting or self.swapped) and self.can_admit(now):
            self._schedule_line(out, now)
        if self.drafter is not None:
            schedule_drafts(out, self.drafter, self.block_manager, self.config.max_model_len)
        self._tell_rows(out)
        return out

    def _tell_rows(self, out: SchedulerOutput) -> None:
        """What the runner's batch must apply: the rows that left it, the rows that join it and
        what the others gained since they were last scheduled."""
        out.finished_ids, self.left_ids = self.left_ids, []
        for request, _ in out.scheduled:
            if not request.has_row:
                out.new_rows.append(new_row(request))
                request.has_row = True
            elif (
                request.num_tokens > request.num_told_tokens
                or len(request.block_ids) > request.num_told_blocks
            ):
                new_outputs = request.num_told_tokens - request.num_prompt_tokens
                out.appends.append(
                    RowAppend(
                        request.request_id,
                        request.output_token_ids[new_outputs:],
                        request.block_ids[request.num_told_blocks :],
                        request.num_told_blocks,
                    )
                )
            request.num_told_tokens = request.num_tokens
            request.num_told_blocks = len(request.block_ids)

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
            if self._inside_last_block(request, num_new):
                self._add_to_step(out, request, num_new, now)
                continue
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

    def _inside_last_block(self, request: Request, num_new: int) -> bool:
        """The tokens stay inside the request's last block without filling it: no block to
        allocate and none to register for prefix caching, so the block manager is not asked."""
        bm = self.block_manager
        end = request.num_computed_tokens + num_new
        if end >= len(request.block_ids) * bm.block_size:
            return False
        return not bm.enable_prefix_caching or end // bm.block_size <= len(request.block_hashes)

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

    # ---- preemption -------------------------------------------------------------------------
    @property
    def num_preemptions(self) -> dict[str, int]:
        return self.preemption.num_preemptions

    @property
    def cost_model(self) -> PreemptionCostModel:
        return self.preemption.cost_model

    def choose_mode(self, victim: Request) -> str:
        return self.preemption.choose_mode(victim)

    def _preempt(self, victim: Request, by: Request, out: SchedulerOutput, now: float) -> None:
        self.running.remove(victim)
        mode = self.preemption.preempt(victim, by, out, now)
        (self.swapped if mode == "swap" else self.waiting).append(victim)

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
        elif not request.output_token_ids and not request.num_pending_tokens:
            ev.emit(
                request,
                ev.PREFILL_CHUNK,
                now,
                num_tokens=num_new,
                num_computed_tokens=request.num_computed_tokens,
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

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[tuple[Request, int]]:
        """A launched step's tokens have landed (one per sampling row today; a row may bring
        several): append them in order until a stop condition finishes the request. Returns
        each request that got tokens and how many it kept, in step order."""
        advanced = []
        for request, _ in out.scheduled:
            if request.is_finished:
                continue  # aborted (or stopped by an earlier step) while the step ran
            token_ids = sampled.get(request.request_id)
            if not token_ids:
                continue
            request.num_pending_tokens -= 1
            advanced.append((request, self._append_until_stop(request, token_ids)))
            if request.request_id in out.draft_token_ids:
                land_drafts(request, len(token_ids), self.block_manager)
        return advanced

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> int:
        for num_kept, token_id in enumerate(token_ids, start=1):
            request.output_token_ids.append(token_id)
            status = self.check_stop(request, token_id)
            if status is not None:
                self.finish_with_event(request, status)
                return num_kept
        return len(token_ids)

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

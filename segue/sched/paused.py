"""Paused (intercepted) requests: applying dispositions each step, budgeted chunked swapping,
and resumption (InferCept §4). Owned by the Scheduler; pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field

from segue.kv.manager import KVCacheManager
from segue.request import Disposition, Interception, Request, RequestStatus
from segue.sched.cost_model import CostModel
from segue.sched.interception import InterceptionPolicy, PausedRequest, StepState


@dataclass
class SwapPlan:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    ready: list[Request] = field(default_factory=list)             # back on the device, runnable


class PausedRequests:
    def __init__(self, kv: KVCacheManager, policy: InterceptionPolicy, cost: CostModel) -> None:
        self.kv = kv
        self.policy = policy
        self.cost = cost
        self.paused: dict[str, Request] = {}
        # Resumed requests whose context is partly on the host, in swap-in order.
        self.swapped: list[Request] = []
        # Fully swapped in during the last step; runnable once that step's copies are done.
        self._landing: list[Request] = []

    def intercept(self, req: Request, now: float, tool: str | None, expected_s: float | None) -> None:
        req.status = RequestStatus.INTERCEPTED
        req.interception = Interception(t_call=now, tool=tool, expected_duration=expected_s)
        req.interceptions.append(req.interception)
        self.paused[req.request_id] = req

    def resume(self, req: Request, tokens: list[int], now: float) -> bool:
        """The interception ended; `tokens` (the tool result) join the context. Returns True when
        the request can queue for compute now, False when it must first swap in."""
        del self.paused[req.request_id]
        req.interception.t_resume = now
        req.interception = None
        req.output_token_ids.extend(tokens)
        req.num_appended_tokens += len(tokens)
        if not self.policy.keeps_arrival_time:
            req.sched_arrival_time = now
        if self.kv.num_host_blocks_of(req.request_id):
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            self.swapped.sort(key=lambda r: (r.sched_arrival_time, r.seq_no))
            return False
        req.status = RequestStatus.WAITING
        return True

    @property
    def landing(self) -> list[Request]:
        return list(self._landing)

    def remove(self, req: Request) -> None:
        self.paused.pop(req.request_id, None)
        if req in self.swapped:
            self.swapped.remove(req)
        if req in self._landing:
            self._landing.remove(req)

    def device_tokens(self, req: Request) -> int:
        held = self.kv.num_device_blocks_of(req.request_id) * self.kv.block_size
        host = self.kv.num_host_blocks_of(req.request_id) * self.kv.block_size
        return max(0, min(held, req.num_computed_tokens - host))

    def held_device_blocks(self) -> int:
        return sum(self.kv.num_device_blocks_of(rid) for rid in self.paused)

    def plan(self, now: float, running_tokens: int, num_running: int, batch_tokens: int,
             keep_free_blocks: int = 0) -> SwapPlan:
        """Spend this step's swap limit: swap-in for resumed requests first (in `swapped` order;
        they are ready to run) without going below `keep_free_blocks` free device blocks, the rest
        as the swap-out budget the policy hands to paused requests."""
        plan = SwapPlan(ready=self._landing)
        self._landing = []
        bs = self.kv.block_size
        limit_blocks = max(1, self.cost.swap_limit(batch_tokens) // bs)
        for req in list(self.swapped):
            room = self.kv.num_free_blocks - keep_free_blocks
            if keep_free_blocks and room < self.kv.num_host_blocks_of(req.request_id):
                break  # a part brought in now would only be swapped out again to keep the floor
            moved = self.kv.swap_in_blocks(req, min(limit_blocks, room))
            plan.swap_in += moved
            limit_blocks -= len(moved)
            if not self.kv.num_host_blocks_of(req.request_id):
                self.swapped.remove(req)
                self._landing.append(req)
            elif not moved:
                break  # no free device blocks: later requests would not fit either
        if not self.policy.acts_on_paused:
            return plan
        views = []
        tables = self.kv.tables
        for rid, req in self.paused.items():
            if not tables.get(rid):
                continue  # nothing left on the device to decide about
            dev = self.device_tokens(req)
            elapsed = now - req.interception.t_call
            views.append(PausedRequest(req, dev, self.kv.num_host_blocks_of(req.request_id) * bs,
                                       elapsed, req.interception.expected_duration))
        if not views:
            return plan
        # The swap-out limit applies to budgeted policies; `swap` asks for everything and the
        # copies past the free limit stall the step (accounted as swap waste).
        state = StepState(now, running_tokens, num_running, limit_blocks * bs, self.cost)
        for rid, decision in self.policy.decide(views, state).items():
            req = self.paused[rid]
            req.interception.disposition = decision.disposition
            if decision.disposition is Disposition.SWAP and decision.swap_out_tokens > 0:
                plan.swap_out += self.kv.swap_out_blocks(req, -(-decision.swap_out_tokens // bs))
            elif decision.disposition is Disposition.DISCARD:
                self.kv.discard_device_blocks(req)
        return plan

    def release_for_memory(self, blocks_needed: int) -> int:
        """Under memory pressure, discard preserved contexts (largest first) before preempting
        running requests: a paused request makes no progress with its memory. Returns blocks freed."""
        freed = 0
        victims = sorted(self.paused.values(), key=lambda r: self.kv.num_device_blocks_of(r.request_id),
                         reverse=True)
        for req in victims:
            if freed >= blocks_needed:
                break
            n = self.kv.num_device_blocks_of(req.request_id)
            if n:
                before = self.kv.num_free_blocks
                self.kv.discard_device_blocks(req)
                req.interception.disposition = Disposition.DISCARD
                freed += self.kv.num_free_blocks - before
        return freed

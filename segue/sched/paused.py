"""Paused (intercepted) requests: the dispositions chosen each step, budgeted chunked swapping,
and resumption (InferCept §4). Owned by the Scheduler. What it chooses to give up (the interception
policy's decisions, the order contexts go in under memory pressure, an abandoned request) it
returns; sched/memory_kept.py releases it with the KV manager. Pure Python."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from segue.kv.interface import KVCache
from segue.request import Disposition, Interception, Request, RequestStatus
from segue.sched.cost_model import CostModel
from segue.sched.interception import Decision, InterceptionPolicy, PausedRequest, StepState


@dataclass
class SwapPlan:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    ready: list[Request] = field(default_factory=list)             # back on the device, runnable
    # The interception policy's decisions, in its order, and the swap-out budget in tokens they
    # were made within: sched/memory_kept.py carries them out (and fills swap_out).
    decisions: dict[str, Decision] = field(default_factory=dict)
    swap_out_budget: int = 0


def _pause_of(req: Request) -> Interception:
    """A paused request's interception: set by intercept() and cleared only by resume()."""
    assert req.interception is not None, f"{req.request_id} is not paused"
    return req.interception


class PausedRequests:
    def __init__(self, kv: KVCache, policy: InterceptionPolicy, cost: CostModel) -> None:
        self.kv = kv
        self.policy = policy
        self.cost = cost
        self.paused: dict[str, Request] = {}
        # Resumed requests whose context is partly on the host, in swap-in order.
        self.swapped: list[Request] = []
        # Fully swapped in during the last step; runnable once that step's copies are done.
        self._landing: list[Request] = []

    def intercept(self, req: Request, now: float, tool: str | None, expected_s: float | None,
                  turn_end: bool = False) -> None:
        req.status = RequestStatus.INTERCEPTED
        req.interception = Interception(t_call=now, tool=tool, expected_duration=expected_s, turn_end=turn_end)
        req.interceptions.append(req.interception)
        self.paused[req.request_id] = req

    def resume(self, req: Request, tokens: list[int], now: float) -> bool:
        """The interception ended; `tokens` (the tool result) join the context. Returns True when
        the request can queue for compute now, False when it must first swap in."""
        del self.paused[req.request_id]
        _pause_of(req).t_resume = now
        req.interception = None
        req.output_token_ids.extend(tokens)
        req.num_appended_tokens += len(tokens)
        if not self.policy.keeps_arrival_time:
            req.sched_arrival_time = now
        if self.kv.held(req.request_id).host:
            self.enqueue_swapped(req)
            return False
        req.status = RequestStatus.WAITING
        return True

    def truncate(self, req: Request, keep: int) -> None:
        """Cut a paused request's context after its first `keep` tokens (never into the prompt),
        before a resume appends what replaces them: a turn whose history the next turn renders
        differently (a cut inside a character, a skipped special token, a stop string)."""
        assert req.request_id in self.paused, f"{req.request_id} is not paused"
        assert req.num_prompt_tokens <= keep <= req.num_tokens, f"{req.request_id}: cannot keep {keep} tokens"
        self.kv.truncate(req, keep)
        req.num_cut_tokens += req.num_tokens - keep
        del req.output_token_ids[keep - req.num_prompt_tokens:]
        # The tokens from `keep` on are new: computing them is not a recompute.
        req.max_computed_tokens = min(req.max_computed_tokens, keep)

    def enqueue_swapped(self, req: Request) -> None:
        """Queue a request with part of its context on the host for swap-in."""
        req.status = RequestStatus.SWAPPED
        self.swapped.append(req)
        self.swapped.sort(key=lambda r: (r.sched_arrival_time, r.seq_no))

    def begin_swap_in(self, req: Request, max_blocks: int) -> list[tuple[int, int]]:
        """Start bringing a request's host part in within this step (a host-tier hit at
        admission); the rest follows in later steps' swap-ins. Returns this step's copies."""
        moved = self.kv.swap_in(req, max_blocks)
        if moved.on_host:
            self.enqueue_swapped(req)
        else:
            req.status = RequestStatus.SWAPPED
            self._landing.append(req)
        return moved.copies

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
        """The context tokens a disposition can act on: those in blocks the request holds alone.
        Blocks shared through the prefix cache (a common system prompt) stay on the device for
        the requests that share them, whatever happens to this one."""
        return self.kv.private_device_tokens(req)

    def held_device_blocks(self) -> int:
        """Device blocks held by paused requests alone (memory that produces no token)."""
        return sum(self.kv.num_private_blocks_of(rid) for rid in self.paused)

    # ---- when a paused request is expected back ------------------------------------------
    def expected_resume_at(self, req: Request, now: float) -> float:
        """The predicted resume time: the known or predicted duration, else InferCept's dynamic
        estimate (a pause expected to last as long again as it has lasted so far; once overdue,
        as long again as it is overdue)."""
        it = _pause_of(req)
        if it.expected_duration is None:
            return now + (now - it.t_call)
        due = it.t_call + it.expected_duration
        return due if due >= now else now + (now - due)  # overdue: it decays like any estimate

    def set_expected_resume(self, request_id: str, t: float) -> bool:
        """A client or predictor says when this paused request will be continued (absolute time;
        math.inf: never). Feeds the policies' duration estimate and the eviction order of its
        blocks once released. False if the request is not paused."""
        req = self.paused.get(request_id)
        if req is None:
            return False
        it = _pause_of(req)
        it.expected_duration = max(0.0, t - it.t_call)
        return True

    def abandon(self, request_id: str) -> Request | None:
        """Nobody is expected to continue this paused request (say, the last turn of a session
        whose client went away): it is expected back never, and its context is the caller's to
        release now, first in line for eviction. It stays resumable; a resume recomputes only
        what was evicted meanwhile. None if it is not paused."""
        req = self.paused.get(request_id)
        if req is not None:
            _pause_of(req).expected_duration = math.inf
        return req

    def known_resume_at(self, req: Request) -> float | None:
        """When a released context's blocks are expected back (their key in the prefix cache):
        the known or predicted resume time. Without one, the blocks join the cache's
        least-recently-released order, which is the dynamic estimate's order: a pause that began
        earlier is expected to last longer (t_call + 2·elapsed), so it is evicted first; a key
        fixed at release time would evict the newest pause first instead (simulator, 32 agents
        sharing a system prompt, discard policy: 1.64 vs 0.38 GB*s of recompute)."""
        it = _pause_of(req)
        return None if it.expected_duration is None else it.t_call + it.expected_duration

    def set_disposition(self, req: Request, disposition: Disposition) -> None:
        _pause_of(req).disposition = disposition

    def plan(self, now: float, running_tokens: int, num_running: int,
             keep_free_blocks: int = 0) -> SwapPlan:
        """Spend this step's link budget (KVCounters.link_budget, opened by the scheduler) first: swap-in
        for resumed requests (in `swapped` order; they are ready to run) without going below
        `keep_free_blocks` free device blocks, the rest as the swap-out budget the policy hands
        to paused requests, within which the interception policy decides about each paused
        context (the plan's decisions, for sched/memory_kept.py to carry out). What is left goes
        to the rest of the step's copies."""
        plan = SwapPlan(ready=self._landing)
        self._landing = []
        bs = self.kv.block_size
        # At least one block, so that a swap-in progresses on a link too slow for a whole block
        # per step. No write-back draws on the budget yet, so this tracks the link's budget.
        limit_blocks = max(1, self.kv.counters().link_budget)
        for req in list(self.swapped):
            room = self.kv.counters().num_free_blocks - keep_free_blocks
            if keep_free_blocks and room < self.kv.held(req.request_id).host:
                break  # a part brought in now would only be swapped out again to keep the floor
            moved = self.kv.swap_in(req, min(limit_blocks, room))
            plan.swap_in += moved.copies
            limit_blocks -= len(moved.copies)
            if not moved.on_host:
                self.swapped.remove(req)
                # Blocks the device cache still held came back without a copy: nothing to wait for.
                (self._landing if moved.copies else plan.ready).append(req)
            elif not moved.blocks:
                break  # no free device blocks: later requests would not fit either
        if not self.policy.acts_on_paused:
            return plan
        views = []
        for rid, req in self.paused.items():
            held = self.kv.held(rid)
            if not held.device:
                continue
            dev = self.device_tokens(req)
            if dev <= 0:
                continue  # nothing of its own left on the device to decide about
            it = _pause_of(req)
            views.append(PausedRequest(req, dev, held.host * bs,
                                       now - it.t_call, it.expected_duration))
        if not views:
            return plan
        # The swap-out limit applies to budgeted policies; `swap` asks for everything and the
        # copies past the free limit stall the step (accounted as swap waste).
        # Without host room, a swap decision would move nothing and leave the context held.
        host_room = self.kv.counters().num_free_host_blocks
        state = StepState(now, running_tokens, num_running, min(limit_blocks, host_room) * bs, self.cost)
        plan.decisions = self.policy.decide(views, state)
        plan.swap_out_budget = state.swap_out_budget
        return plan

    def releasable(self) -> list[str]:
        """The paused requests release_order would offer (those with private blocks)."""
        return [rid for rid in self.paused if self.kv.num_private_blocks_of(rid)]

    def release_order(self, now: float) -> list[Request]:
        """Under memory pressure, preserved contexts go before running requests are preempted: a
        paused request makes no progress with its memory. The latest expected back go first,
        then the largest; only requests that hold private blocks (counted now) free anything."""
        victims = [(self.expected_resume_at(r, now), self.kv.num_private_blocks_of(rid), r)
                   for rid, r in self.paused.items()]
        victims.sort(key=lambda v: (v[0], v[1]), reverse=True)
        return [req for _, n, req in victims if n]

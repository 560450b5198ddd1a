"""The iteration-level scheduler: one token budget per step shared by prefill chunks and decodes.

Every request carries `num_computed_tokens`; a step gives each scheduled request the next
`min(remaining, budget)` of its tokens, so a prompt is prefilled in chunks, a decode is one token,
and a preempted request recomputes its whole context by the same path.
update_from_output decides the stops token ids tell and reports each request's fate (which
decisions are the scheduler's: sched/request_update.py).
"""
from __future__ import annotations

from segue.config import SchedulerConfig
from segue.kv.interface import KVCache
from segue.request import Request, RequestStatus
from segue.sched.admission import admit_waiting
from segue.sched.cost_model import CostModel
from segue.sched.failed_copies import forget_failed_copies
from segue.sched.interception import InterceptionPolicy
from segue.sched.memory import free_for_running, free_for_swap_in, keep_reserve
from segue.sched.memory_kept import abandon, carry_out, free_finished, release_histories
from segue.sched.newcomers import is_newcomer
from segue.sched.output import ScheduledSeq, SchedulerOutput
from segue.sched.policies import SchedulingPolicy
from segue.sched.request_update import Outcome, RequestUpdate
from segue.sched.state import SchedulerState
from segue.sched.thrashing import rejoin_resident, running_needs


class Scheduler:
    """The step and the verbs that change requests. It has its state (sched/state.py) rather than
    being it: the step's helpers take only the state, and callers read queues and counters there
    (`scheduler.state.running`), so the Scheduler's own surface is its verbs."""

    def __init__(self, config: SchedulerConfig, kv: KVCache, policy: SchedulingPolicy, max_model_len: int,
                 interception: InterceptionPolicy | None = None, cost: CostModel | None = None) -> None:
        self.state = SchedulerState(config, kv, policy, max_model_len, interception, cost)

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.state.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.state.requests[request.request_id] = request
        if self.state.agents is not None:
            # Agents forgotten past max_agents let their histories go.
            release_histories(self.state, self.state.agents.on_arrival(request, self.state.now))
        self.state.waiting.append(request)
        if self.state.config.max_newcomer_wait_s is not None and is_newcomer(self.state, request):
            self.state.first_turns.add(request)
        self.state.policy.on_arrival(request, self.state.now)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request for good and free its KV (idempotent)."""
        if request.request_id not in self.state.requests:
            return
        assert status.finished
        del self.state.requests[request.request_id]
        if request in self.state.running:
            self.state.running.remove(request)
        self.state.waiting.discard(request)
        self.state.paused.remove(request)
        request.status = status
        free_finished(self.state, request)
        self.state.policy.on_finished(request, self.state.now)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.state.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def intercept_request(self, request: Request, now: float, tool: str | None = None,
                          expected_s: float | None = None, turn_end: bool = False) -> None:
        """Pause a running request (it just produced the token that triggered the interception)."""
        assert request.status == RequestStatus.RUNNING, f"cannot intercept a {request.status} request"
        self.state.running.remove(request)
        self.state.paused.intercept(request, now, tool, expected_s, turn_end)
        self.state.policy.on_intercepted(request, now)

    def resume_request(self, request: Request, tokens: list[int], now: float) -> None:
        if self.state.paused.resume(request, tokens, now):
            self.state.waiting.append(request)
        self.state.policy.on_resumed(request, now)

    def forget_failed_copies(self, out: SchedulerOutput) -> list[str]:
        """The executor failed on `out`: its copies count as never made (sched/failed_copies.py)."""
        return forget_failed_copies(self.state, out)

    def truncate_paused(self, request: Request, keep: int) -> None:
        """Cut a paused request's context after its first `keep` tokens (PausedRequests.truncate)."""
        self.state.paused.truncate(request, keep)

    def set_expected_resume(self, request_id: str, t: float) -> bool:
        """When a paused request is expected to be continued (absolute clock time; math.inf:
        never). False if it is not paused."""
        return self.state.paused.set_expected_resume(request_id, t)

    def abandon(self, request_id: str) -> bool:
        """Nobody is expected to continue this paused request: its device memory goes back to
        the pool now (its blocks stay in the prefix cache, evicted first). False if not paused."""
        return abandon(self.state, request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.state.requests)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """One step: plan the link's copies, then give the token budget to the running requests
        in the policy's order, then admit waiting ones into what is left."""
        state = self.state
        self._begin_step(now)
        out = SchedulerOutput()
        running_tokens = sum(r.num_computed_tokens for r in state.running)
        reserve = state.policy.reserved_blocks(now)
        # Swap-ins leave the arrival reserve and earmarked blocks free, unless nothing else could run.
        keep_free = reserve + state.earmarked_blocks if state.running or state.waiting else 0
        # Thrashing avoidance: a swap-in starts only when its whole host part fits beside what the
        # running requests still need (as a host-tier hit's load in admission), and so does a rejoin.
        needs = running_needs(state) if state.agents is not None and not state.policy.preemptive else None
        keep_free += needs or 0
        state.earmarked_blocks = 0
        self._plan_swaps(now, out, running_tokens, keep_free)
        self._line_up(now, needs)
        scheduled: list[tuple[Request, int]] = []
        budget = self._schedule_running(now, out, scheduled, state.config.max_num_batched_tokens)
        if not out.preempted:
            admit_waiting(state, out, budget, scheduled)
        self._emit(now, out, scheduled)
        if reserve > 0:
            keep_reserve(state, out, reserve)
        out.blocks_to_back_up = state.kv.take_back_ups()
        return out

    def _begin_step(self, now: float) -> None:
        """The clock moves on: last step's copies are done, expired retained histories go."""
        self.state.now = now
        self.state.policy.on_step(now)
        self.state.kv.begin_step(now)
        if self.state.agents is not None:
            release_histories(self.state, self.state.agents.expire(now))

    def _plan_swaps(self, now: float, out: SchedulerOutput, running_tokens: int, keep_free: int) -> None:
        """Open the step's link budget and spend it first on the paused requests' swaps; the
        requests whose swap-in is done join the waiting queue."""
        state = self.state
        if state.policy.preemptive and state.kv.counters().num_free_blocks > keep_free:
            # Swap in first whoever the policy expects to run soonest (no room: no swap-in to order).
            state.paused.swapped[:] = reversed(state.policy.preemption_order(state.paused.swapped, now))
        # One budget for every copy of the step: the paused requests' swaps are planned first,
        # then host-tier hits, preemptive swap-outs and write-backs of evicted cached blocks
        # take what is left, in the order the step reaches them.
        # Nothing runs: a retained history may give the swap-in that waits its room.
        free_for_swap_in(state, keep_free)
        state.kv.open_link(state.cost.swap_limit(state.last_batch_tokens) // state.kv.block_size)
        plan = state.paused.plan(now, running_tokens, len(state.running), keep_free_blocks=keep_free)
        carry_out(state, plan)  # the interception policy's dispositions for the paused contexts
        out.blocks_to_swap_out, out.blocks_to_swap_in = plan.swap_out, plan.swap_in
        state.kv.open_write_backs(state.cost.copy_pays(state.kv.counters().write_back_reuse_rate, state.kv.block_size))
        for req in plan.ready:
            req.status = RequestStatus.WAITING
            state.waiting.append(req)

    def _line_up(self, now: float, needs: int | None) -> None:
        """Who runs first this step: the running requests in the policy's order (`needs`: what
        they still need, with thrashing avoidance on)."""
        state = self.state
        if state.policy.preemptive:
            # Everyone competes for this step in key order; a loser keeps its KV while it waits.
            for req in state.running:
                req.status = RequestStatus.WAITING
            state.waiting.extend(state.running)
            state.running = []
        else:
            rejoin_resident(state, needs)
        state.running = list(state.policy.order(state.running, now))

    def _schedule_running(self, now: float, out: SchedulerOutput, scheduled: list[tuple[Request, int]],
                          budget: int) -> int:
        """Give each running request its next tokens within `budget`, freeing memory when one does
        not fit (sched/memory_table.py, Site.RUNNING).
        Appends to `scheduled`; returns the budget left."""
        state = self.state
        i = 0
        while i < len(state.running) and budget > 0:
            req = state.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not state.kv.allocate_slots(req, num_new):
                # Only requests not yet scheduled this step may give way (the current one included).
                if free_for_running(state, req, num_new, state.running[i:], out) is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
        return budget

    def _emit(self, now: float, out: SchedulerOutput, scheduled: list[tuple[Request, int]]) -> None:
        """The step's sequences, each with its tokens and block table, for the executor."""
        state = self.state
        state.last_batch_tokens = sum(n for _, n in scheduled)
        state.num_batched_tokens_total += state.last_batch_tokens
        for req, num_new in scheduled:
            start = req.num_computed_tokens
            out.seqs.append(ScheduledSeq(
                request=req,
                token_ids=req.tokens_slice(start, start + num_new),
                start_pos=start,
                block_table=state.kv.block_ids(req.request_id),
                sample=start + num_new == req.num_tokens,
            ))
            state.policy.on_scheduled(req, num_new, now)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestUpdate]:
        """Advance progress, append sampled tokens, and finish requests that hit a stop
        condition the scheduler can see (EOS, stop token ids, max_tokens, context length); with
        pause_on_stop, EOS and stop tokens pause the request instead, with pause_on_length so does
        max_tokens (the context window still finishes). Returns what happened to each request
        that received a token this step, in step order."""
        state = self.state
        updates = []
        state.last_step_recompute_tokens = 0
        for seq in out.seqs:
            req = seq.request
            if req.is_finished:
                continue
            state.last_step_recompute_tokens += max(0, min(req.max_computed_tokens, seq.start_pos + seq.num_tokens)
                                                    - seq.start_pos)
            req.num_computed_tokens += seq.num_tokens
            req.max_computed_tokens = max(req.max_computed_tokens, req.num_computed_tokens)
            state.kv.cache_full_blocks(req)
            if not seq.sample:
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            updates.append(self._end_of_token(req, token))
        return updates

    def _end_of_token(self, req: Request, token: int) -> RequestUpdate:
        """Finish or pause `req` if `token`, its newest, ends it or its turn."""
        status = self._check_stop(req, token)
        if status is None:
            return RequestUpdate(req, Outcome.RUNNING)
        if self._pauses_at(req, status):
            # The turn ended but the conversation goes on: keep the context for the next turn.
            self.intercept_request(req, self.state.now, turn_end=True)
            return RequestUpdate(req, Outcome.TURN_END, status.finish_reason)
        self.finish_request(req, status)
        return RequestUpdate(req, Outcome.FINISHED, status.finish_reason)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """The stop condition `token`, the newest, meets, if any (a stop token before a length
        limit); a stop token id becomes the request's stop_reason."""
        params = req.sampling_params
        if (not params.ignore_eos and token in req.eos_token_ids) or token in params.stop_token_ids:
            # EOS reads as a plain stop; a stop token id is reported back (OpenAI's stop_reason).
            eos = not params.ignore_eos and token in req.eos_token_ids
            req.stop_reason = None if eos else token
            return RequestStatus.FINISHED_STOPPED
        if req.num_generated_tokens >= params.max_tokens or req.num_tokens >= self.state.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _pauses_at(self, req: Request, status: RequestStatus) -> bool:
        """Whether this end of a turn pauses the request (more turns to come) instead of finishing it."""
        params = req.sampling_params
        if status is RequestStatus.FINISHED_STOPPED:
            return params.pause_on_stop
        # Only max_tokens: at the context window no next turn would fit.
        return params.pause_on_length and req.num_tokens < self.state.max_model_len

    def check_invariants(self) -> None:
        self.state.check_invariants()

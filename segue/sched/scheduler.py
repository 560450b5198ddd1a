"""The iteration-level scheduler: one token budget per step shared by prefill chunks and decodes.

Every request carries `num_computed_tokens`; a step gives each scheduled request the next
`min(remaining, budget)` of its tokens, so a prompt is prefilled in chunks, a decode is one token,
and a preempted request recomputes its whole context by the same path.
update_from_output decides the stops token ids tell and reports each request's fate (which
decisions are the scheduler's: sched/request_update.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from segue.request import Request, RequestStatus
from segue.sched.admission import admit_waiting
from segue.sched.output import ScheduledSeq, SchedulerOutput
from segue.sched.preemption import keep_reserve
from segue.sched.request_update import Outcome, RequestUpdate
from segue.sched.state import SchedulerState
from segue.sched.thrashing import rejoin_resident, running_needs


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions_total: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int


class Scheduler(SchedulerState):
    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if self.agents is not None:
            self.agents.on_arrival(request, self.now)
        self.waiting.append(request)
        self.policy.on_arrival(request, self.now)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request for good and free its KV (idempotent)."""
        if request.request_id not in self.requests:
            return
        assert status.finished
        del self.requests[request.request_id]
        if request in self.running:
            self.running.remove(request)
        self.waiting.discard(request)
        self.paused.remove(request)
        request.status = status
        self.free_finished(request)
        self.policy.on_finished(request, self.now)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def intercept_request(self, request: Request, now: float, tool: str | None = None,
                          expected_s: float | None = None, turn_end: bool = False) -> None:
        """Pause a running request (it just produced the token that triggered the interception)."""
        assert request.status == RequestStatus.RUNNING, f"cannot intercept a {request.status} request"
        self.running.remove(request)
        self.paused.intercept(request, now, tool, expected_s, turn_end)
        self.policy.on_intercepted(request, now)

    def resume_request(self, request: Request, tokens: list[int], now: float) -> None:
        if self.paused.resume(request, tokens, now):
            self.waiting.append(request)
        self.policy.on_resumed(request, now)

    def set_expected_resume(self, request_id: str, t: float) -> bool:
        """When a paused request is expected to be continued (absolute clock time; math.inf:
        never). False if it is not paused."""
        return self.paused.set_expected_resume(request_id, t)

    def abandon(self, request_id: str) -> bool:
        """Nobody is expected to continue this paused request: its device memory goes back to
        the pool now (its blocks stay in the prefix cache, evicted first). False if not paused."""
        return self.paused.abandon(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, wait again."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.append(request)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """One step: plan the link's copies, then give the token budget to the running requests
        in the policy's order, then admit waiting ones into what is left."""
        self._begin_step(now)
        out = SchedulerOutput()
        running_tokens = sum(r.num_computed_tokens for r in self.running)
        reserve = self.policy.reserved_blocks(now)
        # Swap-ins leave the arrival reserve and earmarked blocks free, unless nothing else could run.
        keep_free = reserve + self.earmarked_blocks if self.running or self.waiting else 0
        # Thrashing avoidance: a swap-in starts only when its whole host part fits beside what the
        # running requests still need (as a host-tier hit's load in admission), and so does a rejoin.
        needs = running_needs(self) if self.agents is not None and not self.policy.preemptive else None
        keep_free += needs or 0
        self.earmarked_blocks = 0
        self._plan_swaps(now, out, running_tokens, keep_free)
        self._line_up(now, needs)
        scheduled: list[tuple[Request, int]] = []
        budget = self._schedule_running(now, out, scheduled, self.config.max_num_batched_tokens)
        if not out.preempted:
            admit_waiting(self, out, budget, scheduled)
        self._emit(now, out, scheduled)
        if reserve > 0:
            keep_reserve(self, out, reserve, now)
        out.blocks_to_back_up = self.kv.take_back_ups()
        return out

    def _begin_step(self, now: float) -> None:
        """The clock moves on: last step's copies are done, expired retained histories go."""
        self.now = now
        self.policy.on_step(now)
        self.kv.begin_step(now)
        if self.agents is not None:
            self.agents.expire(now)

    def _plan_swaps(self, now: float, out: SchedulerOutput, running_tokens: int, keep_free: int) -> None:
        """Open the step's link budget and spend it first on the paused requests' swaps; the
        requests whose swap-in is done join the waiting queue."""
        if self.policy.preemptive and self.kv.counters().num_free_blocks > keep_free:
            # Swap in first whoever the policy expects to run soonest (no room: no swap-in to order).
            self.paused.swapped[:] = reversed(self.policy.preemption_order(self.paused.swapped, now))
        # One budget for every copy of the step: the paused requests' swaps are planned first,
        # then host-tier hits, preemptive swap-outs and write-backs of evicted cached blocks
        # take what is left, in the order the step reaches them.
        if self.agents is not None and self.paused.swapped and not self.running:
            # Nothing runs, so nothing else will free memory for the swap-in that waits: a
            # retained history gives it room rather than the pool idling until the history
            # expires. (With requests running, swap-ins wait for memory as other requests do:
            # taking it from retained histories there cascaded, each history loaded back from the
            # host taking the next one's room; pressure preset, real engine.)
            head = self.paused.swapped[0].request_id
            short = self.kv.held(head).host + keep_free - self.kv.counters().num_free_blocks
            if short > 0:
                self.agents.release_for_memory(short, now)
        self.kv.open_link(self.cost.swap_limit(self.last_batch_tokens) // self.kv.block_size)
        plan = self.paused.plan(now, running_tokens, len(self.running), keep_free_blocks=keep_free)
        out.blocks_to_swap_out, out.blocks_to_swap_in = plan.swap_out, plan.swap_in
        self.kv.open_write_backs(self.cost.copy_pays(self.kv.counters().write_back_reuse_rate, self.kv.block_size))
        for req in plan.ready:
            req.status = RequestStatus.WAITING
            self.waiting.append(req)

    def _line_up(self, now: float, needs: int | None) -> None:
        """Who runs first this step: the running requests in the policy's order (`needs`: what
        they still need, with thrashing avoidance on)."""
        if self.policy.preemptive:
            # Everyone competes for this step in key order; a loser keeps its KV while it waits.
            for req in self.running:
                req.status = RequestStatus.WAITING
            self.waiting.extend(self.running)
            self.running = []
        else:
            rejoin_resident(self, needs)
        self.running = list(self.policy.order(self.running, now))

    def _schedule_running(self, now: float, out: SchedulerOutput, scheduled: list[tuple[Request, int]],
                          budget: int) -> int:
        """Give each running request its next tokens within `budget`, freeing memory when one does
        not fit (paused contexts, then retained histories, then preemption in the policy's order).
        Appends to `scheduled`; returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                need = self.kv.num_blocks_needed(req, num_new)
                if self.paused.release_for_memory(need, now):
                    continue
                # A history retained for an agent's next turn goes before a running request's.
                if self.agents is not None and self.agents.release_for_memory(need, now):
                    continue
                # Only requests not yet scheduled this step may give way (the current one included).
                victim = self.policy.preemption_order(self.running[i:], now)[0]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
        return budget

    def _emit(self, now: float, out: SchedulerOutput, scheduled: list[tuple[Request, int]]) -> None:
        """The step's sequences, each with its tokens and block table, for the executor."""
        self.last_batch_tokens = sum(n for _, n in scheduled)
        self.num_batched_tokens_total += self.last_batch_tokens
        for req, num_new in scheduled:
            start = req.num_computed_tokens
            out.seqs.append(ScheduledSeq(
                request=req,
                token_ids=req.tokens_slice(start, start + num_new),
                start_pos=start,
                block_table=self.kv.block_ids(req.request_id),
                sample=start + num_new == req.num_tokens,
            ))
            self.policy.on_scheduled(req, num_new, now)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestUpdate]:
        """Advance progress, append sampled tokens, and finish requests that hit a stop
        condition the scheduler can see (EOS, stop token ids, max_tokens, context length); with
        pause_on_stop, EOS and stop tokens pause the request instead, with pause_on_length so does
        max_tokens (the context window still finishes). Returns what happened to each request
        that received a token this step, in step order."""
        updates = []
        self.last_step_recompute_tokens = 0
        for seq in out.seqs:
            req = seq.request
            if req.is_finished:
                continue
            self.last_step_recompute_tokens += max(0, min(req.max_computed_tokens, seq.start_pos + seq.num_tokens)
                                                   - seq.start_pos)
            req.num_computed_tokens += seq.num_tokens
            req.max_computed_tokens = max(req.max_computed_tokens, req.num_computed_tokens)
            self.kv.cache_full_blocks(req)
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
            self.intercept_request(req, self.now, turn_end=True)
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
        if req.num_generated_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _pauses_at(self, req: Request, status: RequestStatus) -> bool:
        """Whether this end of a turn pauses the request (more turns to come) instead of finishing it."""
        params = req.sampling_params
        if status is RequestStatus.FINISHED_STOPPED:
            return params.pause_on_stop
        # Only max_tokens: at the context window no next turn would fit.
        return params.pause_on_length and req.num_tokens < self.max_model_len

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.counters().usage(),
                              self.num_preemptions_total, self.prefix_hit_tokens, self.prefix_query_tokens)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        ids = [r.request_id for r in [*self.running, *self.waiting, *self.paused.swapped, *self.paused.landing]]
        ids += list(self.paused.paused)
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert set(ids) == set(self.requests), "queues and the request table disagree"
        for rid in self.kv.holders():
            assert rid in self.requests, f"finished request {rid} still holds KV blocks"
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            held = self.kv.held(req.request_id).device
            assert held * self.kv.block_size >= req.num_computed_tokens, f"{req.request_id}: KV lost"
        for req in self.waiting:
            assert not self.kv.held(req.request_id).host, f"{req.request_id} waits with KV on the host"
        holders = {r.request_id for r in self.waiting if self.kv.held(r.request_id).device}
        assert holders == {r.request_id for r in self.waiting_holders()}, "waiting holders misfound"
        for req in self.paused.paused.values():
            assert req.status == RequestStatus.INTERCEPTED and req.interception is not None
        for req in self.paused.swapped:
            assert req.status == RequestStatus.SWAPPED and self.kv.held(req.request_id).host
        for rid in self.kv.holders(on_host=True):
            req = self.requests[rid]
            assert req.status in (RequestStatus.INTERCEPTED, RequestStatus.SWAPPED), \
                f"{rid}: host KV while {req.status}"
            held = sum(self.kv.held(rid))
            assert held * self.kv.block_size >= req.num_computed_tokens, f"{rid}: KV lost between the tiers"

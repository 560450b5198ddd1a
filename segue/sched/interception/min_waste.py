"""InferCept's min-waste interception (§4.3): each step, rank paused requests by the waste they
would cause, give the swap-out budget to the largest, and preserve or discard the rest,
whichever wastes less (eqs. 2, 4, 5). Durations come from the tool's history when known, else
from the time paused so far, so a preserved request can later be swapped or discarded. A
session's turn end (Interception.turn_end), which waits for a client rather than a tool, is
released at once instead (see decide)."""
from __future__ import annotations

from segue.request import Disposition
from segue.sched.interception.base import Decision, InterceptionPolicy, PausedRequest, StepState, estimated_duration


def waste_preserve(p: PausedRequest, state: StepState) -> float:
    return state.cost.waste_preserve(estimated_duration(p), p.device_tokens)


def waste_discard(p: PausedRequest, state: StepState) -> float:
    return state.cost.waste_chunked_discard(p.device_tokens, state.running_tokens, state.num_running)


class MinWastePolicy(InterceptionPolicy):
    name = "min-waste"

    def decide(self, paused: list[PausedRequest], state: StepState) -> dict[str, Decision]:
        scored = []
        for p in paused:
            wp, wd = waste_preserve(p, state), waste_discard(p, state)
            scored.append((min(wp, wd), wp, wd, p))
        scored.sort(key=lambda s: s[0], reverse=True)
        budget = state.swap_out_budget
        decisions: dict[str, Decision] = {}
        for _, wp, wd, p in scored:
            if p.request.interception is not None and p.request.interception.turn_end:
                # A turn end waits for a client's next message (seconds to minutes, no tool
                # history to time it): released at once. Its blocks stay findable, evicted in
                # order of expected resume and written back to the host tier, so the next turn
                # revives what is left, as a plain client's next request would. Real engine, CPU,
                # pressure preset with sessions, seeds 1-3: swapped out eagerly, resumed turns
                # waited for their swap-ins (3-13 preemptions a run, 15.5-17.1 s); held, newcomers
                # waited for their memory (16.5 / 9.3 / 20.5 s); released, 13.6 / 8.8 / 14.2 s.
                decisions[p.request.request_id] = Decision(Disposition.DISCARD)
                continue
            if budget > 0:
                take = min(budget, p.device_tokens)
                budget -= take
                decisions[p.request.request_id] = Decision(Disposition.SWAP, take)
                if take == p.device_tokens:
                    continue
            # What the swap budget could not cover is preserved or discarded by eq. 5.
            if wd < wp:
                decisions[p.request.request_id] = Decision(Disposition.DISCARD)
            elif p.request.request_id not in decisions:
                decisions[p.request.request_id] = Decision(Disposition.PRESERVE)
        return decisions

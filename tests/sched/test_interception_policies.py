"""Interception policies on hand-built cases; the expected numbers are worked out by hand from
InferCept's equations 2 (preserve) and 4 (chunked discard)."""
from __future__ import annotations

import pytest

from segue.request import Disposition, Interception, Request
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel
from segue.sched.interception import PausedRequest, StepState, make_interception_policy
from segue.sched.interception.min_waste import waste_discard, waste_preserve

# T_fwd(t) = 1 ms * t + 10 ms; saturation 100 tokens; 1000 bytes of KV per token.
COST = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=10.0, saturation_tokens=100,
                 swap_bytes_per_s=1e6, kv_bytes_per_token=1000)
STATE = StepState(now=10.0, running_tokens=200, num_running=20, swap_out_budget=60, cost=COST)


def paused(rid: str, device: int, elapsed: float, expected: float | None = None, tool: str = "t") -> PausedRequest:
    req = Request(rid, [1, 2, 3], SamplingParams(), 0.0)
    req.interception = Interception(t_call=STATE.now - elapsed, tool=tool, expected_duration=expected)
    return PausedRequest(req, device, 0, elapsed, expected)


A = paused("A", device=50, elapsed=2.0)               # long unknown wait, small context
B = paused("B", device=200, elapsed=0.1)              # just paused, big context
C = paused("C", device=100, elapsed=0.5, expected=0.6)  # known tool, almost done


def test_waste_equations_by_hand():
    # Eq. 2: T_int * C * M. A: dynamic estimate t_now - t_call = 2 s -> 2 * 50 * 1000.
    assert waste_preserve(A, STATE) == pytest.approx(100_000)
    # C: known 0.6 s, 0.5 s elapsed -> 0.1 s left -> 0.1 * 100 * 1000.
    assert waste_preserve(C, STATE) == pytest.approx(10_000)
    # Eq. 4 with chunk = S - running = 100 - 20 = 80 tokens.
    # A: n = 1; own = T(50) * 50 * M / 2 = 0.05 * 50 * 1000 / 2 = 1250;
    #    others = 1 * T(50) * 200 * 1000 = 10_000.
    assert waste_discard(A, STATE) == pytest.approx(11_250)
    # B: n = 3; own = 0.2 * 200 * 1000 / 2 = 20_000; others = 3 * T(200/3) * 200 * 1000 = 40_000.
    assert waste_discard(B, STATE) == pytest.approx(60_000)
    # C: n = 2; own = 0.1 * 100 * 1000 / 2 = 5000; others = 2 * T(50) * 200 * 1000 = 20_000.
    assert waste_discard(C, STATE) == pytest.approx(25_000)


def test_min_waste_gives_swap_budget_to_largest_waste_then_compares():
    # min-waste per request: B 20_000 (preserve 0.1*200*1000), A 11_250 (discard), C 10_000 (preserve).
    decisions = make_interception_policy("min-waste").decide([A, B, C], STATE)
    assert decisions["B"] == make_decision(Disposition.SWAP, 60)  # whole budget, rest stays put
    assert decisions["A"].disposition is Disposition.DISCARD     # eq. 5: 11_250 < 100_000
    assert decisions["C"].disposition is Disposition.PRESERVE    # eq. 5: 10_000 < 25_000


def test_min_waste_releases_a_turn_end_at_once_and_gives_the_budget_to_tool_pauses():
    """A session's turn end (Interception.turn_end) waits for the client's next message: min-waste
    releases it (DISCARD: blocks into the prefix cache, written back when evicted) whatever its
    waste, and the swap budget goes to the tool pauses."""
    turn = paused("T", device=200, elapsed=0.1)  # B's numbers: it would get the whole budget
    turn.request.interception.turn_end = True
    decisions = make_interception_policy("min-waste").decide([A, turn, C], STATE)
    assert decisions["T"].disposition is Disposition.DISCARD
    # The tool pauses share the 60-token budget by waste: A (11_250) all 50, C (10_000) the rest.
    assert decisions["A"] == make_decision(Disposition.SWAP, 50)
    assert decisions["C"] == make_decision(Disposition.SWAP, 10)


def test_min_waste_dynamic_estimate_turns_preserve_into_discard_over_time():
    policy = make_interception_policy("min-waste")
    no_budget = StepState(10.0, 200, 20, 0, COST)
    assert policy.decide([paused("B", 200, elapsed=0.1)], no_budget)["B"].disposition is Disposition.PRESERVE
    # After 0.4 s the estimate is 0.4 * 200 * 1000 = 80_000 > 60_000: discard.
    assert policy.decide([paused("B", 200, elapsed=0.4)], no_budget)["B"].disposition is Disposition.DISCARD


def test_fixed_policies():
    assert all(d.disposition is Disposition.DISCARD
               for d in make_interception_policy("discard").decide([A, B, C], STATE).values())
    assert not make_interception_policy("discard").keeps_arrival_time
    assert make_interception_policy("improved-discard").keeps_arrival_time
    assert make_interception_policy("preserve").decide([A, B, C], STATE) == {}
    swap = make_interception_policy("swap").decide([A, B, C], STATE)
    assert {k: v.swap_out_tokens for k, v in swap.items()} == {"A": 50, "B": 200, "C": 100}


def test_ttl_keeps_until_the_tools_quantile_then_swaps_or_discards():
    policy = make_interception_policy("ttl", quantile_fn=lambda tool, q: 0.5 if tool == "t" else None)
    d = policy.decide([A, B, C], STATE)
    # Oldest first: A (2 s >= 0.5) swaps 50 of the 60-token budget, C (0.5 s) the other 10;
    # B (0.1 s) is within its TTL and keeps its KV.
    assert d["A"] == make_decision(Disposition.SWAP, 50) and d["C"] == make_decision(Disposition.SWAP, 10)
    assert "B" not in d
    d = policy.decide([A, B], StepState(10.0, 200, 20, 0, COST))
    assert d == {"A": make_decision(Disposition.DISCARD)}


def make_decision(disposition, tokens=0):
    from segue.sched.interception import Decision
    return Decision(disposition, tokens)

"""LAMPS ordering and handling in the pure scheduler: the handling follows the waste equations on
hand-worked numbers, the ranking is the memory-over-time score, starving requests get through,
requests are re-ranked after each interception, and the KV invariants hold every step."""
from __future__ import annotations

import random

import pytest

from fake_executor import FakeKVExecutor, PlannedPauses
from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import Disposition, Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel
from segue.sched.interception import Decision, PausedRequest, StepState, make_interception_policy
from segue.sched.interception.lamps import choose_handling
from segue.sched.interception.min_waste import MinWastePolicy
from segue.sched.paused import PausedRequests
from segue.sched.policies import PolicyContext, make_policy
from segue.sched.policies.lamps import LAMPSPolicy
from segue.sched.request_update import RequestUpdate
from segue.sched.scheduler import Scheduler

# Round numbers: T_fwd(n) = (n + 10) ms, so t_fwd_extra(n) = n ms; T_swap(n) = n ms; M = 1 byte,
# so every waste below is in token-seconds.
COST = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=10.0, saturation_tokens=100, swap_bytes_per_s=1000.0,
                 kv_bytes_per_token=1)
# C_other = 200 tokens, 10 sequences per step, τ = 10 ms per decode step.
OPTIONS = {"other_tokens": 200, "num_running": 10, "step_s": 0.01}


def lamps(**options) -> LAMPSPolicy:
    return LAMPSPolicy(PolicyContext(cost=COST, options={**OPTIONS, **options}))


def request(rid: str, prompt: int, out: float | None, api_s: float | None, max_tokens: int = 500) -> Request:
    req = Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens), 0.0)
    req.predicted_output_tokens, req.predicted_interception_s = out, api_s
    return req


# ---- handling ------------------------------------------------------------------------------
# A context of C = 100 at the interception, C_other = 200, 10 running:
#   preserve = d · 100
#   discard  (eq. 4): chunks of 100 - 10 = 90 -> n = 2; 0.100 · 100 / 2 + 2 · 0.050 · 200 = 5 + 20 = 25
#   swap, chunked: T_swap(100) · 100 = 0.1 · 100 = 10;  sync (eq. 3): 2 · 0.1 · (100 + 200) = 60
@pytest.mark.parametrize("api_s, swap_waste, expected, waste", [
    (0.05, "chunked", Disposition.PRESERVE, 5.0),
    (0.5, "chunked", Disposition.SWAP, 10.0),
    (0.2, "sync", Disposition.PRESERVE, 20.0),
    (0.5, "sync", Disposition.DISCARD, 25.0),
])
def test_handling_follows_the_waste_equations(api_s, swap_waste, expected, waste):
    choice = choose_handling(COST, 100, api_s, 200, 10, swap_waste)
    assert choice.disposition is expected
    assert choice.waste == pytest.approx(waste)
    assert choice.wastes[Disposition.DISCARD] == pytest.approx(25.0)
    assert choice.wastes[Disposition.PRESERVE] == pytest.approx(100 * api_s)


def test_policy_predicts_the_handling_of_the_context_at_the_interception():
    # 60 prompt tokens + 40 predicted -> C = 100 when the API call comes.
    policy = lamps()
    short, long_ = request("a", 60, 40, 0.05), request("b", 60, 40, 0.5)
    policy.key(short, 0.0), policy.key(long_, 0.0)
    assert short.predicted_disposition is Disposition.PRESERVE
    assert long_.predicted_disposition is Disposition.SWAP
    # Score = prefill (0.060 · 30 = 1.8) + decode (0.01 · (40 · 60 + 40 · 41 / 2) = 32.2) + handling.
    assert policy.score(short) == pytest.approx(1.8 + 32.2 + 5.0)
    assert policy.score(long_) == pytest.approx(1.8 + 32.2 + 10.0)


def test_without_a_predicted_duration_no_handling_is_predicted():
    policy = lamps()
    req = request("a", 60, 40, None)
    policy.key(req, 0.0)
    assert req.predicted_disposition is None


# ---- ranking -------------------------------------------------------------------------------
def test_ranking_is_ascending_memory_over_time():
    policy = lamps()
    reqs = {
        "short": request("short", 20, 10, 0.0),       # little context, few tokens, no API
        "long": request("long", 20, 200, 0.0),        # same context, many tokens
        "big_prompt": request("big_prompt", 400, 10, 0.0),
        "slow_api": request("slow_api", 20, 10, 30.0),  # like `short` but a long API call ahead
    }
    order = sorted(reqs.values(), key=lambda r: policy.key(r, 0.0))
    assert [r.request_id for r in order] == ["short", "slow_api", "big_prompt", "long"]
    scores = {rid: policy.score(r) for rid, r in reqs.items()}
    # slow_api differs from short only by its handling's waste: C = 30 -> discard
    # (n = 1: 0.030 · 30 / 2 + 0.030 · 200 = 6.45) vs swap (0.030 · 30 = 0.9) vs preserve 900.
    assert scores["slow_api"] - scores["short"] == pytest.approx(0.9)
    assert reqs["slow_api"].predicted_disposition is Disposition.SWAP


def test_fallback_uses_observed_segments_and_max_tokens():
    policy = lamps()
    fresh = request("fresh", 10, None, None, max_tokens=50)
    assert policy.remaining_segment_tokens(fresh) == 50  # nothing observed: max_tokens
    policy.observed.segments, policy.observed.segment_tokens = 4, 80.0
    assert policy.remaining_segment_tokens(fresh) == 20  # the mean completed segment


def test_a_request_past_its_prediction_gets_the_residual_life_of_segments_that_got_as_far():
    # Completed segments of 10, 10, 40 and 100 tokens; one predicted at 8 that has made 20 is
    # like the two that passed 20: (40 - 20 + 100 - 20) / 2 = 50 more, not "about to end".
    policy = lamps()
    for length in (10, 10, 40, 100):
        policy.observed.observe_length(length)
    overrun, on_track = request("overrun", 10, 8, None), request("on_track", 10, 30, None)
    policy.on_arrival(overrun, 0.0)
    policy.on_arrival(on_track, 0.0)
    overrun.output_token_ids.extend([1] * 20)
    assert policy.remaining_segment_tokens(overrun) == 50
    overrun.output_token_ids.extend([1] * 90)  # 110: longer than any seen
    assert policy.remaining_segment_tokens(overrun) == 1
    on_track.output_token_ids.extend([1] * 20)
    assert policy.remaining_segment_tokens(on_track) == 10  # within its prediction: the prediction
    end = lamps(overrun="end")
    end.observed.observe_length(100)
    late = request("late", 10, 8, None)
    end.on_arrival(late, 0.0)
    late.output_token_ids.extend([1] * 20)
    assert end.remaining_segment_tokens(late) == 1
    with pytest.raises(ValueError, match="overrun"):
        lamps(overrun="never")


@pytest.mark.parametrize("starving_order", ["score", "fifo"])
def test_starving_requests_are_ordered_by_score_or_by_when_they_began_to_starve(starving_order):
    policy = lamps(starvation_threshold=2, starving_order=starving_order)
    big, small, fresh = request("big", 400, 200, 0.0), request("small", 10, 5, 0.0), request("fresh", 10, 5, 0.0)
    policy.on_arrival(big, 0.0)
    policy.on_step(0.0)
    policy.on_arrival(small, 0.0)
    for _ in range(3):  # big starves a step before small
        policy.on_step(0.0)
    policy.on_arrival(fresh, 0.0)
    assert policy.tracks["big"].starving and policy.tracks["small"].starving
    assert policy.score(big) > policy.score(small)
    order = sorted([fresh, small, big], key=lambda r: policy.key(r, 0.0))
    expected = ["big", "small", "fresh"] if starving_order == "fifo" else ["small", "big", "fresh"]
    assert [r.request_id for r in order] == expected


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="starvation"):
        lamps(starvaton_threshold=5)


# ---- scheduler-driven ----------------------------------------------------------------------
def make_sched(num_blocks: int, budget: int, max_seqs: int, interception: str = "lamps", host_blocks: int = 64,
               cost: CostModel = COST, **options) -> Scheduler:
    kv = KVCacheManager(4, num_blocks, host_blocks, enable_prefix_caching=False)
    policy = make_policy("lamps", PolicyContext(cost=cost, kv_capacity_tokens=num_blocks * 4, block_size=4,
                                                options=options))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, policy,
                     max_model_len=num_blocks * 4, interception=make_interception_policy(interception), cost=cost)


def step(sched: Scheduler, now: float) -> list[RequestUpdate]:
    out = sched.schedule(now)
    sampled = {s.request.request_id: 1 for s in out.seqs if s.sample}
    got = sched.update_from_output(out, sampled)
    sched.check_invariants()
    return got


def test_starving_request_finishes_within_bound_under_adversarial_small_requests():
    """Two 2-token requests arrive every step and fill all 4 sequence slots; they always rank
    ahead of the big one, which arrives at step 5. Bound with threshold T: T waiting steps, at most
    1 step until a slot frees, 1 prefill step (40-token prompt, 64-token budget), 39 decode steps."""
    threshold, big_tokens, big_arrives = 20, 40, 5

    def run(threshold_opt: int, steps: int) -> int | None:
        sched = make_sched(256, 64, 4, starvation_threshold=threshold_opt)
        big = request("big", 40, big_tokens, 0.0, max_tokens=big_tokens)
        for t in range(steps):
            if t == big_arrives:
                sched.add_request(big)
            for k in range(2):
                sched.add_request(request(f"s{t}.{k}", 4, 2, 0.0, max_tokens=2))
            step(sched, float(t))
            if big.is_finished:
                return t + 1 - big_arrives
        return None

    assert run(0, 300) is None  # without the mechanism the big request never runs
    took = run(threshold, 300)
    assert took is not None and took <= threshold + 1 + 1 + (big_tokens - 1)


def test_starving_request_is_never_the_preemption_victim():
    policy = lamps(starvation_threshold=3)
    big, small = request("big", 100, 100, 0.0), request("small", 4, 2, 0.0)
    for r in (big, small):
        policy.on_arrival(r, 0.0)
    for t in range(4):
        policy.on_step(float(t))
        policy.on_scheduled(small, 1, float(t))
    assert policy.key(big, 4.0) < policy.key(small, 4.0)
    policy.on_step(4.0)  # still ahead after being scheduled: starving lasts until the end
    policy.on_scheduled(big, 1, 4.0)
    assert policy.key(big, 5.0) < policy.key(small, 5.0)


def test_rerank_after_interception():
    sched = make_sched(64, 64, 8)
    a = request("a", 8, 30, 0.0, max_tokens=40)  # a long first segment: ranked behind b
    b = request("b", 8, 10, 0.0, max_tokens=40)
    for r in (a, b):
        sched.add_request(r)
    key = sched.state.policy.key
    assert key(b, 0.0) < key(a, 0.0)
    now = 0.0
    while a.num_generated_tokens < 3:
        step(sched, now)
        now += 1.0
    sched.intercept_request(a, now)
    step(sched, now)
    a.predicted_output_tokens = 1  # the predictor: the next segment is one token
    sched.resume_request(a, [5, 6], now + 0.5)
    assert key(a, now + 1) < key(b, now + 1)


def test_cached_scores_refresh_at_the_interval():
    policy = lamps(score_refresh_steps=5)
    req = request("a", 10, 20, 0.0)
    policy.on_arrival(req, 0.0)
    first = policy.key(req, 0.0)
    for t in range(1, 5):
        policy.on_step(float(t))
        req.output_token_ids.append(1)
        req.num_computed_tokens = req.num_tokens
        assert policy.key(req, float(t)) == first
    policy.on_step(5.0)
    assert policy.key(req, 5.0)[1] < first[1]
    req.predicted_interception_s = 60.0  # a changed prediction re-scores at once
    assert policy.key(req, 5.0)[1] > first[1]


def test_lamps_handling_is_applied_when_the_interception_begins():
    # A link fast enough that one step's swap budget takes a whole context.
    sched = make_sched(64, 64, 8, cost=CostModel(fwd_ms_per_token=1.0, fwd_base_ms=10.0, saturation_tokens=100,
                                                  swap_bytes_per_s=1e5, kv_bytes_per_token=1))
    keep = request("keep", 12, 4, 0.0, max_tokens=20)      # an instant tool: preserve
    drop = request("drop", 12, 4, 100.0, max_tokens=20)    # a long tool: swap out
    for r in (keep, drop):
        sched.add_request(r)
    now = 0.0
    while keep.num_generated_tokens < 4 or drop.num_generated_tokens < 4:
        step(sched, now)
        now += 0.01
    assert keep.predicted_disposition is Disposition.PRESERVE and drop.predicted_disposition is Disposition.SWAP
    for r in (keep, drop):
        sched.intercept_request(r, now)
    for _ in range(3):
        step(sched, now)
        now += 0.01
    assert sched.state.kv.num_host_blocks_of("keep") == 0 and sched.state.kv.num_device_blocks_of("keep") > 0
    assert sched.state.kv.num_host_blocks_of("drop") > 0 and sched.state.kv.num_device_blocks_of("drop") == 0


@pytest.mark.parametrize("api_s, expected", [(100.0, Decision(Disposition.DISCARD)),
                                              (0.1, Decision(Disposition.SWAP, 40))])
def test_swap_beyond_the_budget_discards_when_holding_the_rest_wastes_more(api_s, expected):
    # 100 device tokens, a 40-token budget: discard wastes 25 (see above); holding the context for
    # the rest of a 100 s pause wastes 10,000, for a 0.1 s pause 10.
    req = request("a", 100, None, api_s)
    req.predicted_disposition = Disposition.SWAP
    view = PausedRequest(req, 100, 0, 0.0, None)
    decisions = make_interception_policy("lamps").decide([view], StepState(0.0, 200, 10, 40, COST))
    assert decisions["a"] == expected


def test_interception_policy_alone_predicts_once_and_keeps_it():
    """fcfs + lamps handling: the handling is predicted from the predicted duration when the pause
    begins and kept, where min-waste's dynamic estimate turns against preserving as time passes."""
    policy = make_interception_policy("lamps")
    req = request("a", 100, None, 0.01)
    req.status = RequestStatus.RUNNING
    paused = PausedRequests(KVCacheManager(4, 64, 0), policy, COST)
    paused.intercept(req, 0.0, "t", None)
    state = StepState(0.0, 200, 10, 0, COST)
    for elapsed in (0.0, 1.0, 10.0):
        view = PausedRequest(req, 100, 0, elapsed, None)
        assert policy.decide([view], state)["a"].disposition is Disposition.PRESERVE
    late = PausedRequest(req, 100, 0, 10.0, None)
    assert MinWastePolicy().decide([late], state)["a"].disposition is Disposition.DISCARD


def test_without_predictions_the_interception_policy_is_min_waste():
    policy = make_interception_policy("lamps")
    rng = random.Random(3)
    views = []
    for i in range(6):
        req = request(f"r{i}", 10, None, None)
        views.append(PausedRequest(req, rng.randrange(4, 200), 0, rng.uniform(0, 2), rng.choice([None, 0.1])))
    state = StepState(0.0, 150, 6, 64, COST)
    assert policy.decide(views, state) == MinWastePolicy().decide(views, state)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interception", ["lamps", "min-waste"])
def test_random_workload_with_pauses_keeps_invariants_and_outputs(seed, interception):
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(bs, rng.randrange(14, 40), rng.randrange(0, 40), enable_prefix_caching=rng.random() < 0.5)
    policy = make_policy("lamps", PolicyContext(cost=COST, options={"starvation_threshold": rng.choice([0, 5, 100]),
                                                                    "score_refresh_steps": rng.choice([1, 3])}))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.randrange(4, 40), max_num_seqs=6), kv, policy,
                      max_model_len=kv.device.num_blocks * bs // 2, interception=make_interception_policy(interception),
                      cost=COST)
    ex = FakeKVExecutor(bs)
    reqs, pauses = [], PlannedPauses(rng)
    for i in range(8):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        max_tokens = rng.randrange(2, 8)
        if len(prompt) + max_tokens + 6 > sched.state.max_model_len:
            continue
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), 0.0)
        # Predictions from wildly right to wildly wrong, or none.
        req.predicted_output_tokens = rng.choice([None, 1, max_tokens, 50])
        req.predicted_interception_s = rng.choice([None, 0.0, 0.02, 5.0])
        pauses.plans[req.request_id] = pauses.draw(max_tokens)
        reqs.append(req)
        sched.add_request(req)

    def _repredict(req: Request) -> None:
        # A resumed request is predicted afresh (its next pause may differ).
        req.predicted_interception_s = rng.choice([None, 0.0, 0.3])

    now = 0.0
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        now += 0.01
        pauses.resume_due(sched, now, before=_repredict)
        out = sched.schedule(now)
        got = sched.update_from_output(out, ex.execute(out))
        pauses.pause_planned(sched, (u.request for u in got), now)
        sched.check_invariants()
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    assert kv.num_held_blocks() == 0 and not kv.host_tables
    assert not policy.tracks, "the policy kept state for finished requests"
    for req in reqs:
        assert req.output_token_ids == pauses.expected(req)

"""What update_from_output says happened to each request that got a token: running, finished or
paused at the end of a turn, with vLLM's finish_reason; the engine relays it and asks nothing."""
from __future__ import annotations

from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.policies import make_policy
from segue.sched.request_update import Outcome, RequestUpdate
from segue.sched.scheduler import Scheduler

EOS = 2


def make_scheduler(max_model_len: int = 64) -> Scheduler:
    kv = KVCacheManager(4, 32, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, make_policy("fcfs"),
                     max_model_len=max_model_len)


def one_token(sched: Scheduler, req: Request, token: int, now: float = 0.0) -> RequestUpdate:
    out = sched.schedule(now)
    (update,) = sched.update_from_output(out, {req.request_id: token})
    sched.check_invariants()
    assert update.request is req
    return update


def request(rid: str, **params) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(**params), 0.0, eos_token_ids=(EOS,))


def test_a_token_that_ends_nothing_leaves_the_request_running():
    sched = make_scheduler()
    req = request("a", max_tokens=4)
    sched.add_request(req)
    assert one_token(sched, req, 9) == RequestUpdate(req, Outcome.RUNNING)
    assert req.status is RequestStatus.RUNNING


def test_eos_stop_tokens_and_max_tokens_finish_with_their_reason():
    sched = make_scheduler()
    eos, stop, length = request("eos"), request("stop", stop_token_ids=[11]), request("len", max_tokens=1)
    for req in (eos, stop, length):
        sched.add_request(req)
    out = sched.schedule(0.0)
    updates = sched.update_from_output(out, {"eos": EOS, "stop": 11, "len": 9})
    assert updates == [RequestUpdate(eos, Outcome.FINISHED, "stop"), RequestUpdate(stop, Outcome.FINISHED, "stop"),
                       RequestUpdate(length, Outcome.FINISHED, "length")]
    assert (eos.stop_reason, stop.stop_reason, length.stop_reason) == (None, 11, None)
    assert not sched.has_unfinished_requests()


def test_the_context_window_finishes_even_with_pause_on_length():
    sched = make_scheduler(max_model_len=4)
    req = request("a", max_tokens=8, pause_on_length=True)
    sched.add_request(req)
    assert one_token(sched, req, 9) == RequestUpdate(req, Outcome.FINISHED, "length")


def test_an_end_of_turn_that_pauses_says_why():
    sched = make_scheduler()
    stop, length = request("stop", pause_on_stop=True), request("len", max_tokens=1, pause_on_length=True)
    for req in (stop, length):
        sched.add_request(req)
    out = sched.schedule(0.0)
    updates = sched.update_from_output(out, {"stop": EOS, "len": 9})
    assert updates == [RequestUpdate(stop, Outcome.TURN_END, "stop"), RequestUpdate(length, Outcome.TURN_END, "length")]
    for req in (stop, length):
        assert req.status is RequestStatus.INTERCEPTED and req.interception is not None
        assert req.interception.turn_end
    sched.check_invariants()

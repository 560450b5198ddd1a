"""Agent identity of plain clients: a request continues an agent only on real evidence, its
prompt extending the agent's latest finished turn past the prompt that turn was given (so into
what the turn produced), once. A request that merely shares a prefix with an earlier one (a
common system prompt) starts an agent of its own and queues by its own arrival."""
from __future__ import annotations

from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import Request
from segue.sampling_params import SamplingParams
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler

BS = 4
SYSTEM = list(range(1000, 1012))  # three full blocks every request of the tenant starts with


def make_scheduler() -> Scheduler:
    kv = KVCacheManager(BS, 64)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, agent_retention=True)
    return Scheduler(cfg, kv, make_policy("fcfs"), max_model_len=256)


def turn(rid: str, prompt: list[int], now: float, program_id: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=2, ignore_eos=True), now, program_id=program_id)


def run(sched: Scheduler, req: Request, now: float) -> float:
    sched.state.now = now
    sched.add_request(req)
    while not req.is_finished:
        out = sched.schedule(now)
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.seqs if s.sample})
        sched.check_invariants()
        now += 0.1
    return now


def test_a_shared_system_prompt_is_no_evidence_of_the_same_agent():
    sched = make_scheduler()
    first = turn("x0", SYSTEM + [1, 2], 0.0)  # its prompt's last full block is the system prompt's
    now = run(sched, first, 0.0)
    stranger = turn("u0", SYSTEM + [50, 51, 52, 53, 54], now + 5.0)
    sched.state.now = now + 5.0
    sched.add_request(stranger)
    agent = sched.state.agents.agent_of(stranger)
    assert agent.turns == 1
    assert stranger.sched_arrival_time == now + 5.0, "a stranger inherited another agent's place in line"


def test_the_latest_turn_is_continued_once():
    sched = make_scheduler()
    first = turn("x0", SYSTEM + [1, 2], 0.0)
    now = run(sched, first, 0.0)
    nxt = turn("x1", first.all_token_ids + [3, 4, 5], now + 1.0)
    sched.state.now = now + 1.0
    sched.add_request(nxt)
    agent = sched.state.agents.agent_of(nxt)
    assert agent.turns == 2 and nxt.sched_arrival_time == 0.0
    # A second request extending the same turn (a retry beside it, another client that copied the
    # history) is not that agent's next turn: the turn was already continued.
    fork = turn("x1b", first.all_token_ids + [8, 9], now + 1.5)
    sched.state.now = now + 1.5
    sched.add_request(fork)
    assert sched.state.agents.agent_of(fork) is not agent and fork.sched_arrival_time == now + 1.5


def test_an_older_turn_is_not_the_agents_latest():
    sched = make_scheduler()
    first = turn("x0", SYSTEM + [1, 2], 0.0)
    now = run(sched, first, 0.0)
    second = turn("x1", first.all_token_ids + [3, 4, 5, 6], now)
    now = run(sched, second, now)
    # Extends the first turn's context but not the second's: not this agent's next turn.
    late = turn("y", first.all_token_ids + [60, 61, 62, 63], now + 1.0)
    sched.state.now = now + 1.0
    sched.add_request(late)
    assert sched.state.agents.agent_of(late).turns == 1 and late.sched_arrival_time == now + 1.0
    third = turn("x2", second.all_token_ids + [9], now + 1.0)
    sched.add_request(third)
    assert sched.state.agents.agent_of(third).turns == 3 and third.sched_arrival_time == 0.0


def test_another_program_is_another_agent():
    sched = make_scheduler()
    first = turn("x0", SYSTEM + [1, 2], 0.0, program_id="t:a")
    now = run(sched, first, 0.0)
    other = turn("z", first.all_token_ids + [3], now, program_id="t:b")
    sched.add_request(other)
    assert sched.state.agents.agent_of(other).turns == 1 and other.sched_arrival_time == now
    same = turn("x1", first.all_token_ids + [4], now, program_id="t:a")
    sched.add_request(same)
    assert sched.state.agents.agent_of(same).turns == 2 and same.sched_arrival_time == 0.0

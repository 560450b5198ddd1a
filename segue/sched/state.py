"""What the scheduler knows between steps: its queues, the KV manager, the policies and the
counters. The step's helpers (admission.py, preemption.py, ...) read and change this state; the
Scheduler (scheduler.py) has it as `Scheduler.state` and adds the step and the verbs, so the
helpers sit below the Scheduler and callers read queues and counters here."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from segue.config import SchedulerConfig
from segue.kv.interface import KVCache, KVCounters
from segue.request import Request, RequestStatus
from segue.sched.agents import AgentTracker
from segue.sched.cost_model import CostModel
from segue.sched.first_turns import FirstTurns
from segue.sched.interception import InterceptionPolicy, make_interception_policy
from segue.sched.paused import PausedRequests
from segue.sched.policies import SchedulingPolicy
from segue.sched.request_queue import RequestQueue


class SchedulerState:
    def __init__(self, config: SchedulerConfig, kv: KVCache, policy: SchedulingPolicy,
                 max_model_len: int, interception: InterceptionPolicy | None = None,
                 cost: CostModel | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.max_model_len = max_model_len
        self.cost = cost or CostModel()
        self.paused = PausedRequests(kv, interception or make_interception_policy("preserve"), self.cost)
        self.last_batch_tokens = 0
        # Every token any step ran (prefill, decode, recompute): what the model computed in all.
        self.num_batched_tokens_total = 0
        # Tokens computed a second time (after a discard or a preemption), for waste accounting.
        self.last_step_recompute_tokens = 0
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        # The clock of the latest step; hooks called between steps (finish, abort) use it.
        self.now = 0.0
        # Device blocks that this step's swap-outs free for a waiting higher-priority request:
        # the next step's swap-ins must leave them to it.
        self.earmarked_blocks = 0
        # Finished requests' blocks keyed by their expected reuse (prefix_eviction="reuse"), or plain LRU.
        kv.use_reuse_eviction(config.prefix_eviction == "reuse")
        # Agent identity and histories retained across tool gaps (thrashing avoidance); None: off.
        self.agents = AgentTracker(kv, self.cost) if config.agent_retention else None
        # New agents' first turns in arrival order, for the newcomer bound (sched/newcomers.py).
        self.first_turns = FirstTurns()

    def waiting_holders(self) -> list[Request]:
        """The waiting requests that hold device KV, found through the KV tables: the pool bounds
        them, while an overloaded waiting queue holds thousands and is scanned by no per-step pass."""
        holders = []
        for rid in self.kv.holders():
            req = self.requests[rid]
            if req.status == RequestStatus.WAITING:
                holders.append(req)
        return holders

    # ---- what the engine reads of the KV side (it never reaches into kv or paused) -----------
    def kv_counters(self) -> KVCounters:
        return self.kv.counters()

    def num_held_blocks(self) -> int:
        """Device blocks in requests' tables: 0 once every request is gone."""
        return self.kv.num_held_blocks()

    def num_device_blocks_of(self, requests: Iterable[Request]) -> int:
        return sum(self.kv.held(r.request_id).device for r in requests)

    def num_paused(self) -> int:
        """Paused requests (at a tool call or a turn end); safe off the engine thread (one len())."""
        return len(self.paused.paused)

    def num_swapped(self) -> int:
        """Resumed requests whose context is partly on the host, waiting to be swapped in."""
        return len(self.paused.swapped)

    def paused_device_blocks(self) -> int:
        """Device blocks paused requests hold (what pausing costs the pool, for waste accounting)."""
        return self.paused.held_device_blocks()

    def paused_kv(self) -> dict[str, tuple[int, int, int]]:
        """The paused requests per KV disposition: (requests, device blocks, host blocks)."""
        rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for rid, req in self.paused.paused.items():
            assert req.interception is not None  # paused: intercepted
            row = rows[req.interception.disposition.value]
            held = self.kv.held(rid)
            row[0] += 1
            row[1] += held.device
            row[2] += held.host
        return {d: (n, device, host) for d, (n, device, host) in rows.items()}

    def check_invariants(self) -> None:
        """The queues, the request table and the KV tables agree (tests, and the engine's own check)."""
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

"""What the scheduler knows between steps: its queues, the KV manager, the policies and the
counters. The step's helpers (admission.py, preemption.py) read and change this state; the
Scheduler (scheduler.py) subclasses it with the step itself, so the helpers sit below it."""
from __future__ import annotations

from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.kv.reuse import ReuseTracker
from segue.request import Request, RequestStatus
from segue.sched.agents import AgentTracker
from segue.sched.cost_model import CostModel
from segue.sched.interception import InterceptionPolicy, make_interception_policy
from segue.sched.paused import PausedRequests
from segue.sched.policies import SchedulingPolicy
from segue.sched.request_queue import RequestQueue


class SchedulerState:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: SchedulingPolicy,
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
        # Expected reuse of finished requests' blocks (prefix_eviction="reuse"); None: plain LRU.
        self.reuse = ReuseTracker() if config.prefix_eviction == "reuse" else None
        kv.keyed_reloads = self.reuse is not None
        # Agent identity and histories retained across tool gaps (thrashing avoidance); None: off.
        self.agents = AgentTracker(kv, self.cost) if config.agent_retention else None

    def free_finished(self, request: Request) -> None:
        """Free a finished request's KV; under prefix_eviction="reuse" its cached blocks are
        keyed by their expected reuse (the chain it continued, shared blocks' own history)."""
        if self.agents is not None and self.agents.on_finish(request, self.now):
            return
        rid = request.request_id
        n = self.kv.num_device_blocks_of(rid)
        if self.reuse is None or n == 0 or self.kv.has_host_blocks(rid):
            self.kv.free(request)
            return
        full = request.block_hashes[:min(n, request.num_computed_tokens // self.kv.block_size)]
        cls = self.reuse.admit(full, self.now)
        keys = self.reuse.finish(full, n, cls, self.now, self.cost.t_fwd_extra(self.kv.block_size))
        self.kv.free(request, keys)

    def waiting_holders(self) -> list[Request]:
        """The waiting requests that hold device KV, found through the KV tables: the pool bounds
        them, while an overloaded waiting queue holds thousands and is scanned by no per-step pass."""
        holders = []
        for rid in self.kv.request_ids_with_blocks():
            req = self.requests[rid]
            if req.status == RequestStatus.WAITING:
                holders.append(req)
        return holders

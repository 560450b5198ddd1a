"""The affinity router: keep programs, task groups and shared prefixes together, else balance load.

Order of preference, after Parrot's placement (§5.4, Algorithm 1) with sessions added:
1. program affinity: a program's (session's) calls stay on the replica that holds its context, so
   its paused KV and prefix blocks are reused; long programs never migrate;
2. task group: the parallel calls of one group (a map stage) run batched on one replica;
3. shared prefix: the replica that served the longest run of the prompt's leading blocks, unless it
   is more than `load_slack` requests busier than the least loaded one (then recomputing the prefix
   elsewhere costs less than queueing behind it);
4. load: the replica with the fewest running + waiting requests.
"""
from __future__ import annotations

from collections import OrderedDict

from segue.cluster.prefix_index import PrefixIndex, block_hashes
from segue.cluster.router import PlacementReason, RouteDecision, Router, RouteRequest


class AffinityRouter(Router):
    name = "affinity"

    def __init__(self, num_replicas: int, block_size: int = 16, max_prefix_blocks: int = 64,
                 min_prefix_blocks: int = 1, load_slack: int = 4, max_bindings: int = 65536,
                 prefix_capacity: int = 200_000) -> None:
        super().__init__(num_replicas)
        if block_size < 1 or max_prefix_blocks < 1 or min_prefix_blocks < 1 or load_slack < 0:
            raise ValueError("block_size, max_prefix_blocks and min_prefix_blocks must be >= 1, load_slack >= 0")
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.min_prefix_blocks = min_prefix_blocks
        self.load_slack = load_slack
        self.max_bindings = max_bindings
        self.prefixes = PrefixIndex(prefix_capacity)
        self._programs: OrderedDict[str, int] = OrderedDict()
        self._groups: OrderedDict[str, int] = OrderedDict()

    def _place(self, request: RouteRequest, candidates: list[int]) -> RouteDecision:
        hashes = block_hashes(request.prompt_token_ids, self.block_size, self.max_prefix_blocks, request.cache_salt)
        depths = self.prefixes.match(hashes, candidates)
        decision = self._choose(request, candidates, depths)
        if request.program_id is not None:
            self._bind(self._programs, request.program_id, decision.replica)
        if request.task_group is not None:
            self._bind(self._groups, request.task_group, decision.replica)
        self.prefixes.insert(hashes, decision.replica)
        return decision

    def _choose(self, request: RouteRequest, candidates: list[int], depths: dict[int, int]) -> RouteDecision:
        for key, bindings, reason in ((request.program_id, self._programs, PlacementReason.AFFINITY),
                                      (request.task_group, self._groups, PlacementReason.TASK_GROUP)):
            bound = bindings.get(key) if key is not None else None
            if bound is not None and bound in candidates:
                return RouteDecision(bound, reason, depths.get(bound, 0))
        if depths:
            # Deepest match first; among equally deep holders, the least loaded.
            best = min(depths, key=lambda i: (-depths[i], self.load(i), i))
            floor = min(self.load(i) for i in candidates)
            if depths[best] >= self.min_prefix_blocks and self.load(best) <= floor + self.load_slack:
                return RouteDecision(best, PlacementReason.PREFIX, depths[best])
        least = self.least_loaded(candidates)
        return RouteDecision(least, PlacementReason.LOAD, depths.get(least, 0))

    def _bind(self, bindings: OrderedDict[str, int], key: str, replica: int) -> None:
        bindings[key] = replica
        bindings.move_to_end(key)
        while len(bindings) > self.max_bindings:
            bindings.popitem(last=False)

    def forget_program(self, program_id: str) -> None:
        self._programs.pop(program_id, None)

    def set_available(self, replica: int, available: bool) -> None:
        super().set_available(replica, available)
        if not available:
            self.prefixes.drop_replica(replica)

    def forget_replica(self, replica: int) -> None:
        # Bindings, unlike prefixes, survive an outage (a replica back without a restart still
        # holds its sessions); after a restart they would only steer calls to an empty cache.
        super().forget_replica(replica)
        self.prefixes.drop_replica(replica)
        for bindings in (self._programs, self._groups):
            for key in [k for k, bound in bindings.items() if bound == replica]:
                del bindings[key]

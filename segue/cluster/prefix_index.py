"""Which replicas served which prompt prefixes, by a hash chain over the leading full blocks.

Engines cache KV per full block, keyed by the chain of block contents (segue/kv). The router keeps
a coarse mirror of that: the hash of the first d blocks of each prompt it placed (d up to
max_blocks), mapped to the replicas it sent them to. It cannot see the engines evict, so a match
means "probably still cached"; the capacity bound evicts the least recently used chains here too.
Parrot (§5.3) hashes at semantic-variable boundaries; without prompt structure, block boundaries
are the points where the engine itself can share.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int,
                 salt: Hashable = None) -> list[int]:
    """hash(first d blocks) for d = 1..min(full blocks, max_blocks); each hash chains the previous."""
    hashes: list[int] = []
    prev: int = hash(("segue-prefix", salt))
    full = min(len(token_ids) // block_size, max_blocks)
    for d in range(full):
        prev = hash((prev, tuple(token_ids[d * block_size:(d + 1) * block_size])))
        hashes.append(prev)
    return hashes


class PrefixIndex:
    def __init__(self, capacity: int = 200_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        # chain hash -> replicas that were sent a prompt starting with those blocks
        self._holders: OrderedDict[int, set[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, hashes: Sequence[int], candidates: Sequence[int]) -> dict[int, int]:
        """For each candidate replica holding at least the first block: how many leading blocks it holds."""
        depth: dict[int, int] = {}
        wanted = set(candidates)
        for d, h in enumerate(hashes, start=1):
            holders = self._holders.get(h)
            if not holders:
                break  # a chain cannot continue past a missing link
            present = holders & wanted
            if not present:
                break
            for replica in present:
                depth[replica] = d
            self._holders.move_to_end(h)
        return depth

    def insert(self, hashes: Sequence[int], replica: int) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {replica}
            else:
                holders.add(replica)
                self._holders.move_to_end(h)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def held_by(self, replica: int) -> int:
        """How many prefix chains the replica is believed to hold (introspection: tests, benchmarks)."""
        return sum(replica in holders for holders in self._holders.values())

    def drop_replica(self, replica: int) -> None:
        """A replica restarted or died: whatever it cached is gone."""
        for h in [h for h, holders in self._holders.items() if replica in holders]:
            holders = self._holders[h]
            holders.discard(replica)
            if not holders:
                del self._holders[h]

"""The prefix-cache key of a request's full blocks: a hash chained over the blocks before it (so
equal keys mean equal prefixes, not just equal blocks) and the block's tokens (so a hash collision
is caught on lookup). Shared by the device tables and the host tier."""
from __future__ import annotations

from segue.request import Request


class BlockHasher:
    def __init__(self, block_size: int, hash_salt: int = 0) -> None:
        self.block_size = block_size
        self.hash_salt = hash_salt

    def update(self, request: Request) -> list[int]:
        """Extend the request's cached chain (request.block_hashes) to its full blocks; returns it.
        Incremental: a decode adds one hash per filled block, not the whole chain again."""
        bs = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else hash((self.hash_salt, request.cache_salt))
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hash((parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs))))
            hashes.append(parent)
        return hashes

    def key(self, request: Request, i: int) -> tuple[int, tuple[int, ...]]:
        """Block i's (hash, tokens), for BlockPool.lookup/register; update() must have covered it."""
        bs = self.block_size
        return request.block_hashes[i], tuple(request.tokens_slice(i * bs, (i + 1) * bs))

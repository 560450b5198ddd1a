"""A fake executor for scheduler tests: it stores, per physical KV slot, the token whose KV the
slot holds and checks every read, so that swaps, write-backs, discards and prefix hits are
checked to the token; and the output a paused-and-resumed request must produce."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from segue.request import Request
from segue.sampling_params import SamplingParams

VOCAB = 50


class FakeKVExecutor:
    """Stores, per physical slot, the token whose KV it holds; checks every read."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def execute(self, out) -> dict[str, int]:
        # Write-backs first (their device blocks are overwritten this step), then swap-ins, then
        # swap-outs, as the real executor does.
        for d, h in out.blocks_to_back_up:
            self.host[h] = list(self.device.get(d, [None] * self.bs))
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device.get(d, [None] * self.bs))
        sampled = {}
        for seq in out.seqs:
            req = seq.request
            for pos in range(seq.start_pos):  # the context this step attends to
                block = self.device.get(seq.block_table[pos // self.bs])
                assert block is not None and block[pos % self.bs] == req.token_at(pos), (
                    f"{req.request_id}: KV at position {pos} is wrong")
            for j, tok in enumerate(seq.token_ids):
                pos = seq.start_pos + j
                self.device.setdefault(seq.block_table[pos // self.bs], [None] * self.bs)[pos % self.bs] = tok
            if seq.sample:
                sampled[req.request_id] = (sum(req.all_token_ids) * 31 + req.num_tokens) % VOCAB
        return sampled


def tool_tokens(req: Request, k: int) -> list[int]:
    return [(len(req.prompt_token_ids) * 7 + k + i) % VOCAB for i in range(1 + k % 3)]


def expected_output(prompt, max_tokens, pause_at) -> list[int]:
    req = Request("ref", list(prompt), SamplingParams(max_tokens=max_tokens), 0.0)
    k = 0
    while req.num_generated_tokens < max_tokens:
        req.output_token_ids.append((sum(req.all_token_ids) * 31 + req.num_tokens) % VOCAB)
        if req.num_generated_tokens in pause_at and req.num_generated_tokens < max_tokens:
            toks = tool_tokens(req, k)
            req.output_token_ids += toks
            req.num_appended_tokens += len(toks)
            k += 1
    return req.output_token_ids


@dataclass
class PlannedPauses:
    """Pauses requests at planned output lengths, as a tool call would, and resumes each after a
    random delay with `tool_tokens` appended; the scheduler tests share it so each draws from its
    own `rng` in the same order whatever the policy under test."""
    rng: random.Random
    plans: dict[str, set[int]] = field(default_factory=dict)
    pending: list[tuple[float, Request, list[int]]] = field(default_factory=list)
    done: dict[str, int] = field(default_factory=dict)

    def draw(self, max_tokens: int) -> set[int]:
        """Up to two output lengths (below max_tokens) at which a request pauses."""
        return set(self.rng.sample(range(1, max_tokens), k=min(2, max_tokens - 1)))

    def resume_due(self, sched, now: float, before: Callable[[Request], None] | None = None) -> None:
        """Resumes the paused requests whose tool is done by `now` (`before` runs first on each)."""
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            if before is not None:
                before(item[1])
            sched.resume_request(item[1], item[2], now)

    def pause_planned(self, sched, requests: Iterable[Request], now: float,
                      expected_s: Sequence[float | None] | None = None) -> None:
        """Intercepts each unfinished request that reached a planned pause, its tool's expected
        duration drawn from `expected_s` (none given: not passed)."""
        for req in requests:
            if req.is_finished or req.num_generated_tokens not in self.plans[req.request_id]:
                continue
            k = self.done.get(req.request_id, 0)
            self.done[req.request_id] = k + 1
            if expected_s is None:
                sched.intercept_request(req, now, tool="t")
            else:
                sched.intercept_request(req, now, tool="t", expected_s=self.rng.choice(expected_s))
            self.pending.append((now + self.rng.choice([0.0, 0.02, 0.2]), req, tool_tokens(req, k)))

    def expected(self, req: Request) -> list[int]:
        """The output `req` must produce with its planned pauses."""
        return expected_output(req.prompt_token_ids, req.sampling_params.max_tokens, self.plans[req.request_id])

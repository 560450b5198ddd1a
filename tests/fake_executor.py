"""A fake executor for scheduler tests: it stores, per physical KV slot, the token whose KV the
slot holds and checks every read, so that swaps, write-backs, discards and prefix hits are
checked to the token; and the output a paused-and-resumed request must produce."""
from __future__ import annotations

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

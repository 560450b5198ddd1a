"""Per-step token bitmasks: filled on the CPU by llguidance for the rows that sample under a
grammar, then applied to the batch's logits in one masked_fill on the logits' device."""
from __future__ import annotations

import threading
from typing import Any

import torch

from segue.structured.closing import allow_every_end, allow_only
from segue.structured.request_grammar import RequestGrammar

_executor: Any = None
_executor_lock = threading.Lock()


def _ll_executor() -> Any:
    # llguidance's thread pool fills many rows in parallel (it drops the GIL).
    global _executor
    with _executor_lock:
        if _executor is None:
            from llguidance import LLExecutor
            _executor = LLExecutor()
        return _executor


def fill_bitmask(grammars: list[RequestGrammar | None], outputs: list[list[int]],
                 vocab_size: int, budgets: list[int] | None = None) -> tuple[torch.Tensor, list[int]] | None:
    """The allowed-token bitmask ([rows, ceil(V/32)] int32 on the CPU, bit set = allowed) of the
    rows that have a grammar, and those rows' indices; None when no row has one. Each grammar is
    first advanced over its request's new output tokens (`outputs[i]`). `budgets[i]`: tokens
    request i may still generate by its max_tokens, this one included; rows near it, or near the
    end of the context window (RequestGrammar.budget), are steered to close their answer in time
    (segue.structured.closing)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    words = (vocab_size + 31) // 32
    mask = torch.zeros((len(rows), words), dtype=torch.int32)
    live: list[tuple[Any, int]] = []
    for j, i in enumerate(rows):
        g = grammars[i]
        assert g is not None
        g.sync(outputs[i])
        if g.failed:
            allow_only(mask[j], g.eos_token_ids)
        else:
            live.append((g.matcher, j))
    if len(live) == 1:
        matcher, j = live[0]
        row = mask[j]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
    elif live:
        _ll_executor().unsafe_compute_mask_ptr(live, mask.data_ptr(), words * 4, len(rows))
    for _, j in live:
        allow_every_end(mask[j], grammars[rows[j]].eos_token_ids)  # type: ignore[union-attr]
    if budgets is not None:
        for j, i in enumerate(rows):
            g = grammars[i]
            assert g is not None
            if g.failed or g.steer is None:
                continue
            if not g.closing and g.steer.should_close(g.matcher, g.budget(budgets[i], len(outputs[i]))):
                g.closing = True
            if g.closing:
                g.steer.narrow(g.matcher, mask[j])
    return mask, rows


_BIAS_TABLES: dict[torch.device, torch.Tensor] = {}


def _bias_table(device: torch.device) -> torch.Tensor:
    """[256, 8] float: row b holds 0 where bit i of byte b is set, -inf where it is not."""
    table = _BIAS_TABLES.get(device)
    if table is None:
        bits = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
        table = _BIAS_TABLES[device] = torch.where(bits, 0.0, float("-inf")).to(device)
    return table


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits with the disallowed tokens of `rows` at -inf (a new tensor; `logits` is kept for
    reporting the model's own logprobs).

    The mask's bytes index a 256-entry table of additive biases (an embedding lookup, then one
    add): measured ~6x faster on the CPU than shifting out the 32 bits of each word and masking.
    Bytes are read little-endian, the order llguidance writes the words in.
    """
    vocab = logits.shape[-1]
    device = logits.device
    table = _bias_table(device)
    byte_ids = mask.to(device, non_blocking=True).view(torch.uint8).long()
    bias = torch.nn.functional.embedding(byte_ids, table).view(mask.shape[0], -1)[:, :vocab]
    if len(rows) == logits.shape[0]:
        return logits.float() + bias
    out = logits.float().clone()
    idx = torch.tensor(rows, device=device)
    out.index_add_(0, idx, bias)
    return out

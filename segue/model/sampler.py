"""Batched next-token sampling: greedy, temperature, top-k, top-p, seeded draws and logprobs.

Every row's result depends only on that row's logits, params and position, never on which other
requests share the batch, so that seeded requests reproduce across batching and preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from segue.sampling_params import SamplingParams
from segue.structured.bitmask import apply_bitmask

_MASK64 = (1 << 64) - 1


@dataclass
class SampleResult:
    token_id: int
    # Logprob of the chosen token under the raw (temperature 1, unfiltered) distribution.
    logprob: float | None
    # The params.logprobs most likely (token_id, logprob) pairs, most likely first.
    top: list[tuple[int, float]] | None


def _mix_seed(seed: int, position: int) -> int:
    """Derive a per-step generator seed (splitmix64 finalizer).

    Seeding from (seed, position) rather than advancing one long-lived generator makes the
    draw at step n independent of how many steps ran before in this process (preemption,
    recomputation, batch composition).
    """
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _filter_top_k_top_p(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf.

    x: [R, V] fp32 temperature-scaled logits; ks: [R] long (V = disabled); ps: [R] fp32
    (inf = disabled, so float rounding in the cumsum can never drop tail tokens of a row
    that asked for no nucleus filtering). Top-p is applied to the top-k-renormalized
    distribution, as HF and vLLM do.
    """
    vocab = x.shape[-1]
    # Stable sort so ties are broken identically however the batch is composed.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    # Probability mass strictly before each token: drop once the nucleus already holds top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= ps.unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return x.masked_fill(mask, float("-inf"))


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.

    Unlike multinomial it is one elementwise op plus argmax, and zero-probability tokens can
    never win as long as E > 0 (clamped, since exponential_ may return exactly 0).
    """
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int], rows: list[int]
) -> torch.Tensor:
    """Draw one token for each of `rows` (all non-greedy); returns [len(rows)] long on device."""
    device = logits.device
    vocab = logits.shape[-1]
    idx = torch.tensor(rows, device=device)
    temps = torch.tensor([params[r].temperature for r in rows], device=device, dtype=torch.float32)
    x = logits.index_select(0, idx).float() / temps.unsqueeze(1)

    # Only rows that ask for filtering pay for the sort; the others keep their logits untouched,
    # which is what makes a row's result independent of its neighbours' settings.
    filt = [j for j, r in enumerate(rows) if params[r].top_k > 0 or params[r].top_p < 1.0]
    if filt:
        fidx = torch.tensor(filt, device=device)
        ks = torch.tensor(
            [min(params[rows[j]].top_k, vocab) if params[rows[j]].top_k > 0 else vocab for j in filt],
            device=device,
        )
        ps = torch.tensor(
            [params[rows[j]].top_p if params[rows[j]].top_p < 1.0 else float("inf") for j in filt],
            device=device,
            dtype=torch.float32,
        )
        x.index_copy_(0, fidx, _filter_top_k_top_p(x.index_select(0, fidx), ks, ps))

    probs = x.softmax(dim=-1)
    out = torch.empty(len(rows), dtype=torch.long, device=device)

    unseeded = [j for j, r in enumerate(rows) if params[r].seed is None]
    if unseeded:
        uidx = torch.tensor(unseeded, device=device)
        p = probs.index_select(0, uidx)
        out.index_copy_(0, uidx, _race(p, torch.empty_like(p).exponential_()))

    for j, r in enumerate(rows):
        seed = params[r].seed
        if seed is None:
            continue
        gen = torch.Generator(device=device)
        gen.manual_seed(_mix_seed(seed, positions[r]))
        p = probs[j : j + 1]
        out[j : j + 1] = _race(p, torch.empty_like(p).exponential_(generator=gen))
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           allowed: tuple[torch.Tensor, list[int]] | None = None) -> list[SampleResult]:
    """Pick the next token for every row of `logits` ([B, V], any float dtype, CPU or CUDA).

    positions[i] is how many tokens request i has generated so far; it only feeds the seed
    of seeded rows. `allowed` (segue.structured.bitmask.fill_bitmask) restricts the listed rows
    to their grammar's tokens; reported logprobs stay the model's own.
    """
    batch = logits.shape[0]
    if len(params) != batch or len(positions) != batch:
        raise ValueError(f"got {batch} logit rows, {len(params)} params and {len(positions)} positions")
    if batch == 0:
        return []

    want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    scores = logits if allowed is None else apply_bitmask(logits, *allowed)

    # Fast path for the common all-greedy batch: one kernel, one device->host copy.
    if len(greedy) == batch and not want_lp:
        return [SampleResult(t, None, None) for t in scores.argmax(dim=-1).tolist()]

    device = logits.device
    chosen = torch.empty(batch, dtype=torch.long, device=device)
    if greedy:
        gidx = torch.tensor(greedy, device=device)
        chosen.index_copy_(0, gidx, scores.index_select(0, gidx).argmax(dim=-1))
    sampled = [i for i in range(batch) if not params[i].greedy]
    if sampled:
        chosen.index_copy_(0, torch.tensor(sampled, device=device), _sample_rows(scores, params, positions, sampled))

    chosen_lp: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    if want_lp:
        lidx = torch.tensor(want_lp, device=device)
        # Reported logprobs follow OpenAI/vLLM: the model's raw distribution, before
        # temperature and filtering, so they are comparable across sampling settings.
        lp = logits.index_select(0, lidx).float().log_softmax(dim=-1)
        chosen_lp = lp.gather(1, chosen.index_select(0, lidx).unsqueeze(1)).squeeze(1).tolist()
        n = max(params[i].logprobs or 0 for i in want_lp)
        if n > 0:
            vals, ids = lp.topk(min(n, lp.shape[-1]), dim=-1)
            top_ids, top_lps = ids.tolist(), vals.tolist()

    tokens = chosen.tolist()
    results = [SampleResult(t, None, None) for t in tokens]
    for j, i in enumerate(want_lp):
        n = params[i].logprobs or 0
        top = list(zip(top_ids[j][:n], top_lps[j][:n])) if n > 0 else []
        results[i] = SampleResult(tokens[i], chosen_lp[j], top)
    return results

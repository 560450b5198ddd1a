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


# Candidates kept by torch.topk before filtering. Sorting a 49k vocabulary per row dominated
# sampling (a third of a batch-64 decode step); a nucleus at the temperatures people sample
# with almost always closes within the few hundred most likely tokens. Rows whose top-k or
# nucleus reaches past the candidates fall back to the full sort, so the result is exact.
_CANDIDATES = 256


def _filter_top_k_top_p(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf (full sort; exact for any k, p).

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


def _candidate_filter(
    logits: torch.Tensor, temps: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k / nucleus filtering restricted to each row's _CANDIDATES most likely tokens.

    logits: [R, V] raw (any float dtype); temps: [R] fp32; ks, ps as in _filter_top_k_top_p.
    Returns (vals, ids, exact): vals [R, C] the candidates' temperature-scaled fp32 logits (-inf
    where filtered out), ids [R, C] their token ids, and exact [R] bool — True where every token
    outside the candidates would have been filtered out anyway (the row's top-k fits, or its
    nucleus closes inside the candidates), i.e. where sampling from the candidates equals
    sampling from the fully filtered row.
    """
    vocab = logits.shape[-1]
    cand = min(vocab, _CANDIDATES)
    # Temperature is positive, so the raw top-k is the scaled top-k: scale only what is kept.
    vals, ids = logits.topk(cand, dim=-1)
    vals = vals.float() / temps.unsqueeze(1)
    in_k = torch.arange(cand, device=logits.device).unsqueeze(0) < ks.unsqueeze(1)
    vals = vals.masked_fill(~in_k, float("-inf"))
    k_fits = ks <= cand
    # Normalize over the top-k when it fits in the candidates, else over the whole row. The
    # tokens outside the candidates weigh at most (V - C) * e^(smallest candidate - lse) of the
    # candidates' mass; where that is below fp32 resolution (peaked rows, low temperatures) the
    # candidates' own normalizer is the row's, and the full-row pass (a third of the filter's
    # time) is skipped.
    lse = vals.logsumexp(dim=-1)
    tail_bound = (vocab - cand) * (vals[:, -1] - lse).exp()
    full = ((~k_fits) & ~(tail_bound < 1e-7)).nonzero().flatten()
    if full.numel():
        full_lse = (logits.index_select(0, full).float() / temps.index_select(0, full).unsqueeze(1)).logsumexp(dim=-1)
        lse = lse.index_copy(0, full, full_lse)
    probs = (vals - lse.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=-1)
    drop = ~in_k | (cum - probs >= ps.unsqueeze(1))
    drop[:, 0] = False  # the most likely token always survives
    # A top-k between the candidates and the vocabulary renormalizes over tokens not seen here.
    exact = k_fits | ((ks >= vocab) & (cum[:, -1] >= ps))
    return vals.masked_fill(drop, float("-inf")), ids, exact


def _exp_noise(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) draws shaped like `like`, as -log(U): on CPU 4x faster than Tensor.exponential_."""
    return torch.empty_like(like).uniform_(generator=generator).log_().neg_()


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.

    Unlike multinomial it is one elementwise op plus argmax, and zero-probability tokens can
    never win as long as E > 0 (clamped; a draw of U = 0 gives E = inf, which merely loses).
    """
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int], rows: list[int]
) -> torch.Tensor:
    """Draw one token for each of `rows` (all non-greedy); returns [len(rows)] long on device."""
    device = logits.device
    vocab = logits.shape[-1]

    def select(src: torch.Tensor, js: list[int]) -> torch.Tensor:
        # A full-vocabulary row copy costs ~0.2 ms; skip it in the common all-rows case.
        return src if js == list(range(src.shape[0])) else src.index_select(0, torch.tensor(js, device=device))

    src = select(logits, rows)
    temp_list = [params[r].temperature for r in rows]

    # Only rows that ask for filtering pay for it; the others keep their logits untouched,
    # which is what makes a row's result independent of its neighbours' settings.
    filt = [j for j, r in enumerate(rows) if params[r].top_k > 0 or params[r].top_p < 1.0]
    # Filtered rows whose top-k / nucleus lies within the candidates sample among those
    # (cand_pos[j] = their row in cand_probs); all other rows sample over the whole vocabulary.
    cand_pos: dict[int, int] = {}
    ks_of: dict[int, int] = {}
    ps_of: dict[int, float] = {}
    if filt:
        for j in filt:
            p = params[rows[j]]
            ks_of[j] = min(p.top_k, vocab) if p.top_k > 0 else vocab
            ps_of[j] = p.top_p if p.top_p < 1.0 else float("inf")
        cand_vals, cand_ids, exact = _candidate_filter(
            select(src, filt),
            torch.tensor([temp_list[j] for j in filt], device=device, dtype=torch.float32),
            torch.tensor([ks_of[j] for j in filt], device=device),
            torch.tensor([ps_of[j] for j in filt], device=device, dtype=torch.float32),
        )
        cand_probs = cand_vals.softmax(dim=-1)
        cand_pos = {j: i for i, (j, ok) in enumerate(zip(filt, exact.tolist(), strict=True)) if ok}

    full = [j for j in range(len(rows)) if j not in cand_pos]
    full_pos = {j: i for i, j in enumerate(full)}
    probs = None
    if full:
        temps = torch.tensor([temp_list[j] for j in full], device=device, dtype=torch.float32)
        x = select(src, full).float() / temps.unsqueeze(1)
        inexact = [i for i, j in enumerate(full) if j in ks_of]
        if inexact:
            sub = torch.tensor(inexact, device=device)
            ks = torch.tensor([ks_of[full[i]] for i in inexact], device=device)
            ps = torch.tensor([ps_of[full[i]] for i in inexact], device=device, dtype=torch.float32)
            x.index_copy_(0, sub, _filter_top_k_top_p(x.index_select(0, sub), ks, ps))
        probs = x.softmax(dim=-1)

    def draw(js: list[int], gen: torch.Generator | None = None) -> torch.Tensor:
        """Token ids for rows `js`, which all sample from one source (candidates or vocabulary)."""
        if js[0] in cand_pos:
            pos = [cand_pos[j] for j in js]
            p = select(cand_probs, pos)
            return select(cand_ids, pos).gather(1, _race(p, _exp_noise(p, gen)).unsqueeze(1)).squeeze(1)
        assert probs is not None  # rows without candidates are the `full` ones
        p = select(probs, [full_pos[j] for j in js])
        return _race(p, _exp_noise(p, gen))

    out = torch.empty(len(rows), dtype=torch.long, device=device)
    unseeded = [j for j, r in enumerate(rows) if params[r].seed is None]
    for js in ([j for j in unseeded if j in cand_pos], [j for j in unseeded if j not in cand_pos]):
        if js:
            out.index_copy_(0, torch.tensor(js, device=device), draw(js))
    for j, r in enumerate(rows):
        seed = params[r].seed
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(_mix_seed(seed, positions[r]))
            out[j : j + 1] = draw([j], gen)
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
        top = list(zip(top_ids[j][:n], top_lps[j][:n], strict=True)) if n > 0 else []
        results[i] = SampleResult(tokens[i], chosen_lp[j], top)
    return results

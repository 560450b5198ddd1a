"""The agent workload's report table, shared by `segue sim --workload agents` and `segue bench agents`.

Beside agent time it reports the trade that protecting running agents makes: time to first token
of agents' first turns (a newcomer waiting for memory) apart from their later turns (whose histories
retention keeps), each as mean / p50 / p90. A turn that never got a token (a newcomer starved until
the run ended, or one whose stream ended without a token) counts with its wait until then: a lower
bound on its TTFT, so a starved turn raises the p90 instead of vanishing from it; the table says
how many such turns a cell counts."""
from __future__ import annotations

from typing import Any

from segue.sim.metrics import percentiles

TTFT_KINDS = ("first", "later")
TTFT_STATS = ("mean", "p50", "p90")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)


def ttft_fields(first: list[float], later: list[float],
                no_token: tuple[int, int] = (0, 0)) -> dict[str, float | None]:
    """`{first,later}_ttft_{mean,p50,p90}_s` of first turns' and later turns' TTFTs (None: no turn),
    and `{first,later}_ttft_no_token`: how many of them are turns that never got a token, counted
    at their wait until the run's end (`no_token`, included in the lists)."""
    fields: dict[str, float | None] = {}
    for kind, xs, n in zip(TTFT_KINDS, (first, later), no_token, strict=True):
        p = percentiles(xs, (50.0, 90.0)) if xs else {}
        fields[f"{kind}_ttft_mean_s"] = _mean(xs)
        fields[f"{kind}_ttft_p50_s"] = p.get("p50")
        fields[f"{kind}_ttft_p90_s"] = p.get("p90")
        fields[f"{kind}_ttft_no_token"] = n
    return fields


def _ttft_cell(r: dict[str, Any], kind: str) -> str:
    vals = [r.get(f"{kind}_ttft_{s}_s") for s in TTFT_STATS]
    if all(v is None for v in vals):
        return "n/a"
    cell = " / ".join(_f(v, "{:.2f}") for v in vals)
    n = r.get(f"{kind}_ttft_no_token") or 0
    return cell + (f" (≥; {n:.0f} without a token)" if n else "")


def render(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"### {title}", "", "| config | target | mode | interception | done | agent time − tool time (s) | "
             "first-turn TTFT mean / p50 / p90 (s) | later-turn TTFT mean / p50 / p90 (s) | "
             "preemptions | recompute waste (GB·s) | total waste (GB·s) | prefix hits | computed prompt tokens "
             "(× minimum) |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        computed, least = r.get("computed_prompt_tokens"), r.get("min_prompt_tokens")
        ratio = f" ({computed / least:.2f}×)" if computed is not None and least else ""
        lines.append(f"| {r['config']} | {r['target']} | {r['mode']} | {r['interception'] or 'server default'} | "
                     f"{r['num_finished']}/{r['num_agents']} | {_f(r['mean_busy_s'], '{:.2f}')} | "
                     f"{_ttft_cell(r, 'first')} | {_ttft_cell(r, 'later')} | "
                     f"{_f(r['preemptions'], '{:.0f}')} | {_f(r['recompute_gbs'], '{:.2f}')} | "
                     f"{_f(r['waste_total_gbs'], '{:.2f}')} | {_f(r['prefix_hit'], '{:.0%}')} | "
                     f"{_f(computed, '{:,}')}{ratio} |")
    if any(r.get(f"{k}_ttft_no_token") for r in rows for k in TTFT_KINDS):
        lines += ["", "≥: turns that never got a token count with their wait until the run's end (a lower "
                  "bound on their TTFT), so a starved turn raises the percentiles instead of leaving them."]
    least = next((r["min_prompt_tokens"] for r in rows if r.get("min_prompt_tokens")), None)
    if least:
        lines += ["", f"Minimum computed prompt tokens (every token no earlier step computed, once): {least:,}."]
    base = rows[0].get("mean_busy_s") if rows else None
    if base:
        lines += ["", "Ratios to the first configuration (agent time − tool time; > 1 is slower): " + ", ".join(
            f"{r['config']} {r['mean_busy_s'] / base:.2f}×" for r in rows[1:] if r.get("mean_busy_s"))]
    return "\n".join(lines)

"""The agent workload's report table, shared by `segue sim --workload agents` and `segue bench agents`."""
from __future__ import annotations

from typing import Any


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)


def render(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"### {title}", "", "| config | target | mode | interception | done | agent time − tool time (s) | "
             "preemptions | recompute waste (GB·s) | total waste (GB·s) | prefix hits | computed prompt tokens "
             "(× minimum) |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        computed, least = r.get("computed_prompt_tokens"), r.get("min_prompt_tokens")
        ratio = f" ({computed / least:.2f}×)" if computed is not None and least else ""
        lines.append(f"| {r['config']} | {r['target']} | {r['mode']} | {r['interception'] or 'server default'} | "
                     f"{r['num_finished']}/{r['num_agents']} | {_f(r['mean_busy_s'], '{:.2f}')} | "
                     f"{_f(r['preemptions'], '{:.0f}')} | {_f(r['recompute_gbs'], '{:.2f}')} | "
                     f"{_f(r['waste_total_gbs'], '{:.2f}')} | {_f(r['prefix_hit'], '{:.0%}')} | "
                     f"{_f(computed, '{:,}')}{ratio} |")
    least = next((r["min_prompt_tokens"] for r in rows if r.get("min_prompt_tokens")), None)
    if least:
        lines += ["", f"Minimum computed prompt tokens (every token no earlier step computed, once): {least:,}."]
    base = rows[0].get("mean_busy_s") if rows else None
    if base:
        lines += ["", "Ratios to the first configuration (agent time − tool time; > 1 is slower): " + ", ".join(
            f"{r['config']} {r['mean_busy_s'] / base:.2f}×" for r in rows[1:] if r.get("mean_busy_s"))]
    return "\n".join(lines)

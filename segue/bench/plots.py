"""PNG plots of a comparison (matplotlib, Agg backend: no display needed): latency against arrival
rate per configuration, and latency CDFs per rate."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segue.bench.report import metric, records_of
from segue.sim.metrics import normalized_latency, ttft


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_vs_rate(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Mean and p99 normalized latency against rate, one line per configuration."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for ax, stat in zip(axes, ("mean", "p99"), strict=True):
        ys_all = []
        for c in configs:
            measured = sorted((r["rate"], metric(r, "normalized_latency", stat)) for r in rows if r["config"] == c)
            pts = [(x, y) for x, y in measured if y is not None]
            ys_all += [y for _, y in pts]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=c)
        if ys_all and min(ys_all) > 0 and max(ys_all) / min(ys_all) > 20:
            ax.set_yscale("log")  # one collapsing configuration would otherwise flatten the rest
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"{stat} normalized latency (s/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_cdfs(rows: Sequence[dict[str, Any]], path: str | Path, title: str, max_rates: int = 4) -> None:
    """Empirical CDFs of normalized latency and TTFT, one row of panels per rate (the highest
    `max_rates` rates, where configurations differ most)."""
    plt = _pyplot()
    rates = sorted(dict.fromkeys(r["rate"] for r in rows))[-max_rates:]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(len(rates), 2, figsize=(11, 3.4 * len(rates)), squeeze=False)
    for (ax_n, ax_t), rate in zip(axes, rates, strict=True):
        for c in configs:
            recs = [rec for r in rows if r["config"] == c and r["rate"] == rate for rec in records_of(r)]
            if not recs:
                continue
            for ax, values in ((ax_n, [normalized_latency(x) for x in recs]), (ax_t, [ttft(x) for x in recs])):
                xs = np.sort(values)
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=c)
        for ax, what in ((ax_n, "normalized latency (s/token)"), (ax_t, "TTFT (s)")):
            ax.set_xlabel(what)
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{rate:g} req/s")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

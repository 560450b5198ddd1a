"""Command line for the soak: `python -m tests.soak.run --requests 3000 --concurrency 32 --json out.json`.

Prints the Markdown summary and exits 1 if the soak found a problem (see SoakReport.problems).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from .driver import SoakConfig, run_soak


def main(argv: list[str] | None = None) -> int:
    defaults = SoakConfig()
    p = argparse.ArgumentParser(prog="python -m tests.soak.run", description=__doc__)
    p.add_argument("--requests", type=int, default=defaults.requests, help="HTTP request budget")
    p.add_argument("--concurrency", type=int, default=defaults.concurrency)
    p.add_argument("--seconds", type=float, default=defaults.seconds, help="time budget for starting scenarios")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--policy", default=defaults.policy, help="interception policy")
    p.add_argument("--kv-cache-tokens", type=int, default=defaults.kv_cache_tokens, help="device KV pool")
    p.add_argument("--session-ttl", type=float, default=defaults.session_ttl_s)
    p.add_argument("--deadline", type=float, default=defaults.deadline_s, help="per-scenario hang deadline (s)")
    p.add_argument("--max-rss-growth", type=float, default=defaults.max_rss_growth)
    p.add_argument("--json", help="write the full report here")
    args = p.parse_args(argv)
    # The server logs every expected failure (tool errors, aborts) at warning level; keep the summary readable.
    logging.basicConfig(level=logging.ERROR)
    cfg = dataclasses.replace(defaults, requests=args.requests, concurrency=args.concurrency, seconds=args.seconds,
                              seed=args.seed, policy=args.policy, kv_cache_tokens=args.kv_cache_tokens,
                              session_ttl_s=args.session_ttl,
                              deadline_s=args.deadline, max_rss_growth=args.max_rss_growth)
    report = run_soak(cfg)
    print(report.markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())

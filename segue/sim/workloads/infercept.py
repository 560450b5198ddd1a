"""The InferCept six-augmentation trace, shipped gzip-compressed in segue/sim/data/infercept
(Apache-2.0; origin and format in its NOTICE). SEGUE_WORKLOADS=DIR reads DIR/infercept/<name>
(plain or .gz) instead.

Segments are the model generating `completion_tokens`, then an interception of `api_time`
seconds after which `api_token_length` tokens are appended. Text-form segments are counted with
the tokenizer given (token counts otherwise come from GPT-J's tokenizer, as recorded)."""
from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from typing import Callable

from segue.sim.workloads.trace_request import TraceRequest

PACKAGED_DIR = Path(__file__).resolve().parents[1] / "data" / "infercept"
_HEX = re.compile(r"^[0-9a-f]{32}$")


def trace_path(name: str = "merged_exp_uniform.json") -> Path:
    """The trace file: under $SEGUE_WORKLOADS/infercept when that is set (an override, e.g. a
    newer copy), else the packaged copy."""
    override = os.environ.get("SEGUE_WORKLOADS")
    base = Path(override) / "infercept" if override else PACKAGED_DIR
    for candidate in (base / name, base / f"{name}.gz"):
        if candidate.exists():
            return candidate
    where = f"SEGUE_WORKLOADS={override}" if override else f"the package ({PACKAGED_DIR})"
    raise FileNotFoundError(f"InferCept trace {name} not found in {where}")


def read_trace_json(path: Path) -> dict:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def classify(key: str, segments: list[dict]) -> str:
    text_form = "prompt" in segments[0]
    if _HEX.match(key):
        first = segments[0].get("api_time")
        return "math" if first is not None and first < 0.01 else "qa"
    if key.isdigit():
        return "chatbot" if text_form else "ve"
    suffix = key.rsplit("_", 1)[-1]
    return {"1": "tts", "2": "image", "3": "image"}.get(suffix, "other")


def load_infercept(path: str | Path | None = None, count_tokens: Callable[[str], int] | None = None,
                   ) -> list[TraceRequest]:
    path = Path(path) if path else trace_path()
    data = read_trace_json(Path(path))
    count = count_tokens or (lambda s: max(1, round(len(s.split()) * 1.3)))
    requests = []
    for key, segs in data.items():
        first = segs[0]
        prompt = first["prompt_tokens"] if "prompt_tokens" in first else count(first["prompt"])
        out: list[tuple[int, float | None, int]] = []
        for i, seg in enumerate(segs):
            gen = seg["completion_tokens"] if "completion_tokens" in seg else count(seg.get("completion", ""))
            last = i == len(segs) - 1 or "api_time" not in seg
            if last:
                out.append((max(1, gen), None, 0))
                break
            appended = seg["api_token_length"] if "api_token_length" in seg else count(str(seg.get("api_token", "")))
            # Known quirk: a few VE calls record -2 returned tokens.
            out.append((max(1, gen), float(seg["api_time"]), max(0, appended)))
        requests.append(TraceRequest(key, classify(key, segs), max(1, prompt), out))
    return requests


def fit_to_context(requests: list[TraceRequest], max_len: int) -> tuple[list[TraceRequest], int]:
    """Drop requests whose whole context would not fit the engine; returns (kept, dropped)."""
    kept = [r for r in requests if r.total_tokens < max_len]
    return kept, len(requests) - len(kept)

"""The workloads of `segue bench programs`: the same summaries written as a program (semantic
functions over /v1/programs) and as a request-centric client (each call through /v1/completions,
outputs fed to the next call on the client). Both pay an emulated network delay on every HTTP
round trip, half before the request leaves and half before the response arrives.
"""
from __future__ import annotations

import glob
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

DEFAULT_DOCUMENT = "/usr/include/lzma/*.h"
CHAIN = ("Summary of the document so far:\n{{input:summary}}\n\nNext part of the document:\n{{input:chunk}}\n\n"
         "Updated summary of the document so far:{{output:new_summary}}")
MAP = "Summarize this part of a document.\n\n{{input:chunk}}\n\nSummary:{{output:summary}}"
QUESTIONS = ["What is this about?", "List the main functions.", "Which errors can occur?", "Who wrote it?",
             "What does it return?", "Is it thread safe?", "What are the limits?", "Give an example."]


def load_document(pattern: str) -> str:
    """The files' text with C comment markers and preprocessor lines removed."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise SystemExit(f"no document found at {pattern!r}; pass --document PATH (any long text file)")
    lines = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            raw = f.read().splitlines()
        for line in raw:
            line = re.sub(r"^\s*(/\*\*?|\*/|\*)", "", line).replace("*/", "").rstrip()
            if not line.lstrip().startswith("#"):
                lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def delayed_transport(delay_s: float) -> Any:
    import httpx

    class DelayedTransport(httpx.HTTPTransport):
        """Emulated WAN latency: every round trip takes delay_s longer (half each way)."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            time.sleep(delay_s / 2)
            response = super().handle_request(request)
            time.sleep(delay_s / 2)
            return response
    return DelayedTransport()


def chain_program(url: str, chunks: list[str], n: int, delay: float) -> float:
    from segue.program.client import Client, semantic_function, strip

    summarize = semantic_function(CHAIN, max_tokens=n, ignore_eos=True, transforms=[strip()])(
        lambda summary, chunk: None)
    with Client(url, transport=delayed_transport(delay)) as client:
        start = time.monotonic()
        with client.program():
            summary: Any = "(nothing yet)"
            for chunk in chunks:
                summary = summarize(summary, chunk)
            summary.get(criteria="latency")
            return time.monotonic() - start


def map_reduce_program(url: str, chunks: list[str], n: int, delay: float) -> float:
    from segue.program.client import Client, semantic_function, strip

    summarize = semantic_function(MAP, max_tokens=n, ignore_eos=True, transforms=[strip()])(lambda chunk: None)
    combine = semantic_function(_reduce_template(len(chunks)), max_tokens=n, ignore_eos=True)(lambda **s: None)
    with Client(url, transport=delayed_transport(delay)) as client:
        start = time.monotonic()
        with client.program():
            parts = [summarize(c) for c in chunks]
            combine(**{f"s{i}": p for i, p in enumerate(parts)}).get(criteria="latency")
            return time.monotonic() - start


def _reduce_template(k: int) -> str:
    return ("Combine these summaries of parts of one document into one summary.\n\n"
            + "\n".join(f"- {{{{input:s{i}}}}}" for i in range(k)) + "\n\nSummary:{{output:final}}")


def _complete(http: Any, prompt: str, n: int) -> str:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"].strip()


def chain_baseline(url: str, chunks: list[str], n: int, delay: float) -> float:
    import httpx

    from segue.program.template import Template

    t = Template.parse(CHAIN)
    with httpx.Client(base_url=url, transport=delayed_transport(delay), timeout=600) as http:
        start = time.monotonic()
        summary = "(nothing yet)"
        for chunk in chunks:
            summary = _complete(http, t.render_text({"summary": summary, "chunk": chunk}), n)
        return time.monotonic() - start


def map_reduce_baseline(url: str, chunks: list[str], n: int, delay: float) -> float:
    import httpx

    from segue.program.template import Template

    t, r = Template.parse(MAP), Template.parse(_reduce_template(len(chunks)))
    with httpx.Client(base_url=url, transport=delayed_transport(delay), timeout=600) as http, \
            ThreadPoolExecutor(len(chunks)) as pool:
        start = time.monotonic()
        # Independent calls go out concurrently, as the paper's baseline does too.
        parts = list(pool.map(lambda c: _complete(http, t.render_text({"chunk": c}), n), chunks))
        _complete(http, r.render_text({f"s{i}": p for i, p in enumerate(parts)}), n)
        return time.monotonic() - start


def shared_prefix_run(url: str, doc: str, calls: int, n: int) -> float:
    """Seconds from the document being set to the last answer (all calls are submitted first)."""
    from segue.program.client import Client, semantic_function

    with Client(url) as client, client.program() as p:
        document = p.variable(None, "doc")
        answers = [semantic_function(f"{{{{input:doc}}}}\n\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]}\n"
                                     "Answer:{{output:answer}}", max_tokens=n, ignore_eos=True)(
            lambda doc: None)(document) for i in range(calls)]
        for a in answers:
            a.id  # every call is on the server before the clock starts
        start = time.monotonic()
        document.set(doc)
        for a in answers:
            a.get(criteria="throughput")
        return time.monotonic() - start

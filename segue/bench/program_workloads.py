"""The workloads of `segue bench programs`: the same summaries (and a coder/reviewer loop) written
as a program (semantic functions over /v1/programs) and as a request-centric client (each call
through /v1/completions, outputs fed to the next call on the client). Both pay an emulated network
delay on every HTTP round trip, half before the request leaves and half before the response arrives.
"""
from __future__ import annotations

import glob
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from segue.program.client import RemoteProgram, RemoteVariable

DEFAULT_DOCUMENT = "/usr/include/lzma/*.h"
CHAIN = ("Summary of the document so far:\n{{input:summary}}\n\nNext part of the document:\n{{input:chunk}}\n\n"
         "Updated summary of the document so far:{{output:new_summary}}")
MAP = "Summarize this part of a document.\n\n{{input:chunk}}\n\nSummary:{{output:summary}}"
# Two agents over one shared context (paper 003 §8.4, cut down to one file and one coder): the task
# comes first in both templates so the coder's and the reviewer's prompts share it as a prefix.
CODER = ("{{input:task}}\n\nYou are the coder. Write the code for the task above, addressing the "
         "reviewer's latest comments.\nLatest review:\n{{input:review}}\n\nCode:{{output:code}}")
REVIEWER = ("{{input:task}}\n\nYou are the reviewer. Review this code for the task above and list what "
            "to fix.\nCode:\n{{input:code}}\n\nReview:{{output:review}}")
NO_REVIEW = "(no review yet)"
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


def _complete(http: Any, prompt: str, n: int, record: list[dict[str, Any]] | None = None) -> str:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True})
    r.raise_for_status()
    body = r.json()
    if record is not None:
        usage = body["usage"]
        record.append({"prompt_tokens": usage["prompt_tokens"],
                       "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})
    return body["choices"][0]["text"].strip()


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
            a.id  # noqa: B018 -- the id waits for its submission: every call is on the server before the clock starts
        start = time.monotonic()
        document.set(doc)
        for a in answers:
            a.get(criteria="throughput")
        return time.monotonic() - start


def coder_reviewer_program(url: str, task_text: str, rounds: int, n: int, delay: float,
                           record: list[dict[str, Any]] | None = None) -> float:
    """`rounds` coder calls and `rounds` reviewer calls, each reading the one before, submitted
    together; `record` (if given) gets each call's GET /v1/programs/{id} entry, in loop order."""
    from segue.program.client import Client

    with Client(url, transport=delayed_transport(delay)) as client:
        start = time.monotonic()
        with client.program() as p:
            task = p.variable(task_text, "task")
            # Empty output variables made up front (concurrently, on the client's pool) let every call
            # name its input and output by id at once; with the calls' own outputs (semantic_function)
            # each submission would wait for the previous one's round trip.
            outputs = [p.variable(None, name) for _ in range(rounds) for name in ("code", "review")]
            submits = []
            for i, out in enumerate(outputs):
                previous: RemoteVariable | str = outputs[i - 1] if i else NO_REVIEW
                template, inputs = (CODER, {"review": previous}) if i % 2 == 0 else (REVIEWER, {"code": previous})
                submits.append(client.pool.submit(_submit_call, p, template, {"task": task, **inputs}, out, n,
                                                  i == len(outputs) - 1))
            for f in submits:  # a refused call would leave its output unset and the get below waiting forever
                f.result()
            outputs[-1].get(criteria="latency")
            seconds = time.monotonic() - start
            if record is not None:
                order = {v.id: i for i, v in enumerate(outputs)}
                record.extend(sorted(p.info()["calls"], key=lambda c: order[c["output"]["id"]]))
            return seconds


def _submit_call(p: RemoteProgram, template: str, inputs: dict[str, RemoteVariable | str], out: RemoteVariable,
                 n: int, last: bool) -> None:
    from segue.program.client import RemoteVariable, strip

    body: dict[str, Any] = {
        "program_id": p.id, "template": template, "output_variable": out.id, "max_tokens": n,
        "temperature": 0.0, "ignore_eos": True, "transforms": [strip()],
        "inputs": {k: v.id if isinstance(v, RemoteVariable) else {"value": v} for k, v in inputs.items()}}
    if last:
        body["criteria"] = "latency"  # the objective is known at submission, before the get arrives
    p.client.request("POST", "/v1/programs/calls", json=body)


def coder_reviewer_baseline(url: str, task_text: str, rounds: int, n: int, delay: float,
                            record: list[dict[str, Any]] | None = None) -> float:
    """The same loop with a round trip per call; `record` gets each call's prompt and cached tokens."""
    import httpx

    from segue.program.template import Template

    coder, reviewer = Template.parse(CODER), Template.parse(REVIEWER)
    with httpx.Client(base_url=url, transport=delayed_transport(delay), timeout=600) as http:
        start = time.monotonic()
        review = NO_REVIEW
        for _ in range(rounds):
            code = _complete(http, coder.render_text({"task": task_text, "review": review}), n, record)
            review = _complete(http, reviewer.render_text({"task": task_text, "code": code}), n, record)
        return time.monotonic() - start

"""`segue bench structured`: what constrained decoding costs and what it buys, on the real engine.

Three measurements (all in one process, so ratios compare like with like):
- compile: building llguidance's view of the tokenizer (once per engine), compiling each kind of
  grammar cold, and a cached compile (cache hit plus the per-request matcher copy).
- tpot: time per output token at each batch size, unconstrained vs. the "auto" tool grammar (free
  text that may turn into a call: the grammar every tool-using chat request carries) vs. a JSON
  schema that cannot complete within the run (so every step computes a real mask). EOS is
  ignored, so all configurations generate the same number of tokens; configurations alternate
  within each repeat so that drift in machine load hits all of them alike.
- validity: sampled requests (temperature 0.7, seeds 0..N-1) for tool_choice required / named /
  auto and response_format json_schema, each with and without the constraint, rendered with the
  server's own chat renderer and judged with the server's own tool-call parser and jsonschema.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from segue.bench import Benchmark

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": "forecast length in days"}},
        "required": ["city", "days"]}}}
SEARCH: dict[str, Any] = {"type": "function", "function": {
    "name": "web_search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
TOOL_QUESTIONS = ["What will the weather be in Paris for the next 3 days?", "Will it rain in Tokyo tomorrow?",
                  "I am flying to Lima next week, what weather should I expect there for 5 days?",
                  "Find out who won the 2018 football world cup."]
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
JSON_QUESTION = "Describe a fictional person as a JSON object with their name, age and city."
# For the TPOT run: an array that must hold more items than the run generates tokens.
LONG_ARRAY = {"type": "array", "minItems": 1000, "items": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--samples", type=int, default=24, help="sampled requests per mode and setting (default: 24)")
    g.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    g.add_argument("--max-tokens", type=int, default=64, help="max tokens of each validity request (default: 64)")
    g.add_argument("--batch-sizes", default="1,32", help="batch sizes of the TPOT run (default: 1,32)")
    g.add_argument("--output-len", type=int, default=48, help="tokens per request in the TPOT run (default: 48)")
    g.add_argument("--repeats", type=int, default=2, help="TPOT repeats per configuration (default: 2)")
    g.add_argument("--skip-tpot", action="store_true", help="skip the time-per-token runs")
    g.add_argument("--skip-validity", action="store_true", help="skip the output-validity runs")
    g.add_argument("--output-json", default=None, metavar="PATH", help="write all results here")


def _drain(engine: Any) -> list[Any]:
    done: list[Any] = []
    while engine.has_unfinished_requests():
        done.extend(o for o in engine.step() if o.finished)
    return done


def measure_compile(engine: Any) -> dict[str, Any]:
    from segue.structured import StructuredSpec
    from segue.structured.backend import GrammarBackend
    from segue.structured.tool_grammar import auto_grammar, forced_grammar

    eos = engine.model_config.eos_token_ids[0]
    backend = GrammarBackend(engine.tokenizer, engine.model_config.vocab_size, eos)
    t0 = time.perf_counter()
    backend.ll_tokenizer  # noqa: B018 -- built on first use; timed on its own
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - t0, "cold_s": {}, "cached_s": {}}
    specs = {"json_schema": StructuredSpec.json_schema(PERSON), "tool_auto": auto_grammar(TOOLS),
             "tool_required": forced_grammar(TOOLS)}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        backend.compile(spec)
        out["cold_s"][name] = time.perf_counter() - t0
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            backend.matcher(spec, 0)
        out["cached_s"][name] = (time.perf_counter() - t0) / reps
    return out


def measure_tpot(engine: Any, prompt: list[int], batch: int, output_len: int, spec: Any) -> float:
    from segue.engine.engine_request import EngineRequest
    from segue.sampling_params import SamplingParams
    from segue.sim.metrics import RequestRecord, tpot

    for i in range(batch):
        params = SamplingParams(max_tokens=output_len, temperature=0.7, seed=i, ignore_eos=True, structured=spec)
        engine.add_request(EngineRequest(prompt, params))
    values = [tpot(RequestRecord.from_output(o)) for o in _drain(engine)]
    return sum(v for v in values if v is not None) / len(values)


def run_tpot(engine: Any, renderer: Any, args: argparse.Namespace) -> dict[str, Any]:
    from segue.structured import StructuredSpec
    from segue.structured.tool_grammar import auto_grammar

    prompt = engine.encode(renderer.render([{"role": "user", "content": TOOL_QUESTIONS[0]}], TOOLS))
    configs = {"none": None, "tool_auto": auto_grammar(TOOLS), "json_array": StructuredSpec.json_schema(LONG_ARRAY)}
    for spec in configs.values():
        if spec is not None:
            engine.grammars.compile(spec)
    measure_tpot(engine, prompt, 1, 4, None)  # warm-up
    out: dict[str, Any] = {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        samples: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, spec in configs.items():
                samples[name].append(measure_tpot(engine, prompt, batch, args.output_len, spec))
                print(f"batch {batch} {name}: TPOT {samples[name][-1] * 1e3:.1f} ms", file=sys.stderr)
        base = sum(samples["none"]) / len(samples["none"])
        out[str(batch)] = {name: {"tpot_ms": [v * 1e3 for v in vals],
                                  "overhead": sum(vals) / len(vals) / base - 1.0}
                           for name, vals in samples.items()}
    return out


def _judge(mode: str, text: str) -> str:
    """valid | text (no call, allowed for auto only) | invalid."""
    import jsonschema

    from segue.tools.parser import ToolCallParser

    if mode == "json_schema":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return "invalid"
        return "valid"
    _, calls = ToolCallParser().find_calls(text)
    if not calls:
        return "text" if mode == "auto" and "<tool_call>" not in text else "invalid"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        if call.error or call.name not in schemas or (mode == "named" and call.name != "get_weather"):
            return "invalid"
        try:
            jsonschema.validate(call.arguments, schemas[call.name])
        except jsonschema.ValidationError:
            return "invalid"
    return "valid"


def run_validity(engine: Any, renderer: Any, args: argparse.Namespace) -> dict[str, Any]:
    from segue.engine.engine_request import EngineRequest
    from segue.sampling_params import SamplingParams
    from segue.structured import StructuredSpec
    from segue.structured.tool_grammar import auto_grammar, forced_grammar

    modes = {"required": forced_grammar(TOOLS), "named": forced_grammar([WEATHER], TOOLS),
             "auto": auto_grammar(TOOLS), "json_schema": StructuredSpec.json_schema(PERSON)}
    jobs: dict[str, tuple[str, bool]] = {}
    for mode, spec in modes.items():
        for constrained in (False, True):
            for i in range(args.samples):
                if mode == "json_schema":
                    prompt = renderer.render([{"role": "user", "content": JSON_QUESTION}], None)
                else:
                    question = TOOL_QUESTIONS[i % len(TOOL_QUESTIONS)]
                    prompt = renderer.render([{"role": "user", "content": question}], TOOLS)
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                                        structured=spec if constrained else None)
                rid = f"{mode}-{int(constrained)}-{i}"
                engine.add_request(EngineRequest(engine.encode(prompt), params, rid))
                jobs[rid] = (mode, constrained)
    results: dict[str, Any] = {}
    examples: dict[str, str] = {}
    for o in _drain(engine):
        mode, constrained = jobs[o.request_id]
        verdict = _judge(mode, o.outputs[0].text)
        key = f"{mode}/{'constrained' if constrained else 'unconstrained'}"
        tally = results.setdefault(key, {"valid": 0, "text": 0, "invalid": 0})
        tally[verdict] += 1
        examples.setdefault(f"{key}/{verdict}", o.outputs[0].text[:200])
    return {"counts": dict(sorted(results.items())), "examples": examples}


def run(args: argparse.Namespace) -> int:
    import platform

    from segue.engine.args import engine_config_from_args
    from segue.engine.llm_engine import LLMEngine
    from segue.server.templating import ChatRenderer

    engine = LLMEngine(engine_config_from_args(args))
    renderer = ChatRenderer(engine.apply_chat_template, engine.chat_template)
    result: dict[str, Any] = {"model": engine.model_name, "cpu": platform.processor() or platform.machine(),
                              "argv": sys.argv[1:], "compile": measure_compile(engine)}
    print(json.dumps({"compile": result["compile"]}, indent=1))
    if not args.skip_tpot:
        result["tpot"] = run_tpot(engine, renderer, args)
        print(json.dumps({"tpot": result["tpot"]}, indent=1))
    if not args.skip_validity:
        result["validity"] = run_validity(engine, renderer, args)
        print(json.dumps({"validity": result["validity"]}, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


BENCHMARK = Benchmark("structured", "constrained decoding: compile time, TPOT overhead, valid-call rate",
                      add_arguments, run, description=__doc__)

"""The engine: what turns requests into tokens, one step at a time, behind one typed seam.

Read it in this order:
- `protocol.py`: EngineClient, everything the server (and programs) may ask of an engine, with the
  types it speaks (`engine_request.py`: the one value a new request crosses it as; `model_info.py`,
  `stats.py`).
- `llm_engine.py`: LLMEngine, the synchronous step loop; `request_lifecycle.py` holds what callers
  do to requests between steps (the LLMEngine has one); `request_factory.py` (with
  `input_processor.py`, `detokenizer.py`, `request_text.py`) makes a request off the engine thread;
  `output_processor.py` relays what the scheduler says happened to each request and decides at
  stop strings and tool calls (its docstring lists who owns which decision); `request_text.py`
  also makes a request's output; `scheduler_builder.py` builds the scheduling side from the config;
  `reports.py` reads it for /metrics and routers; `hooks.py` is how the simulator takes part.
- `async_engine.py`: AsyncLLMEngine, one LLMEngine on its own thread (`engine_thread.py`) with
  per-request streams (`streams.py`); `llm.py`: the offline LLM class.
- `args.py`: the engine's command-line flags; `generation_defaults.py`: the model's recommended
  sampling settings.

Nothing is imported here, so importing the seam's types does not load torch; the public entry
points are `segue.LLM`, `segue.LLMEngine` and `segue.AsyncLLMEngine`.
"""

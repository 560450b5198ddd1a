"""Online predictors learned from the server's own traffic: output lengths (prompt features or the
served model's hidden state, TRAIL-style) and tool durations (per-tool running quantiles), each
with its accuracy (MAE, Acc-5, Acc-15 as in LAMPS) and a noise-injection knob. Pure Python + numpy.

`online.py` holds OnlinePredictors, the set an engine has; `accuracy.py` the scores (its
AccuracySnapshot crosses the engine's seam in EngineStats), `output_length.py`, `tool_duration.py`,
`regressor.py`, `features.py` and `noise.py` the parts. Nothing is imported here: the seam imports
`accuracy.py` alone, and importing this package must not load numpy for it.
"""

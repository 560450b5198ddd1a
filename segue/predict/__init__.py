"""Online predictors learned from the server's own traffic: output lengths (prompt features or the
served model's hidden state, TRAIL-style) and tool durations (per-tool running quantiles), each
with its accuracy (MAE, Acc-5, Acc-15 as in LAMPS) and a noise-injection knob. Pure Python + numpy."""
from segue.predict.accuracy import AccuracySnapshot, AccuracyTracker
from segue.predict.features import RandomProjection, SegmentContext, prompt_features
from segue.predict.noise import GaussianNoise
from segue.predict.online import OUTPUT_HIDDEN, OUTPUT_PROMPT, TOOL_DURATION, OnlinePredictors
from segue.predict.output_length import OutputLengthPredictor
from segue.predict.regressor import OnlineRidge
from segue.predict.tool_duration import ToolDurationPredictor

__all__ = ["AccuracySnapshot", "AccuracyTracker", "GaussianNoise", "OUTPUT_HIDDEN", "OUTPUT_PROMPT",
           "OnlinePredictors", "OnlineRidge", "OutputLengthPredictor", "RandomProjection", "SegmentContext",
           "TOOL_DURATION", "ToolDurationPredictor", "prompt_features"]

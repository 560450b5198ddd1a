"""The engine's flags describe what their defaults do (engine/args.py against config.py)."""
from __future__ import annotations

import argparse

from segue.config import ModelLoadConfig
from segue.engine.args import add_engine_args


def _help(flag: str) -> str:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    action = next(a for a in p._actions if flag in a.option_strings)
    return " ".join((action.help or "").split())


def test_quantization_help_describes_the_lossless_default():
    # auto keeps a checkpoint's numbers (a GGUF file's own format, or none for float weights); the
    # help once said it picked int8 wherever it measured faster, a lossy re-quantization.
    assert ModelLoadConfig.quantization == "auto"
    text = _help("--quantization")
    assert "int8 for the batch sizes" not in text
    assert "exactly" in text and "never a lossy re-quantization" in text and "none on CUDA" in text

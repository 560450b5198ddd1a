"""A model's recommended sampling settings, used for the ones a client leaves out (as vLLM uses a
checkpoint's generation_config.json).

Sources, in order: a Hugging Face directory's generation_config.json; a GGUF file's
general.sampling.* keys (llama.cpp's convention); for the embedded default model, whose GGUF file
carries none, the settings of the SmolLM2-135M-Instruct model card's usage example
(HuggingFaceTB/SmolLM2-135M-Instruct on the Hugging Face Hub: `temperature=0.2, top_p=0.9`).
At the OpenAI default temperature 1.0 that 135M model mostly answers nonsense.
"""
from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_SAMPLING: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9}
_HF_KEYS = {"temperature": float, "top_p": float, "top_k": int}
_GGUF_KEYS = {"general.sampling.temp": ("temperature", float), "general.sampling.top_p": ("top_p", float),
              "general.sampling.top_k": ("top_k", int)}


def generation_defaults(model: str | None, source: str = "auto") -> dict[str, Any]:
    """Sampling settings for the fields a request leaves out. source "auto": those recommended for
    the model at `model` (None: the embedded default); "none": no defaults (the OpenAI API's);
    any other value: a directory with a generation_config.json."""
    if source == "none":
        return {}
    if source != "auto":
        model = source
        if not (pathlib.Path(model).expanduser() / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
    if model is None:
        return dict(DEFAULT_MODEL_SAMPLING)
    path = pathlib.Path(model).expanduser()
    try:
        if path.is_dir() and (path / "generation_config.json").is_file():
            cfg = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
            return {k: cast(cfg[k]) for k, cast in _HF_KEYS.items() if cfg.get(k) is not None}
        ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf")) if path.is_dir() else []
        if len(ggufs) == 1 and ggufs[0].suffix.lower() == ".gguf":
            return _gguf_defaults(ggufs[0])
    except (OSError, ValueError, TypeError) as e:
        # Defaults are a convenience: a checkpoint the loader accepted must not fail on them.
        logger.warning("cannot read the recommended sampling settings of %s: %s", model, e)
    return {}


def _gguf_defaults(path: pathlib.Path) -> dict[str, Any]:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    out: dict[str, Any] = {}
    for key, (name, cast) in _GGUF_KEYS.items():
        field = fields.get(key)
        if field is not None and field.data:
            out[name] = cast(field.parts[field.data[0]][0])
    return out

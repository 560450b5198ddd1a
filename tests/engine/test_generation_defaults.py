"""Sampling settings for fields a request leaves out (segue/engine/generation_defaults.py) and the
--generation-config switch that turns them off or points them elsewhere."""
from __future__ import annotations

import json
import pathlib

import pytest

from segue.engine.generation_defaults import DEFAULT_MODEL_SAMPLING, generation_defaults
from segue.server.request_bodies import CompletionRequest


def test_sources(tmp_path: pathlib.Path) -> None:
    assert generation_defaults(None) == DEFAULT_MODEL_SAMPLING
    assert generation_defaults(None, "none") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20,
                                                                  "bos_token_id": 1}))
    assert generation_defaults(None, str(tmp_path)) == {"temperature": 0.6, "top_k": 20}
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_k": 20}
    with pytest.raises(ValueError, match="generation_config.json"):
        generation_defaults(None, str(tmp_path / "missing"))


def test_client_values_win_over_defaults() -> None:
    body = CompletionRequest(model="m", prompt="hi", top_p=0.5)
    params = body._sampling_params(8, None, {"temperature": 0.2, "top_p": 0.9})
    assert (params.temperature, params.top_p) == (0.2, 0.5)
    openai = body._sampling_params(8, None, generation_defaults(None, "none"))
    assert (openai.temperature, openai.top_p) == (1.0, 0.5)

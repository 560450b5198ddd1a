"""What a request's output reads at any point: its text so far, tokens, logprobs, finish or pause."""
from __future__ import annotations

from typing import Any

from segue.engine.detokenizer import IncrementalDetokenizer
from segue.engine.request_state import RequestState
from segue.outputs import CompletionOutput, RequestOutput, TokenLogprob


def make_output(state: RequestState) -> RequestOutput:
    req = state.request
    finished = req.is_finished
    done = finished or state.turn_end is not None
    text = state.text_before + (state.detokenizer.flush() if done else state.detokenizer.text)
    reason = req.status.finish_reason or state.turn_end
    completion = CompletionOutput(0, text, list(req.output_token_ids), reason,
                                  req.stop_reason, list(state.logprobs) if state.logprobs is not None else None,
                                  req.num_generated_tokens, state.tool_calls)
    state.metrics.intercepted_time = req.intercepted_seconds
    return RequestOutput(req.request_id, state.prompt, req.prompt_token_ids, [completion], finished,
                         state.metrics, max(req.num_cached_tokens, 0), paused=req.interception is not None)


def token_logprob(detok: IncrementalDetokenizer, token: int, sample: Any) -> TokenLogprob:
    """The sampled token's logprob and its top alternatives', with their texts."""
    return TokenLogprob(token, detok.token_text(token), sample.logprob or 0.0,
                        [(t, detok.token_text(t), lp) for t, lp in (sample.top or [])])

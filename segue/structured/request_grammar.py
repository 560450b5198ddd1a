"""One request's grammar state: an llguidance matcher advanced over the request's output tokens.

The matcher follows the tokens the request holds rather than being told about each sampled token,
so there is one code path for every way those tokens come about: a sampled token is consumed the
next time the request samples, preemption and recomputation leave the tokens (and so the state)
as they were, and after a resume the engine starts a new matcher at the first token the request
will generate (the appended tool result or user turn is context, not constrained output): the one
that follows this grammar (`resumed`), compiled with it, or one compiled from new sampling params.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from segue.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from segue.structured.closing import ClosingSteer

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Compiled:
    """A spec's pristine matcher (compiled by backend.py), and the Compiled of what follows a
    resume (itself for a sticky spec; None: unconstrained). Held by each request's grammar, so no
    cache eviction can ever make a resume compile."""
    spec: StructuredSpec
    matcher: Any
    next: Compiled | None = None


class RequestGrammar:
    def __init__(self, compiled: Compiled, start: int, eos_token_ids: tuple[int, ...],
                 steer: ClosingSteer | None = None, output_limit: int | None = None) -> None:
        self.compiled = compiled
        self.spec = compiled.spec
        self.matcher = compiled.matcher.deep_copy()
        # Index in output_token_ids of the first constrained token.
        self.start = start
        self.num_consumed = 0
        # Every token that may end the answer; llguidance knows only the first.
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_ids[0]
        # Output tokens (all of output_token_ids, not only the constrained ones) the context
        # window holds: max_model_len - prompt length. The closing steer budgets by it too, so an
        # answer the context window would cut is steered to close as well. None: no such limit.
        self.output_limit = output_limit
        self.failed = False
        # Budget-aware closing (segue.structured.closing): once set, stays set.
        self.steer = steer
        self.closing = False

    def resumed(self, start: int) -> RequestGrammar | None:
        """The grammar of what the request generates after a resume (the spec's after_resume, or
        itself when sticky), from output index `start`; None: unconstrained. Never compiles."""
        follow = self.compiled.next
        if follow is None:
            return None
        return RequestGrammar(follow, start, self.eos_token_ids, self.steer, self.output_limit)

    def budget(self, max_tokens_left: int, num_output_tokens: int) -> int:
        """Tokens the request may still generate, this one included: the smaller of what
        max_tokens and what the context window leave."""
        if self.output_limit is None:
            return max_tokens_left
        return min(max_tokens_left, self.output_limit - num_output_tokens)

    def sync(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not yet seen (normally the one sampled last step)."""
        new = output_token_ids[self.start + self.num_consumed:]
        if not new or self.failed:
            return
        self.num_consumed += len(new)
        # Any end-of-turn token is the end llguidance knows as its one EOS.
        new = [self.eos_token_id if t in self.eos_token_ids else t for t in new]
        if self.matcher.is_stopped():
            # Only end-of-sequence can follow a finished grammar; anything after it (a stop token
            # the grammar does not know) ends the constrained part.
            return
        if not self.matcher.consume_tokens(new):
            # Cannot happen for tokens sampled under this matcher's mask; guard anyway so one bad
            # request only ever gets end-of-sequence instead of breaking the batch.
            self.failed = True
            logger.error("grammar rejected tokens %s: %s", new, self.matcher.get_error()[:500])

    @property
    def done(self) -> bool:
        return self.failed or self.matcher.is_stopped()

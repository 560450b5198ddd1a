"""One request's grammar state: an llguidance matcher advanced over the request's output tokens.

The matcher follows the tokens the request holds rather than being told about each sampled token,
so there is one code path for every way those tokens come about: a sampled token is consumed the
next time the request samples, preemption and recomputation leave the tokens (and so the state)
as they were, and after a resume the engine starts a new matcher at the first token the request
will generate (the appended tool result or user turn is context, not constrained output).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from segue.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from segue.structured.closing import ClosingSteer

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(self, spec: StructuredSpec, matcher: Any, start: int, eos_token_id: int,
                 steer: ClosingSteer | None = None) -> None:
        self.spec = spec
        self.matcher = matcher
        # Index in output_token_ids of the first constrained token.
        self.start = start
        self.num_consumed = 0
        self.eos_token_id = eos_token_id
        self.failed = False
        # Budget-aware closing (segue.structured.closing): once set, stays set.
        self.steer = steer
        self.closing = False

    def sync(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not yet seen (normally the one sampled last step)."""
        new = output_token_ids[self.start + self.num_consumed:]
        if not new or self.failed:
            return
        self.num_consumed += len(new)
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

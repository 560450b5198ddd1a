"""StepHooks: how a driver takes part in the engine's step loop without the loop knowing it.

The simulator's trace replay (segue/sim/script.py) is the one driver: scripted requests pause
after so many tokens, come back after a recorded tool time with recorded tokens, and, with oracle
predictions, tell the predictors the truth. The engine calls these at fixed points of a step and of
a request's life; everything the hooks do to the engine goes through its public methods."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from segue.outputs import RequestOutput
    from segue.request import Request


class StepHooks(Protocol):
    def before_step(self, now: float) -> list["RequestOutput"]:
        """Before scheduling: resume what is due; the outputs of requests this ended."""

    def after_token(self, request_id: str, num_generated: int, now: float) -> bool:
        """A running request got a token and neither finished nor paused: True if the hook
        paused it (then the engine's own tool-call interception does not look at it)."""

    def after_prediction(self, request: "Request") -> None:
        """The predictors have just (re)predicted the request: at arrival, pause and resume."""

    def on_request_end(self, request_id: str) -> None:
        """The request finished or was aborted."""

    def next_event(self) -> float | None:
        """When the hooks will next act on their own (an idle loop may sleep until then)."""

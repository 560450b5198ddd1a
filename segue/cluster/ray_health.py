"""Whether a Ray engine actor is up, down while Ray restarts it, or gone for good.

Engine actors are created with `max_restarts` (`segue serve --engine-restarts`): when the actor's
process dies, Ray starts a new one and re-runs the constructor, which rebuilds the engine from the
same config. Calls in flight fail (ActorUnavailableError while Ray restarts it) and the replica
marks itself down. While it is down, one ping at a time goes to the actor; a failed one is followed
by the next after an exponentially growing delay. `poll()` only looks whether the pending ping has
answered (ray.wait with a zero timeout), so whoever asks (the pool before each placement, /health)
learns the state without blocking an event loop, and nothing runs while nobody asks.

The actor answers pings, and tags every streamed output, with its incarnation: a number drawn in
its constructor. A new incarnation means Ray restarted it and what the old engine held (cached
prefixes, paused requests, tool hints) is gone; the same one means the outage was transient and
nothing was lost. ActorDiedError is Ray's word that the actor will never answer again: restarts
are exhausted or off, or the engine failed to rebuild. The replica then stays down.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import ray
import ray.exceptions

logger = logging.getLogger(__name__)

# Seconds before the first re-ping and the cap of its doubling: a restart rebuilds the engine
# (seconds for a small model, a minute for a large one) and each ping to a restarting actor already
# takes Ray a second or two to refuse, so a finer schedule would only add refusals.
BACKOFF_S = (0.2, 5.0)


class ActorHealth:
    def __init__(self, index: int, ping: Callable[[], Any], max_restarts: int,
                 on_restart: Callable[[], None] = lambda: None, backoff_s: tuple[float, float] = BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.on_restart = on_restart
        self.max_restarts = max_restarts
        self.incarnation: int | None = None
        self.restarts = 0  # restarts seen (a restart between two answers is seen at the next one)
        self.down: str | None = None  # why, while down
        self.gone = False
        self._ping = ping
        self._pending: Any = None  # the ping in flight, if any
        self._retry_at = 0.0
        self._delay = backoff_s[0]
        self._backoff = backoff_s
        self._clock = clock
        # The pool asks from the server's loop; tests and uvicorn threads may ask concurrently.
        self._lock = threading.Lock()

    @property
    def is_up(self) -> bool:
        return self.down is None and not self.gone

    def mark_down(self, reason: str) -> None:
        with self._lock:
            if self.down is not None or self.gone:
                return
            self.down = reason
            self._delay, self._retry_at = self._backoff[0], 0.0
        if self.max_restarts > 0:
            logger.error("engine replica %d is down (%s); waiting for Ray to restart it", self.index, reason)
        else:
            logger.error("engine replica %d is down (%s); restarts are off (--engine-restarts 0)", self.index, reason)

    def observe(self, incarnation: int) -> bool:
        """An answer carrying the actor's incarnation; True when it is a new one (Ray restarted it
        between two answers, while nothing was in flight to notice)."""
        with self._lock:
            restarted = self._observe(incarnation)
        if restarted:
            logger.warning("engine replica %d was restarted by Ray while idle (restart %d, at most %d)",
                           self.index, self.restarts, self.max_restarts)
            self.on_restart()
        return restarted

    def poll(self) -> bool:
        """True while up. While down: take the pending ping's answer if it came, send the next when due."""
        with self._lock:
            if self.gone:
                return False
            if self.down is None:
                return True
            if self._pending is None:
                if self._clock() < self._retry_at:
                    return False
                self._pending = self._ping()
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return False
            ref, self._pending = self._pending, None
            try:
                incarnation = ray.get(ref, timeout=0)
            except ray.exceptions.ActorDiedError as e:
                self._give_up(e)
                return False
            except ray.exceptions.RayError as e:
                # Restarting (ActorUnavailableError), or the death not yet known here: ask again later.
                logger.debug("engine replica %d: ping failed, retrying in %.1fs: %r", self.index, self._delay, e)
                self._retry_at = self._clock() + self._delay
                self._delay = min(self._delay * 2, self._backoff[1])
                return False
            restarted = self._observe(incarnation)
            self.down = None
        if restarted:
            logger.warning("engine replica %d is up again: Ray restarted it (restart %d, at most %d)",
                           self.index, self.restarts, self.max_restarts)
            self.on_restart()
        else:
            logger.warning("engine replica %d answers again; it was not restarted", self.index)
        return True

    def _observe(self, incarnation: int) -> bool:
        if incarnation == self.incarnation:
            return False
        first = self.incarnation is None
        self.incarnation = incarnation
        if not first:
            self.restarts += 1
        return not first

    def _give_up(self, e: BaseException) -> None:
        self.gone = True
        if getattr(e, "actor_init_failed", False):
            why = "its engine failed to rebuild"
        elif self.max_restarts == 0:
            why = "restarts are off (--engine-restarts 0)"
        else:
            why = f"restarts are exhausted (--engine-restarts {self.max_restarts})"
        detail = str(e).strip().splitlines()
        logger.error("engine replica %d is gone for good: %s; it stays down (%s)",
                     self.index, why, detail[-1] if detail else repr(e))

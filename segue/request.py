"""A request as the scheduler sees it: token ids, progress and state (no torch, no text)."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from segue.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Preempted under memory pressure; waits again and recomputes (or swaps in).
    PREEMPTED = "preempted"
    # Paused by an interception (tool call, human turn); its KV has a Disposition meanwhile.
    INTERCEPTED = "intercepted"
    # The interception ended but part of the context is still on the host: waits for swap-in.
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Disposition(enum.Enum):
    """Where a paused request's context lives while it waits (DESIGN.md, request lifecycle)."""
    PRESERVE = "preserve"
    SWAP = "swap"
    DISCARD = "discard"


@dataclass
class Interception:
    """One pause of a request: when it started, what it waits for, and what comes back."""
    t_call: float
    tool: str | None = None
    # Known duration (trace replay) or a predictor's estimate; None: estimate from elapsed time.
    expected_duration: float | None = None
    t_resume: float | None = None
    disposition: Disposition = Disposition.PRESERVE
    # Paused at the end of a turn (pause_on_stop, pause_on_length, a stop string): what continues
    # it is a client's next message, not a tool result.
    turn_end: bool = False


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    # Scheduling hints from the API; policies may read them.
    priority: int = 0
    program_id: str | None = None
    # Parrot's objective: a plain API request is assumed latency-sensitive; a program call deduced
    # to serve throughput (a task group of parallel map calls) is not, and may run in batches
    # beyond the latency capacity (SchedulerConfig.latency_capacity_tokens).
    latency_sensitive: bool = True
    # Prefix-cache namespace (a tenant): blocks hashed under different salts never match, so one
    # tenant cannot learn another's prompts from cache-hit timing.
    cache_salt: str | None = None
    # Tie-breaker that keeps FCFS stable when arrival times are equal.
    seq_no: int = field(default_factory=lambda: next(_arrival_counter))

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in the device cache (prompt and output alike).
    num_computed_tokens: int = 0
    # High-water mark of num_computed_tokens: tokens below it that run again are recompute.
    max_computed_tokens: int = 0
    # Tokens served from the prefix cache at first admission (reported to clients).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    # Hashes of the full blocks of all_token_ids, extended lazily by the KV manager.
    block_hashes: list[int] = field(default_factory=list)
    # Tokens appended by interceptions (tool results) sit in output_token_ids among the generated
    # ones; max_tokens counts generated tokens only.
    num_appended_tokens: int = 0
    # Output tokens cut from the context at a resume (PausedRequests.truncate: the next turn's
    # history renders them differently). Still counted as generated: usage and max_tokens count
    # what the model produced, and a client's count never goes down.
    num_cut_tokens: int = 0
    interception: Interception | None = None
    interceptions: list[Interception] = field(default_factory=list)
    # Arrival time the scheduler orders by; `discard` resets it at each resume, others keep it.
    sched_arrival_time: float = -1.0
    # Online predictions (segue/predict), set by the engine at arrival and after each resume:
    # tokens the request will generate before its next interception or its end, and how long
    # its next interception will last. None: no prediction (policies fall back to defaults).
    predicted_output_tokens: float | None = None
    predicted_interception_s: float | None = None
    # The handling (preserve / swap / discard) the LAMPS ordering policy predicted for the next
    # interception; the `lamps` interception policy applies it. None: not predicted.
    predicted_disposition: Disposition | None = None
    # Constrained decoding state (segue.structured.RequestGrammar), set by the engine; opaque here:
    # the scheduler and the simulator never look at it.
    grammar: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.output_token_ids) - self.num_appended_tokens + self.num_cut_tokens

    @property
    def intercepted_seconds(self) -> float:
        """Time spent inside finished interceptions (excluded from normalized latency)."""
        return sum(i.t_resume - i.t_call for i in self.interceptions if i.t_resume is not None)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __post_init__(self) -> None:
        if self.sched_arrival_time < 0:
            self.sched_arrival_time = self.arrival_time

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

"""LAMPS ordering (paper 001 §3–4): rank requests by the memory they will hold over their predicted
remaining life, with the handling of their next interception predicted before they run.

For a request with context c (tokens), predicted r more tokens before its next interception (or
its end) and a predicted interception of d seconds, the score in byte-seconds is

    prefill/recompute still to do:  T_fwd(pending) · (computed + pending/2) · M
  + pre-API part:                   τ · (r·c + r(r+1)/2) · M        (one token per decode step of τ s)
  + the interception:               min over preserve / swap / discard of its waste (InferCept's
                                    equations; see segue/sched/interception/lamps.py)

and the handling that reaches the minimum is written to `request.predicted_disposition` for the
`lamps` interception policy to apply. Requests with several interceptions are scored one segment
at a time (§4.2 "Multi-API") and re-scored when they resume. Ascending score is served first, so
the largest score is preempted first.

Predictions come from `request.predicted_output_tokens` / `predicted_interception_s`. Without them
the policy falls back to what it has observed: the mean length of completed segments (before any,
the remaining max_tokens), and the mean interception duration weighted by the fraction of segments
that ended in an interception; in that case no handling is predicted (min-waste decides at run
time). τ, C_other (context of the rest of the batch) and the batch size come from the steps seen.

Starvation (§4.4): a request counts the steps it spends runnable but not scheduled; being
scheduled or intercepted resets the count. At `starvation_threshold` it is marked starving and
stays ahead of every non-starving request until it ends, so it is also never the preemption
victim while others remain. Among starving requests the order is the option `starving_order`:
"score" (default) keeps LAMPS's ranking, "fifo" goes by the step they began to starve. Under
sustained overload nearly everyone starves within 100 steps, so "fifo" turns LAMPS into FCFS (and
loses its gain), while "score" lets the largest requests wait for as long as smaller ones keep
starving (measured in the simulator, BENCHMARKS.md). The count starts at arrival, not at first
admission (the paper's wording is ambiguous), so a request never admitted cannot starve forever.

Options (`scheduler.policy_options`):
  starvation_threshold  steps (default 100; 0 disables)
  score_refresh_steps   recompute cached scores every N steps (default 1: every step, as the paper
                        on all but ToolBench, where it uses 10); arrivals, interceptions,
                        resumptions and changed predictions always re-score
  swap_waste            "chunked" (default) or "sync" (InferCept eq. 3)
  step_s, other_tokens, num_running   fix τ, C_other and the batch size instead of measuring them
  victim                "rank" (default, the paper's order): when memory runs out the largest
                        score gives way — long contexts, the costliest to rebuild; "cheapest":
                        the running request with the least computed context gives way instead
                        (measured in the simulator: no better, see BENCHMARKS.md)
  overrun               a request that has run past its predicted length: "residual" (default)
                        expects the mean remaining length of the recent completed segments that got
                        as far (their residual life); "end" expects it to end within a token. With
                        online predictions "end" collapses at high load: every underpredicted long
                        segment jumps to the head as "about to end" and keeps its growing context
                        there while others are preempted (measured: BENCHMARKS.md)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from segue.request import Request, RequestStatus
from segue.sched.interception.lamps import HandlingChoice, choose_handling
from segue.sched.policies.base import PolicyContext, SchedulingPolicy
from segue.sched.policies.lamps_observed import ObservedTraffic

_OPTIONS = {"starvation_threshold", "score_refresh_steps", "swap_waste", "step_s", "other_tokens", "num_running",
            "victim", "overrun", "starving_order"}


@dataclass
class _Track:
    """What the policy remembers about one live request."""
    seg_start_generated: int   # generated tokens when the current segment began
    joined_step: int           # step count when it last became runnable
    waited_steps: int = 0
    starving: bool = False
    starving_since: int = 0    # step it began to starve: the order among starving requests
    paused: bool = False
    score: float = 0.0
    scored_step: int = -1      # -1: must be re-scored
    scored_inputs: tuple[Any, ...] = ()


class LAMPSPolicy(SchedulingPolicy):
    name = "lamps"

    def __init__(self, context: PolicyContext | None = None) -> None:
        super().__init__(context)
        opts = self.context.options
        unknown = set(opts) - _OPTIONS
        if unknown:
            raise ValueError(f"unknown lamps options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
        self.starvation_threshold = int(opts.get("starvation_threshold", 100))
        self.score_refresh_steps = max(1, int(opts.get("score_refresh_steps", 1)))
        self.swap_waste = str(opts.get("swap_waste", "chunked"))
        self.victim = str(opts.get("victim", "rank"))
        if self.victim not in ("cheapest", "rank"):
            raise ValueError(f"lamps victim must be 'cheapest' or 'rank', not {self.victim!r}")
        self.starving_order = str(opts.get("starving_order", "score"))
        if self.starving_order not in ("score", "fifo"):
            raise ValueError(f"lamps starving_order must be 'score' or 'fifo', not {self.starving_order!r}")
        self.overrun = str(opts.get("overrun", "residual"))
        if self.overrun not in ("residual", "end"):
            raise ValueError(f"lamps overrun must be 'residual' or 'end', not {self.overrun!r}")
        self.fixed_step_s: float | None = opts.get("step_s")
        self.fixed_other_tokens: float | None = opts.get("other_tokens")
        self.fixed_num_running: float | None = opts.get("num_running")
        self.tracks: dict[str, _Track] = {}
        self.observed = ObservedTraffic()
        self.steps = 0
        # This step's scheduled requests: tokens computed and context held, for the batch estimates.
        self._step_tokens: dict[str, int] = {}
        self._step_context: dict[str, int] = {}

    # ---- estimates -----------------------------------------------------------------------
    def step_s(self) -> float:
        """τ: seconds per decode step, T_fwd of the typical batch (a saturated one before any step)."""
        if self.fixed_step_s is not None:
            return float(self.fixed_step_s)
        tokens = self.observed.batch_tokens
        return self.context.cost.t_fwd(self.context.cost.saturation_tokens if tokens is None else tokens)

    def other_tokens(self) -> float:
        return float(self.fixed_other_tokens if self.fixed_other_tokens is not None else self.observed.batch_context)

    def num_running(self) -> float:
        return float(self.fixed_num_running if self.fixed_num_running is not None else self.observed.batch_seqs)

    def remaining_segment_tokens(self, request: Request) -> float:
        """Predicted tokens left before the next interception or the end. A request past its
        prediction ("overrun"): "residual" takes the mean remaining length of the completed
        segments that got as far; "end" takes it to be about to end (1 token)."""
        track = self._track(request)
        done = request.num_generated_tokens - track.seg_start_generated
        predicted = request.predicted_output_tokens
        if predicted is None:
            predicted = self.observed.mean_segment_tokens()
        left_by_limit = max(1, request.sampling_params.max_tokens - request.num_generated_tokens)
        if predicted is None:
            return float(left_by_limit)
        left = predicted - done
        if left < 1.0 and self.overrun == "residual":
            left = self.observed.mean_residual(done) or 1.0
        return float(min(max(left, 1.0), left_by_limit))

    def handling(self, request: Request, context_at_interception: float, duration_s: float) -> HandlingChoice:
        """The handling LAMPS predicts for the request's next interception (§4.2)."""
        return choose_handling(self.context.cost, context_at_interception, duration_s, self.other_tokens(),
                               self.num_running(), self.swap_waste)

    # ---- the score -----------------------------------------------------------------------
    def pre_interception_area(self, request: Request, remaining_tokens: float) -> float:
        """Byte-seconds held from now until the next interception: the prefill or recompute still
        to do, then one more token of context per decode step."""
        cost, m = self.context.cost, self.context.cost.kv_bytes_per_token
        c = request.num_tokens
        pending = max(0, c - request.num_computed_tokens)
        prefill = cost.t_prefill(pending, request.num_computed_tokens) * (request.num_computed_tokens + pending / 2)
        r = remaining_tokens
        return (prefill + self.step_s() * (r * c + r * (r + 1) / 2)) * m

    def score(self, request: Request) -> float:
        """The memory-over-time of the rest of the current segment and its interception; sets
        `request.predicted_disposition` when the interception's duration is predicted."""
        r = self.remaining_segment_tokens(request)
        area = self.pre_interception_area(request, r)
        if request.predicted_interception_s is not None:
            choice = self.handling(request, request.num_tokens + r, request.predicted_interception_s)
            request.predicted_disposition = choice.disposition
            return area + choice.waste
        request.predicted_disposition = None
        odds, mean_s = self.observed.interception_odds()
        if odds == 0.0:
            return area
        return area + odds * self.handling(request, request.num_tokens + r, mean_s).waste

    def key(self, request: Request, now: float) -> tuple[int, float, int]:
        track = self._track(request)
        inputs = (request.predicted_output_tokens, request.predicted_interception_s)
        if (track.scored_step < 0 or self.steps - track.scored_step >= self.score_refresh_steps
                or inputs != track.scored_inputs):
            track.score = self.score(request)
            track.scored_step, track.scored_inputs = self.steps, inputs
        if track.starving and self.starving_order == "fifo":
            return (0, track.starving_since, request.seq_no)
        return (0 if track.starving else 1, track.score, request.seq_no)

    # ---- hooks ---------------------------------------------------------------------------
    def _track(self, request: Request) -> _Track:
        track = self.tracks.get(request.request_id)
        if track is None:
            track = _Track(request.num_generated_tokens, self.steps)
            self.tracks[request.request_id] = track
        return track

    def on_arrival(self, request: Request, now: float) -> None:
        self._track(request)

    def on_step(self, now: float) -> None:
        if self._step_tokens:
            self.observed.record_step(sum(self._step_tokens.values()), sum(self._step_context.values()),
                                      len(self._step_tokens))
        if self.starvation_threshold > 0:
            for rid, track in self.tracks.items():
                # Only requests that were runnable during the last step (joined before it) count.
                if track.paused or track.starving or rid in self._step_tokens or track.joined_step >= self.steps:
                    continue
                track.waited_steps += 1
                if track.waited_steps >= self.starvation_threshold:
                    track.starving, track.starving_since = True, self.steps
        self._step_tokens, self._step_context = {}, {}
        self.steps += 1

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        self._step_tokens[request.request_id] = num_tokens
        self._step_context[request.request_id] = request.num_computed_tokens + num_tokens
        track = self._track(request)
        if not track.starving:
            track.waited_steps = 0

    def on_intercepted(self, request: Request, now: float) -> None:
        track = self._track(request)
        self._observe_segment(request, track, intercepted=True)
        track.paused = True
        if not track.starving:
            track.waited_steps = 0

    def on_resumed(self, request: Request, now: float) -> None:
        track = self._track(request)
        last = request.interceptions[-1] if request.interceptions else None
        if last is not None and last.t_resume is not None:
            self.observed.interception_s += last.t_resume - last.t_call
            self.observed.ended_interceptions += 1
        track.paused = False
        track.seg_start_generated = request.num_generated_tokens
        track.joined_step = self.steps
        track.scored_step = -1
        # The old prediction was for the interception that just ended.
        request.predicted_disposition = None

    def on_finished(self, request: Request, now: float) -> None:
        track = self.tracks.pop(request.request_id, None)
        if track is not None and request.status != RequestStatus.FINISHED_ABORTED and not track.paused:
            self._observe_segment(request, track, intercepted=False)

    def _observe_segment(self, request: Request, track: _Track, intercepted: bool) -> None:
        obs = self.observed
        obs.segments += 1
        obs.segment_tokens += request.num_generated_tokens - track.seg_start_generated
        obs.observe_length(request.num_generated_tokens - track.seg_start_generated)
        if intercepted:
            obs.intercepted_segments += 1

    def preemption_order(self, requests: list[Request], now: float) -> list[Request]:
        """"rank": the largest key first (the base order). "cheapest": starving requests are never
        victims while others remain; then the least computed context, the cheapest to rebuild."""
        if self.victim == "rank":
            return super().preemption_order(requests, now)
        def order(r: Request) -> tuple[bool, int]:
            track = self.tracks.get(r.request_id)
            return (track is not None and track.starving, r.num_computed_tokens)
        return sorted(requests, key=order)

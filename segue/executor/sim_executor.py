"""A model-free executor on a virtual clock: each step costs what the cost model says it would cost
on the modelled machine, so the real scheduler, KV manager and policies can be evaluated at paper
scale (A100 cost models, 30-minute traces) on a laptop CPU."""
from __future__ import annotations

from typing import Any

from segue.executor.base import Executor, SampledToken
from segue.model.config import ModelConfig
from segue.sched.cost_model import CostModel
from segue.sched.output import SchedulerOutput
from segue.sched.step_charge import step_seconds

# An ordinary id in the middle of any vocabulary: never EOS, never a special token.
SIM_TOKEN_ID = 1234
SIM_VOCAB_SIZE = 50400  # GPT-J's; only bounds the random prompt ids


class SimClock:
    """Virtual seconds. The engine reads it through `engine.clock`; only the executor (step cost)
    and the replay driver (idle gaps) move it, so a simulated hour takes as long as its steps do."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    __call__ = now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"the clock cannot go back (dt={dt})")
        self._now += dt

    def advance_to(self, t: float) -> None:
        # Waiting for an instant already past is a no-op, as time.sleep of a negative gap would be.
        if t > self._now:
            self._now = t


class SimExecutor(Executor):
    def __init__(self, cost: CostModel, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 clock: SimClock) -> None:
        self.cost = cost
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.clock = clock
        self.kv_bytes_per_token = cost.kv_bytes_per_token
        self.device_name = cost.device
        self.last_swap_seconds = 0.0
        self.num_steps = 0
        self.busy_seconds = 0.0

    def step_seconds(self, out: SchedulerOutput) -> tuple[float, float]:
        """(step time, swap stall) of one batch, as the cost model charges it."""
        return step_seconds(self.cost, out, self.block_size)

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        dt, stall = self.step_seconds(out)
        self.last_swap_seconds = stall
        self.clock.advance(dt)
        self.num_steps += 1
        self.busy_seconds += dt
        return {s.request.request_id: SampledToken(SIM_TOKEN_ID) for s in out.seqs if s.sample}


class SimTokenizer:
    """Just enough of a tokenizer for IncrementalDetokenizer: one character per token, so every
    token yields new text (the detokenizer's window then stays at one or two tokens and costs
    next to nothing per step)."""

    def decode(self, ids: Any, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False,
               **_: Any) -> str:
        return "x" * (1 if isinstance(ids, int) else len(ids))

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        return "x" if isinstance(ids, int) else ["x"] * len(ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [SIM_TOKEN_ID] * len(text)

    def __len__(self) -> int:
        return SIM_VOCAB_SIZE


def sim_model_config(max_model_len: int, vocab_size: int = SIM_VOCAB_SIZE) -> ModelConfig:
    # Only vocab_size, max_position_embeddings and eos_token_ids matter to the engine; the rest
    # describe GPT-J for anyone who prints it. No EOS: scripted requests ignore it anyway.
    return ModelConfig(vocab_size=vocab_size, hidden_size=4096, intermediate_size=16384, num_layers=28,
                       num_heads=16, num_kv_heads=16, head_dim=256, max_position_embeddings=max_model_len,
                       architecture="sim")

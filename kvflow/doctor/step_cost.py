"""What one engine step costs, as a function of what it computes:

    step_ms = fixed + per_row x decode rows + overhead
              + (prefill_fixed + per_token x (prefill tokens + ratio x attention work)  if any prefill)
    attention work = sum over the step's rows of tokens x the keys they see

`prefill_fixed` is what a step costs more as soon as it carries a prompt chunk: kvflow runs a
decode-only step's layers in one native call and any other step layer by layer in Python.

`overhead` is what passes between steps (the engine loop, handing tokens to the HTTP side): not in
the server's step times, but in the cadence its clients see, so it is fitted to the client's TPOT.

`attention_ratio` is the model's attention FLOPs per (query token x key) over its linear FLOPs per
token, (4 x layers x q_heads x head_dim) / (2 x layer params), so a long context costs what its
QK^T and PV cost next to the matmuls. The coefficients are fitted to the server's measured step
times by kind (kvflow's engine_step_time_seconds{step_kind}) in kvflow/doctor/calibrate.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float  # scheduling, the forward's per-step overhead, sampling and outputs of a step
    per_row_ms: float  # one more decode row
    per_token_ms: float  # one more prefill token (and per unit of attention work)
    attention_ratio: float  # attention work per (token x key) in prefill-token units
    overhead_ms: float = 0.0  # between steps: engine loop, output delivery
    prefill_fixed_ms: float = 0.0  # a step with any prompt chunk: the layer-by-layer path

    def step_ms(self, decode_rows: int, prefill_tokens: int, attention_work: float) -> float:
        return (
            self.fixed_ms
            + self.overhead_ms
            + self.per_row_ms * decode_rows
            + self.prefill_ms((prefill_tokens, attention_work))
        )

    def work(self, tokens: int, attention: float) -> float:
        """Prefill work in token units: the tokens and what their attention adds."""
        return tokens + self.attention_ratio * attention

    def prefill_ms(self, work: tuple[int, float]) -> float:
        """What a step's prompt chunks (work = (prefill tokens, their attention work)) add to it."""
        tokens, attention = work
        if tokens <= 0:
            return 0.0
        return self.prefill_fixed_ms + self.per_token_ms * self.work(tokens, attention)


def attention_work(num_tokens: int, context_end: int) -> float:
    """Keys seen by `num_tokens` queries ending at `context_end` (causal: each query sees the keys
    before it): n x (context_end - (n - 1) / 2)."""
    return num_tokens * (context_end - (num_tokens - 1) / 2)

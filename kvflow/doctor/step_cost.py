"""What one engine step costs, as a function of what it computes:

    step_ms = fixed + overhead + per_token x (decode rows + prefill tokens + ratio x attention work)
    attention work = sum over the step's prompt chunks and decode rows of tokens x the keys they see

A decode row and a prompt token each pass once through every matmul: one per-token cost for both.
`overhead` is what passes between steps (the engine loop, handing tokens to the HTTP side): not in
the server's step times, but in the cadence its clients see, so it is fitted to the client's TPOT.
`attention_ratio` is the model's attention FLOPs per (query token x key) over its linear FLOPs per
token, (4 x layers x q_heads x head_dim) / (2 x layer params), so a long context costs what its
QK^T and PV cost next to the matmuls. `fixed` and `per_token` are fitted to the server's measured
step times by kind (kvflow's engine_step_time_seconds{step_kind}) in kvflow/doctor/calibrate.py.

(A separate fixed cost for steps that carry a prompt chunk, and a separate cost per decode row, were
tried: fitted to three step means, one of them often from a single step, they came out unstable
and predicted chunk-size changes worse than the two coefficients above.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float  # scheduling, the forward's per-step overhead, sampling and outputs of a step
    per_token_ms: float  # one more decode row or prompt token (and per unit of attention work)
    attention_ratio: float  # attention work per (token x key) in token units
    overhead_ms: float = 0.0  # between steps: engine loop, output delivery

    def work(self, tokens: int, attention: float) -> float:
        """Work in token units: the tokens and what their attention adds."""
        return tokens + self.attention_ratio * attention

    def step_ms(self, decode_rows: int, prefill_tokens: int, attention_work: float) -> float:
        return (
            self.fixed_ms
            + self.overhead_ms
            + self.per_token_ms * self.work(decode_rows + prefill_tokens, attention_work)
        )

    def prefill_ms(self, work: tuple[int, float]) -> float:
        """What prompt chunks of (tokens, their attention work) add to a step."""
        return self.per_token_ms * self.work(*work)


def attention_work(num_tokens: int, context_end: int) -> float:
    """Keys seen by `num_tokens` queries ending at `context_end` (causal: each query sees the keys
    before it): n x (context_end - (n - 1) / 2)."""
    return num_tokens * (context_end - (num_tokens - 1) / 2)

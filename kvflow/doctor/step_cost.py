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

With a measured step profile (kvflow/doctor/step_profile.py) the shape of the cost comes from the
profile's curves instead, and only a constant per step kind is fitted (what the server adds to the
profiled engine's step):

    decode-only step   step_ms = D(rows) + extra + overhead
    step with a prompt step_ms = P(tokens + rows) x factor + constant + overhead
    either               + per_key x (keys attended beyond the probe's: a chunk after a long context)
A decode step's excess on the server is per-step work (1.3 ms on the planted runs for a 0.5 ms
forward, about the same at 8 rows), while a step with prompts grows with them (its first tokens, and
the compute the benchmark's client contends for): an added constant fitted to 1-prompt steps put an
8-prompt step at half its measured time, a factor put it within 5% (benchmarks/NOTES.md, session 23).
With the server's own step records (kvflow bench keeps them from a kvflow server) the factor and the
constant of prompt steps are fitted together over those steps; from the per-kind means alone, the
factor only.

The fitted cost is each step's mean. A server's steps also vary around it (the engine thread
contends for the GIL and the cores with HTTP bursts, scrapes and, on one machine, the benchmark's
client), and tail latencies (ITL p99) are made of those few long steps, so with step records the
simulator adds to each step a departure drawn from the recorded ones (`residuals`, a bootstrap of
the measured run's own variation).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvflow.doctor.step_profile import StepProfile

MIN_STEP_MS = 0.01  # a fitted constant never makes a step free


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float  # scheduling, the forward's per-step overhead, sampling and outputs of a step
    per_token_ms: float  # one more decode row or prompt token (and per unit of attention work)
    attention_ratio: float  # attention work per (token x key) in token units
    overhead_ms: float = 0.0  # between steps: engine loop, output delivery
    profile: StepProfile | None = None  # measured curves: the shape of the cost (module docstring)
    # With a profile (calibrate.py): (added to a decode-only step, the factor on a step with prompt
    # tokens, added to a step with prompt tokens).
    kind_extra_ms: tuple[float, float, float] = (0.0, 1.0, 0.0)
    # With a profile: ms per attended key beyond what the profile's probe of the same shape attended.
    attention_ms_per_key: float = 0.0
    # What the server's recorded steps took beyond this cost, centred on zero per kind: decode-only
    # steps' in ms, steps with prompt tokens' as fractions of the step (calibrate.step_residuals).
    # Each simulated step draws one, so the simulated steps vary as the recorded ones did. Empty:
    # every step costs its mean.
    residuals: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    # Every step's server time x this: the same steps on a share of the cores (a what-if that splits
    # the machine, kvflow/doctor/disaggregation.py). 1: the measured server.
    scale: float = 1.0

    def work(self, tokens: int, attention: float) -> float:
        """Work in token units: the tokens and what their attention adds."""
        return tokens + self.attention_ratio * attention

    def step_ms(self, decode_rows: int, prefill_tokens: int, attention_work: float) -> float:
        if self.profile is not None:
            shape = self.profile.shape_ms(decode_rows, prefill_tokens)
            decode_add, prompt_factor, prompt_add = self.kind_extra_ms
            server = shape * prompt_factor + prompt_add if prefill_tokens else shape + decode_add
            beyond = max(attention_work - self.profile.probe_attention(decode_rows, prefill_tokens), 0.0)
            server += self.attention_ms_per_key * beyond
            return max(server, MIN_STEP_MS) * self.scale + self.overhead_ms
        server = self.fixed_ms + self.per_token_ms * self.work(decode_rows + prefill_tokens, attention_work)
        return server * self.scale + self.overhead_ms

    def with_drawn_residual(self, step_ms: float, has_prompt: bool, rng: random.Random) -> float:
        """`step_ms` plus one recorded step's departure from its mean, drawn for a step of this kind:
        ms added to a decode-only step, a fraction of a step with prompt tokens; unchanged without
        records."""
        residuals = self.residuals[1 if has_prompt else 0]
        if not residuals:
            return step_ms
        drawn = rng.choice(residuals)
        if not has_prompt:
            return step_ms + drawn
        return (step_ms - self.overhead_ms) * (1.0 + drawn) + self.overhead_ms  # the server's part

    def prefill_ms(self, work: tuple[int, float]) -> float:
        """What prompt chunks of (tokens, their attention work) add to a step."""
        if self.profile is not None:
            return self.profile.prefill.slope(work[0]) * work[0] * self.scale
        return self.per_token_ms * self.work(*work) * self.scale


def attention_work(num_tokens: int, context_end: int) -> float:
    """Keys seen by `num_tokens` queries ending at `context_end` (causal: each query sees the keys
    before it): n x (context_end - (n - 1) / 2)."""
    return num_tokens * (context_end - (num_tokens - 1) / 2)

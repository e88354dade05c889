"""The model runner's typed answer to a `SchedulerOutput` (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.outputs import TokenLogprobs


@dataclass
class ModelRunnerOutput:
    # request id -> tokens sampled this step (one per request without speculation), only for
    # requests whose ScheduledRequest had do_sample=True.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> per sampled token, the sampled token's logprob plus the top-n requested.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

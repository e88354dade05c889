"""Typed results, never bare dicts: what the engine returns (vLLM's `RequestOutput` shape) and what the
model runner hands back to the scheduler (`ModelRunnerOutput`, as in vLLM v1's outputs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.stats import RequestTimeline


@dataclass(frozen=True)
class Logprob:
    logprob: float  # log-probability under the model's raw (unfiltered, temperature 1) distribution
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One generated position: token id -> Logprob, holding the sampled token plus the top-n.
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestTimeline
    num_cached_tokens: int = 0
    # For streaming: the text and token ids produced by the step that made this output.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Logprobs of `delta_token_ids` (None unless the request asked for logprobs).
    delta_logprobs: list[TokenLogprobs] | None = None
    # vLLM's prompt_logprobs: one entry per prompt token, None for the first (nothing scores it);
    # None unless the request asked. Complete from the request's first output on.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Set (with finished=True, finish_reason "abort") when processing this request failed inside
    # the engine; the other requests of the batch are unaffected.
    error: str | None = None
    # Prefill role (kvflow/kv_transfer/): where a decode instance fetches this prompt's KV; on the
    # final output only, None otherwise.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class ModelRunnerOutput:
    """The model runner's typed answer to a `SchedulerOutput` (the hand-off back to the scheduler)."""

    # request id -> tokens sampled this step (one per request without speculation), only for
    # requests whose ScheduledRequest had do_sample=True.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> per sampled token, the sampled token's logprob plus the top-n requested.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> why its own part of the step failed (its sampling parameters, its generator, its
    # draft verification). The engine ends these requests with the error; the rest of the batch,
    # which does not appear here, advances normally.
    failed: dict[str, str] = field(default_factory=dict)
    # request id -> (first prompt position, its entries onward): prompt logprobs of this step's chunk
    # (worker/prompt_logprobs.py), for requests that asked for prompt_logprobs.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)

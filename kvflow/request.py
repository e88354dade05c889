"""A request's state as the scheduler sees it (pure Python).

The central invariant (vLLM v1's "count tokens, not phases"): `num_computed_tokens` chases
`num_tokens` = len(prompt) + len(output). Prefill, chunked prefill, a prefix-cache hit and
recompute after preemption are all just "schedule `num_tokens - num_computed_tokens` tokens".
"""

from __future__ import annotations

import enum
import time
from typing import Any

from kvflow.sampling_params import SamplingParams
from kvflow.stats import RequestTimeline


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Its grammar compiles off the engine thread; the engine hands it to the scheduler once ready.
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; it will be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED}
)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        # --scheduling-policy priority: lower values are served first (vLLM's convention).
        self.priority = priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.timeline = RequestTimeline(arrival_time if arrival_time is not None else time.monotonic())
        self.timeline.priority = priority
        # Chained hashes of the full blocks of `all_token_ids`, filled in by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Draft tokens proposed for the next step (speculative decoding); consumed when scheduled.
        self.spec_token_ids: list[int] = []
        # The draft model's distributions q [k, V] behind sampled drafts (a torch tensor; None for
        # greedy or deterministic drafts): the verifier's rejection rule needs them.
        self.spec_draft_probs: Any = None
        # Structured output: the request's grammar matcher (kvflow/structured/), None if unconstrained.
        self.structured_state: Any = None
        # Prefill/decode disaggregation (kvflow/kv_transfer/): on a decode instance, where the
        # prompt's KV waits (a RemotePrefill); on a prefill instance, keep the prompt's KV for a
        # decode instance once the request finishes.
        self.remote_prefill: Any = None
        self.kv_export = False
        # prompt_logprobs: entry p = TokenLogprobs of prompt token p (None for p = 0), filled as its
        # chunks are computed; None unless the request asked.
        self.prompt_logprobs: list[Any] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

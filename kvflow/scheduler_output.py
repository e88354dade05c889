"""The narrow typed hand-off from the scheduler to the model runner (pure Python)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvflow.sampling_params import SamplingParams


@dataclass(frozen=True)
class StateStep:
    """One step of one request in one linear-attention cache group (pool block ids; each state is
    `pages_per_state` of them, in order; kvflow/kv_cache/single_type_manager.py).

    source: the pages the state is read from before the step: a prefix hit's checkpoint on the
            first step after admission, the running state after that, None for a fresh request
            (the state starts at zero);
    state:  the running state's pages, written at the end of the step;
    checkpoints: (j, pages): also write the state after the step's first j tokens to `pages`."""

    source: list[int] | None
    state: list[int]
    checkpoints: list[tuple[int, list[int]]]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute KV for `token_ids` at positions
    `num_computed_tokens .. num_computed_tokens + len(token_ids) - 1`.

    `block_ids[g]` is the request's whole block table in cache group g at the time of the step
    (kvflow/kv_cache/: one table per group; a single-group model has one): position p lives in block
    `block_ids[g][p // block_size]`, slot `p % block_size`. Blocks that sliding-window attention
    released are replaced by the null block id; no attended position ever falls in one. A
    linear-attention group's table is its running state's pages, and `state_steps` (one per such
    group, in group order) says where this step reads and writes the state.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[list[int]]
    do_sample: bool  # the chunk reaches the request's last token: sample the next one
    is_decode: bool  # one token: the last sampled one (anything else is prefill, recompute included)
    sampling_params: SamplingParams
    # References to the request's live lists (penalties read them when sampling).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Speculative decoding: the last `num_spec_tokens` of `token_ids` are draft tokens to verify;
    # the runner then returns the accepted drafts plus one token (at least one, at most k + 1).
    num_spec_tokens: int = 0
    spec_draft_probs: Any = None  # [num_spec_tokens, V] draft distributions, or None (see Request)
    state_steps: tuple[StateStep, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class GrammarBitmask:
    """Structured output's allowed tokens for one step (kvflow/structured/manager.py fills it while the
    forward pass runs). `future` resolves to a numpy int32 array [N, ceil(V_tok / 32)]: row
    `rows[request_id]` holds that request's mask, bit b of word w set = token 32 * w + b allowed
    (vLLM v1's layout); tokens at or past 32 * width (model vocab padding) are never allowed. A
    request verifying k drafts has k + 1 rows from there: the mask after each draft prefix."""

    rows: dict[str, int]
    future: Future[Any]

    def array(self) -> Any:
        return self.future.result()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the previous step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Constrained rows' allowed tokens (structured output), attached by the engine; None: no such row.
    grammar_bitmask: GrammarBitmask | None = None
    # KV offload tier (kvflow/kv_offload/restores.py), in this order before the forward pass:
    # cached blocks evicted this step, to copy out to the tier: (block_id, block_hash);
    kv_saves: list[tuple[int, bytes]] = field(default_factory=list)
    # blocks read back from the tier, to copy into the request's new blocks: (block_id, payload).
    kv_restores: list[tuple[int, bytes | memoryview]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

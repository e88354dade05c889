"""Per-request timelines: the raw material of TTFT/ITL metrics, `kvflow bench` and `kvflow doctor`.

All times are `time.monotonic()` seconds (intervals only; never compared across processes).
Definitions (docs/ARCHITECTURE.md section 4):
    queue_time   = first_scheduled - arrival
    prefill_time = first_token - first_scheduled
    ttft         = first_token - arrival
    itl[i]       = token_times[i + 1] - token_times[i]
    tpot         = (last_token - first_token) / (num_output_tokens - 1)
    e2e          = last_token - arrival
No Prometheus (or torch) import here: the server's metrics layer reads these objects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default); q in [0, 100]. The one
    percentile of the server, `kvflow bench` and `kvflow doctor`."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class PrefillChunk:
    time: float  # when the step computing this chunk was scheduled
    num_tokens: int  # tokens computed in that step for this request
    num_computed_tokens: int  # the request's computed tokens before the chunk


@dataclass
class RequestTimeline:
    arrival_time: float
    # On a server: when its HTTP handler, started at `arrival_time`, had parsed and tokenized it and
    # queued it for the engine thread (AsyncLLMEngine.add_requests). The handler's work, slower while
    # the engine's steps hold the GIL. None: not served that way (an offline LLM).
    handed_off_time: float | None = None
    # When the engine took it in (LLMEngine.add_processed_request): the engine thread drains its
    # queue between steps, so a request handed off during a step waits for the step's end. Until
    # then no step can schedule it, free slot or not. None: never added.
    added_time: float | None = None
    first_scheduled_time: float | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    # Of those, read back from the KV offload tier (kvflow/kv_offload/), and the seconds the reads
    # took (the request waited that long in the queue, others running meanwhile); None: no restore.
    num_restored_tokens: int = 0
    kv_restore_time: float | None = None
    # Structured output: seconds between arrival and its grammar being ready (compiled off the engine
    # thread, or a cache hit); part of queue_time. None for unconstrained requests.
    grammar_compile_time: float | None = None
    # --scheduling-policy priority: the request's priority (lower first), for queueing per priority.
    priority: int = 0
    # The HTTP request's x-request-id (the client's, or the one the server made up): what a client's
    # own record knows the request by, so its story can be found (kvflow doctor --request).
    x_request_id: str | None = None

    def record_scheduled(
        self, now: float, num_tokens: int, num_computed_tokens: int, is_prefill: bool
    ) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
        if is_prefill:
            self.prefill_chunks.append(PrefillChunk(now, num_tokens, num_computed_tokens))

    def record_tokens(self, now: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.extend([now] * num_tokens)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or not self.token_times:
            return None
        return self.token_times[-1] - self.first_token_time

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2 or self.first_token_time is None:
            return None
        return (self.token_times[-1] - self.first_token_time) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        if not self.token_times:
            return None
        return self.token_times[-1] - self.arrival_time


@dataclass(frozen=True)
class StepStats:
    """What one engine step computed and how long it took (the server's step-level metrics).

    A step is `decode_only`, `prefill_only` or `mixed` (prefill chunks sharing the step with decodes):
    an ITL spike that lines up with `mixed` steps is a prefill chunk stalling the decodes.
    """

    start_time: float  # monotonic seconds
    duration: float  # schedule -> model -> update -> outputs, seconds
    num_prefill_tokens: int  # prompt chunks and recomputed tokens after preemption
    num_decode_tokens: int  # one per decoding request
    num_running: int  # after the step
    num_waiting: int  # after the step (preempted requests included)
    kv_cache_usage: float  # used blocks / usable blocks, after the step
    num_preemptions: int  # requests preempted while scheduling this step
    spec: SpecDecodeStats | None = None  # speculative decoding in this step (None: none ran)
    # Keys the step's queries attend, summed (causal: a chunk of n tokens ending at position e sees
    # n x (e - (n - 1) / 2)): what attention adds to a step beyond its token count.
    attention_work: float = 0.0
    # Of those: the prompt tokens attended as single-token query rows (chunks of at most
    # MAX_QUERY_ROWS_PER_CHUNK tokens, kvflow/query_rows.py), and the keys all query rows (these and
    # the decodes) attended. A row re-reads its context: its cost per key differs from a prefill
    # chunk's per query x key, so the doctor fits the two apart (kvflow/doctor/step_cost.py).
    num_row_prefill_tokens: int = 0
    row_attention_work: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kind(self) -> str:
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        if self.num_prefill_tokens:
            return "prefill_only"
        return "decode_only" if self.num_decode_tokens else "idle"


@dataclass
class SpecDecodeStats:
    """Speculative decoding acceptance over some steps (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.append(0)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        while len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.append(0)
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + the one always emitted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

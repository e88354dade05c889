"""The dashboard's wire format: every event is one JSON object (a "frame").

Rows are arrays, not objects (a step row is sent hundreds of times a second on a busy server); the
field order of each row kind is sent once, in the hello frame's `fields`, and is listed here.
Times are the server's `time.monotonic()` seconds, rounded to the microsecond; the page maps them
to its own clock with the frame's `now`.

    {"type": "hello" | "update", "v": SCHEMA_VERSION, "now": t,
     "config": {...}                          hello only: model, pool size, limits, window
     "fields": {"step": [...], ...}           hello only: STEP_FIELDS, SECOND_FIELDS, ITL_FIELDS
     "steps": [step row, ...]                 new engine steps, oldest first
     "seconds": [second row, ...]             per-second aggregates changed by this frame
     "requests": [request object, ...]        requests that changed (the hello: every one kept)
     "itl": [[t, gap_ms], ...]                new inter-token gaps of every request
     "running": [id, ...], "waiting": [id, ...]   after the last step (waiting: queued + preempted)
     "kv": block map | null                   null: unchanged since the previous frame
     "totals": {...}}                         running totals since the server started
"""

from __future__ import annotations

import heapq
from typing import Any

from kvflow.kv_cache.block_map import BlockMap
from kvflow.stats import RequestTimeline, StepStats, percentile

SCHEMA_VERSION = 1

STEP_FIELDS = (
    "t",  # step start
    "dur_ms",
    "prefill_tokens",  # prompt chunks and recomputation after preemption
    "decode_tokens",
    "output_tokens",  # tokens the step emitted (more than decode_tokens when drafts are accepted)
    "running",
    "waiting",
    "kv_usage",  # used blocks / usable blocks after the step
    "preemptions",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "attention",  # keys the step's queries attended, summed (StepStats.attention_work)
    "row_prefill_tokens",  # prompt tokens attended as single-token query rows (kvflow/query_rows.py)
    "row_attention",  # keys the query rows (decodes and those prompt tokens) attended
)
SECOND_FIELDS = (
    "t",  # the second's start (whole seconds of the monotonic clock)
    "steps",
    "busy_ms",  # summed step durations
    "prefill_tokens",
    "decode_tokens",
    "output_tokens",
    "kv_usage_max",
    "running_max",
    "waiting_max",
    "preemptions",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)
ITL_FIELDS = ("t", "gap_ms")  # t: when the later token of the pair was produced

# Request states (the Gantt row's current colour): queued before its first scheduling, prefill while
# prompt (or recomputed) tokens remain, decode after, preempted while waiting to be recomputed.
REQUEST_STATES = ("queued", "prefill", "decode", "preempted", "finished")


def _t(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def step_row(stats: StepStats, num_output_tokens: int) -> list[Any]:
    spec = stats.spec
    return [
        _t(stats.start_time),
        _ms(stats.duration),
        stats.num_prefill_tokens,
        stats.num_decode_tokens,
        num_output_tokens,
        stats.num_running,
        stats.num_waiting,
        round(stats.kv_cache_usage, 5),
        stats.num_preemptions,
        spec.num_draft_tokens if spec is not None else 0,
        spec.num_accepted_tokens if spec is not None else 0,
        round(stats.attention_work),
        stats.num_row_prefill_tokens,
        round(stats.row_attention_work),
    ]


# While a request runs, its ITL percentiles cover its last this-many gaps: sorting every gap of every
# running request 4 times a second would cost the engine thread more the longer the outputs grow.
# At its finish they cover all of its gaps.
RUNNING_ITL_GAPS = 256
# The slowest gaps a row carries (with when each ended), for one request's story
# (kvflow/doctor/request_story.py: what the steps inside each gap were doing).
SLOWEST_GAPS = 3


def request_object(
    request_id: str,
    state: str,
    timeline: RequestTimeline,
    num_prompt_tokens: int,
    num_output_tokens: int,
    preemptions: list[list[float | None]],
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One Gantt row: the request's life so far and its hover numbers (definitions: kvflow/stats.py).

    `chunks`: [t, tokens] per prefill chunk (recomputation after a preemption included);
    `preemptions`: [preempted at, resumed at | null]; ITL percentiles: see RUNNING_ITL_GAPS."""
    times = timeline.token_times
    if state != "finished":
        times = times[-(RUNNING_ITL_GAPS + 1) :]
    gaps = [times[i + 1] - times[i] for i in range(len(times) - 1)]
    return {
        "id": request_id,
        "state": state,
        "reason": finish_reason,
        "arrival": _t(timeline.arrival_time),
        "handed_off": _t(timeline.handed_off_time),
        "added": _t(timeline.added_time),
        "first_scheduled": _t(timeline.first_scheduled_time),
        "first_token": _t(timeline.first_token_time),
        "last_token": _t(timeline.token_times[-1]) if timeline.token_times else None,
        "finished": _t(timeline.finished_time) if state == "finished" else None,
        "chunks": [[_t(c.time), c.num_tokens] for c in timeline.prefill_chunks],
        "preemptions": preemptions,
        "prompt_tokens": num_prompt_tokens,
        "cached_tokens": timeline.num_cached_prompt_tokens,
        "output_tokens": num_output_tokens,
        "priority": timeline.priority,
        "x_request_id": timeline.x_request_id,
        "ttft_ms": _ms(timeline.ttft),
        "itl_p50_ms": _ms(percentile(gaps, 50)) if gaps else None,
        "itl_p99_ms": _ms(percentile(gaps, 99)) if gaps else None,
        "slowest_gaps": [
            [_t(times[i + 1]), _ms(gaps[i])]
            for i in heapq.nlargest(SLOWEST_GAPS, range(len(gaps)), key=gaps.__getitem__)
        ],
        "grammar_ms": _ms(timeline.grammar_compile_time),
        "restore_ms": _ms(timeline.kv_restore_time),
    }


def block_map_object(block_map: BlockMap) -> dict[str, Any]:
    """`owner[i]` for usable block i + 1: -1 free, -2 free but caching a prefix, k >= 0 held by the
    requests `groups[k]` (two or more: a shared prefix block); `cached_in_use`: indices i of held
    blocks that are also in the prefix-cache index. Cache groups (kvflow/kv_cache/kv_cache_config.py):
    `cache_group_kinds[g]` is group g's kind (full_attention, sliding_attention, mla,
    linear_attention); `cache_group[i]` the group whose tables hold block i, -1 for a free block, or
    null when the model has one group (every held block is group 0: a list per block would only
    repeat `owner`)."""
    one_group = len(block_map.cache_group_kinds) <= 1
    return {
        "owner": block_map.owner,
        "groups": block_map.owner_groups,
        "cached_in_use": [i for i, cached in enumerate(block_map.cached_in_use) if cached],
        "used": block_map.num_used,
        "cached_free": block_map.num_cached_free,
        "shared": block_map.num_shared,
        "cache_group": None if one_group else block_map.cache_group,
        "cache_group_kinds": block_map.cache_group_kinds,
    }

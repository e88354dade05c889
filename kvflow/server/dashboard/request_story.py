"""One slow request explained (the dashboard's `/dashboard/request/ID`, which `kvflow doctor --request
ID` reads): where its TTFT and its slowest gaps went, from the server's recorded window (the
dashboard's request rows and engine steps, schema.py). Torch-free: the doctor imports it.

    TTFT = queue (arrival -> first scheduled) + prefill (first scheduled -> first token)
    queue        its HTTP handoff (arrival -> the engine took it in: the handler parses and tokenizes
                 between the engine's steps, which hold the GIL), its grammar compile and its KV
                 restore (all waited in the queue); behind whom:
                 the requests running while it waited and those that arrived before it and were
                 scheduled after it arrived; why: the binding limit over the steps it waited through
                 (max_num_seqs when they ran full, the KV pool when usage stood at KV_FULL or steps
                 preempted, the token budget when steps filled max_num_batched_tokens; else none of
                 these: the steps were busy; or the handoff, when it was most of the wait)
    prefill      each chunk: its tokens and the step that computed it (duration, the other prompt
                 tokens and decode rows that shared it)
    preemptions  when it was preempted and when its recomputation started
    slow gaps    its slowest inter-token gaps: the steps inside each, their prompt tokens (other
                 requests' chunks stall the decodes of a step), and whether it was preempted then

Times in the output are milliseconds after the request's arrival.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.server.dashboard.schema import STEP_FIELDS

KV_FULL = 0.9  # KV usage at which admission waits for blocks (as the doctor's TTFT check)
_S = {name: i for i, name in enumerate(STEP_FIELDS)}
TIME_TOLERANCE_S = 1e-5  # a chunk is stamped with its step's start (both rounded to the microsecond)


@dataclass(frozen=True)
class WindowView:
    """What the story reads: the dashboard window's request rows and step rows, and the limits."""

    requests: dict[str, dict[str, Any]]
    steps: Sequence[Sequence[Any]]
    max_num_seqs: int | None
    max_num_batched_tokens: int | None


def _ms(t: float | None, origin: float) -> float | None:
    return None if t is None else round((t - origin) * 1e3, 3)


def _steps_between(view: WindowView, start: float, end: float) -> list[Sequence[Any]]:
    """Steps that started in [start, end)."""
    return [s for s in view.steps if start - TIME_TOLERANCE_S <= s[_S["t"]] < end - TIME_TOLERANCE_S]


def _step_at(view: WindowView, t: float) -> Sequence[Any] | None:
    return next((s for s in view.steps if abs(s[_S["t"]] - t) <= TIME_TOLERANCE_S), None)


def _binding_limit(view: WindowView, steps: Sequence[Sequence[Any]]) -> str:
    if not steps:
        return "none"
    full = view.max_num_seqs is not None and sum(s[_S["running"]] >= view.max_num_seqs for s in steps)
    if full and full > len(steps) / 2:  # the slots stood full for most of its wait
        return "max_num_seqs"
    if any(s[_S["preemptions"]] for s in steps) or max(s[_S["kv_usage"]] for s in steps) >= KV_FULL:
        return "kv_pool"
    budget = view.max_num_batched_tokens
    if budget is not None and any(s[_S["prefill_tokens"]] + s[_S["decode_tokens"]] >= budget for s in steps):
        return "token_budget"
    return "busy"


_LIMIT_WORDS = {
    "max_num_seqs": "every running slot was taken (max_num_seqs={})",
    "kv_pool": "the KV pool was full (usage at or above 90%, or preemptions)",
    "token_budget": "steps were full of prompt tokens (max_num_batched_tokens={})",
    "busy": "the engine was busy with other requests' steps; no limit was reached",
    "none": "no step ran while it waited",
    "handoff": "most of the wait was before the engine had it: the HTTP handler parses and tokenizes "
    "a request between the engine's steps",
}


def _queue(view: WindowView, row: dict[str, Any]) -> dict[str, Any]:
    arrival, scheduled, added = row["arrival"], row["first_scheduled"], row.get("added")
    end = scheduled if scheduled is not None else max((s[_S["t"]] for s in view.steps), default=arrival)
    steps = _steps_between(view, arrival, end)
    handoff_ms = _ms(added, arrival)  # None: a server that does not report it
    running, ahead = [], []
    for other in view.requests.values():
        if other["id"] == row["id"] or other["first_scheduled"] is None:
            continue
        done = other["finished"] if other["finished"] is not None else float("inf")
        if other["first_scheduled"] <= arrival < done:
            running.append(other["id"])
        elif other["arrival"] < arrival and arrival <= other["first_scheduled"] <= end:
            ahead.append(other["id"])
    queue_ms = _ms(scheduled, arrival)
    if handoff_ms is not None and queue_ms and 2 * handoff_ms >= queue_ms:
        limit = "handoff"  # the slots and the budget could not hold back what the engine did not have
    else:  # the limits bind once the engine has it
        limit = _binding_limit(view, _steps_between(view, added, end) if added is not None else steps)
    setting = view.max_num_seqs if limit == "max_num_seqs" else view.max_num_batched_tokens
    return {
        "queue_ms": queue_ms,
        "handoff_ms": handoff_ms,
        "grammar_ms": row.get("grammar_ms"),
        "restore_ms": row.get("restore_ms"),
        "steps_waited": len(steps),
        "running_when_it_arrived": running,
        "scheduled_ahead_of_it": ahead,
        "limit": limit,
        "why": _LIMIT_WORDS[limit].format(setting),
    }


def _chunks(view: WindowView, row: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for t, tokens in row["chunks"]:
        step = _step_at(view, t)
        entry: dict[str, Any] = {"at_ms": _ms(t, row["arrival"]), "tokens": tokens, "step_ms": None}
        if step is not None:
            entry.update(
                step_ms=step[_S["dur_ms"]],
                other_prefill_tokens=max(step[_S["prefill_tokens"]] - tokens, 0),
                decode_rows=step[_S["decode_tokens"]],
                running=step[_S["running"]],
            )
        out.append(entry)
    return out


def _gaps(view: WindowView, row: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    spans = row.get("preemptions") or []
    for end, gap_ms in row.get("slowest_gaps") or []:
        start = end - gap_ms / 1e3
        steps = _steps_between(view, start, end)
        preempted = any(p0 is not None and start <= p0 < end for p0, _ in spans)
        prefill = sum(s[_S["prefill_tokens"]] for s in steps)
        longest = max((s[_S["dur_ms"]] for s in steps), default=None)
        if preempted:
            why = "it was preempted (KV pool full) and waited to be recomputed"
        elif prefill:
            why = f"{prefill:,} prompt tokens of other requests were computed in the steps of this gap"
        else:
            why = "decode steps only: the step time itself (batch size, context)"
        out.append(
            {
                "end_ms": _ms(end, row["arrival"]),
                "gap_ms": gap_ms,
                "steps": len(steps),
                "prefill_tokens_in_gap": prefill,
                "longest_step_ms": longest,
                "preempted": preempted,
                "why": why,
            }
        )
    return out


def rows_by_x_request_id(view: WindowView) -> dict[str, str]:
    """HTTP x-request-id -> the window's row of it (the first choice of an n > 1 request)."""
    rows: dict[str, str] = {}
    for rid in sorted(view.requests):
        header = view.requests[rid].get("x_request_id")
        if header is not None:
            rows.setdefault(header, rid)
    return rows


def pick_request(view: WindowView, request_id: str) -> str | None:
    """The id itself when the window holds it; else the request whose HTTP x-request-id it is;
    `slowest`: the request with the highest TTFT."""
    if request_id in view.requests:
        return request_id
    by_header = rows_by_x_request_id(view).get(request_id)
    if by_header is not None:
        return by_header
    if request_id == "slowest":
        timed = [r for r in view.requests.values() if r.get("ttft_ms") is not None]
        return max(timed, key=lambda r: r["ttft_ms"])["id"] if timed else None
    return None


def explain_request(view: WindowView, request_id: str) -> dict[str, Any]:
    """The story of `request_id` (module docstring); KeyError when the window does not hold it."""
    row = view.requests[request_id]
    arrival = row["arrival"]
    queue = _queue(view, row)
    story: dict[str, Any] = {
        "id": request_id,
        "state": row["state"],
        "priority": row.get("priority"),
        "prompt_tokens": row["prompt_tokens"],
        "cached_tokens": row.get("cached_tokens"),
        "output_tokens": row["output_tokens"],
        "ttft_ms": row.get("ttft_ms"),
        "queue": queue,
        "prefill_ms": _ms(row["first_token"], row["first_scheduled"]) if row["first_scheduled"] else None,
        "prefill_chunks": _chunks(view, row),
        "preemptions": [
            {"at_ms": _ms(p0, arrival), "recompute_from_ms": _ms(p1, arrival)}
            for p0, p1 in row["preemptions"]
        ],
        "slowest_gaps": _gaps(view, row),
    }
    story["summary"] = story_text(story)
    return story


def story_text(story: dict[str, Any]) -> str:
    q = story["queue"]
    lines = [
        f"request {story['id']} ({story['state']}, priority {story['priority']}): "
        f"{story['prompt_tokens']:,} prompt tokens ({story['cached_tokens'] or 0:,} cached), "
        f"{story['output_tokens']:,} output; TTFT {_num(story['ttft_ms'])} ms = queue "
        f"{_num(q['queue_ms'])} + prefill {_num(story['prefill_ms'])}"
    ]
    served_first = [*q["running_when_it_arrived"], *q["scheduled_ahead_of_it"]]
    shown = ", ".join(served_first[:8]) + (", ..." if len(served_first) > 8 else "")
    queued = f"  queued {_num(q['queue_ms'])} ms ({q['steps_waited']} steps"
    if q.get("handoff_ms") is not None:
        queued += f"; the engine took it in after {_num(q['handoff_ms'])} ms"
    queued += ")"
    if served_first:
        queued += (
            f" behind {len(served_first)} request(s) served first ({shown}; "
            f"{len(q['running_when_it_arrived'])} already running when it arrived)"
        )
    queued += f": {q['why']}"
    if q["grammar_ms"]:
        queued += f"; grammar compile {_num(q['grammar_ms'])} ms"
    if q["restore_ms"]:
        queued += f"; KV restore {_num(q['restore_ms'])} ms"
    lines.append(queued)
    for c in story["prefill_chunks"]:
        shared = " (its step has left the window)"
        if c["step_ms"] is not None:
            shared = (
                f" in a {_num(c['step_ms'])} ms step with {c['other_prefill_tokens']:,} other prompt "
                f"tokens and {c['decode_rows']:,} decodes"
            )
        lines.append(f"  prefill chunk at +{_num(c['at_ms'])} ms: {c['tokens']:,} tokens{shared}")
    for p in story["preemptions"]:
        lines.append(
            f"  preempted at +{_num(p['at_ms'])} ms, recomputed from +{_num(p['recompute_from_ms'])} ms"
        )
    for g in story["slowest_gaps"]:
        lines.append(
            f"  gap of {_num(g['gap_ms'])} ms ending +{_num(g['end_ms'])} ms over {g['steps']} step(s): "
            f"{g['why']}"
        )
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:,.1f}"

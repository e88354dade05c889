"""One request of a kvflow bench result explained (`kvflow doctor --request ID --bench RESULT`), once
the server is gone: the server's story of it (kvflow/server/dashboard/request_story.py, from the
window the result kept: kvflow/bench/server_steps.py) beside what the client measured.

    client TTFT = the server's TTFT (queue + prefill, the story) + delivery (the HTTP path and the
                  client: what the server's clock does not see)

ID: the request's index in the result's `requests`, its x-request-id, the server's id of it, or
`slowest` (the highest client TTFT among the requests the window holds).
"""

from __future__ import annotations

from typing import Any

from kvflow.server.dashboard.request_story import WindowView, explain_request, rows_by_x_request_id

SLOWEST_CLIENT_GAPS = 3


def window_view(result: dict[str, Any]) -> WindowView | None:
    """The server's window the result kept, as the story reads it (None: not a kvflow run, or a
    result from before kvflow bench kept it)."""
    window = (result.get("server") or {}).get("window")
    if not isinstance(window, dict):
        return None
    return WindowView(
        requests={row["id"]: row for row in window.get("requests") or []},
        steps=window.get("steps") or [],
        max_num_seqs=window.get("max_num_seqs"),
        max_num_batched_tokens=window.get("max_num_batched_tokens"),
    )


def pick_bench_request(result: dict[str, Any], view: WindowView, ident: str) -> tuple[dict[str, Any], str]:
    """(the bench request, the server's row id) for ID (module docstring); ValueError naming what is
    missing."""
    entries = [e for e in result.get("requests") or [] if e.get("error") is None]
    by_header = rows_by_x_request_id(view)
    found = [(e, by_header.get(e.get("x_request_id") or "")) for e in entries]
    if ident == "slowest":
        held = [(e, row) for e, row in found if row is not None]
        if not held:
            raise ValueError("--request slowest: no request of this run is in the server's window")
        return max(held, key=lambda pair: pair[0].get("ttft_ms") or 0.0)
    for entry, row in found:
        if ident in (str(entry.get("index")), entry.get("x_request_id"), row):
            if row is None:
                raise ValueError(
                    f"--request {ident}: the server's window no longer holds it (the dashboard keeps "
                    "the last 30 s of steps: a longer run keeps the stories of its last requests)"
                )
            return entry, row
    raise ValueError(f"--request {ident}: not a succeeded request of this result (index, x-request-id or id)")


def bench_story(result: dict[str, Any], ident: str) -> dict[str, Any]:
    """The server's story of the request plus the client's view ("client"), and a summary of both."""
    view = window_view(result)
    if view is None:
        raise ValueError(
            "--request with --bench: this result has no server window (kvflow bench keeps one from a "
            "kvflow server with its dashboard on); against a live server use --server URL"
        )
    entry, row = pick_bench_request(result, view, ident)
    story = explain_request(view, row)
    server_ttft = story.get("ttft_ms")
    client_ttft = entry.get("ttft_ms")
    gaps = sorted(entry.get("itl_ms") or [], reverse=True)[:SLOWEST_CLIENT_GAPS]
    story["client"] = {
        "index": entry.get("index"),
        "x_request_id": entry.get("x_request_id"),
        "ttft_ms": client_ttft,
        "delivery_ms": None if client_ttft is None or server_ttft is None else client_ttft - server_ttft,
        "e2e_ms": entry.get("e2e_ms"),
        "slowest_gaps_ms": gaps,
    }
    story["summary"] = _client_line(story["client"]) + "\n" + story["summary"]
    return story


def _client_line(client: dict[str, Any]) -> str:
    def num(value: float | None) -> str:
        return "?" if value is None else f"{value:,.1f}"

    gaps = ", ".join(num(g) for g in client["slowest_gaps_ms"]) or "none"
    return (
        f"bench request {client['index']} ({client['x_request_id']}): client TTFT {num(client['ttft_ms'])} "
        f"ms = the server's TTFT below + {num(client['delivery_ms'])} ms delivery; slowest gaps the "
        f"client saw: {gaps} ms"
    )

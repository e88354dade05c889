"""The dashboard's routes: the page, its static files, the event stream and the doctor's view.

Authentication (when the server has an API key): the same key as the API, but a browser's
EventSource cannot send an `Authorization` header, so under /dashboard the key is also accepted as
the `api_key` query parameter or the `kvflow_dashboard_key` cookie (middleware.py). Opening
`/dashboard?api_key=KEY` once sets that cookie (HttpOnly, SameSite=Strict, path /dashboard), and the
page's own requests then carry it: the key leaves the address bar's history after the first visit.
"""

from __future__ import annotations

import asyncio
import html
from http import HTTPStatus
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from kvflow.assets import shared_css
from kvflow.server.dashboard.doctor_window import LiveDoctor
from kvflow.server.dashboard.hub import DashboardHub
from kvflow.server.dashboard.request_story import explain_request, pick_request
from kvflow.server.dashboard.stream import EventStreamResponse
from kvflow.server.errors import APIError, error_response
from kvflow.server.middleware import DASHBOARD_COOKIE, DASHBOARD_KEY_PARAM
from kvflow.server.shutdown import DrainState

STATIC_DIR = Path(__file__).resolve().parent / "static"


def install_dashboard_routes(
    app: FastAPI, hub: DashboardHub, drain: DrainState, model_dir: str, live_doctor: LiveDoctor | None
) -> None:
    router = APIRouter(include_in_schema=False)
    page = (STATIC_DIR / "index.html").read_text()

    @router.get("/dashboard")
    async def dashboard_page(request: Request) -> Response:
        response = HTMLResponse(page, headers={"cache-control": "no-store"})
        key = request.query_params.get(DASHBOARD_KEY_PARAM)
        if key:  # the middleware let the request in: the key is right
            response.set_cookie(DASHBOARD_COOKIE, key, path="/dashboard", httponly=True, samesite="strict")
        return response

    @router.get("/dashboard/events")
    async def dashboard_events() -> Response:
        return EventStreamResponse(hub, drain)

    @router.get("/dashboard/kvflow.css")
    async def dashboard_css() -> Response:
        return Response(shared_css(), media_type="text/css")

    @router.get("/dashboard/doctor")
    async def dashboard_doctor() -> Response:
        if live_doctor is None:
            body = (
                "<p>The doctor is not wired into this server: it is started by <code>kvflow serve</code>. "
                "Run <code>kvflow doctor --bench RESULT.json</code> on a benchmark instead.</p>"
            )
            return HTMLResponse(body, status_code=HTTPStatus.NOT_IMPLEMENTED)
        window = hub.doctor_window(model_dir)
        try:  # a worker thread: the diagnosis (and a first hardware probe) must not stall the loop
            report = await asyncio.to_thread(live_doctor, window)
        except ValueError as exc:  # e.g. no finished request in the window yet
            return HTMLResponse(f"<p>{html.escape(str(exc))}</p>", status_code=HTTPStatus.CONFLICT)
        return HTMLResponse(report)

    @router.get("/dashboard/request/{request_id}")
    async def dashboard_request(request_id: str, request: Request) -> Response:
        """One request's story (request_story.py): HTML, or JSON with ?format=json; the id as the
        Gantt row shows it, or `slowest` (the highest TTFT in the window)."""
        view = hub.request_view()
        chosen = pick_request(view, request_id)
        if chosen is None:
            error = APIError(
                HTTPStatus.NOT_FOUND,
                f"request {request_id!r} is not in the dashboard's window (finished requests stay "
                f"{hub.window.limits.window_s:.0f} s)",
            )
            return error_response(error)
        story = await asyncio.to_thread(explain_request, view, chosen)
        if request.query_params.get("format") == "json":
            return JSONResponse(story)
        body = (
            f"<!doctype html><html><head><meta charset='utf-8'><title>kvflow: {html.escape(chosen)}</title>"
            f"<style>{shared_css()}</style></head><body><h1><span class='brand'>kvflow</span> request "
            f"{html.escape(chosen)}</h1><pre>{html.escape(story['summary'])}</pre></body></html>"
        )
        return HTMLResponse(body)

    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

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
from fastapi.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

from kvflow.assets import shared_css
from kvflow.server.dashboard.doctor_window import LiveDoctor
from kvflow.server.dashboard.hub import DashboardHub
from kvflow.server.dashboard.stream import EventStreamResponse
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

    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

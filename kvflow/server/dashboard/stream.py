"""/dashboard/events: one client's server-sent event stream.

Three things end it, whichever comes first: the client disconnects (`http.disconnect`), the hub
drops the client for not reading (hub.py), or the server stops. The frames are written by a task of
their own, so that a client whose socket no longer drains (the write blocks on the transport's
flow control) can still be cut: the task is cancelled and the response left incomplete, which makes
the server close the connection.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvflow.server.dashboard.hub import DashboardHub, Subscriber
from kvflow.server.shutdown import DrainState

# A comment line now and then keeps proxies from closing an idle stream (and reveals a dead peer).
KEEPALIVE_S = 15.0
# How long an EventSource waits before reconnecting after the stream ends (the `retry:` field).
RECONNECT_MS = 2000
# How often a stream checks whether the server drains (shutdown.py): it then ends at once, so an open
# dashboard never holds the shutdown for its grace period.
DRAIN_POLL_S = 0.25


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, hub: DashboardHub, drain: DrainState) -> None:
        super().__init__(
            headers={"cache-control": "no-store", "x-accel-buffering": "no"}, media_type=self.media_type
        )
        # A stream has no length (Response adds content-length: 0 for an empty body).
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.hub = hub
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sub = self.hub.subscribe()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send(
                {
                    "type": "http.response.body",
                    "body": f"retry: {RECONNECT_MS}\n\n".encode(),
                    "more_body": True,
                }
            )
            writer = asyncio.ensure_future(_write_frames(sub, send))
            disconnect = asyncio.ensure_future(_wait_disconnect(receive))
            dropped = asyncio.ensure_future(sub.dropped.wait())
            draining = asyncio.ensure_future(_wait_drain(self.drain))
            done, pending = await asyncio.wait(
                (writer, disconnect, dropped, draining), return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if writer in done and not isinstance(writer.exception(), OSError):
                writer.result()  # a bug surfaces; a client gone mid-write (OSError) is just gone
        finally:
            self.hub.unsubscribe(sub)


async def _write_frames(sub: Subscriber, send: Send) -> None:
    while True:
        try:
            message = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)
        except asyncio.TimeoutError:
            message = b": keep-alive\n\n"
        await send({"type": "http.response.body", "body": message, "more_body": True})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _wait_drain(drain: DrainState) -> None:
    while not drain.draining:
        await asyncio.sleep(DRAIN_POLL_S)

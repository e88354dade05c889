"""The dashboard's event-loop side: deltas from the engine thread in, frames to every client out.

Coalescing: deltas are merged into one pending update, and an update goes out at most once every
`interval_s`, however fast the engine steps. Each frame is encoded once, whatever the number of
clients.

Back-pressure: each client has a queue of at most `queue_frames` frames. A client that stops
reading fills its queue; the next frame then drops it (its `dropped` event fires and its connection
is closed, stream.py) instead of growing memory or making anyone wait: the engine thread only ever
schedules a callback on the loop, and the loop never waits for a client. An EventSource reconnects
by itself and starts again from a fresh hello.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.server.dashboard.doctor_window import DoctorWindow
from kvflow.server.dashboard.recorder import Delta
from kvflow.server.dashboard.request_story import WindowView
from kvflow.server.dashboard.schema import ITL_FIELDS, SCHEMA_VERSION, SECOND_FIELDS, STEP_FIELDS
from kvflow.server.dashboard.window import Window, WindowLimits

logger = logging.getLogger(__name__)

# At 4 frames/s a client may fall 4 s behind before it is dropped.
DEFAULT_QUEUE_FRAMES = 16
# How often /metrics is sampled into the window for the doctor's view (its gauges and the deltas).
METRICS_SAMPLE_S = 5.0


@dataclass
class Subscriber:
    queue: asyncio.Queue[bytes]
    dropped: asyncio.Event = field(default_factory=asyncio.Event)


def encode(frame: dict[str, Any]) -> bytes:
    """One server-sent event (`data:` lines end at the first newline, and compact JSON has none)."""
    return b"data: " + json.dumps(frame, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


class DashboardHub:
    def __init__(
        self,
        config: dict[str, Any],
        render_metrics: Callable[[], bytes],
        interval_s: float = 0.25,
        limits: WindowLimits | None = None,
        queue_frames: int = DEFAULT_QUEUE_FRAMES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.window = Window(limits or WindowLimits())
        self.config = {**config, "interval_s": interval_s, "window_s": self.window.limits.window_s}
        self.render_metrics = render_metrics
        self.queue_frames = queue_frames
        self.clock = clock
        self.subscribers: list[Subscriber] = []
        self.num_dropped = 0  # clients dropped for not reading (tests and logs read it)
        self.num_frames_sent = 0
        self.metrics_samples: list[tuple[float, bytes]] = []  # (monotonic time, /metrics text)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, Any] | None = None
        self._changed_seconds: set[int] = set()
        self._send_handle: asyncio.TimerHandle | None = None
        self._last_send = float("-inf")

    # ------------------------------------------------------------------------------- engine thread

    def watched(self) -> bool:
        """Whether a client is connected (read from the engine thread: a list length, no lock needed)."""
        return bool(self.subscribers)

    def publish_threadsafe(self, delta: Delta) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.apply, delta)

    # --------------------------------------------------------------------------------- event loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the hub belongs to (None before the app starts)."""
        return self._loop

    def start(self) -> None:
        """Bind to the running loop (the app's lifespan): deltas published before are not kept."""
        self._loop = asyncio.get_running_loop()
        self._sample_metrics()

    def stop(self) -> None:
        if self._send_handle is not None:
            self._send_handle.cancel()
        for sub in self.subscribers:
            sub.dropped.set()
        self.subscribers = []
        self._loop = None

    def apply(self, delta: Delta) -> None:
        self._changed_seconds |= self.window.apply(delta)
        self._merge_pending(delta)
        if self.clock() - self._sample_time() >= METRICS_SAMPLE_S:
            self._sample_metrics()
        if self._send_handle is None and self._loop is not None:
            wait = max(0.0, self._last_send + self.interval_s - self.clock())
            self._send_handle = self._loop.call_later(wait, self._send)

    def _merge_pending(self, delta: Delta) -> None:
        p = self._pending
        if p is None:
            p = self._pending = {"steps": [], "requests": {}, "itl": [], "kv": None}
        p["now"] = delta.now
        p["steps"].extend(delta.steps)
        p["itl"].extend(delta.itl)
        for obj in delta.requests:
            p["requests"][obj["id"]] = obj
        p["running"], p["waiting"] = delta.running, delta.waiting
        if delta.kv is not None:
            p["kv"] = delta.kv

    def _send(self) -> None:
        self._send_handle = None
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._last_send = self.clock()
        seconds = [self.window.seconds[s] for s in sorted(self._changed_seconds) if s in self.window.seconds]
        self._changed_seconds = set()
        frame = {
            "type": "update",
            "v": SCHEMA_VERSION,
            **pending,
            "requests": list(pending["requests"].values()),
            "seconds": seconds,
            "totals": self.window.totals.as_json(),
        }
        if self.subscribers:
            self._broadcast(encode(frame))

    def _broadcast(self, message: bytes) -> None:
        self.num_frames_sent += 1
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(message)
            except asyncio.QueueFull:
                self.drop(sub)

    def drop(self, sub: Subscriber) -> None:
        """Stop feeding `sub` and tell its stream to close the connection."""
        self.num_dropped += 1
        logger.info("dashboard: a client fell %d frames behind and was dropped", self.queue_frames)
        self.unsubscribe(sub)
        sub.dropped.set()

    def hello(self) -> dict[str, Any]:
        return {
            "type": "hello",
            "v": SCHEMA_VERSION,
            "config": self.config,
            "fields": {"step": STEP_FIELDS, "second": SECOND_FIELDS, "itl": ITL_FIELDS},
            **self.window.hello(),
        }

    def subscribe(self) -> Subscriber:
        """A new client: its queue starts with the hello frame (everything kept), updates follow."""
        sub = Subscriber(asyncio.Queue(maxsize=self.queue_frames))
        sub.queue.put_nowait(encode(self.hello()))
        self.subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)

    # ------------------------------------------------------------------------ the doctor's samples

    def _sample_time(self) -> float:
        return self.metrics_samples[-1][0] if self.metrics_samples else float("-inf")

    def _sample_metrics(self) -> None:
        now = self.clock()
        self.metrics_samples.append((now, self.render_metrics()))
        horizon = now - self.window.limits.window_s
        while len(self.metrics_samples) > 1 and self.metrics_samples[1][0] <= horizon:
            self.metrics_samples.pop(0)

    def request_view(self) -> WindowView:
        """The recorded requests and steps, for one request's story (call on the event loop)."""
        return WindowView(
            requests=dict(self.window.requests),
            steps=list(self.window.steps),
            max_num_seqs=self.config.get("max_num_seqs"),
            max_num_batched_tokens=self.config.get("max_num_batched_tokens"),
        )

    def doctor_window(self, model_dir: str) -> DoctorWindow:
        """The window for the doctor (call on the event loop: the window's state is the loop's)."""
        window = self.window
        samples = self.metrics_samples
        started = samples[0][0] if samples else window.now
        return DoctorWindow(
            model_dir=model_dir,
            started=started,
            now=max(window.now, self.clock()),
            requests=[r for r in window.requests.values() if r["state"] == "finished"],
            itl_ms=[gap for t, gap in window.itl if t >= started],
            seconds=[row for row in window.seconds.values() if row[0] >= started - 1],
            metrics_before=samples[0][1] if samples else b"",
            metrics_after=self.render_metrics(),
            metrics_samples=[text for _, text in samples],
            max_concurrency=int(self.config.get("max_num_seqs", 1)),
        )

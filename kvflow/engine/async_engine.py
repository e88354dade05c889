"""AsyncLLMEngine: the engine steps in its own thread; request streams are consumed from asyncio.

Why a dedicated thread: a step is CPU work (scheduling, the model, detokenization). Run on the event
loop it would stall every connection for the step's duration; run as one `to_thread` call per step,
the loop would have to drive the engine. Here the engine thread loops on its own: it drains commands
(add / abort), steps while any request is unfinished, and blocks when idle. The matmuls release the
GIL, so the event loop keeps accepting connections and streaming while a step runs.

Ownership (the invariant that makes this thread-safe without locks around the engine): only the
engine thread touches `LLMEngine` state and the `_streams` table. Other threads talk to it through
`_commands`; outputs travel back in one `call_soon_threadsafe` per step. The admission counters are
the only state both sides touch, under `_admission_lock`.

Admission (`max_waiting`): the engine holds `max_num_seqs` running requests plus at most
`max_waiting` queued ones. A request counts from the moment it is admitted, whether or not the
engine thread has picked it up yet, but it only counts as *waiting* once the running slots are
full: a burst on an idle server fills the free slots first (requests admitted but not yet picked up
are not "waiting" while a slot is free for them). KV memory can still make a request wait with a
slot free; the bound is on requests, not blocks. A request that needs more engine requests (its
prompts x n) than running slots + max_waiting could ever hold is refused as invalid, not 429.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.engine.engine import LLMEngine
from kvflow.errors import EngineOverloadedError, InvalidRequestError, KVFlowError, RequestFailedError
from kvflow.outputs import RequestOutput
from kvflow.request import Request
from kvflow.stats import StepStats

logger = logging.getLogger(__name__)

# Called in the engine thread after every step with its stats and outputs (the metrics layer).
StepObserver = Callable[[StepStats, list[RequestOutput]], None]
# How long `shutdown` waits for the engine thread to finish its current step.
SHUTDOWN_JOIN_TIMEOUT_S = 30.0


class EngineDeadError(KVFlowError):
    """The engine thread has stopped (shutdown or an unrecoverable error)."""


class OutputStream:
    """The outputs of a group of requests (one per choice of an HTTP request), in step order.

    Iterate with `async for`; it ends when every request has finished. Raises RequestFailedError if
    the engine failed one of them, EngineDeadError if the engine stopped first; either way the
    group's other requests are aborted. `close()` aborts whatever is unfinished (client gone)."""

    def __init__(self, request_ids: Sequence[str], abort: Callable[[str], None]) -> None:
        self.request_ids = list(request_ids)
        self._abort = abort
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def is_open(self, request_id: str) -> bool:
        return request_id in self._unfinished

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
            if item.error is not None:
                self.close()
                raise RequestFailedError(item.error)
        return item

    def close(self) -> None:
        """Abort the requests that have not finished (client gone, handler cancelled, failure)."""
        unfinished, self._unfinished = self._unfinished, set()
        for request_id in unfinished:
            self._abort(request_id)


@dataclass(frozen=True)
class _Add:
    request: Request
    stream: OutputStream


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _AbortAll:
    """Abort every unfinished request; each stream then ends with finish_reason "abort"."""


class _Shutdown:
    pass


_Command = _Add | _Abort | _AbortAll | _Shutdown


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int | None = None,
        step_observer: StepObserver | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_num_seqs = engine.config.scheduler_config.max_num_seqs
        self._step_observers: list[StepObserver] = [step_observer] if step_observer is not None else []
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, OutputStream] = {}  # request id -> its group's stream; engine thread only
        self._admission_lock = threading.Lock()
        self._num_pending_adds = 0  # submitted, not yet seen by the engine thread
        self._num_unfinished = 0  # the scheduler's running + waiting requests after the last step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: str | None = None
        self._fatal: str | None = None  # set when the engine thread died of an error (not a shutdown)

    # ------------------------------------------------------------------ lifecycle (event loop side)

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread after its current step; unfinished streams end with EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(_Shutdown())
        self._thread.join(SHUTDOWN_JOIN_TIMEOUT_S)
        self._thread = None

    def add_step_observer(self, observer: StepObserver) -> None:
        """Also call `observer` in the engine thread after every step (the live dashboard). Add
        observers before `start()`: the list is read by the engine thread without a lock."""
        self._step_observers.append(observer)

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can serve no more (a tensor-parallel rank died, the engine thread crashed),
        even while it idles; None while it can. The server exits non-zero on it."""
        return self._fatal or self.engine.fatal_error

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def num_admitted(self) -> int:
        """Requests admitted and not finished (those the engine thread has not picked up included)."""
        with self._admission_lock:
            return self._num_pending_adds + self._num_unfinished

    @property
    def capacity(self) -> int | None:
        """How many unfinished requests admission allows: running slots + max_waiting (None: no bound)."""
        return None if self.max_waiting is None else self.max_num_seqs + self.max_waiting

    # ------------------------------------------------------------------ requests (event loop side)

    def add_requests(self, requests: Sequence[Request]) -> OutputStream:
        """Admit all of `requests` or none (a request with n choices is n engine requests).

        Raises EngineOverloadedError when they would take the waiting queue past `max_waiting`
        (requests already admitted are never dropped to make room), InvalidRequestError when they
        could not fit even on an idle engine (module docstring)."""
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        capacity = self.capacity
        if capacity is not None and len(requests) > capacity:
            raise InvalidRequestError(
                f"this request needs {len(requests)} engine requests (prompts x n) and the server holds at "
                f"most {capacity} ({self.max_num_seqs} running + max_waiting {self.max_waiting}): "
                "send fewer prompts or a smaller n"
            )
        with self._admission_lock:
            admitted = self._num_pending_adds + self._num_unfinished
            if capacity is not None and admitted + len(requests) > capacity:
                num_waiting = max(0, admitted - self.max_num_seqs)
                raise EngineOverloadedError(
                    f"{num_waiting} requests are waiting for one of {self.max_num_seqs} running slots and "
                    f"max_waiting is {self.max_waiting}; this request needs {len(requests)} more "
                    "slot(s): retry later"
                )
            self._num_pending_adds += len(requests)
        stream = OutputStream([r.request_id for r in requests], self.abort)
        for request in requests:
            request.timeline.handed_off_time = time.monotonic()  # before the engine thread owns it
            self._commands.put(_Add(request, stream))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its KV blocks return to the pool at the next drain."""
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every unfinished request (thread-safe): the server's shutdown cut. Their streams
        still receive a final output (finish_reason "abort"), so each response ends properly."""
        self._commands.put(_AbortAll())

    # ------------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while self._drain_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # never silently: every waiting client gets the reason
            logger.exception("the engine thread stopped")
            self._dead = self._fatal = f"the engine stopped: {type(exc).__name__}: {exc}"
        self._dead = self._dead or "the engine was shut down"
        self._fail_all(EngineDeadError(self._dead))
        self.engine.close()  # queued tier writes reach the disk, queued KV events go out

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once shutdown is requested."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Shutdown):
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort | _AbortAll) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        if isinstance(command, _AbortAll):
            self.engine.abort_request(list(self.engine.scheduler.requests))
            return
        try:
            if command.stream.is_open(command.request.request_id):  # else closed before admission
                self.engine.add_processed_request(command.request)
                self._streams[command.request.request_id] = command.stream
        except KVFlowError as exc:
            self._deliver([(command.stream, exc)])
        except Exception as exc:  # one request's input must never stop the engine thread
            logger.exception("adding request %s failed", command.request.request_id)
            failure = RequestFailedError(f"adding the request failed: {type(exc).__name__}: {exc}")
            self._deliver([(command.stream, failure)])
        finally:
            with self._admission_lock:
                self._num_pending_adds -= 1
                self._num_unfinished = self.engine.get_num_unfinished_requests()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug outside one request's processing: reset rather than die
            logger.exception("engine step failed; aborting every unfinished request")
            self._fail_all(RequestFailedError(f"engine step failed: {type(exc).__name__}: {exc}"))
            self.engine.abort_request(list(self.engine.scheduler.requests))
            self.engine.step()  # flush the aborts (their outputs have no stream left)
            with self._admission_lock:
                self._num_unfinished = self.engine.get_num_unfinished_requests()
            return
        with self._admission_lock:
            self._num_unfinished = self.engine.get_num_unfinished_requests()
        deliveries: list[tuple[OutputStream, RequestOutput | BaseException]] = []
        for output in outputs:
            stream = self._streams.pop(output.request_id) if output.finished else None
            stream = stream or self._streams.get(output.request_id)
            if stream is not None:
                deliveries.append((stream, output))
        self._deliver(deliveries)
        stats = self.engine.last_step_stats
        if stats is None:
            return
        for observer in self._step_observers:
            try:
                observer(stats, outputs)
            except Exception:  # metrics must never take the engine down
                logger.exception("the step observer %r failed", observer)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = {id(s): s for s in self._streams.values()}, {}
        self._deliver([(stream, exc) for stream in streams.values()])

    def _deliver(self, items: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)

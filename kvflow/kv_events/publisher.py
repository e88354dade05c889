"""The ZeroMQ side of KV events: a PUB socket (and an optional replay ROUTER), fed by the engine.

Frames as vLLM's ZmqEventPublisher sends them, so its subscribers read kvflow unchanged:
    PUB     [topic, seq (8 bytes, big-endian), msgpack KVEventBatch]
    replay  request [start_seq (8 bytes)]; reply one [seq, payload] per buffered batch with
            seq >= start_seq, then [-1 (8 bytes, signed), b""]
The engine thread only encodes and enqueues (`publish`); a daemon thread owns both sockets (ZeroMQ
sockets are not thread-safe) and does the sending, so a slow subscriber never stalls a step. A full
queue drops the batch and counts it: its sequence number is still spent, so subscribers see the gap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from kvflow.config import ConfigError, KVEventsConfig
from kvflow.kv_events.events import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

SEQ_BYTES = 8
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
# How long the publisher thread blocks on its queue before looking at the replay socket again.
POLL_S = 0.05
# On shutdown, how long queued batches and unsent frames may take to leave.
SHUTDOWN_S = 1.0


@dataclass
class PublisherStats:
    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0  # the queue was full (a stalled publisher thread)
    replays_served: int = 0


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.stats = PublisherStats()
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            self._open(self._pub, config.endpoint)
            self._replay: zmq.Socket[bytes] | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ConfigError(
                f"kv_events_config: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {exc}"
            ) from None
        # Socket ownership passes to the thread here (thread start is a full memory barrier).
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket: zmq.Socket[bytes], address: str) -> None:
        if "*" in address or "::" in address or address.startswith(("ipc://", "inproc://")):
            socket.bind(address)
        else:
            socket.connect(address)

    def publish(self, events: list[KVEvent]) -> None:
        """One step's events as one batch (nothing is sent for an empty list)."""
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, encode_batch(batch)))
        except queue.Full:
            self.stats.batches_dropped += 1
            logger.warning("KV events: the publisher queue is full; batch %d dropped", seq)
            return
        self.stats.events_published += len(events)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, payload = item
            self._pub.send_multipart((self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload))
            self._buffer.append((seq, payload))
            self.stats.batches_published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:  # [identity, b"", start_seq]
            logger.warning("KV events: malformed replay request of %d frames ignored", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(SEQ_BYTES, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
        self.stats.replays_served += 1

    def close(self) -> None:
        """Send what is queued (up to SHUTDOWN_S), then close the sockets. Idempotent."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout=SHUTDOWN_S)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not finish within %.1f s", SHUTDOWN_S)
            return  # the daemon thread still owns the sockets; the process exit reclaims them
        self._ctx.destroy(linger=int(SHUTDOWN_S * 1000))

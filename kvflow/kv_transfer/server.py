"""Prefill side: the ZeroMQ ROUTER socket a decode instance fetches a prompt's KV from.

One request, one reply (frames):
    request  [msgpack {"transfer_id", "fingerprint", "first_block", "num_blocks", "host_id", "backend"}]
    reply    [msgpack {"error": str | None, "block_hashes": [hex], "sizes", "segment", "nixl_metadata",
              "nixl_descriptors"}, payload, ...]
Payloads go out as their own frames (ZeroMQ sends them without another copy); or, when the decode
side's host_id is this machine's, in one shared-memory segment the reply names (no payload frames;
kvflow/kv_transfer/shared_memory.py); or, when the decode side asks for NIXL, staged in a registered
buffer it READs (kvflow/kv_transfer/nixl_transport.py). The reply carries the hashes of the blocks
it sends, so the decode side checks they are the blocks of its own prompt.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from kvflow.config import ConfigError
from kvflow.kv_transfer.exports import KVExports
from kvflow.kv_transfer.nixl_transport import NixlExports, nixl_available
from kvflow.kv_transfer.shared_memory import (
    SegmentJanitor,
    host_identity,
    shared_memory_usable,
    write_segment,
)

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the serving thread looks at its stop flag


class FetchRequest(msgspec.Struct):
    transfer_id: str
    fingerprint: str
    first_block: int
    num_blocks: int
    host_id: str = ""  # the decode side's machine (shared_memory.host_identity); "": TCP only
    backend: str = "auto"  # "nixl": stage the blocks for a NIXL READ


class FetchReply(msgspec.Struct):
    error: str | None
    block_hashes: list[str]
    sizes: list[int] = []  # bytes of each payload in the segment or the NIXL buffer
    segment: str | None = None  # a shared-memory segment holding the payloads, in order
    nixl_metadata: bytes = b""  # this prefill's NIXL agent: its connection and the staged buffer
    nixl_descriptors: bytes = b""  # its staged buffer's serialized descriptors


class KVTransferServer:
    def __init__(
        self, exports: KVExports, fingerprint: str, bind_host: str, port: int, segment_keep_s: float = 60.0
    ) -> None:
        self.exports = exports
        self.fingerprint = fingerprint
        # Same-machine fetches get a shared-memory segment; one unread past segment_keep_s is dropped.
        self.host_id = host_identity() if shared_memory_usable() else ""
        self.segments = SegmentJanitor(segment_keep_s)
        self.segment_keep_s = segment_keep_s
        self.nixl: NixlExports | None = None  # started by the first NIXL fetch
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        try:
            if port == 0:
                self.port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
            else:
                self._socket.bind(f"tcp://{bind_host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ConfigError(f"kv_transfer_port: cannot listen on {bind_host}:{port}: {exc}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-transfer-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.segments.sweep()
            if self.nixl is not None:
                self.nixl.sweep()
            if not self._socket.poll(POLL_MS):
                continue
            identity, *frames = self._socket.recv_multipart()
            try:
                reply = self._answer(frames)
            except Exception as exc:  # a malformed request: answer it, keep serving the others
                logger.warning("KV transfer: bad fetch request: %s", exc)
                reply = [msgspec.msgpack.encode(FetchReply(f"bad request: {exc}", []))]
            self._socket.send_multipart([identity, b"", *reply], copy=False)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        ask = msgspec.msgpack.decode(frames[-1], type=FetchRequest)
        if ask.fingerprint != self.fingerprint:
            return [
                msgspec.msgpack.encode(
                    FetchReply("the decode instance's KV layout differs from this prefill's", [])
                )
            ]
        export = self.exports.take(ask.transfer_id)
        if export is None:
            error = (
                f"transfer {ask.transfer_id} is unknown here or expired (fetched already, or past its TTL)"
            )
            return [msgspec.msgpack.encode(FetchReply(error, []))]
        end = ask.first_block + ask.num_blocks
        hashes = [h.hex() for h in export.block_hashes[ask.first_block : end]]
        payloads = export.payloads[ask.first_block : end]
        sizes = [len(p) for p in payloads]
        if ask.backend == "nixl":
            return [msgspec.msgpack.encode(self._stage_for_nixl(ask, hashes, payloads, sizes))]
        if self.host_id and ask.host_id == self.host_id:
            try:
                segment = write_segment(payloads)
            except OSError as exc:  # /dev/shm full or gone: the frames still work
                logger.warning("KV transfer: shared memory unavailable (%s); sending over TCP", exc)
            else:
                self.segments.add(segment)
                return [msgspec.msgpack.encode(FetchReply(None, hashes, sizes, segment))]
        return [msgspec.msgpack.encode(FetchReply(None, hashes)), *payloads]

    def _stage_for_nixl(
        self, ask: FetchRequest, hashes: list[str], payloads: list[bytes], sizes: list[int]
    ) -> FetchReply:
        if not nixl_available():
            return FetchReply("this prefill instance has no NIXL (pip install nixl-cu12 beside kvflow)", [])
        if self.nixl is None:
            self.nixl = NixlExports(self.segment_keep_s)
        metadata, descriptors = self.nixl.stage(ask.transfer_id, payloads)
        return FetchReply(None, hashes, sizes, nixl_metadata=metadata, nixl_descriptors=descriptors)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000)
        self._ctx.destroy(linger=0)
        self.segments.close()
        if self.nixl is not None:
            self.nixl.close()

"""Decode side: fetching a prompt's KV blocks from its prefill instance, off the engine step.

A fetch runs on a small thread pool and returns a Future[TierRead] (the KV offload tier's read type:
the scheduler restores either the same way). It fails with KVTransferError on a timeout, a prefill
that answers with an error, or blocks that are not the ones asked for; the engine then fails the
request with that message (kvflow/engine/engine.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import zmq

from kvflow.config import KVTransferBackend
from kvflow.errors import KVFlowError
from kvflow.kv_offload.disk_tier import TierRead
from kvflow.kv_transfer.nixl_transport import NixlReader, require_nixl
from kvflow.kv_transfer.params import RemotePrefill
from kvflow.kv_transfer.server import FetchReply, FetchRequest
from kvflow.kv_transfer.shared_memory import host_identity, read_segment

# Concurrent fetches (each a socket and a thread waiting on the network, not on the CPU).
MAX_FETCHES = 4


class KVTransferError(KVFlowError):
    """The prompt's KV did not arrive from the prefill instance."""


class KVTransferClient:
    def __init__(self, timeout_s: float, backend: KVTransferBackend = "auto") -> None:
        self.timeout_s = timeout_s
        self.backend = backend
        # auto: asks a prefill server on this machine for a shared-memory segment (shared_memory.py).
        self.host_id = host_identity() if backend == "auto" else ""
        self.nixl: NixlReader | None = None
        if backend == "nixl":
            require_nixl()
            self.nixl = NixlReader()
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(MAX_FETCHES, thread_name_prefix="kv-transfer-fetch")

    def fetch_async(self, remote: RemotePrefill, first_block: int, num_blocks: int) -> Future[TierRead]:
        return self._pool.submit(self._fetch, remote, first_block, num_blocks)

    def _fetch(self, remote: RemotePrefill, first_block: int, num_blocks: int) -> TierRead:
        start = time.monotonic()
        return TierRead(self._ask(remote, first_block, num_blocks), time.monotonic() - start)

    def _ask(self, remote: RemotePrefill, first_block: int, num_blocks: int) -> Sequence[bytes | memoryview]:
        where = f"{remote.host}:{remote.port}"
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{where}")
            ask = FetchRequest(
                remote.transfer_id, remote.fingerprint, first_block, num_blocks, self.host_id, self.backend
            )
            socket.send_multipart([b"", msgspec.msgpack.encode(ask)])
            if not socket.poll(int(self.timeout_s * 1000)):
                raise KVTransferError(
                    f"the prefill instance at {where} sent no KV for transfer {remote.transfer_id} within "
                    f"{self.timeout_s:g} s (it died, or is unreachable)"
                )
            _, header, *frames = socket.recv_multipart()
        finally:
            socket.close()
        reply = msgspec.msgpack.decode(header, type=FetchReply)
        if reply.error is not None:
            raise KVTransferError(f"the prefill instance at {where}: {reply.error}")
        payloads: Sequence[bytes | memoryview] = frames
        if reply.nixl_descriptors and self.nixl is not None:
            try:
                payloads = self.nixl.read(
                    remote.transfer_id,
                    reply.nixl_metadata,
                    reply.nixl_descriptors,
                    reply.sizes,
                    self.timeout_s,
                )
            except (TimeoutError, RuntimeError) as exc:
                raise KVTransferError(f"the prefill instance at {where}: {exc}") from None
        elif reply.segment is not None:
            try:
                payloads = read_segment(reply.segment, reply.sizes)
            except (OSError, ValueError) as exc:  # gone (read past its deadline) or not the one named
                raise KVTransferError(
                    f"the prefill instance at {where} put the KV in shared memory {reply.segment}, which "
                    f"cannot be read here: {exc}"
                ) from None
        wanted = [h.hex() for h in remote.block_hashes[first_block : first_block + num_blocks]]
        if reply.block_hashes != wanted or len(payloads) != len(wanted):
            raise KVTransferError(f"the prefill instance at {where} sent other blocks than those asked for")
        return payloads

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ctx.destroy(linger=0)

"""Decode side, the scheduler's view: requests whose prompt KV is in flight from a prefill instance.

Like a tier restore (kvflow/kv_offload/restores.py): a waiting request with a remote prefill is not
admitted until its blocks have arrived; the scheduler steps over it meanwhile. Blocks its own pool
already holds (a shared system prompt) are not fetched: the fetch starts past the pool's hit. Only
blocks whose hash equals the request's own are fetched (same tokens, same position); the tokens past
them (the partial last block, and the last prompt token always) are computed here. A failed fetch is
reported once (`take_failures`) for the engine to fail the request with its message.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from kvflow.kv_offload.disk_tier import TierRead
from kvflow.kv_transfer.params import RemotePrefill

NOTHING = TierRead([], 0.0)
Fetch = Callable[[RemotePrefill, int, int], "Future[TierRead]"]


@dataclass
class KVImports:
    fetch: Fetch
    _pending: dict[str, tuple[int, Future[TierRead]]] = field(default_factory=dict)
    _failures: list[tuple[str, str]] = field(default_factory=list)

    def plan(
        self,
        request_id: str,
        remote: RemotePrefill,
        block_hashes: list[bytes],
        first_block: int,
        max_blocks: int,
    ) -> TierRead | None:
        """The remote blocks past the pool's hit of `first_block` blocks: None while in flight (or
        failed: see take_failures), else the blocks (none: nothing to fetch)."""
        pending = self._pending.get(request_id)
        if pending is None:
            n = 0
            limit = min(max_blocks, len(remote.block_hashes), len(block_hashes))
            while (
                first_block + n < limit
                and remote.block_hashes[first_block + n] == block_hashes[first_block + n]
            ):
                n += 1
            if n == 0:
                return NOTHING
            pending = (first_block, self.fetch(remote, first_block, n))
            self._pending[request_id] = pending
        fetched_from, future = pending
        if not future.done():
            return None
        try:
            read = future.result()
        except Exception as exc:
            self._pending.pop(request_id, None)
            self._failures.append((request_id, str(exc)))
            return None
        if fetched_from != first_block:  # the pool's hit moved meanwhile: the blocks no longer continue it
            self._pending.pop(request_id, None)
            return NOTHING
        return read

    def take_failures(self) -> list[tuple[str, str]]:
        failures, self._failures = self._failures, []
        return failures

    def commit(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        in_flight = [f for _, f in self._pending.values() if not f.done()]
        if in_flight:
            wait(in_flight, timeout=timeout, return_when=FIRST_COMPLETED)

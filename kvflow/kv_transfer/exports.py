"""Prefill side: the block bytes of finished prompts, held until a decode instance fetches them.

The engine copies a prompt's full blocks out of its pool when the prompt's request finishes (on the
engine thread, before the next step could evict them), so the transfer server reads immutable bytes
from another thread without touching the pool. An export is fetched once (then dropped, as vLLM's
prefill frees its blocks once the decode's read is done) or expires after `ttl_s` (the decode never
came: its router failed, or it died); the oldest go first beyond `capacity_bytes`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Export:
    block_hashes: list[bytes]
    payloads: list[bytes]
    expires_at: float

    @property
    def num_bytes(self) -> int:
        return sum(len(p) for p in self.payloads)


@dataclass
class ExportStats:
    exported: int = 0
    fetched: int = 0
    expired: int = 0  # never fetched within the TTL, or pushed out by newer exports
    bytes_sent: int = 0


class KVExports:
    def __init__(self, ttl_s: float, capacity_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.capacity_bytes = capacity_bytes
        self.stats = ExportStats()
        self._lock = threading.Lock()
        self._exports: OrderedDict[str, Export] = OrderedDict()  # oldest first
        self._bytes = 0

    def put(self, transfer_id: str, block_hashes: list[bytes], payloads: list[bytes]) -> None:
        export = Export(block_hashes, payloads, time.monotonic() + self.ttl_s)
        with self._lock:
            self._expire(time.monotonic())
            self._exports[transfer_id] = export
            self._bytes += export.num_bytes
            while self._bytes > self.capacity_bytes and len(self._exports) > 1:
                self._drop(next(iter(self._exports)))
            self.stats.exported += 1

    def take(self, transfer_id: str) -> Export | None:
        """The export, removed (one fetch each); None if unknown or expired."""
        with self._lock:
            self._expire(time.monotonic())
            export = self._exports.pop(transfer_id, None)
            if export is not None:
                self._bytes -= export.num_bytes
                self.stats.fetched += 1
                self.stats.bytes_sent += export.num_bytes
            return export

    def _expire(self, now: float) -> None:
        while self._exports:
            oldest = next(iter(self._exports))
            if self._exports[oldest].expires_at > now:
                return
            self._drop(oldest)

    def _drop(self, transfer_id: str) -> None:
        export = self._exports.pop(transfer_id)
        self._bytes -= export.num_bytes
        self.stats.expired += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._exports)

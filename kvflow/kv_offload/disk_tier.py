"""A KV offload tier on disk: full prefix-cache blocks evicted from the pool, kept as files and read
back on a later prefix miss (vLLM's OffloadingConnector, SGLang's HiCache, llama.cpp's slot save).
Pure Python, no torch: a block's KV arrives as bytes (kvflow/kv_offload/block_bytes.py makes them).

Keys. A block is named by its prefix-cache hash (kvflow/kv_cache/manager.py: the chained hash of
every token up to the block's end) together with a `fingerprint` of everything else that decides
its bytes: the model's files, dtype, KV dtype, quantization, block size, the per-block layout. The
file name is sha256(fingerprint || block hash), so two models never share a name, and the header
repeats the fingerprint, so a file copied in from another model is recognised and skipped.

One file per block, `<name>.kvblock`:
    header  magic b"KVFLOWKV", format version u16, fingerprint [32 B], payload bytes u64, crc32 u32
    payload the block's KV bytes
written to a temporary name and renamed (POSIX rename is atomic): a crash leaves a stray temporary
or nothing, never a half-written block under a real name. A restart rebuilds the index by reading
every header (LRU order from the files' modification times); a torn file (length not the
header's), a foreign one (another fingerprint) or a damaged one (crc) is skipped and logged, never
loaded.

Threads. Writes are queued to one writer thread (a store never waits for the disk); reads run on
one reader thread and return futures (kvflow/engine/scheduler.py lets a request whose blocks are
being read wait without stalling the others). The index is shared under a lock. A full disk, a
directory that vanishes, any OSError: counted in `stats`, logged once per kind, and the block is
simply not in the tier (the request recomputes it) - the engine never sees the error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from kvflow.config import ConfigError

logger = logging.getLogger(__name__)

MAGIC = b"KVFLOWKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sH32sQI")  # magic, version, fingerprint, payload bytes, crc32
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvblock"
_TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class TierRead:
    """Blocks read back in order (a prefix of those asked for: the read stops at the first block
    missing or damaged) and the seconds the read took."""

    payloads: Sequence[bytes | memoryview]  # memoryview: a KV transfer's shared-memory mapping
    seconds: float


@dataclass
class TierStats:
    """Cumulative counters (the server's metrics read them; blocks, bytes, seconds)."""

    blocks_stored: int = 0
    bytes_written: int = 0
    blocks_evicted: int = 0  # LRU deletions to stay within the size
    blocks_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    write_errors: int = 0
    read_errors: int = 0  # damaged or vanished files met on a read (the block recomputed instead)
    files_skipped: int = 0  # torn or foreign files found by the index rebuild


class DiskKVTier:
    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: bytes) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"kv_offload_size must be > 0, got {capacity_bytes} bytes")
        if len(fingerprint) != 32:
            raise ValueError("the tier's fingerprint is a sha256 digest (32 bytes)")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> file bytes, LRU first
        self._bytes = 0
        self._logged: set[tuple[str, str]] = set()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"kv_offload_path {str(self.path)!r}: cannot create it ({exc})") from exc
        self._rebuild_index()
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvflow-kv-offload-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-kv-offload-reader")

    # ---------------------------------------------------------------------------------- lookups

    def name(self, block_hash: bytes) -> str:
        return sha256(self.fingerprint + block_hash).hexdigest() + SUFFIX

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return self.name(block_hash) in self._index

    def num_consecutive(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, the tier holds without a gap."""
        with self._lock:
            n = 0
            for block_hash in block_hashes:
                if self.name(block_hash) not in self._index:
                    break
                n += 1
            return n

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._bytes

    # ----------------------------------------------------------------------------------- writes

    def refresh(self, block_hash: bytes) -> bool:
        """Mark a block the tier holds as recently used; False when it does not hold it."""
        name = self.name(block_hash)
        with self._lock:
            if name not in self._index:
                return False
            self._index.move_to_end(name)
            return True

    def store(self, block_hash: bytes, payload: bytes) -> None:
        """Queue a block for writing (returns at once); a block the tier holds is only refreshed."""
        if not self.refresh(block_hash):
            self._writes.put((self.name(block_hash), payload))

    def flush(self) -> None:
        """Wait until every queued write is on disk (or failed)."""
        self._writes.join()

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._writes.task_done()

    def _write(self, name: str, payload: bytes) -> None:
        size = _HEADER.size + len(payload)
        if size > self.capacity_bytes:
            self._fail("write", "too large", f"a {size}-byte block exceeds the tier's {self.capacity_bytes}")
            return
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, self.fingerprint, len(payload), zlib.crc32(payload))
        target = self.path / name
        tmp = target.with_suffix(_TMP_SUFFIX)
        try:
            self._make_room(size)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, target)
        except OSError as exc:  # full disk, vanished directory, permissions
            self._fail("write", type(exc).__name__, f"cannot write {target} ({exc})")
            with contextlib.suppress(OSError):  # the directory itself may be gone
                tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._index[name] = size
            self._bytes += size
            self.stats.blocks_stored += 1
            self.stats.bytes_written += size

    def _make_room(self, size: int) -> None:
        """Delete least recently used blocks until `size` more bytes fit."""
        while True:
            with self._lock:
                if self._bytes + size <= self.capacity_bytes or not self._index:
                    return
                name, old = self._index.popitem(last=False)
                self._bytes -= old
                self.stats.blocks_evicted += 1
            (self.path / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------ reads

    def load_async(self, block_hashes: Sequence[bytes]) -> Future[TierRead]:
        """Read blocks in order on the reader thread (TierRead: up to the first missing or damaged
        block; the rest is recomputed)."""
        return self._reader.submit(self._load_all, list(block_hashes))

    def _load_all(self, block_hashes: list[bytes]) -> TierRead:
        start = time.perf_counter()
        payloads = []
        for block_hash in block_hashes:
            payload = self.load(block_hash)
            if payload is None:
                break
            payloads.append(payload)
        return TierRead(payloads, time.perf_counter() - start)

    def load(self, block_hash: bytes) -> bytes | None:
        name = self.name(block_hash)
        start = time.perf_counter()
        try:
            data = (self.path / name).read_bytes()
        except OSError as exc:
            self._drop(name)
            self._fail("read", type(exc).__name__, f"cannot read {self.path / name} ({exc})")
            return None
        payload = self._payload(data)
        if payload is None:
            self._drop(name)
            (self.path / name).unlink(missing_ok=True)
            self._fail("read", "damaged", f"{self.path / name} is damaged (header or checksum): recomputed")
            return None
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            self.stats.blocks_read += 1
            self.stats.bytes_read += len(data)
            self.stats.read_seconds += time.perf_counter() - start
        return payload

    def _payload(self, data: bytes) -> bytes | None:
        """The payload of a whole, undamaged block file of this fingerprint, else None."""
        if len(data) < _HEADER.size:
            return None
        magic, version, fingerprint, length, crc = _HEADER.unpack_from(data)
        if magic != MAGIC or version != FORMAT_VERSION or fingerprint != self.fingerprint:
            return None
        payload = data[_HEADER.size :]
        if len(payload) != length or zlib.crc32(payload) != crc:
            return None
        return payload

    def _drop(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size

    # ---------------------------------------------------------------------------------- restart

    def _rebuild_index(self) -> None:
        """Index this fingerprint's whole block files, oldest first (headers only: the checksum is
        checked when a block is read)."""
        found: list[tuple[float, str, int]] = []
        torn = foreign = 0
        for entry in os.scandir(self.path):
            if entry.name.endswith(_TMP_SUFFIX):  # a write interrupted by a crash
                Path(entry.path).unlink(missing_ok=True)
                continue
            if not entry.name.endswith(SUFFIX) or not entry.is_file():
                continue
            st = entry.stat()
            try:
                with open(entry.path, "rb") as f:
                    head = f.read(_HEADER.size)
            except OSError:
                torn += 1
                continue
            if len(head) < _HEADER.size:
                torn += 1
                continue
            magic, version, fingerprint, length, _ = _HEADER.unpack(head)
            if magic != MAGIC or version != FORMAT_VERSION or fingerprint != self.fingerprint:
                foreign += 1
            elif st.st_size != _HEADER.size + length:
                torn += 1
            else:
                found.append((st.st_mtime, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._bytes += size
        self.stats.files_skipped = torn + foreign
        if torn or foreign:
            logger.warning(
                "KV offload tier %s: skipped %d torn and %d foreign block files (another model or setting)",
                self.path,
                torn,
                foreign,
            )
        logger.info(
            "KV offload tier %s: %d blocks, %.1f of %.1f MiB",
            self.path,
            len(self._index),
            self._bytes / 2**20,
            self.capacity_bytes / 2**20,
        )
        while self._bytes > self.capacity_bytes and self._index:  # restarted with a smaller size
            name, size = self._index.popitem(last=False)
            self._bytes -= size
            (self.path / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------- misc

    def _fail(self, kind: str, reason: str, message: str) -> None:
        """Count a failed write or read; log the first of each kind and reason (a full disk would
        otherwise log every block)."""
        with self._lock:
            if kind == "write":
                self.stats.write_errors += 1
            else:
                self.stats.read_errors += 1
            first = (kind, reason) not in self._logged
            self._logged.add((kind, reason))
        if first:
            logger.warning("KV offload tier: %s", message)

    def close(self) -> None:
        """Finish the queued writes and stop the threads."""
        self._writes.put(None)
        self._writer.join()
        self._reader.shutdown(wait=True)

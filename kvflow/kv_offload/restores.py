"""The scheduler's side of the KV offload tier (pure Python, no torch): which waiting requests have
blocks being read back, and what each step hands the model runner to save and restore.

A waiting request whose prefix runs past the pool's hit into blocks the tier holds is not admitted
at once: its blocks are read on the tier's reader thread, and until they are in memory the scheduler
steps over it (it keeps its place in the queue; the requests behind it are admitted as usual). Once
read, it is admitted with those blocks counted as computed; the step's `kv_restores` carries their
bytes, which the runner copies into the newly allocated blocks before the forward pass. A restore
is work with a cost (the read), not a free hit: its time is the request's `kv_restore_ms`.

Saves run the other way: blocks the pool evicts to make room (BlockPool.evicted) are listed in the
step's `kv_saves`; the runner copies their bytes out before the forward pass overwrites them and
queues them to the tier's writer thread.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from kvflow.kv_offload.disk_tier import DiskKVTier, TierRead

NOTHING = TierRead([], 0.0)


@dataclass(frozen=True)
class PendingRestore:
    first_block: int  # the request's block index of the first block read (the pool's hit ends there)
    future: Future[TierRead]


@dataclass
class RestoreTracker:
    tier: DiskKVTier
    _pending: dict[str, PendingRestore] = field(default_factory=dict)

    def plan(
        self, request_id: str, block_hashes: list[bytes], first_block: int, max_blocks: int
    ) -> TierRead | None:
        """What the tier adds past the pool's hit of `first_block` blocks (at most `max_blocks` in
        all): None while blocks are being read (step over the request), else the blocks read (none:
        nothing to restore)."""
        pending = self._pending.get(request_id)
        if pending is not None and pending.first_block != first_block:
            # The pool's hit moved while the blocks were read (evicted, or computed by another
            # request): the payloads no longer continue it. Drop them; the prefix is recomputed.
            self.discard(request_id)
            return NOTHING
        if pending is None:
            wanted = block_hashes[first_block:max_blocks]
            n = self.tier.num_consecutive(wanted)
            if n == 0:
                return NOTHING
            pending = PendingRestore(first_block, self.tier.load_async(wanted[:n]))
            self._pending[request_id] = pending
        if not pending.future.done():
            return None
        try:
            read = pending.future.result()
        except Exception:  # the reader failed as a whole: recompute (the tier logged and counted it)
            read = NOTHING
        if not read.payloads:  # every block missing or damaged: nothing to commit
            self.discard(request_id)
        return read

    def commit(self, request_id: str) -> None:
        """The request was admitted with its restored blocks."""
        self._pending.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        """A request finished or aborted while (or after) its blocks were read."""
        self._pending.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        """Block until a read finishes or `timeout` passes (an engine with nothing else to run)."""
        reading = [p.future for p in self._pending.values() if not p.future.done()]
        if reading:
            wait(reading, timeout=timeout, return_when=FIRST_COMPLETED)

"""The one failure tensor parallelism adds: a rank that is gone takes the engine down."""

from __future__ import annotations

from kvflow.errors import KVFlowError


class WorkerDiedError(KVFlowError):
    """A tensor-parallel rank stopped (crashed, killed, its machine lost): no step can run without
    its shard, so the engine stops and every request in flight fails with this message."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} died: {reason}")
        self.rank = rank
        self.reason = reason

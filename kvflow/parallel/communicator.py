"""The collectives tensor parallelism needs, behind one interface with two implementations:

    all_reduce(t)  every rank's t summed (or maxed), the same bytes on every rank  [row-parallel]
    gather(t)      rank 0 gets every rank's t concatenated on the last dim, in rank order
                   (the vocabulary parts of the logits); other ranks get None
- GlooCommunicator: torch.distributed's gloo process group; works across machines (torchrun).
- ShmCommunicator (shm_communicator.py): ranks on one machine through shared memory; gloo's TCP
  round trips cost about a millisecond per all-reduce on a loaded 2-core machine (measured in
  benchmarks/tensor_parallel.py), which for 2 x 24 layers would cost more than the decode step.
Both keep `CommStats` (calls, seconds, bytes), which the benchmark prints per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

ReduceOp = Literal["sum", "max"]


@dataclass
class CommStats:
    """Cumulative since the communicator was made (reset by the benchmark between phases)."""

    all_reduce_calls: int = 0
    all_reduce_seconds: float = 0.0
    all_reduce_bytes: int = 0  # each rank's input bytes, summed over calls
    gather_calls: int = 0
    gather_seconds: float = 0.0
    gather_bytes: int = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class Communicator(Protocol):
    rank: int
    world_size: int
    stats: CommStats
    name: str

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """The reduction of `tensor` over ranks (written into `tensor`, which is returned)."""
        ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """[R, C] on every rank -> [R, N x C] on rank 0 (rank order), None on the others."""
        ...

    def close(self) -> None: ...


_GLOO_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class GlooCommunicator:
    name = "gloo"

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group  # a torch.distributed.ProcessGroupGloo (its stubs lack the collectives)
        self.rank = rank
        self.world_size = world_size
        self.stats = CommStats()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        started = time.perf_counter()
        t = tensor.contiguous()
        opts = dist.AllreduceOptions()
        opts.reduceOp = _GLOO_OPS[op]
        self.group.allreduce([t], opts).wait()
        if t is not tensor:
            tensor.copy_(t)
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += t.numel() * t.element_size()
        self.stats.all_reduce_seconds += time.perf_counter() - started
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor | None:
        started = time.perf_counter()
        t = tensor.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else []
        self.group.gather([parts] if self.rank == 0 else [], [t], opts).wait()
        self.stats.gather_calls += 1
        self.stats.gather_bytes += t.numel() * t.element_size()
        self.stats.gather_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def close(self) -> None:
        return None

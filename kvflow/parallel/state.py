"""ParallelContext: who this rank is and how it talks to the others, passed to what needs it (no
module-level state: several engines, each with its own group, can live in one process).

Rendezvous (torch.distributed's, no protocol of our own): a TCPStore at the master address and a
gloo process group made from it directly (not `init_process_group`, whose default group is a
process-wide global). Ranks that find themselves on one machine (same host name and boot id,
exchanged through the store) all-reduce through shared memory; otherwise through gloo.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvflow.config import AllReduceBackend, ConfigError
from kvflow.parallel.communicator import Communicator, GlooCommunicator
from kvflow.parallel.shm_communicator import ShmCommunicator, shm_file_size

logger = logging.getLogger("kvflow")

# A collective waits this long for a peer that is alive but silent (a crashed peer fails it at once:
# its sockets close). Covers the slowest step we expect (a long prefill chunk on a big model).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long ranks wait for each other to join (workers import torch and read their shards first).
JOIN_TIMEOUT = timedelta(minutes=5)
# Shared-memory slot per rank: one decode step's hidden state is a few KB, a 512-token prefill chunk
# of a 4096-wide model 4 MiB; larger tensors go in several rounds. Grown to a logits row if needed.
SHM_SLOT_BYTES = 4 * 2**20


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    comm: Communicator
    group: Any  # torch.distributed.ProcessGroupGloo (its stubs lack the collectives)
    store: dist.Store
    local_rank: int = 0
    local_world_size: int = 1
    pinned_cpus: list[int] = field(default_factory=list)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        self.comm.close()


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def connect(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: AllReduceBackend = "auto",
    slot_bytes: int = SHM_SLOT_BYTES,
    prefix: str = "kvflow-tp",
) -> tuple[Any, Communicator]:
    """Join the gloo group over `store`, then choose the communicator (module docstring)."""
    store = dist.PrefixStore(prefix, store)
    group: Any = dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)
    store.set(f"host/{rank}", _host_id())
    hosts = {store.get(f"host/{r}").decode() for r in range(world_size)}
    # x86 only: the shared-memory protocol relies on its store ordering (shm_communicator.py).
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    shm_possible = len(hosts) == 1 and x86 and hasattr(os, "sched_yield") and Path("/proc/self/stat").exists()
    if backend == "shm" and not shm_possible:
        raise ConfigError("all_reduce_backend shm needs every rank on this machine (Linux, x86-64)")
    if backend == "gloo" or not shm_possible:
        return group, GlooCommunicator(group, rank, world_size)
    if rank == 0:
        path = _shm_dir() / f"kvflow-tp-{uuid.uuid4().hex}"
        with open(path, "wb") as f:
            f.truncate(shm_file_size(world_size, slot_bytes))
        store.set("shm_path", str(path))
    path = Path(store.get("shm_path").decode())
    comm = ShmCommunicator(path, rank, world_size, slot_bytes)
    group.allreduce(
        [torch.zeros(1)]
    ).wait()  # a barrier: every rank has mapped the file: it can go from the file system
    if rank == 0:
        path.unlink(missing_ok=True)
    return group, comm


def pin_threads(local_rank: int, local_world_size: int, threads_per_rank: int | None) -> list[int]:
    """Pin this process to its share of the machine's CPUs and run torch on that many threads.

    Default: the CPUs this process may use, split evenly between the ranks of this machine (rank r
    takes the r-th run). On a multi-socket machine give each rank one socket (README: NUMA)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = threads_per_rank or max(1, len(cpus) // local_world_size)
    start = local_rank * per_rank
    mine = cpus[start : start + per_rank]
    if len(mine) < per_rank:  # more ranks x threads than CPUs: share, and say so
        mine = [cpus[(start + i) % len(cpus)] for i in range(per_rank)]
        logger.warning(
            "tensor parallel: %d ranks x %d threads exceed the %d CPUs", local_world_size, per_rank, len(cpus)
        )
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine

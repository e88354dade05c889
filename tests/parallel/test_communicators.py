"""The two communicators between two real processes: sums, maxima and gathers equal to the
single-process result, for tensors larger than a shared-memory slot (several rounds) and
non-contiguous inputs, and the same bytes on every rank."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvflow.parallel.state import connect

# 1 KiB slots: a 3,000-element float32 tensor takes 12 rounds, a gather of 40 rows of 100 floats 17.
SLOT_BYTES = 1024
ROWS, COLS = 40, 100


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {
        "sum": torch.randn(3000, generator=g),
        "bf16": torch.randn(7, 896, generator=g).bfloat16(),
        "max": torch.randn(50, 60, generator=g).t(),  # non-contiguous
        "gather": torch.randn(ROWS, COLS, generator=g),
    }


def _collectives(rank: int, store: dist.Store, backend: str) -> dict[str, Any]:
    _, comm = connect(store, rank, 2, backend, slot_bytes=SLOT_BYTES)  # type: ignore[arg-type]
    x = _inputs(rank)
    out = {
        "name": comm.name,
        "sum": comm.all_reduce(x["sum"].clone()),
        "bf16": comm.all_reduce(x["bf16"].clone()),
        "max": comm.all_reduce(x["max"].clone(), op="max"),
        "gather": comm.gather(x["gather"]),
    }
    comm.close()
    return out


def _worker(port: int, backend: str, queue: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    # Plain pickle: torch's queue reducer would share the tensors by file descriptor, gone when this exits.
    queue.put(pickle.dumps(_collectives(1, store, backend)))


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_collectives_match_one_process(backend: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=_worker, args=(store.port, backend, queue))
    worker.start()
    try:
        mine = _collectives(0, store, backend)
        theirs = pickle.loads(queue.get(timeout=60))
    finally:
        worker.join(timeout=60)
    a, b = _inputs(0), _inputs(1)
    assert mine["name"] == backend
    torch.testing.assert_close(mine["sum"], a["sum"] + b["sum"], rtol=0, atol=0)
    torch.testing.assert_close(mine["bf16"], a["bf16"] + b["bf16"], rtol=0, atol=0)
    torch.testing.assert_close(mine["max"], torch.maximum(a["max"], b["max"]), rtol=0, atol=0)
    torch.testing.assert_close(mine["gather"], torch.cat([a["gather"], b["gather"]], dim=-1), rtol=0, atol=0)
    assert theirs["gather"] is None  # only rank 0 receives the parts
    for key in ("sum", "bf16", "max"):  # a replicated state must not drift between ranks
        assert torch.equal(mine[key], theirs[key])

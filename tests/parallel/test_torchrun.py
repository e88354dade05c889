"""The multi-machine join, on one machine: torchrun starts both ranks of `kvflow generate` (README,
"Tensor parallel"); rank 0 prints what one process prints, rank 1 serves as a worker and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvflow.server.spawn import free_port

# Both runs import torch and load a tiny model; this only keeps a regression from hanging the suite.
RUN_TIMEOUT_S = 180
GENERATE = ["-m", "kvflow.cli", "generate", "--prompt", "Hello world", "--max-tokens", "8", "--ignore-eos"]


def test_torchrun_ranks_join_and_match_one_process(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    model = str(tiny_checkpoint_factory("qwen2"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run(
        [sys.executable, *GENERATE, model], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
    )
    assert single.returncode == 0, single.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    tp = subprocess.run(
        [*torchrun, *GENERATE, model, "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
    )
    assert tp.returncode == 0, tp.stderr[-2000:]
    assert tp.stdout == single.stdout  # rank 0's completion; the worker prints nothing
    assert "tensor parallel: 2 ranks joined" in tp.stderr

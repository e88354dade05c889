"""Rank 0's side: start or join the other ranks, drive them every step, notice when one is gone.

Two ways to get N ranks (vLLM's, on torch.distributed):
- one machine: rank 0 is the engine process; it starts ranks 1..N-1 with torch.multiprocessing
  (spawn) and a TCPStore on 127.0.0.1 (port chosen by the OS);
- several machines: every process is started by torchrun (WORLD_SIZE, RANK, MASTER_ADDR,
  MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE), `kvflow serve` / `kvflow generate` with the same
  flags everywhere; rank 0 serves, the others run worker.py (README, "Tensor parallel").
Each step rank 0 sends the SchedulerOutput in one message (step_channel.py), then runs its own
shard through the ordinary ModelRunner: the collectives keep the ranks in step, the LM head's
gather brings the sampled rows' logits to rank 0, and rank 0 samples.

A rank that dies takes the engine down, never into a hang: a monitor thread waits on every worker's
connection (and, on one machine, its process); a collective with a dead peer fails (gloo: closed
socket; shared memory: the peer's pid is gone), and the step raises WorkerDiedError naming the
rank and its exit status or error. The ranks cannot be trusted to be in step after any failed
forward, so every exception out of a step is fatal in tensor-parallel mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvflow.arch_config import ArchConfig, load_hf_config
from kvflow.attention.kv_store import KVStore
from kvflow.config import ConfigError, EngineConfig
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.parallel.errors import WorkerDiedError
from kvflow.parallel.model_loader import check_supported, load_shard
from kvflow.parallel.sharding import ShardLayout
from kvflow.parallel.state import JOIN_TIMEOUT, ParallelContext, connect, pin_threads
from kvflow.parallel.step_channel import SHUTDOWN, KVSpec, LoadSpec, encode_step
from kvflow.parallel.worker import (
    ALIVE_KEY,
    ERROR_KEY,
    STORE_PREFIX,
    control_store,
    run_worker,
    spawned_worker_main,
)
from kvflow.quant.checkpoint_formats import parse_quantization_config
from kvflow.scheduler_output import SchedulerOutput
from kvflow.worker.model_runner import ModelRunner

logger = logging.getLogger("kvflow")

# How long a failed step waits for the monitor to name the rank that died (its exit is seen at once;
# this covers the process still exiting when its socket already closed).
DIAGNOSE_WAIT_S = 3.0
# How long shutdown waits for a worker to leave before it is terminated.
WORKER_EXIT_WAIT_S = 5.0
# How often rank 0 checks that spawned workers are still starting while it waits for them.
STARTUP_POLL_S = 0.1


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int
    local_world_size: int
    agent_store: bool  # torchrun's agent hosts the store at MASTER_PORT (rank 0 then joins it)


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun environment of this process, or None when it was not started by torchrun."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env or "MASTER_ADDR" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return TorchrunEnv(
        int(env["RANK"]),
        world,
        env["MASTER_ADDR"],
        int(env.get("MASTER_PORT", "29500")),
        int(env.get("LOCAL_RANK", env["RANK"])),
        int(env.get("LOCAL_WORLD_SIZE", str(world))),
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def run_torchrun_worker(config: EngineConfig) -> int | None:
    """In a torchrun rank other than 0: run as a worker and return its exit status; else None."""
    env = torchrun_env()
    if env is None or env.rank == 0 or config.parallel_config.tensor_parallel_size == 1:
        return None
    _check_world(env, config)
    level = logging.getLogger().getEffectiveLevel()
    return run_worker(
        config,
        env.rank,
        env.world_size,
        env.master_addr,
        env.master_port,
        env.local_rank,
        env.local_world_size,
        level,
    )


def _check_world(env: TorchrunEnv, config: EngineConfig) -> None:
    tp = config.parallel_config.tensor_parallel_size
    if env.world_size != tp:
        raise ConfigError(
            f"torchrun started {env.world_size} processes (WORLD_SIZE) for tensor_parallel_size {tp}"
        )


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "its connection closed (process or machine gone)"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class TensorParallelDriver:
    """Rank 0: the ranks, the step channel, the monitor. `shutdown()` ends the workers (also run
    when the driver is garbage-collected, and by the workers themselves when rank 0 exits)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tp = config.parallel_config.tensor_parallel_size
        self.world_size = tp
        env = torchrun_env()
        self._procs: dict[int, Any] = {}
        self._saved_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._saved_threads = torch.get_num_threads()
        if env is not None:
            _check_world(env, config)
            store = dist.TCPStore(
                env.master_addr, env.master_port, tp, not env.agent_store, timeout=JOIN_TIMEOUT
            )
            listen, advertise = "0.0.0.0", env.master_addr
            local_rank, local_world = env.local_rank, env.local_world_size
        else:
            store = dist.TCPStore("127.0.0.1", 0, tp, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
            listen = advertise = "127.0.0.1"
            local_rank, local_world = 0, tp
        self.store = store
        ctl = control_store(store)
        authkey = secrets.token_bytes(32)
        listener = Listener((listen, 0), authkey=authkey)
        ctl.set("step_addr", f"{advertise}:{listener.address[1]}")
        ctl.set("authkey", authkey.hex())
        if env is None:
            self._spawn_workers(config, store.port)
        cpus = pin_threads(local_rank, local_world, config.parallel_config.cpu_threads_per_rank)
        logger.info(
            "tensor parallel rank 0/%d: pinned to CPUs %s, %d torch threads",
            tp,
            cpus,
            torch.get_num_threads(),
        )
        group, comm = connect(store, 0, tp, config.parallel_config.all_reduce_backend, prefix=STORE_PREFIX)
        self.ctx = ParallelContext(0, tp, comm, group, store, local_rank, local_world, cpus)
        logger.info("tensor parallel: %d ranks joined; all-reduce over %s", tp, comm.name)
        self.conns: dict[int, Connection] = {}
        for _ in range(tp - 1):
            conn = listener.accept()
            self.conns[int(conn.recv())] = conn
        listener.close()
        self.broadcast_seconds = 0.0
        self.broadcast_bytes = 0
        self.broadcast_calls = 0
        self._death: WorkerDiedError | None = None
        self._died = threading.Event()
        self._wake_r, self._wake_w = connection.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="kvflow-tp-monitor", daemon=True)
        self._monitor.start()
        self._finalizer = weakref.finalize(
            self,
            _shutdown,
            dict(self.conns),
            dict(self._procs),
            self._wake_w,
            self.ctx,
            self._saved_cpus,
            self._saved_threads,
        )

    # ------------------------------------------------------------------ start

    def _spawn_workers(self, config: EngineConfig, port: int) -> None:
        spawn = mp.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, self.world_size):
            proc = spawn.Process(
                target=spawned_worker_main,
                args=(config, rank, self.world_size, port, level),
                name=f"kvflow-tp-rank{rank}",
                daemon=True,
            )
            with _main_script_hidden():
                proc.start()
            self._procs[rank] = proc
        ctl = control_store(self.store)
        keys = [ALIVE_KEY.format(rank=r) for r in self._procs]
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while not ctl.check(keys):  # a worker that fails to start must not leave rank 0 waiting
            for rank, proc in self._procs.items():
                if not proc.is_alive():
                    raise WorkerDiedError(rank, f"while starting: {_exit_reason(proc.exitcode)}")
            if time.monotonic() > deadline:
                raise WorkerDiedError(min(self._procs), "did not start within the join timeout")
            time.sleep(STARTUP_POLL_S)

    def load_model(
        self, model_dir: Path, arch: ArchConfig, dtype: torch.dtype, max_model_len: int
    ) -> LlamaFamilyForCausalLM:
        """Rank 0's shard; every worker loads its own at the same time."""
        # Refuse a size that cannot split before the workers load anything.
        check_supported(arch)
        checkpoint_quant = parse_quantization_config(load_hf_config(model_dir))
        ShardLayout.plan(arch, 0, self.world_size, self.config.quant_config, checkpoint_quant)
        self._send_all(LoadSpec(str(dtype).removeprefix("torch."), max_model_len))
        return load_shard(model_dir, arch, dtype, max_model_len, self.config.quant_config, self.ctx)

    def model_runner(
        self,
        model: LlamaFamilyForCausalLM,
        kv_store: KVStore,
        eos_token_ids: frozenset[int],
        seed: int,
    ) -> DriverModelRunner:
        """Size every worker's pool like rank 0's, then the runner the engine drives."""
        mc = self.config.model_config
        if mc.batch_invariant:
            raise ConfigError(
                "batch_invariant needs the native decode forward, which tensor parallelism does not use"
            )
        cache = self.config.cache_config
        self._send_all(KVSpec(kv_store.num_blocks, kv_store.block_size, cache.kv_cache_dtype))
        runner = DriverModelRunner(self, model, kv_store, eos_token_ids, seed)
        if not mc.enforce_eager:  # the workers decide alike: same weights, same kernels
            runner.native_decode = model.bind_native_decoder(kv_store, self.ctx.comm.all_reduce)
        logger.info(
            "tensor parallel decode: %s",
            "native, all-reducing o_proj and down_proj from inside the one-call forward"
            if runner.native_decode
            else "Python layers (the native decode forward is off)",
        )
        return runner

    def _send_all(self, message: object) -> None:
        for rank, conn in self.conns.items():
            try:
                conn.send(message)
            except OSError as exc:
                raise self.diagnose(exc, rank) from exc

    # ------------------------------------------------------------------ steps

    def broadcast_step(self, output: SchedulerOutput) -> None:
        started = time.perf_counter()
        self.check_alive()
        payload = encode_step(output)
        for rank, conn in self.conns.items():
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                raise self.diagnose(exc, rank) from exc
        self.broadcast_calls += 1
        self.broadcast_bytes += len(payload)
        self.broadcast_seconds += time.perf_counter() - started

    def check_alive(self) -> None:
        if self._death is not None:
            raise self._death

    def diagnose(self, exc: BaseException, rank: int | None = None) -> WorkerDiedError:
        """The error a failed step ends the engine with: the dead rank as the monitor saw it if one
        died (waiting briefly for it to notice), else the step's own failure."""
        if isinstance(exc, WorkerDiedError) and rank is None:
            rank = exc.rank
        self._died.wait(DIAGNOSE_WAIT_S)
        if self._death is not None:
            return self._death
        if isinstance(exc, WorkerDiedError):
            return exc
        where = 0 if rank is None else rank
        return WorkerDiedError(
            where,
            f"the step failed ({type(exc).__name__}: {exc}); the ranks may be out of step, the engine stops",
        )

    def _watch(self) -> None:
        waitables: dict[Any, int] = {conn: rank for rank, conn in self.conns.items()}
        waitables.update({proc.sentinel: rank for rank, proc in self._procs.items()})
        ready = connection.wait([*waitables, self._wake_r])
        if self._wake_r in ready:
            return  # shutdown
        rank = min(waitables[w] for w in ready)
        proc = self._procs.get(rank)
        code = None
        if proc is not None:
            proc.join(WORKER_EXIT_WAIT_S)
            code = proc.exitcode
        reason = _exit_reason(code)
        try:
            key = ERROR_KEY.format(rank=rank)
            ctl = control_store(self.store)
            if ctl.check([key]):
                reason += f": {ctl.get(key).decode()}"
        except Exception:  # the store is rank 0's own; reading it should not fail, but never mask the death
            pass
        self._death = WorkerDiedError(rank, reason)
        logger.error("%s", self._death)
        self._died.set()

    @property
    def worker_pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self._procs.items()}

    @property
    def dead_reason(self) -> str | None:
        return None if self._death is None else str(self._death)

    def shutdown(self) -> None:
        self._finalizer()


def _shutdown(
    conns: dict[int, Connection],
    procs: dict[int, Any],
    wake: Connection,
    ctx: ParallelContext,
    saved_cpus: list[int],
    saved_threads: int,
) -> None:
    with contextlib.suppress(OSError):
        wake.send(None)
    for conn in conns.values():
        try:
            conn.send_bytes(SHUTDOWN)
            conn.close()
        except OSError:
            pass
    for proc in procs.values():
        proc.join(WORKER_EXIT_WAIT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(WORKER_EXIT_WAIT_S)
    ctx.close()
    if saved_cpus:  # the engine process goes back to the CPUs and threads it had (tests, notebooks)
        os.sched_setaffinity(0, saved_cpus)
    torch.set_num_threads(saved_threads)


class DriverModelRunner(ModelRunner):
    """The model runner of rank 0: each step goes to the workers first, then through rank 0's
    shard as usual (kvflow/worker/model_runner.py); any failure is the engine's end (module docstring).
    Built eager; TensorParallelDriver.model_runner binds the native decode forward with the all-reduce."""

    def __init__(
        self,
        driver: TensorParallelDriver,
        model: LlamaFamilyForCausalLM,
        kv_store: KVStore,
        eos_token_ids: frozenset[int],
        seed: int,
    ) -> None:
        super().__init__(model, kv_store, eos_token_ids, seed, enforce_eager=True)
        self.driver = driver

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        if scheduler_output.is_empty:  # nothing to compute: the workers need not hear of it
            self.driver.check_alive()
            return super().execute_model(scheduler_output)
        self.driver.broadcast_step(scheduler_output)
        try:
            return super().execute_model(scheduler_output)
        except Exception as exc:
            raise self.driver.diagnose(exc) from exc


@contextmanager
def _main_script_hidden() -> Iterator[None]:
    """While a worker is spawned, `__main__` names no script: a spawned child otherwise re-runs the
    user's script as `__mp_main__` (multiprocessing's spawn preparation), and a script without an
    `if __name__ == "__main__":` guard builds a second LLM inside the worker, which dies. The worker
    needs nothing of it: its target and arguments are kvflow's (vLLM's workers likewise start from
    its own entry point)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    spec, path = getattr(main, "__spec__", None), getattr(main, "__file__", None)
    main.__spec__ = None
    if path is not None:
        del main.__file__
    try:
        yield
    finally:
        main.__spec__ = spec
        if path is not None:
            main.__file__ = path

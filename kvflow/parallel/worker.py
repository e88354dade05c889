"""A worker rank (1..N-1): join, load its shard, then run every step rank 0 sends until it stops.

A worker runs the forward only: the same flat batch (kvflow/worker/input_batch.py) as rank 0, its
shard of every layer with the same collectives in the same order, and its vocabulary part of the
logits of the rows that are sampled, which go to rank 0 in the LM head's gather. It samples
nothing and keeps no request state beyond its share of the KV pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kvflow.arch_config import load_arch_config
from kvflow.attention.kv_store import KVStore, kv_cache_config_for
from kvflow.config import EngineConfig
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.parallel.errors import WorkerDiedError
from kvflow.parallel.model_loader import load_shard
from kvflow.parallel.state import JOIN_TIMEOUT, ParallelContext, connect, pin_threads
from kvflow.parallel.step_channel import SHUTDOWN, KVSpec, LoadSpec, decode_step
from kvflow.worker.model_runner import forward_step

logger = logging.getLogger("kvflow")

STORE_PREFIX = "kvflow-tp"
# Store keys (under STORE_PREFIX/ctl): a worker's "I am up" flag and its last error.
ALIVE_KEY = "alive/{rank}"
ERROR_KEY = "error/{rank}"


def control_store(store: dist.Store) -> dist.Store:
    return dist.PrefixStore(f"{STORE_PREFIX}/ctl", store)


def connect_step_channel(ctl: dist.Store, rank: int) -> Connection:
    host, port = ctl.get("step_addr").decode().rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(ctl.get("authkey").decode()))
    conn.send(rank)
    return conn


def run_worker(
    config: EngineConfig,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    local_rank: int,
    local_world_size: int,
    log_level: int = logging.INFO,
) -> int:
    """The worker process's whole life; returns its exit status (0: rank 0 ended it)."""
    logging.basicConfig(
        level=log_level, format=f"%(levelname)s [tp rank {rank}] %(name)s: %(message)s", force=True
    )
    store = dist.TCPStore(master_addr, master_port, world_size, False, timeout=JOIN_TIMEOUT)
    ctl = control_store(store)
    try:
        ctl.set(ALIVE_KEY.format(rank=rank), str(os.getpid()))
        cpus = pin_threads(local_rank, local_world_size, config.parallel_config.cpu_threads_per_rank)
        logger.info("pinned to CPUs %s, %d torch threads", cpus, torch.get_num_threads())
        group, comm = connect(
            store, rank, world_size, config.parallel_config.all_reduce_backend, prefix=STORE_PREFIX
        )
        ctx = ParallelContext(rank, world_size, comm, group, store, local_rank, local_world_size, cpus)
        conn = connect_step_channel(ctl, rank)
        _serve(config, ctx, conn)
        return 0
    except (EOFError, ConnectionError):
        logger.info("rank 0 is gone: stopping")
        return 0
    except WorkerDiedError as exc:
        logger.error("%s: stopping", exc)
        return 1
    except BaseException as exc:  # the reason goes to rank 0, which reports it with this rank
        logger.exception("worker failed")
        with contextlib.suppress(Exception):  # the store went with rank 0: nobody to tell
            ctl.set(ERROR_KEY.format(rank=rank), f"{type(exc).__name__}: {exc}")
        return 1


@torch.inference_mode()
def _serve(config: EngineConfig, ctx: ParallelContext, conn: Connection) -> None:
    spec = conn.recv()
    assert isinstance(spec, LoadSpec)
    mc = config.model_config
    model_dir = Path(mc.model).expanduser()
    arch = load_arch_config(model_dir)
    dtype = getattr(torch, spec.dtype)
    model = load_shard(model_dir, arch, dtype, spec.max_model_len, config.quant_config, ctx)
    kv = conn.recv()
    assert isinstance(kv, KVSpec)
    a = model.config  # per-rank shapes: this rank's KV heads only
    kv_cache_config, state_layout = kv_cache_config_for(a, dtype, config.cache_config)
    kv_store = KVStore(
        a.num_hidden_layers,
        kv.num_blocks,
        kv.block_size,
        a.num_key_value_heads,
        a.head_dim,
        dtype,
        kv.kv_cache_dtype,
        latent=a.kv_latent,
        kv_cache_config=kv_cache_config,
        state_layout=state_layout,
    )
    logger.info(
        "KV pool of this rank: %.1f MiB (%d KV heads per layer)",
        kv_store.num_bytes / 2**20,
        a.num_key_value_heads,
    )
    # As rank 0 does (executor.py): the collectives come in the same order.
    native = not mc.enforce_eager and model.bind_native_decoder(kv_store, ctx.comm.all_reduce)
    _loop(model, kv_store, native, conn)


def _loop(model: LlamaFamilyForCausalLM, kv_store: KVStore, native_decode: bool, conn: Connection) -> None:
    while True:
        payload = conn.recv_bytes()
        if payload == SHUTDOWN:
            return
        scheduler_output = decode_step(payload)
        # The same forward as rank 0's runner (decode-only steps as lists on the native decoder).
        _, sampling_requests, _, sampled = forward_step(model, kv_store, scheduler_output, native_decode)
        if sampling_requests:  # this rank's part of the sampled rows' logits -> rank 0
            model.compute_logits(sampled)


def spawned_worker_main(
    config: EngineConfig,
    rank: int,
    world_size: int,
    master_port: int,
    log_level: int,
) -> None:
    """torch.multiprocessing entry point of a worker on rank 0's machine."""
    code = run_worker(config, rank, world_size, "127.0.0.1", master_port, rank, world_size, log_level)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: gloo's threads may still hold the dead peer's sockets

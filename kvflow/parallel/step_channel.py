"""The per-step message rank 0 -> workers, and the connection it travels on.

One message per step (vLLM broadcasts its SchedulerOutput the same way): the scheduled requests
reduced to what the forward reads (token ids, positions, block table, whether the last token is
sampled), pickled once and written to each worker's connection. Sampling parameters and token
histories stay on rank 0, which alone samples. A `multiprocessing.connection` over TCP serves one
machine and several alike, has no idle timeout (a collective would time out while the server
waits for requests), and a closed end reads as EOF: a worker leaves when rank 0 is gone, and rank 0
sees a worker leave (executor.py watches the connections).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from kvflow.config import KVCacheDType
from kvflow.sampling_params import SamplingParams
from kvflow.scheduler_output import ScheduledRequest, SchedulerOutput, StateStep

# What a worker does not read but ScheduledRequest requires.
_WORKER_PARAMS = SamplingParams()


@dataclass(frozen=True)
class LoadSpec:
    """Sent once, first: what rank 0 resolved from the checkpoint (workers load the same way)."""

    dtype: str  # torch dtype name, e.g. "bfloat16"
    max_model_len: int


@dataclass(frozen=True)
class KVSpec:
    """Sent once the pool is sized: every rank's pool has the same blocks (rank 0 schedules them)."""

    num_blocks: int  # null block included
    block_size: int
    kv_cache_dtype: KVCacheDType


# (request_id, token_ids, num_computed_tokens, block_ids (one table per cache group), do_sample,
#  is_decode, num_spec_tokens, state_steps)
_Row = tuple[str, list[int], int, list[list[int]], bool, bool, int, tuple[StateStep, ...]]


def encode_step(output: SchedulerOutput) -> bytes:
    rows: list[_Row] = [
        (
            s.request_id,
            s.token_ids,
            s.num_computed_tokens,
            s.block_ids,
            s.do_sample,
            s.is_decode,
            s.num_spec_tokens,
            s.state_steps,
        )
        for s in output.scheduled
    ]
    return pickle.dumps((rows, output.num_batched_tokens), protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(payload: bytes) -> SchedulerOutput:
    rows, num_batched_tokens = pickle.loads(payload)
    scheduled = [
        ScheduledRequest(
            request_id=rid,
            token_ids=token_ids,
            num_computed_tokens=computed,
            block_ids=block_ids,
            do_sample=do_sample,
            is_decode=is_decode,
            sampling_params=_WORKER_PARAMS,
            prompt_token_ids=[],
            output_token_ids=[],
            num_spec_tokens=num_spec,
            state_steps=state_steps,
        )
        for rid, token_ids, computed, block_ids, do_sample, is_decode, num_spec, state_steps in rows
    ]
    return SchedulerOutput(scheduled, num_batched_tokens)


# An empty payload ends the worker's loop.
SHUTDOWN = b""

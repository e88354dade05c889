"""The flat batch's attention metadata: the fast paths give the general path's values.

- build_input_batch without a sliding window takes the slots of a request's rows from one table
  per request (_causal_decode_metadata); a window wider than every position must change nothing, so
  the windowed path (which computes every row's key positions) is the reference.
- query_rows_metadata (the draft model's k steps) builds query rows from slot vectors; it must
  describe the same keys, slots and positions as build_input_batch does for the same requests.
"""

from __future__ import annotations

import random

import torch

from kvflow.sampling_params import SamplingParams
from kvflow.scheduler_output import ScheduledRequest, SchedulerOutput
from kvflow.worker.input_batch import (
    _decode_metadata,
    _QueryRow,
    build_input_batch,
    query_rows_metadata,
    slot_vector,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def _random_requests(rng: random.Random) -> list[tuple[list[int], int, int]]:
    """(block_ids, num_computed_tokens, num_tokens) of 1-5 requests, 1-4 query rows each."""
    requests = []
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    for _ in range(rng.randint(1, 5)):
        computed, n = rng.randint(0, 30), rng.randint(1, 4)
        needed = -(-(computed + n) // BLOCK_SIZE) + rng.randint(0, 2)  # sometimes blocks to spare
        requests.append(([free.pop() for _ in range(needed)], computed, n))
    return requests


def test_causal_decode_metadata_equals_the_windowed_path_with_an_unreachable_window() -> None:
    rng = random.Random(0)
    for _ in range(200):
        rows = [
            _QueryRow(blocks, p)
            for blocks, start, n in _random_requests(rng)
            for p in range(start, start + n)
        ]
        fast = _decode_metadata(rows, BLOCK_SIZE, None)
        reference = _decode_metadata(rows, BLOCK_SIZE, 10**9)
        for got, want in zip(fast, reference, strict=True):
            assert torch.equal(got, want)


def _scheduled(i: int, blocks: list[int], start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=str(i),
        token_ids=list(range(n)),
        num_computed_tokens=start,
        block_ids=[blocks],
        do_sample=True,
        is_decode=n == 1,
        sampling_params=SamplingParams(),
        prompt_token_ids=[0] * max(start, 1),
        output_token_ids=[],
    )


def test_query_rows_metadata_describes_the_same_rows_as_build_input_batch() -> None:
    rng = random.Random(1)
    for _ in range(200):
        requests = _random_requests(rng)
        scheduled = [_scheduled(i, *r) for i, r in enumerate(requests)]
        batch = build_input_batch(
            SchedulerOutput(scheduled, sum(r.num_tokens for r in scheduled)), BLOCK_SIZE, None
        )
        want = batch.attn_metadata
        got = query_rows_metadata([(slot_vector(b, BLOCK_SIZE), start, n) for b, start, n in requests])
        assert torch.equal(got.positions, want.positions)
        assert torch.equal(got.slot_mapping, want.slot_mapping)
        assert got.num_decode_tokens == want.num_decode_tokens and not got.prefills
        assert got.decode_num_keys is not None and want.decode_num_keys is not None
        assert torch.equal(got.decode_num_keys, want.decode_num_keys)
        assert got.decode_attend is not None and torch.equal(got.decode_attend, want.decode_attend)
        # Entries past a row's keys may differ (the row's own later slots against slot 0): never read.
        assert got.decode_kv_slots is not None and want.decode_kv_slots is not None
        valid = want.decode_attend[:, 0, 0, :]
        assert torch.equal(got.decode_kv_slots[valid], want.decode_kv_slots[valid])

"""KV events from the block bookkeeping (no torch): the published stream, replayed from the start,
reconstructs exactly the set of cached blocks, and every stored block carries its own tokens."""

from __future__ import annotations

import random

import pytest
from fixtures.kv_event_replica import Replica

from kvflow.kv_cache.manager import KVCacheManager
from kvflow.kv_cache.single_type_manager import group_key
from kvflow.kv_events.event_log import GroupTag, KVEventLog
from kvflow.kv_events.events import BlockStored, KVEventBatch, encode_batch, external_block_hash
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8), arrival_time=0.0)


def recording_manager(num_blocks: int) -> tuple[KVCacheManager, KVEventLog]:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    log = KVEventLog(BLOCK_SIZE)
    manager.block_pool.kv_events = log
    return manager, log


def chained_tokens(manager: KVCacheManager, request: Request) -> dict[int, tuple[int, ...]]:
    """wire hash -> tokens of each full block of `request` (what its events must say)."""
    hashes = manager.hash_request_blocks(request)
    ids = request.all_token_ids
    return {
        external_block_hash(group_key(h, 0)): tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        for i, h in enumerate(hashes)
    }


@pytest.mark.parametrize("seed", range(4))
def test_replayed_stream_reconstructs_exactly_the_cached_blocks(seed: int) -> None:
    """Conversations sharing system prompts, a pool too small for them all: blocks are cached,
    shared, evicted and re-cached; after every step the replayed stream equals the pool's index."""
    rng = random.Random(seed)
    manager, log = recording_manager(num_blocks=24)
    replica = Replica()
    system_prompts = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 9)))] for _ in range(3)]
    running: list[Request] = []
    expected_tokens: dict[int, tuple[int, ...]] = {}
    for step in range(200):
        if running and (rng.random() < 0.4 or len(running) > 3):
            done = running.pop(rng.randrange(len(running)))
            manager.free(done)
        else:
            prompt = [
                *rng.choice(system_prompts),
                *(rng.randrange(1000) for _ in range(rng.randrange(1, 14))),
            ]
            request = make_request(f"r{step}", prompt)
            hit = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit):
                request.num_computed_tokens = request.num_tokens
                running.append(request)
                expected_tokens.update(chained_tokens(manager, request))
        replica.apply(log.take())
        index = {external_block_hash(key) for key in manager.block_pool.cached_block_hash_to_block}
        assert replica.cached == index == log.announced, f"step {step}"
    for h in replica.cached:  # each cached block's tokens are the tokens hashed into its key
        assert replica.tokens[h] == expected_tokens[h]
    assert len(replica.tokens) > 24, "the pool never evicted: the test is not exercising removals"


def test_a_block_cached_by_another_request_first_splits_the_stored_run() -> None:
    """Two requests that computed the same prefix in one step: the first's blocks enter the index,
    the second's duplicates do not, so the second announces only its own tail, chained to the
    first's block as parent."""
    manager, log = recording_manager(num_blocks=16)
    shared = list(range(8))
    a, b = make_request("a", [*shared, 50]), make_request("b", [*shared, 60, 61, 62, 63, 64])
    for request in (a, b):  # both allocated before either is computed: no hit for b
        assert manager.allocate_slots(request, request.num_tokens, None)
    events = log.take()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.token_ids == shared and first.parent_block_hash is None
    assert second.token_ids == [60, 61, 62, 63] and second.parent_block_hash == first.block_hashes[-1]


def test_stored_event_checks_its_token_count() -> None:
    log = KVEventLog(BLOCK_SIZE)
    with pytest.raises(ValueError, match="2 blocks of 4 tokens carry 7"):
        log.stored([b"a", b"b"], None, list(range(7)), GroupTag(0, "full_attention"))


def test_wire_bytes_match_vllm_layout() -> None:
    """The batch is a positional array, each event a map tagged with its class name (what
    vllm-router's decoder reads); default-valued trailing fields are omitted."""
    import msgspec

    log = KVEventLog(BLOCK_SIZE)
    log.stored([b"k1"], None, [1, 2, 3, 4], GroupTag(0, "full_attention"))
    log.removed(b"k1")
    log.cleared()
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=1.5, events=log.take(), data_parallel_rank=0)))
    assert raw[0] == 1.5 and raw[2] == 0
    stored, removed, cleared = raw[1]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [external_block_hash(b"k1")]
    assert list(stored)[:8] == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert stored["medium"] == "GPU" and stored["kv_cache_spec_kind"] == "full_attention"
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [external_block_hash(b"k1")],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert cleared == {"type": "AllBlocksCleared"}
    assert 0 <= external_block_hash(b"k1") < 2**64

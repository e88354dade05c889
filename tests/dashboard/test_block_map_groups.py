"""The block map's cache groups on the wire (kvflow/server/dashboard/schema.py block_map_object): the
group of every held block and the kinds, for a model mixing kinds; null for a model of one group."""

from __future__ import annotations

from kvflow.kv_cache.block_map import snapshot_block_map
from kvflow.kv_cache.kv_cache_config import build_kv_cache_config
from kvflow.kv_cache.manager import KVCacheManager
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.server.dashboard.schema import block_map_object

BLOCK_SIZE = 4
WINDOW = 4  # the sliding group keeps about WINDOW / BLOCK_SIZE + 1 blocks


def admitted(manager: KVCacheManager, request_id: str, num_tokens: int) -> Request:
    request = Request(request_id, list(range(num_tokens)), SamplingParams(max_tokens=4), arrival_time=0.0)
    assert manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    return request


def test_each_held_block_names_its_cache_group() -> None:
    kinds = ("sliding_attention", "full_attention") * 2  # gpt-oss's pattern: two groups of 2 layers
    config = build_kv_cache_config(kinds, block_size=BLOCK_SIZE, token_bytes=8, sliding_window=WINDOW)
    manager = KVCacheManager(32, BLOCK_SIZE, False, kv_cache_config=config)
    request = admitted(manager, "a", 20)  # a 20-token prompt: 5 blocks in each group while computed
    assert manager.allocate_slots(request, 1)  # the next token: the window lets 4 sliding blocks go
    kv = block_map_object(snapshot_block_map(manager))
    assert kv["cache_group_kinds"] == ["sliding_attention", "full_attention"]
    groups = kv["cache_group"]
    assert len(groups) == len(kv["owner"])
    assert all((g >= 0) == (code >= 0) for g, code in zip(groups, kv["owner"], strict=True))
    held = [groups.count(0), groups.count(1)]
    assert held == [config.groups[0].spec.num_blocks_held(21), 6] == [2, 6]
    assert kv["used"] == sum(held)


def test_one_group_sends_no_per_block_list() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, False)
    admitted(manager, "a", 6)
    kv = block_map_object(snapshot_block_map(manager))
    assert kv["cache_group"] is None and kv["cache_group_kinds"] == ["full_attention"]

"""snapshot_block_map: exact owners of each block, shared prefix blocks, cached free blocks (no torch)."""

from __future__ import annotations

from kvflow.kv_cache.block_map import CACHED, FREE, snapshot_block_map
from kvflow.kv_cache.manager import KVCacheManager
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8), arrival_time=0.0)


def admit(manager: KVCacheManager, request: Request) -> None:
    hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    request.num_computed_tokens = request.num_tokens


def test_owners_shared_prefix_and_cached_free_blocks() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prefix = list(range(100, 108))  # two full blocks both requests share
    a = make_request("a", [*prefix, 1, 2, 3])
    b = make_request("b", [*prefix, 7, 8, 9, 10, 11])
    admit(manager, a)
    admit(manager, b)
    table_a, table_b = manager.block_table("a"), manager.block_table("b")
    assert table_a[:2] == table_b[:2]  # the prefix hit

    snap = snapshot_block_map(manager)
    assert snap.num_blocks == 8  # the null block is not shown
    for block_id in table_a[:2]:
        assert snap.owner_groups[snap.owner[block_id - 1]] == ["a", "b"]
        assert snap.cached_in_use[block_id - 1]
    assert snap.owner_groups[snap.owner[table_a[2] - 1]] == ["a"]
    assert [snap.owner_groups[snap.owner[i - 1]] for i in table_b[2:]] == [["b"], ["b"]]
    assert snap.num_used == 5 and snap.num_shared == 2
    assert snap.num_used == round(manager.usage * manager.block_pool.num_usable_blocks)

    manager.free(b)  # b's own full block stays cached and reusable; its partial tail does not
    snap = snapshot_block_map(manager)
    assert snap.owner[table_b[2] - 1] == CACHED
    assert snap.owner[table_b[3] - 1] == FREE
    assert snap.owner_groups[snap.owner[table_a[0] - 1]] == ["a"]  # no longer shared
    assert snap.num_used == 3 and snap.num_cached_free == 1 and snap.num_free == 5
    manager.check_integrity()


def test_empty_pool_is_all_free() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    snap = snapshot_block_map(manager)
    assert snap.owner == [FREE] * 4 and snap.owner_groups == [] and snap.num_used == 0

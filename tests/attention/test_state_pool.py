"""Linear-attention states over the KV pool's pages: what is written is read back bit for bit, from
pages in any order, and nothing outside a state's pages changes (no torch model needed)."""

from __future__ import annotations

import pytest
import torch

from kvflow.attention.kv_layer import make_kv_layer
from kvflow.attention.state_pool import PagedStateLayer, StateLayout, page_views

NUM_BLOCKS, BLOCK_SIZE = 12, 4


@pytest.mark.parametrize(("kv_dtype", "head_dim"), [("auto", 8), ("int8", 8), ("int4", 6), ("auto", 3)])
def test_states_round_trip_over_scattered_pages(kv_dtype: str, head_dim: int) -> None:
    layer = make_kv_layer(kv_dtype, NUM_BLOCKS * BLOCK_SIZE, 2, head_dim, torch.bfloat16)
    pages = page_views(layer.data_tensors, NUM_BLOCKS)
    # The widest word dividing every page: 2 heads x 8 dims x 4 tokens of bf16 = 128 bytes -> int64;
    # int4 pages of 2 x 3 bytes x 4 = 24 bytes -> int64; 2 x 3 bf16 x 4 = 48 -> int64.
    assert len({p.dtype for p in pages}) == 1
    layout = StateLayout((2, 3, 5), (7, 3), torch.bfloat16.itemsize)  # 120 + 42 bytes
    states = PagedStateLayer(pages, layout, torch.bfloat16)
    per_state = -(-layout.num_bytes // states.page_bytes)
    table = torch.tensor([[9, 2, 5, 11][:per_state], [1, 7, 3, 4][:per_state]])
    before = [t.clone() for t in layer.tensors]
    recurrent = torch.randn(2, 2, 3, 5)
    conv = torch.randn(2, 7, 3).to(torch.bfloat16)
    states.write(table, recurrent, conv)
    got_recurrent, got_conv = states.read(table)
    assert torch.equal(got_recurrent, recurrent) and torch.equal(got_conv, conv)
    one_recurrent, _ = states.read(table[1:])
    assert torch.equal(one_recurrent[0], recurrent[1])
    touched = set(table.reshape(-1).tolist())
    for old, new in zip(before, layer.tensors, strict=True):  # blocks of no state: unchanged bytes
        if old.shape[0] != NUM_BLOCKS * BLOCK_SIZE:
            continue
        for block in set(range(NUM_BLOCKS)) - touched:
            rows = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
            assert torch.equal(old[rows].view(torch.uint8), new[rows].view(torch.uint8))

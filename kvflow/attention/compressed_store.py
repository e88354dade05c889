"""DeepSeek-V4's cache layers over the pool's pages (kvflow/kv_cache/compressed_kinds.py).

Each layer slot is one tensor [num_blocks, block_size x head_dim] of the model dtype: a window
group's block holds block_size K=V vectors, an entries group's block `entries_per_block` entries
of `width` values (head_dim for CSA / HCA entries, index_head_dim for indexer keys), a compressor
state's pages its float32 rows as raw bytes. A block id is one page in every slot, so a block a
window held yesterday holds indexer keys today. Block 0 (the null block) stays zero.
"""

from __future__ import annotations

import torch

from kvflow.attention.state_pool import page_views


class EntryPool:
    """One cache layer's rows: slot s = block * per + offset is row `offset` of page `block`."""

    def __init__(self, pages: torch.Tensor, per: int, width: int) -> None:
        num_blocks, page_elems = pages.shape
        if per * width > page_elems:
            raise ValueError(f"{per} rows of {width} values do not fit a page of {page_elems}")
        self.per, self.width = per, width
        self.rows = pages.as_strided((num_blocks, per, width), (page_elems, width, 1))

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [N, width] -> rows `slots` [N]."""
        self.rows[slots // self.per, slots % self.per] = values.to(self.rows.dtype)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[N, width] copies of rows `slots` [N]."""
        return self.rows[slots // self.per, slots % self.per]


class RingState:
    """A compressor's state in its pages: float32 [ring_rows, row_width], raw bytes of the slot's pages."""

    def __init__(self, pages: torch.Tensor, num_blocks: int, ring_rows: int, row_width: int) -> None:
        self.words = page_views([pages], num_blocks)[0]  # [num_blocks, page words]
        self.shape = (ring_rows, row_width)
        self.num_bytes = ring_rows * row_width * 4

    def read(self, pages: list[int]) -> torch.Tensor:
        blob = self.words.index_select(0, torch.tensor(pages, dtype=torch.int64)).reshape(-1)
        return blob.view(torch.uint8)[: self.num_bytes].view(torch.float32).view(self.shape).clone()

    def write(self, pages: list[int], state: torch.Tensor) -> None:
        page_words = self.words.shape[1]
        blob = torch.zeros(len(pages) * page_words, dtype=self.words.dtype)
        blob.view(torch.uint8)[: self.num_bytes] = state.contiguous().view(torch.uint8).reshape(-1)
        self.words.index_copy_(0, torch.tensor(pages, dtype=torch.int64), blob.view(len(pages), page_words))


class CompressedPages:
    """The layer slots' page tensors of a DeepSeek-V4 model."""

    def __init__(
        self, num_layer_slots: int, num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slots = [
            torch.zeros(num_blocks, block_size * head_dim, dtype=dtype) for _ in range(num_layer_slots)
        ]

    def entries(self, slot: int, per: int, width: int) -> EntryPool:
        return EntryPool(self.slots[slot], per, width)

    def state(self, slot: int, ring_rows: int, row_width: int) -> RingState:
        return RingState(self.slots[slot], self.num_blocks, ring_rows, row_width)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.slots

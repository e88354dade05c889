"""DeepSeek-V4's cache layers over the pool's pages (kvflow/kv_cache/compressed_kinds.py).

Each layer slot is one byte tensor [num_blocks, page_bytes]: a window group's block holds
block_size K=V vectors, an entries group's block `entries_per_block` entries of `width` values
(head_dim for CSA / HCA entries, index_head_dim for indexer keys), a compressor state's pages its
float32 rows as raw bytes. A block id is one page in every slot, so a block a window held yesterday
holds indexer keys today. Block 0 (the null block) stays zero.
Formats: the model dtype (or bfloat16 / float16), or int8 / fp8_e4m3 (kv_cache_dtype) with one fp16
absmax scale per vector: a page is then [per x width bytes | per fp16 scales]
(kvflow/attention/kv_layer.py quantize_8bit, the K/V pools' arithmetic).
"""

from __future__ import annotations

import torch

from kvflow.attention.kv_layer import (
    QUANTIZED_KV_DTYPES,
    SCALE_DTYPE,
    dequantize_8bit,
    plain_dtype,
    quantize_8bit,
)
from kvflow.attention.state_pool import page_views


class EntryPool:
    """One cache layer's rows: slot s = block * per + offset is row `offset` of page `block`."""

    def __init__(
        self, pages: torch.Tensor, per: int, width: int, model_dtype: torch.dtype, kv_cache_dtype: str
    ) -> None:
        num_blocks, page_bytes = pages.shape
        self.per, self.width, self.model_dtype, self.kind = per, width, model_dtype, kv_cache_dtype
        self.scale: torch.Tensor | None = None
        if kv_cache_dtype in QUANTIZED_KV_DTYPES:
            if per * (width + SCALE_DTYPE.itemsize) > page_bytes or (per * width) % SCALE_DTYPE.itemsize:
                raise ValueError(
                    f"{per} rows of {width} quantized values do not fit a {page_bytes}-byte page"
                )
            self.rows = pages.as_strided((num_blocks, per, width), (page_bytes, width, 1))
            half = pages.view(SCALE_DTYPE)  # [num_blocks, page_bytes / 2]
            stride = page_bytes // SCALE_DTYPE.itemsize
            self.scale = half.as_strided((num_blocks, per), (stride, 1), per * width // SCALE_DTYPE.itemsize)
            return
        values = pages.view(plain_dtype(kv_cache_dtype, model_dtype))
        elems = values.shape[1]
        if per * width > elems:
            raise ValueError(f"{per} rows of {width} values do not fit a page of {elems}")
        self.rows = values.as_strided((num_blocks, per, width), (elems, width, 1))

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [N, width] -> rows `slots` [N]."""
        block, offset = slots // self.per, slots % self.per
        if self.scale is None:
            self.rows[block, offset] = values.to(self.rows.dtype)
            return
        q, scale = quantize_8bit(values, self.kind)
        self.rows[block, offset] = q.view(torch.uint8)
        self.scale[block, offset] = scale.to(SCALE_DTYPE)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[N, width] copies of rows `slots` [N], in the model dtype (dequantized if the pool is)."""
        block, offset = slots // self.per, slots % self.per
        if self.scale is None:
            return self.rows[block, offset].to(self.model_dtype)
        scale = self.scale[block, offset].float()[..., None]
        return dequantize_8bit(self.rows[block, offset], scale, self.kind).to(self.model_dtype)


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
        self,
        num_layer_slots: int,
        num_blocks: int,
        page_bytes: int,
        model_dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.num_blocks = num_blocks
        self.model_dtype, self.kv_cache_dtype = model_dtype, kv_cache_dtype
        self.slots = [torch.zeros(num_blocks, page_bytes, dtype=torch.uint8) for _ in range(num_layer_slots)]

    def entries(self, slot: int, per: int, width: int) -> EntryPool:
        return EntryPool(self.slots[slot], per, width, self.model_dtype, self.kv_cache_dtype)

    def state(self, slot: int, ring_rows: int, row_width: int) -> RingState:
        return RingState(self.slots[slot], self.num_blocks, ring_rows, row_width)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.slots

"""Linear-attention states laid over the pages of the shared KV pool (kvflow/kv_cache/kv_cache_config.py).

A Gated DeltaNet layer keeps, per request, a recurrent state S [Hv, dk, dv] (float32, as transformers
keeps it) and the last kernel - 1 inputs of its causal convolution [conv_dim, kernel - 1] (model
dtype). As bytes, one layer's state is
    [ S: Hv * dk * dv * 4 | conv: conv_dim * (kernel - 1) * itemsize ]   (StateLayout.num_bytes)
and it lives in `pages_per_state` pool blocks of the layer slot the layer shares with the attention
groups: each block contributes its pages of that slot's K/V data tensors, in order (K data, then V
data; quantized pools' scales are not used), so a block a state held yesterday holds a full
attention group's keys today. The pages of a state need not be contiguous: `read` gathers them,
`write` scatters them back, in 8-byte words: a step moves each state twice more than an in-place
kernel would (at the Qwen3-Next shape a few percent of a decode step: benchmarks/NOTES.md, session
17).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RECURRENT_DTYPE = torch.float32  # the delta-rule state is accumulated and kept in float32


@dataclass(frozen=True)
class StateLayout:
    """One linear-attention layer's state: shapes and dtypes, and its bytes."""

    recurrent_shape: tuple[int, int, int]  # [Hv, dk, dv]
    conv_shape: tuple[int, int]  # [conv_dim, kernel - 1]
    conv_itemsize: int  # bytes per element of the conv inputs (the model dtype)

    @property
    def recurrent_bytes(self) -> int:
        hv, dk, dv = self.recurrent_shape
        return hv * dk * dv * RECURRENT_DTYPE.itemsize

    @property
    def conv_bytes(self) -> int:
        return self.conv_shape[0] * self.conv_shape[1] * self.conv_itemsize

    @property
    def num_bytes(self) -> int:
        return self.recurrent_bytes + self.conv_bytes


# The widest word a state's pages are gathered and scattered in: index_copy_ on int64 words moved a
# 2 MiB state over 66 pages in 129 us where uint8 took 750 us (benchmarks/NOTES.md, session 17).
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def page_views(tensors: list[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Each K/V data tensor [num_blocks * block_size, ...] as raw pages [num_blocks, page words], in
    the widest integer word that divides every page (the bytes are reinterpreted, never converted)."""
    pages = [t.view(torch.uint8).view(num_blocks, -1) for t in tensors]
    word = next(w for w in _WORDS if all(p.shape[1] % w.itemsize == 0 for p in pages))
    return [p.view(word) for p in pages]


class PagedStateLayer:
    def __init__(self, pages: list[torch.Tensor], layout: StateLayout, conv_dtype: torch.dtype) -> None:
        """`pages`: the slot's page views (page_views), each [num_blocks, words], one word dtype."""
        self.pages = pages
        self.layout = layout
        self.conv_dtype = conv_dtype
        self.word = pages[0].dtype
        self.page_words = sum(p.shape[1] for p in pages)
        self.page_bytes = self.page_words * self.word.itemsize
        if layout.recurrent_bytes % 4 or self.page_bytes % 4:
            raise ValueError("state pages must hold whole float32 words")

    def _blob_views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blob [B, n * page_words] -> views of its recurrent [B, Hv, dk, dv] and conv [B, C, K-1]."""
        blob = blob.view(torch.uint8)
        b, r = blob.shape[0], self.layout.recurrent_bytes
        recurrent = blob[:, :r].view(RECURRENT_DTYPE).view(b, *self.layout.recurrent_shape)
        conv = blob[:, r : r + self.layout.conv_bytes].view(self.conv_dtype).view(b, *self.layout.conv_shape)
        return recurrent, conv

    def read(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [B, n] block ids -> (recurrent [B, Hv, dk, dv] float32, conv [B, C, K-1]), copies."""
        b, n = pages.shape
        flat = pages.reshape(-1)
        parts = [p.index_select(0, flat).view(b, n, -1) for p in self.pages]  # each [B, n, words_i]
        blob = torch.cat(parts, dim=-1).view(b, n * self.page_words)
        return self._blob_views(blob)

    def write(self, pages: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        """Store B states (read's shapes) into their pages [B, n]."""
        b, n = pages.shape
        blob = torch.empty(b, n * self.page_words, dtype=self.word)
        blob_recurrent, blob_conv = self._blob_views(blob)
        blob_recurrent.copy_(recurrent)
        blob_conv.copy_(conv)
        flat = pages.reshape(-1)
        per_page = blob.view(b, n, self.page_words)
        offset = 0
        for p in self.pages:
            width = p.shape[1]
            p.index_copy_(0, flat, per_page[:, :, offset : offset + width].reshape(b * n, width))
            offset += width

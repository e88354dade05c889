"""DeepSeek-V4's KV compressor: every `rate` tokens pooled into one entry, carried across steps.

Per token t the compressor projects the hidden state to kv_t and gate_t (`series` x d values each:
CSA's overlapping windows have two series, Ca and Cb; HCA's one). Entry w pools window w =
positions [w m, (w + 1) m) (m = rate), per channel c:
    HCA   entry_w = Σ_{t in window w} softmax_t(gate_t + ape_{t mod m})_c kv_t,c
    CSA   the softmax runs over 2m slots: window w - 1's Ca half and window w's Cb half (window
          -1's slots are empty: weight 0), so entries overlap by m tokens at stride m
then RMSNorm (the compressor's norm) and RoPE at position w m on the trailing rotary dims
(transformers' DeepseekV4HCACompressor / DeepseekV4CSACompressor, the same arithmetic).

Between steps the compressor keeps its *ring*: the raw [kv | gate] rows of the last `ring_rows`
positions (CSA 2m: the open window and the one before it; HCA m), row p % ring_rows for position
p, float32 (compressed_kinds.py CompressorStateSpec). A step computing positions [s, e) reads the
rows of [lo, s) from the ring (lo: the first position an entry closing in [s, e) pools), pools
every window closing in (s, e], and writes the ring after e (and after each checkpoint offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CompressorShape:
    rate: int  # m
    width: int  # d: values per entry
    series: int  # 2 for CSA's overlapping windows, 1 for HCA

    @property
    def row_width(self) -> int:
        """Values per ring row: kv (series x d), then gate (series x d)."""
        return 2 * self.series * self.width

    @property
    def ring_rows(self) -> int:
        return self.series * self.rate


def first_pooled_position(shape: CompressorShape, start: int) -> int:
    """The earliest position an entry closing at or after `start` pools."""
    return max(0, (start // shape.rate - (shape.series - 1)) * shape.rate)


def step_rows(ring: torch.Tensor, rows: torch.Tensor, start: int, ring_rows: int) -> tuple[torch.Tensor, int]:
    """ring [R, C] (rows of positions before `start`), rows [n, C] of positions [start, start + n)
    -> (the rows of positions [lo, start + n) in order, lo), lo = max(0, start - R)."""
    lo = max(0, start - ring_rows)
    old = ring[torch.arange(lo, start) % ring_rows]
    return torch.cat((old, rows.to(ring.dtype)), dim=0), lo


def ring_after(ring: torch.Tensor, rows: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """The ring once the first `count` of `rows` (positions start ..) are computed."""
    r = ring.shape[0]
    out = ring.clone()
    first = max(start, start + count - r)
    positions = torch.arange(first, start + count)
    out[positions % r] = rows[positions - start].to(ring.dtype)
    return out


def pool_windows(
    shape: CompressorShape,
    seq: torch.Tensor,
    lo: int,
    windows: range,
    ape: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The (un-normed, un-rotated) entries of `windows` [W, d] in `dtype`.

    seq [n, row_width] float32: raw rows of positions [lo, lo + n), covering every window pooled;
    ape [rate, series x d] float32: the gate's bias per offset in the window."""
    m, d, k = shape.rate, shape.width, shape.series
    w = torch.tensor(list(windows), dtype=torch.int64)  # [W]
    offsets = torch.arange(m)
    cur = seq[(w[:, None] * m + offsets[None, :]) - lo]  # [W, m, row]
    kv, gate = cur[..., : k * d], cur[..., k * d :] + ape  # [W, m, k d]
    if k == 1:
        kvs, gates = kv, gate
    else:
        prev_pos = (w[:, None] - 1) * m + offsets[None, :]  # window w - 1
        has_prev = (w >= 1)[:, None, None]
        prev = seq[(prev_pos - lo).clamp(min=0)]
        prev_kv = torch.where(has_prev, prev[..., :d], 0.0)
        prev_gate = torch.where(has_prev, prev[..., k * d : k * d + d] + ape[:, :d], float("-inf"))
        kvs = torch.cat((prev_kv, kv[..., d:]), dim=1)  # [W, 2m, d]: Ca of w - 1, then Cb of w
        gates = torch.cat((prev_gate, gate[..., d:]), dim=1)
    weights = gates.softmax(dim=1).to(dtype)
    return (kvs.to(dtype) * weights).sum(dim=1)

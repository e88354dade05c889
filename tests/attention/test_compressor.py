"""DeepSeek-V4's compressor (kvflow/attention/compressor.py): entries pooled step by step through the
ring (the pending tail and CSA's overlap carried across chunk boundaries) equal a direct computation
over the whole sequence, for CSA's overlapping windows and HCA's plain ones."""

from __future__ import annotations

import pytest
import torch

from kvflow.attention.compressor import CompressorShape, pool_windows, ring_after, step_rows


def _direct(shape: CompressorShape, rows: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Entry w, channel c, by the formula: softmax over the window's slots (CSA: window w - 1's Ca
    half then window w's Cb half; window -1 contributes nothing)."""
    m, d, k = shape.rate, shape.width, shape.series
    out = []
    for w in range(rows.shape[0] // m):
        kvs, gates = [], []
        if k == 2 and w >= 1:
            for j in range(m):
                row = rows[(w - 1) * m + j]
                kvs.append(row[:d])
                gates.append(row[k * d : k * d + d] + ape[j, :d])
        for j in range(m):
            row = rows[w * m + j]
            kvs.append(row[(k - 1) * d : k * d])
            gates.append(row[k * d + (k - 1) * d :] + ape[j, (k - 1) * d :])
        kv, gate = torch.stack(kvs), torch.stack(gates)
        out.append((torch.softmax(gate, dim=0) * kv).sum(dim=0))
    return torch.stack(out)


@pytest.mark.parametrize("series", [1, 2])
@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 64])
def test_entries_through_the_ring_match_the_direct_computation(series: int, chunk: int) -> None:
    shape = CompressorShape(rate=4, width=6, series=series)
    torch.manual_seed(0)
    n = 37  # 9 windows closed, one token pending at the end
    rows = torch.randn(n, shape.row_width, dtype=torch.float64)
    ape = torch.randn(shape.rate, series * shape.width, dtype=torch.float64)
    expected = _direct(shape, rows, ape)
    ring = torch.full((shape.ring_rows, shape.row_width), float("nan"), dtype=torch.float64)  # never read
    entries = []
    for start in range(0, n, chunk):
        new = rows[start : start + chunk]
        seq, lo = step_rows(ring, new, start, shape.ring_rows)
        windows = range(start // shape.rate, (start + len(new)) // shape.rate)
        if len(windows):
            entries.append(pool_windows(shape, seq.double(), lo, windows, ape, torch.float64))
        ring = ring_after(ring, new, start, len(new)).double()
    got = torch.cat(entries)
    assert got.shape == expected.shape == (n // shape.rate, shape.width)
    torch.testing.assert_close(got, expected)


def test_the_ring_keeps_the_last_positions_at_their_rows() -> None:
    ring = torch.zeros(8, 2)
    rows = torch.arange(10.0).repeat_interleave(2).view(10, 2)  # row i holds position 5 + i
    after = ring_after(ring, rows, start=5, count=10)
    # positions 7 .. 14 at rows p % 8
    assert [int(after[p % 8, 0]) for p in range(7, 15)] == [p - 5 for p in range(7, 15)]
    partial = ring_after(ring, rows, start=5, count=2)  # positions 5, 6 only; the rest untouched
    assert partial[5, 0] == 0 and partial[6, 0] == 1 and partial[7].abs().sum() == 0

"""Quantize / dequantize weight matrices [out, in] (pure tensor math, no kernels).

int8, symmetric per output channel:   q = round(w / s), s = max|w_row| / 127, q in [-127, 127]
                                      w ~ q x s, |error| <= s / 2
int4, asymmetric per group of g inputs (a row is cut into in / g groups):
                                      s = (max - min) / 15, q = round((w - min) / s) in [0, 15]
                                      w ~ q x s + min, |error| <= s / 2
An all-equal group has s = 0: it is stored with s = 1 (any value works, q is 0) and reconstructs
exactly; a zero row in int8 likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_LEVELS = 15  # 4 bits: q in [0, 15]


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor  # [out, in] int32 holding 0..15 (unpacked; the kernel packs it)
    scales: torch.Tensor  # [out, in / group_size] float32
    mins: torch.Tensor  # [out, in / group_size] float32: the value q = 0 stands for
    group_size: int

    def dequantize(self) -> torch.Tensor:
        out, inp = self.qweight.shape
        q = self.qweight.reshape(out, inp // self.group_size, self.group_size).float()
        return (q * self.scales[..., None] + self.mins[..., None]).reshape(out, inp)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scales)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    out, inp = weight.shape
    if inp % group_size:
        raise ValueError(f"in_features {inp} is not a multiple of the int4 group size {group_size}")
    w = weight.float().reshape(out, inp // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    spread = hi - lo
    scales = torch.where(spread > 0, spread / INT4_LEVELS, torch.ones_like(spread))
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, INT4_LEVELS).to(torch.int32)
    return Int4Weight(q.reshape(out, inp), scales, lo, group_size)

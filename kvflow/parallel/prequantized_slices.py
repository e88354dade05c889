"""A rank's slices of a pre-quantized projection (GPTQ, AWQ GEMM, compressed-tensors pack-quantized,
kvflow/quant/checkpoint_formats.py), read packed: the same output rows or input columns as the dense
weight (sharding.py), in each tensor's own layout. P = 32 / bits values per int32 word, g the group
size (per-channel: one group of all K inputs).

                      column-parallel (outputs [o0, o1))     row-parallel (inputs [i0, i1))
GPTQ  qweight [K/P, N]     dim 1 [o0, o1)                     dim 0 [i0/P, i1/P)
      qzeros  [G, N/P]     dim 1 [o0/P, o1/P)                 dim 0 [i0/g, i1/g)
      scales  [G, N]       dim 1 [o0, o1)                     dim 0 [i0/g, i1/g)
      g_idx   [K]          whole                              [i0, i1) minus i0/g
AWQ   qweight [K, N/P]     dim 1 [o0/P, o1/P)                 dim 0 [i0, i1)
      qzeros  [G, N/P]     dim 1 [o0/P, o1/P)                 dim 0 [i0/g, i1/g)
      scales  [G, N]       dim 1 [o0, o1)                     dim 0 [i0/g, i1/g)
CT    weight_packed [N, K/P]      dim 0 [o0, o1)              dim 1 [i0/P, i1/P)
      weight_scale  [N, G]        dim 0 [o0, o1)              dim 1 [i0/g, i1/g)
      weight_zero_point [N/P, G]  dim 0 [o0/P, o1/P)          dim 1 [i0/g, i1/g)
      weight_shape [2]            [o1 - o0, K]                [N, i1 - i0]
FP8   weight [N, K]           dim 0 [o0, o1)              dim 1 [i0, i1)    (a dense weight's slice)
      weight_scale_inv [N/bn, K/bk]  dim 0 [o0/bn, o1/bn)  dim 1 [i0/bk, i1/bk)
CT8   weight_scale [N, 1] / [1]      dim 0 [o0, o1)        whole
NVFP4 weight_packed [N, K/2]         dim 0 [o0, o1)        dim 1 [i0/2, i1/2)
      weight_scale  [N, K/16]        dim 0 [o0, o1)        dim 1 [i0/16, i1/16)
      weight_global_scale, input_global_scale [1]: whole (not projection slices: read as they are)
Per-channel scales and zeros (one group) stay whole when inputs are split; a per-tensor scale (a
dimension of one) is read whole whichever way (sharded_reader.py). Boundaries must fall on
words and groups (checked at plan time: `check_alignment`); GPTQ act-order (desc_act) orders the
inputs by group, so its row-parallel layers cannot be split by input range and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import ConfigError
from kvflow.quant.checkpoint_formats import BITS_PER_WORD, CheckpointQuant
from kvflow.quant.gguf_linear import GROUP as NVFP4_KERNEL_BLOCK


@dataclass(frozen=True)
class PackedSlice:
    """What to read of one packed tensor: `dim` [start, start + length) (None: the whole tensor);
    `subtract` from the values read (g_idx); `shape_value`: a synthesized weight_shape instead."""

    dim: int | None = None
    start: int = 0
    length: int = 0
    subtract: int = 0
    shape_value: tuple[int, int] | None = None


def _group(quant: CheckpointQuant) -> int | None:
    return quant.group_size if quant.group_size > 0 else None  # None: per channel


def packed_slice(
    quant: CheckpointQuant,
    suffix: str,
    column_parallel: bool,
    start: int,
    end: int,
    full_out: int,
    full_in: int,
) -> PackedSlice:
    """[start, end) are outputs (column-parallel) or inputs (row-parallel) of the projection."""
    n = end - start
    if quant.method in ("fp8", "compressed-tensors-fp8"):
        return _fp8_slice(quant, suffix, column_parallel, start, n)
    if quant.method == "compressed-tensors-nvfp4":
        if column_parallel:
            return PackedSlice(0, start, n)
        per_element = {"weight_packed": 2, "weight_scale": quant.group_size}[suffix]  # inputs per element
        return PackedSlice(1, start // per_element, n // per_element)
    p = BITS_PER_WORD // quant.bits
    g = _group(quant)
    if column_parallel:
        table = {
            "gptq": {"qweight": (1, start, n), "qzeros": (1, start // p, n // p), "scales": (1, start, n)},
            "awq": {
                "qweight": (1, start // p, n // p),
                "qzeros": (1, start // p, n // p),
                "scales": (1, start, n),
            },
            "compressed-tensors": {
                "weight_packed": (0, start, n),
                "weight_scale": (0, start, n),
                "weight_zero_point": (0, start // p, n // p),
            },
        }
        if suffix == "g_idx":
            return PackedSlice()
        if suffix == "weight_shape":
            return PackedSlice(shape_value=(n, full_in))
        dim, s, length = table[quant.method][suffix]
        return PackedSlice(dim, s, length)
    grouped = None if g is None else (start // g, n // g)
    if suffix == "weight_shape":
        return PackedSlice(shape_value=(full_out, n))
    if suffix == "g_idx":
        return PackedSlice(0, start, n, subtract=0 if g is None else start // g)
    if quant.method == "gptq" and suffix == "qweight":
        return PackedSlice(0, start // p, n // p)
    if quant.method == "awq" and suffix == "qweight":
        return PackedSlice(0, start, n)
    if quant.method == "compressed-tensors" and suffix == "weight_packed":
        return PackedSlice(1, start // p, n // p)
    if grouped is None:  # per-channel scales / zeros: every input of a row shares them
        return PackedSlice()
    dim = 1 if quant.method == "compressed-tensors" else 0
    return PackedSlice(dim, grouped[0], grouped[1])


def _fp8_slice(quant: CheckpointQuant, suffix: str, column_parallel: bool, start: int, n: int) -> PackedSlice:
    """FP8's scales (the e4m3 `weight` is sliced as a dense weight): block scales by block, per-channel
    scales by output row, a per-tensor scale whole."""
    if quant.method == "fp8":  # weight_scale_inv [ceil(N / bn), ceil(K / bk)]
        if column_parallel:
            return PackedSlice(0, start // quant.block_rows, -(-n // quant.block_rows))
        return PackedSlice(1, start // quant.group_size, -(-n // quant.group_size))
    return PackedSlice(0, start, n) if column_parallel else PackedSlice()  # weight_scale [N, 1] or [1]


def check_fp8_alignment(
    quant: CheckpointQuant, column_widths: dict[str, int], row_widths: dict[str, int]
) -> None:
    """Refuse a tensor_parallel_size whose slices would cut an FP8 scale block: each rank's outputs
    a multiple of the block's rows, its inputs of the block's columns (per-channel and per-tensor
    scales split anywhere)."""
    if quant.method != "fp8":
        return
    for widths, step, what in (
        (column_widths, quant.block_rows, "outputs"),
        (row_widths, quant.group_size, "input columns"),
    ):
        for name, width in widths.items():
            if width % step:
                raise ConfigError(
                    f"fp8 checkpoint: each rank's {name} would hold {width} {what}, not a multiple of the "
                    f"weight_block_size's {step}: a scale block would be split across ranks; choose "
                    "another tensor_parallel_size"
                )


def check_alignment(
    quant: CheckpointQuant, column_widths: dict[str, int], row_widths: dict[str, int]
) -> None:
    """Refuse a tensor_parallel_size whose slices would cut a packed word or a group."""
    if quant.method in ("fp8", "compressed-tensors-fp8"):
        check_fp8_alignment(quant, column_widths, row_widths)
        return
    if quant.method == "compressed-tensors-nvfp4":
        for name, width in row_widths.items():
            if width % NVFP4_KERNEL_BLOCK:
                raise ConfigError(
                    f"nvfp4 checkpoint: each rank's {name} would hold {width} input columns, not a multiple "
                    f"of {NVFP4_KERNEL_BLOCK} (the NVFP4 kernel's block of two 16-input scale groups); "
                    "choose another tensor_parallel_size"
                )
        return
    p = BITS_PER_WORD // quant.bits
    g = _group(quant)
    packed_outputs = quant.method in ("gptq", "awq") or not quant.symmetric  # zeros (or weights) along N
    for name, width in column_widths.items():
        if packed_outputs and width % p:
            raise ConfigError(
                f"{quant.method} checkpoint: each rank's {name} would hold {width} outputs, which cuts "
                f"its {p}-per-word packing; choose another tensor_parallel_size"
            )
    for name, width in row_widths.items():
        if quant.method == "gptq" and quant.desc_act:
            raise ConfigError(
                "GPTQ act-order (desc_act) checkpoints cannot be split by input columns (row-parallel "
                f"{name}); use tensor_parallel_size 1 or a checkpoint without act-order"
            )
        if width % p or (g is not None and width % g):
            step = p if g is None else max(p, g)
            raise ConfigError(
                f"{quant.method} checkpoint: each rank's {name} would hold {width} input columns, not a "
                f"multiple of {step} (the packing and group size {quant.group_size}): groups would be split "
                "across ranks; choose another tensor_parallel_size"
            )

"""Build kvflow's quantized layers from a pre-quantized checkpoint's tensors (GPTQ, AWQ,
compressed-tensors, FP8, NVFP4), merging q/k/v and gate/up the way the dense loader concatenates them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.kernels import ggml_weight_kernels
from kvflow.layers.linear import Linear
from kvflow.quant.checkpoint_formats import (
    TENSOR_SUFFIXES,
    UNPACKERS,
    CheckpointQuant,
    Unpacked,
    UnpackedInt4,
    UnpackedInt8,
)
from kvflow.quant.fp8 import Fp8Linear, UnpackedFp8
from kvflow.quant.gguf_linear import GGUFLinear, UnpackedGGML, concat_rows
from kvflow.quant.linear import ConcatLinear, Int4Linear, Int8Linear
from kvflow.quant.weights import Int4Weight, Int8Weight


def is_prequantized(source: str, available: set[str], quant: CheckpointQuant) -> bool:
    """Does the checkpoint hold `source` (e.g. model.layers.0.self_attn.q_proj) in packed form?"""
    return f"{source}.{TENSOR_SUFFIXES[quant.method][0]}" in available


def unpack_source(
    source: str, quant: CheckpointQuant, read: Callable[[str], torch.Tensor], available: set[str]
) -> Unpacked:
    tensors = {
        s: read(f"{source}.{s}") for s in TENSOR_SUFFIXES[quant.method] if f"{source}.{s}" in available
    }
    try:
        return UNPACKERS[quant.method](tensors, quant)
    except KeyError as exc:
        raise ModelLoadError(f"{source}: missing tensor {exc} of the {quant.method} format") from exc
    except ModelLoadError as exc:  # the unpacker's reason, with the projection it is about
        raise ModelLoadError(f"{source}: {exc}") from exc


def build_linear(parts: list[Unpacked], bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """One module for a (possibly merged) projection; the bias is the merged bias."""
    if all(isinstance(p, UnpackedGGML) for p in parts):
        return _fp4_linear(concat_rows([p for p in parts if isinstance(p, UnpackedGGML)]), bias, dtype)
    if all(isinstance(p, UnpackedFp8) for p in parts):
        fp8 = [p for p in parts if isinstance(p, UnpackedFp8)]
        if len({p.block for p in fp8}) != 1:
            raise ModelLoadError("a merged FP8 projection mixes scale block sizes")
        merged = UnpackedFp8(torch.cat([p.q for p in fp8]), torch.cat([p.scale for p in fp8]), fp8[0].block)
        return Fp8Linear(merged, bias, dtype)
    if all(isinstance(p, UnpackedInt8) for p in parts):
        int8 = [p for p in parts if isinstance(p, UnpackedInt8)]
        q = torch.cat([p.q for p in int8])
        scale = torch.cat([p.scale for p in int8])
        return Int8Linear(Int8Weight(q, scale), bias, dtype)
    if not all(isinstance(p, UnpackedInt4) for p in parts):
        raise ModelLoadError("a merged projection mixes formats (4-bit, 8-bit, FP8, NVFP4 parts)")
    int4 = [p for p in parts if isinstance(p, UnpackedInt4)]
    same_order = all(p.perm is None for p in int4) or all(
        p.perm is not None and int4[0].perm is not None and torch.equal(p.perm, int4[0].perm) for p in int4
    )
    if same_order and len({p.group_size for p in int4}) == 1:
        weight = Int4Weight(
            torch.cat([p.q for p in int4]),
            torch.cat([p.scale for p in int4]),
            torch.cat([p.min for p in int4]),
            int4[0].group_size,
        )
        return Int4Linear(weight, bias, dtype, int4[0].perm)
    biases = [None] * len(int4) if bias is None else list(torch.split(bias, [p.q.shape[0] for p in int4]))
    return ConcatLinear(
        [
            Int4Linear(Int4Weight(p.q, p.scale, p.min, p.group_size), b, dtype, p.perm)
            for p, b in zip(int4, biases, strict=True)
        ]
    )


def _fp4_linear(weight: UnpackedGGML, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """An NVFP4 projection on its codes (bf16 with the native kernels), else its dequantized weight
    in `dtype` (float32 models, CPUs without the kernels): the same numbers, 4x-8x the memory."""
    kernels = ggml_weight_kernels() if dtype == torch.bfloat16 else None
    if kernels is not None:
        return GGUFLinear(weight, bias, kernels)
    n, k = weight.q.shape
    dense = Linear(k, n, bias is not None, dtype)
    dense.weight.data.copy_(weight.dequantize().to(dtype))
    if bias is not None:
        assert dense.bias is not None
        dense.bias.data.copy_(bias.to(dtype))
    return dense

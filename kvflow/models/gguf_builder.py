"""Which GGUF projections compute on their stored blocks, and the layers that do.

A projection whose every source is of a type with a kernel (kvflow/quant/gguf_linear.py) becomes
that kernel's layer on the file's own bytes, when the model runs in bfloat16 with the native
kernels. Everything else (float32 models, types without a kernel, embeddings) is dequantized at
load into the model dtype; the summary line says which types and what that costs in memory.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from kvflow.kernels import ggml_weight_kernels
from kvflow.models.gguf_loader import GGUFTensorReader
from kvflow.quant.gguf_linear import KERNEL_TYPES, GGUFLinear, UnpackedGGML, concat_rows, unpack_ggml
from kvflow.quant.linear import ConcatLinear

logger = logging.getLogger("kvflow")


class GGUFLinearBuilder:
    def __init__(self, reader: GGUFTensorReader, dtype: torch.dtype) -> None:
        self.reader = reader
        self.dtype = dtype
        self.kernels = ggml_weight_kernels() if dtype == torch.bfloat16 else None
        self.packed_types: dict[str, int] = defaultdict(int)  # type -> tensors computed on their blocks

    def is_packed(self, sources: list[str]) -> bool:
        """Whether every source is stored in a type with a kernel (and the model runs them: bf16)."""
        if self.kernels is None or not all(s in self.reader.files for s in sources):
            return False
        return all(self.reader.stored_type(s) in KERNEL_TYPES for s in sources)

    def build(self, sources: list[str], bias: torch.Tensor | None) -> nn.Module:
        """One GGUFLinear over the sources stacked along the output dimension, or, where the file
        stores them in different types (Q4_K_M: attn_v in Q6_K beside q/k in Q4_K), one per run of
        equal types, concatenated."""
        assert self.kernels is not None
        parts: list[UnpackedGGML] = []
        for source in sources:
            stored = self.reader.stored(source)
            parts.append(
                unpack_ggml(
                    stored.type_name, stored.data, stored.shape, f"{self.reader.gguf.path}: {stored.name}"
                )
            )
            self.packed_types[stored.type_name] += 1
        runs: list[list[UnpackedGGML]] = []
        for part in parts:
            if runs and runs[-1][0].type_name == part.type_name:
                runs[-1].append(part)
            else:
                runs.append([part])
        merged = [concat_rows(run) for run in runs]
        if len(merged) == 1:
            return GGUFLinear(merged[0], bias, self.kernels)
        sizes = [m.q.shape[0] for m in merged]
        biases = [None] * len(merged) if bias is None else list(torch.split(bias, sizes))
        return ConcatLinear([GGUFLinear(m, b, self.kernels) for m, b in zip(merged, biases, strict=True)])

    def log_summary(self) -> str:
        """One line: the projections on their own blocks by type, and the block-quantized tensors
        dequantized at load with the memory that costs (`dtype` bytes per value against the file's)."""
        path = self.reader.gguf.path
        kept = ", ".join(f"{n} {t}" for t, n in sorted(self.packed_types.items())) or "none"
        if self.kernels is None:
            kept += (
                f" (the model runs in {str(self.dtype).removeprefix('torch.')}: the kernels compute in bf16)"
            )
        by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for type_name, file_bytes, values in self.reader.dequantized.values():
            entry = by_type[type_name]
            entry[0] += 1
            entry[1] += file_bytes
            entry[2] += values * self.dtype.itemsize
        line = f"GGUF {path.name}: projections computing on the file's blocks: {kept}"
        if by_type:
            parts = [
                f"{n} {t} ({file_bytes / 2**20:.1f} MiB in the file -> {held / 2**20:.1f} MiB)"
                for t, (n, file_bytes, held) in sorted(by_type.items())
            ]
            line += f"; dequantized at load to {str(self.dtype).removeprefix('torch.')}: " + ", ".join(parts)
        logger.info(line)
        return line

"""Read a rank's slices of checkpoint tensors without reading the rest (safetensors `get_slice`).

safetensors maps the file and `get_slice(name)[a:b]` copies only the bytes of those rows (or, for a
column slice, of those columns of each row): a rank never materialises a whole projection it holds
a part of, so N ranks together read the model once, not N times.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvflow.errors import ModelLoadError
from kvflow.models.loader import open_safetensors
from kvflow.parallel.prequantized_slices import PackedSlice
from kvflow.parallel.sharding import ShardLayout, TensorSlice


class ShardedTensorReader:
    """The loader's tensor reader (kvflow/models/loader.py TensorReader) for one rank."""

    def __init__(self, files: dict[str, Path], layout: ShardLayout) -> None:
        self.files = files
        self.layout = layout
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0  # what this rank read from the files (the startup log reports it)

    def _handle(self, name: str) -> Any:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = open_safetensors(path)
        return self._handles[path]

    def read(self, name: str) -> torch.Tensor:
        packed = self.layout.packed_slice_of(name)
        part = None if packed is not None else self.layout.slice_of(name)
        try:
            view = self._handle(name).get_slice(name)
            if packed is not None:
                tensor = _read_packed(view, packed)
            else:
                tensor = view[:] if part is None else _read_part(view, part, name)
        except ModelLoadError:
            raise
        except Exception as exc:  # a truncated file, a header listing bytes it does not hold
            raise ModelLoadError(
                f"{self.files[name]}: cannot read {name!r} ({type(exc).__name__}: {exc})"
            ) from exc
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _read_part(view: Any, part: TensorSlice, name: str) -> torch.Tensor:
    shape = list(view.get_shape())
    if part.zeros:
        return torch.zeros(shape, dtype=_dtype_of(view))
    end = part.start + part.length
    if end > shape[part.dim]:
        raise ModelLoadError(
            f"{name}: shape {tuple(shape)} has no {'rows' if part.dim == 0 else 'columns'} "
            f"[{part.start}, {end}) for this rank (does config.json match the weights?)"
        )
    tensor = view[part.start : end] if part.dim == 0 else view[:, part.start : end]
    if part.pad_to is not None and tensor.shape[0] < part.pad_to:
        pad = torch.zeros((part.pad_to - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
        tensor = torch.cat((tensor, pad))
    return tensor


def _read_packed(view: Any, part: PackedSlice) -> torch.Tensor:
    if part.shape_value is not None:  # compressed-tensors' weight_shape: this rank's [N, K]
        return torch.tensor(part.shape_value, dtype=_dtype_of(view))
    if part.dim is None or view.get_shape()[part.dim] == 1:  # whole, or a per-tensor scale
        return view[:]
    end = part.start + part.length
    tensor = view[part.start : end] if part.dim == 0 else view[:, part.start : end]
    return tensor - part.subtract if part.subtract else tensor


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def _dtype_of(view: Any) -> torch.dtype:
    return _SAFETENSORS_DTYPES.get(view.get_dtype(), torch.float32)

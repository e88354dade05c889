"""One GGUF file: its metadata and tensor table, parsed here; types and block sizes from the `gguf`
package (llama.cpp's own Python package).

A GGUF file is a header (magic "GGUF", version, tensor and key counts), key/value metadata (the
architecture's hyperparameters, the tokenizer, the chat template), a table of tensors (name, dims,
ggml type, offset) and the tensor data, aligned. The data is memory-mapped: opening costs the
metadata only, and tensor bytes are read when a layer is built from them.

Why not `gguf.GGUFReader`: it builds a numpy view per metadata part, and a 150k-token vocabulary
(tokens and merges: 300k strings) took it 6.3 s of a 7.2 s open on this machine; this parser reads
the same file in well under a second. Errors name the file and, where one is at fault, the tensor:
truncated data, an unknown ggml type, a damaged header.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
_REQUIRED = object()


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. `shape` is torch's order (outermost first: [..., rows, K]); `data` is
    a read-only view of the mapped file: values for F32 / F16 ([..., rows, K]), raw bytes for every
    other type, BF16 included ([..., rows, K / block x bytes per block])."""

    name: str
    type_name: str  # ggml's name: "F16", "Q8_0", "Q4_K", ...
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.num_bytes / max(1, int(np.prod(self.shape)))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.field("general.architecture"))

    def field(self, key: str, default: Any = _REQUIRED) -> Any:
        """The metadata value of `key` (a ModelLoadError naming the file when required and absent)."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.path}: the GGUF metadata has no {key!r}")
        return default

    def arch_field(self, key: str, default: Any = _REQUIRED) -> Any:
        """`{architecture}.{key}`, e.g. arch_field("block_count") -> metadata["qwen2.block_count"]."""
        return self.field(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path}: the GGUF file has no tensor {name!r}")
        return self.tensors[name]


def is_gguf_path(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (a regular file ending in .gguf or starting with its magic)."""
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    if p.suffix == GGUF_SUFFIX:
        return True
    with open(p, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor table. Parsed once per (path, size, mtime): the engine, its
    loader and the doctor ask for the same file several times, and a 150k-token vocabulary takes
    seconds to parse."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    stat = p.stat()
    return _open_cached(p, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError as exc:  # a declared dependency; a broken environment still gets a clear message
        raise ModelLoadError(f"{path}: reading GGUF files needs the `gguf` package ({exc})") from exc
    with open(path, "rb") as f:
        if size == 0:
            raise ModelLoadError(f"{path}: the file is empty")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        header = _Header(buf, path)
        metadata, infos, data_start = header.parse()
    except _Truncated as exc:
        raise ModelLoadError(
            f"{path}: truncated in its header ({size} bytes): the download may be incomplete, fetch it again"
        ) from exc
    except (ValueError, UnicodeDecodeError, struct.error) as exc:
        raise ModelLoadError(f"{path}: a damaged GGUF header: {exc}") from exc
    known = {int(t) for t in GGMLQuantizationType}
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = {}
    for name, dims, type_id, offset in infos:
        if type_id not in known:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has ggml type {type_id}, which the installed gguf package does not "
                "know (a newer llama.cpp type?): upgrade gguf, or use a file quantized to a known type"
            )
        ggml_type = GGMLQuantizationType(type_id)
        block, type_bytes = GGML_QUANT_SIZES[ggml_type]
        shape = tuple(reversed(dims))  # GGUF lists the innermost dim first
        elements = int(np.prod(shape)) if shape else 1
        if shape and shape[-1] % block:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ({ggml_type.name}) has rows of {shape[-1]} values, not a multiple "
                f"of its block of {block}"
            )
        begin = data_start + offset
        end = begin + elements // block * type_bytes
        if end > size:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ({ggml_type.name}, dims {list(shape)}) ends at byte {end} but the "
                f"file has {size}: the file is truncated, fetch it again"
            )
        raw = data[begin:end]
        values = _typed(raw, ggml_type.name, shape)
        tensors[name] = GGUFTensor(name, ggml_type.name, type_id, shape, values)
    return GGUFFile(path, metadata, tensors)


_FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16}


def _typed(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """F32 / F16 as their values [*shape]; every other type as bytes [*shape[:-1], row bytes]."""
    if type_name in _FLOAT_VIEWS:
        return raw.view(_FLOAT_VIEWS[type_name]).reshape(shape)
    rows = shape[:-1] if shape else ()
    return raw.reshape(*rows, -1) if rows else raw


# ------------------------------------------------------------------------------------ the header

# GGUF metadata value types (gguf.GGUFValueType): struct formats of the scalars, and the two others.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_SUPPORTED_VERSIONS = (2, 3)


class _Truncated(Exception):
    pass


class _Header:
    """A little-endian GGUF header read from `buf` (module docstring)."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def _read(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def _string(self) -> str:
        length = self._read("Q")
        if self.pos + length > len(self.buf):
            raise _Truncated
        text = self.buf[self.pos : self.pos + length].decode("utf-8")
        self.pos += length
        return text

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"a metadata value of unknown type {vtype}")
        item_type, count = self._read("I"), self._read("Q")
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
            if self.pos + count * dtype.itemsize > len(self.buf):
                raise _Truncated
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return items.tolist()
        return [self._value(item_type) for _ in range(count)]

    def parse(self) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
        """(metadata, [(tensor name, dims innermost first, ggml type id, data offset)], data start)."""
        if bytes(self.buf[: len(GGUF_MAGIC)]) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (it does not start with the magic bytes 'GGUF')")
        self.pos = len(GGUF_MAGIC)
        version = self._read("I")
        if version not in _SUPPORTED_VERSIONS:
            swapped = version & 0xFFFF == 0
            raise ValueError(
                "a big-endian GGUF file (kvflow reads little-endian ones)"
                if swapped
                else f"GGUF version {version} (kvflow reads versions {_SUPPORTED_VERSIONS})"
            )
        num_tensors, num_keys = self._read("Q"), self._read("Q")
        metadata = {}
        for _ in range(num_keys):
            key = self._string()
            metadata[key] = self._value(self._read("I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = tuple(self._read("Q") for _ in range(self._read("I")))
            type_id, offset = self._read("I"), self._read("Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        return metadata, infos, -(-self.pos // alignment) * alignment

"""What decides a KV block's bytes besides its tokens: the offload tier's fingerprint
(kvflow/kv_offload/disk_tier.py keys every block by it and writes it into every file's header), and
the KV transfer's (kvflow/kv_transfer/: the same, with the checkpoint identified across machines).

The model is identified by its files (names, sizes, modification times, and config.json's bytes):
a different checkpoint, or the same directory with new weights, never reads another's blocks.
Then every setting that changes the K/V bytes of the same tokens: the dtype, the KV cache dtype,
weight quantization, block size, and the store's layout of a block (tensor shapes and order), which
also covers a different number of KV heads per process under tensor parallelism.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvflow.kv_offload.disk_tier import FORMAT_VERSION

_MODEL_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")


def model_files_identity(model: str) -> list[Any]:
    """(name, size, mtime_ns) of the checkpoint's files, and config.json's bytes hashed."""
    path = Path(model)
    files = (
        [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _MODEL_FILE_SUFFIXES)
    )
    identity: list[Any] = [os.path.realpath(path)]
    for f in files:
        st = f.stat()
        identity.append([f.name, st.st_size, st.st_mtime_ns])
    config = path / "config.json"
    if config.is_file():
        identity.append(hashlib.sha256(config.read_bytes()).hexdigest())
    return identity


def portable_model_identity(model: str) -> list[Any]:
    """The checkpoint as another machine sees the same one: config.json's bytes and the weight
    files' names and sizes (no path, no modification time)."""
    path = Path(model)
    if path.is_file():
        return [path.name, path.stat().st_size]
    config = path / "config.json"
    identity: list[Any] = [hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None]
    return identity + sorted(
        [f.name, f.stat().st_size] for f in path.iterdir() if f.suffix in (".safetensors", ".gguf")
    )


def _digest(model_identity: list[Any], settings: dict[str, Any], block_layout: list[Any]) -> bytes:
    record = {
        "format": FORMAT_VERSION,
        "model": model_identity,
        "settings": settings,
        "block_layout": block_layout,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).digest()


def tier_fingerprint(model: str, settings: dict[str, Any], block_layout: list[Any]) -> bytes:
    """sha256 over the model's files, the KV-relevant settings and the block layout (32 bytes)."""
    return _digest(model_files_identity(model), settings, block_layout)


def transfer_fingerprint(model: str, settings: dict[str, Any], block_layout: list[Any]) -> str:
    """The same for a prompt's KV moving between instances (kvflow/kv_transfer/): what must match for
    one instance's block bytes to mean the same in another's pool, on another machine too (the
    checkpoint by portable_model_identity). Hex, as it travels in kv_transfer_params."""
    return _digest(portable_model_identity(model), settings, block_layout).hex()[:32]

"""What decides a KV block's bytes besides its tokens: the offload tier's fingerprint
(kvflow/kv_offload/disk_tier.py keys every block by it and writes it into every file's header).

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


def tier_fingerprint(model: str, settings: dict[str, Any], block_layout: list[Any]) -> bytes:
    """sha256 over the model's files, the KV-relevant settings and the block layout (32 bytes)."""
    record = {
        "format": FORMAT_VERSION,
        "model": model_files_identity(model),
        "settings": settings,
        "block_layout": block_layout,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).digest()

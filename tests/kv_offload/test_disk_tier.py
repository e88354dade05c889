"""The offload tier's files (kvflow/kv_offload/disk_tier.py), without torch: blocks round-trip,
the size bound evicts least recently used first, a restart rebuilds the index from the files, and
torn, foreign, damaged and half-written files are skipped, never loaded."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from kvflow.kv_offload.disk_tier import HEADER_BYTES, DiskKVTier

FINGERPRINT = hashlib.sha256(b"model A, bf16, block 16").digest()
OTHER = hashlib.sha256(b"model B").digest()
PAYLOAD = 1000  # bytes per block in these tests; a file is HEADER_BYTES more


def _hash(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _payload(i: int) -> bytes:
    return bytes([i % 256]) * PAYLOAD


def _tier(path: Path, blocks: float = 100, fingerprint: bytes = FINGERPRINT) -> DiskKVTier:
    return DiskKVTier(path, int(blocks * (PAYLOAD + HEADER_BYTES)), fingerprint)


def test_blocks_round_trip_and_consecutive_hits_stop_at_a_gap(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i in (0, 1, 2, 4):
        tier.store(_hash(i), _payload(i))
    tier.flush()
    assert tier.num_consecutive([_hash(i) for i in range(6)]) == 3
    read = tier.load_async([_hash(i) for i in range(6)]).result()
    assert read.payloads == [_payload(i) for i in range(3)] and read.seconds > 0
    assert tier.stats.blocks_read == 3 and tier.stats.blocks_stored == 4
    assert tier.load(_hash(3)) is None  # never stored


def test_the_size_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    tier = _tier(tmp_path, blocks=3)
    for i in range(3):
        tier.store(_hash(i), _payload(i))
    tier.flush()
    assert tier.load(_hash(0)) == _payload(0)  # a read makes 0 recently used
    assert tier.refresh(_hash(1)) and not tier.refresh(_hash(7))  # so does a refresh (1; 7 is not held)
    tier.store(_hash(3), _payload(3))
    tier.flush()
    assert [_hash(i) in tier for i in range(4)] == [True, True, False, True]
    assert tier.stats.blocks_evicted == 1 and tier.num_blocks == 3
    assert len(list(tmp_path.iterdir())) == 3


def test_a_restart_rebuilds_the_index_and_skips_torn_and_foreign_files(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i in range(4):
        tier.store(_hash(i), _payload(i))
    tier.close()
    files = sorted(tmp_path.iterdir(), key=lambda f: f.name)
    torn = tmp_path / tier.name(_hash(1))
    torn.write_bytes(torn.read_bytes()[:-10])  # a block cut short
    foreign = _tier(tmp_path / "b", fingerprint=OTHER)
    foreign.store(_hash(9), _payload(9))
    foreign.close()
    for f in (tmp_path / "b").iterdir():
        os.replace(f, tmp_path / f.name)  # another model's block in this directory
    (tmp_path / "leftover.tmp").write_bytes(b"half a write")  # a crash mid-write
    again = _tier(tmp_path)
    assert [_hash(i) in again for i in range(4)] == [True, False, True, True]
    assert again.stats.files_skipped == 2
    assert again.load(_hash(2)) == _payload(2)
    assert not (tmp_path / "leftover.tmp").exists()
    assert len(files) == 4


def test_a_damaged_payload_is_dropped_and_counted(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.store(_hash(0), _payload(0))
    tier.flush()
    path = tmp_path / tier.name(_hash(0))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert tier.load(_hash(0)) is None
    assert tier.stats.read_errors == 1 and _hash(0) not in tier and not path.exists()


def test_restarting_with_a_smaller_size_trims_the_oldest(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i in range(4):
        tier.store(_hash(i), _payload(i))
        tier.flush()
        os.utime(tmp_path / tier.name(_hash(i)), (time.time() + i, time.time() + i))
    tier.close()
    smaller = _tier(tmp_path, blocks=2)
    assert [_hash(i) in smaller for i in range(4)] == [False, False, True, True]
    assert len(list(tmp_path.iterdir())) == 2

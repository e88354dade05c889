"""glibc's thresholds fixed for `kvflow profile-steps` (kvflow/engine/heap.py): a freed block the
next step allocates again is not faulted in again. Each check runs in a fresh interpreter: the
settings are the process's."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kvflow.engine.heap import TRIM_THRESHOLD_BYTES

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# A step's temporary: above glibc's initial mmap threshold (128 KiB), below MMAP_THRESHOLD_BYTES.
BLOCK_BYTES = 20 << 20
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

# Allocates and writes BLOCK_BYTES three times, freeing it each time; prints whether the settings
# took and the page faults of each round.
PROBE = """
import ctypes, json, resource, sys
from kvflow.engine.heap import keep_freed_heap
kept = keep_freed_heap() if sys.argv[1] == "fixed" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(int(sys.argv[2]))
    libc.memset(block, 1, int(sys.argv[2]))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _probe(mode: str, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(BLOCK_BYTES)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_freed_step_temporary_is_not_faulted_in_again() -> None:
    block_pages = BLOCK_BYTES // PAGE_BYTES
    fixed = _probe("fixed")
    assert fixed["kept"] is True
    first, *again = fixed["faults"]  # type: ignore[misc]
    assert first >= block_pages // 2  # the first allocation maps its pages
    assert max(again) < block_pages // 20  # later ones reuse them: the heap kept the freed block
    # glibc's adaptive default: the first free unmaps the block, the next allocation maps it anew.
    default = _probe("default")
    assert default["faults"][1] >= block_pages // 2  # type: ignore[index]
    assert BLOCK_BYTES < TRIM_THRESHOLD_BYTES


def test_the_users_own_malloc_settings_are_left_alone() -> None:
    assert _probe("fixed", {"MALLOC_TRIM_THRESHOLD_": str(64 << 20)})["kept"] is False
    assert _probe("fixed", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=67108864"})["kept"] is False

"""glibc malloc's thresholds fixed for a process that times the engine's steps in its main thread
(`kvflow profile-steps`), so that its steps cost what a server's do.

Why: in the main thread glibc adapts its mmap threshold to the largest block freed so far and gives
the heap's free top back to the kernel beyond twice that. The torch path's step temporaries (each
query row's gathered keys: an 8-token suffix after 768 cached tokens gathers 8 x 776 keys x 4 heads
x 64 x 4 bytes, 6.4 MB, per layer for K and V) are then unmapped after one step and faulted in again
by the next. On the planted wide model (float32, 2-core Zen 4, session 43) such a step took 29-47
ms with 12,288 page faults in about half of the processes, 13-19 ms with none in the others and in
every process with the thresholds fixed, and a 512-token prefill faulted up to 13,000 pages.
A server runs its engine in a thread of its own, whose arena glibc does not give back that way: its
steps do not fault, and took the same with and without fixed thresholds (the 8-token suffix's step
a median 20.4 and 19.7 ms, two servers alternated). The doctor prices a server's steps from the
profile (kvflow/doctor/step_profile.py), so the profile is measured without the faults too.

Not applied to servers or offline engines: on a bfloat16 model with 9,728-wide MLPs, glibc keeping
1-4 GiB of freed memory sped a 2,048-token prefill up by 11% and slowed a 512-token one and the
offline workload by about 3% (benchmarks/NOTES.md, session 8).
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt(3)'s parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap: the largest threshold glibc's own adaptation reaches on a
# 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX), so larger blocks stay mapped and unmapped as before.
MMAP_THRESHOLD_BYTES = 32 << 20
# Freed heap top kept mapped, up to this: several steps' temporaries of a small model (a 512-token
# prefill of the planted wide model, 4 layers of 512 wide, allocates ~50 MB in one step).
TRIM_THRESHOLD_BYTES = 256 << 20
# A user's own settings of these (glibc reads them at start): left as they are.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_heap() -> bool:
    """Fix glibc's mmap and trim thresholds (MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES) for this
    process; False, with nothing changed, where the C library is not glibc, where the user set
    glibc's malloc tunables, or where mallopt refuses."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)  # int mallopt(int param, int value)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )

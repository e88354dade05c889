"""Where and how the native kernels are built: once per key, one process at a time, never wedged.

Key. A build lives in `<root>/<toolchain>-<sources>/` (root: KVFLOW_KERNEL_CACHE, else
~/.cache/kvflow/kernels). `toolchain` hashes what makes a binary incompatible: torch's version, the
Python ABI, the compiler and the flags; `sources` hashes every source and header. Two environments
(two venvs, two kvflow versions) thus keep two builds instead of rebuilding each other's on every
switch, and a build is never reused for sources it was not made from.

Lock. A build holds an OS file lock (`fcntl.flock` on `<root>/<key>.lock`). The kernel releases it
when its process dies, however it dies (Ctrl-C during the first `kvflow demo`, SIGKILL, a timeout),
so a killed build can never make later starts wait forever (a lock file that its owner must
delete, as torch.utils.cpp_extension's is, wedges every later start after a Ctrl-C).

Progress. A build prints what it does and how long it took; a process that waits for another's build
says so every WAIT_REPORT_S, and gives up after `wait_timeout_s` (its caller then uses the torch
paths, as when a build fails).

Incremental. A new key's directory starts as a copy of the newest build of the same toolchain
(objects, ninja's logs, modification times kept): ninja then recompiles only the sources that
changed, as it would in place. Builds unused for PRUNE_AFTER_S are deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")

CACHE_ENV = "KVFLOW_KERNEL_CACHE"
# While another process builds: how often to say so, and how long to wait at most (a build takes
# about 21 s on 2 cores, 2.5 minutes before aten_lite.h and ninja_build.py; a much longer wait
# means that process is stuck, not slow).
WAIT_REPORT_S = 10.0
DEFAULT_WAIT_TIMEOUT_S = 20 * 60.0
LOCK_POLL_S = 0.2
PRUNE_AFTER_S = 14 * 24 * 3600.0


class BuildLockTimeout(TimeoutError):
    """Another process held the build lock for longer than the wait allows."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvflow" / "kernels")


def toolchain_key(cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """What makes a build binary-incompatible: torch, the Python ABI, the compiler, the flags."""
    import torch

    parts = [
        torch.__version__,
        sys.implementation.cache_tag or "",
        platform.machine(),
        _compiler_identity(),
        *cflags,
        "|",
        *ldflags,
    ]
    return _digest(p.encode() for p in parts)


def sources_key(paths: Sequence[Path]) -> str:
    """Every source and header, by name and content."""
    return _digest(part for p in sorted(paths) for part in (p.name.encode(), p.read_bytes()))


def build_dir_for(root: Path, toolchain: str, sources: str) -> Path:
    return root / f"{toolchain}-{sources}"


def locked_build(
    build_dir: Path,
    build: Callable[[Path], T],
    what: str,
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    is_built: Callable[[Path], bool] | None = None,
    load: Callable[[Path], T] | None = None,
) -> T:
    """`build(build_dir)` under the directory's lock (module docstring). `is_built(dir)` says whether
    a finished build is there: then `load(dir)` (default: `build`) runs instead, quietly."""
    root = build_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    with build_lock(root / f"{build_dir.name}.lock", what, wait_timeout_s):
        fresh = is_built is None or not is_built(build_dir)
        if fresh:
            _seed_from_sibling(build_dir)
        build_dir.mkdir(exist_ok=True)
        os.utime(build_dir)  # "last used", for pruning
        if not fresh:
            return (load or build)(build_dir)
        build_progress(f"building {what} in {build_dir} (once for these sources, torch and compiler) ...")
        started = time.monotonic()
        result = build(build_dir)
        build_progress(f"built {what} in {time.monotonic() - started:.0f} s")
    _prune(root, keep=build_dir)
    return result


@contextlib.contextmanager
def build_lock(lock_path: Path, what: str, wait_timeout_s: float) -> Iterator[None]:
    """An exclusive flock on `lock_path`, released on exit or when the process dies."""
    with open(lock_path, "a+") as handle:
        if not _try_lock(handle):
            _wait_for_lock(handle, lock_path, what, wait_timeout_s)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")  # who holds it, for the waiting message; not the lock itself
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _try_lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_for_lock(handle: IO[str], lock_path: Path, what: str, wait_timeout_s: float) -> None:
    started = time.monotonic()
    next_report = started
    while not _try_lock(handle):
        waited = time.monotonic() - started
        if waited >= wait_timeout_s:
            raise BuildLockTimeout(
                f"another process (pid {_holder(lock_path)}) has been building {what} for over "
                f"{wait_timeout_s:.0f} s ({lock_path})"
            )
        if time.monotonic() >= next_report:
            build_progress(
                f"waiting for another process (pid {_holder(lock_path)}) building {what} "
                f"({waited:.0f} s so far)"
            )
            next_report += WAIT_REPORT_S
        time.sleep(LOCK_POLL_S)


def _holder(lock_path: Path) -> str:
    with contextlib.suppress(OSError):
        return lock_path.read_text().strip() or "?"
    return "?"


def _seed_from_sibling(build_dir: Path) -> None:
    """Copy the newest finished build of the same toolchain into `build_dir` (module docstring)."""
    toolchain = build_dir.name.split("-", 1)[0]
    siblings = [
        d
        for d in build_dir.parent.glob(f"{toolchain}-*")
        if d.is_dir() and d != build_dir and any(d.glob("*.so"))
    ]
    for sibling in sorted(siblings, key=lambda d: d.stat().st_mtime, reverse=True)[:1]:
        with open(build_dir.parent / f"{sibling.name}.lock", "a+") as handle:
            if not _try_lock(handle):
                return  # being rebuilt right now: start from scratch rather than from half a build
            try:
                build_dir.mkdir(exist_ok=True)
                for item in sibling.iterdir():
                    if item.is_file():
                        shutil.copy2(item, build_dir / item.name)
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _prune(root: Path, keep: Path) -> None:
    """Delete builds unused for PRUNE_AFTER_S, each only while its lock is free."""
    cutoff = time.time() - PRUNE_AFTER_S
    for directory in root.iterdir():
        if not directory.is_dir() or directory == keep or directory.stat().st_mtime > cutoff:
            continue
        with open(root / f"{directory.name}.lock", "a+") as handle:
            if _try_lock(handle):
                try:
                    shutil.rmtree(directory, ignore_errors=True)
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)


def _compiler_identity() -> str:
    """The C++ compiler torch will call (CXX, else c++), by resolved path and modification time:
    an upgraded compiler counts as another toolchain, without running it on every start."""
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name)
    if path is None:
        return name
    resolved = Path(path).resolve()
    return f"{resolved}:{resolved.stat().st_mtime_ns}"


def _digest(parts: Iterator[bytes] | Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def build_progress(message: str) -> None:
    # Printed, not logged: a library's logging is often unconfigured, and a silent multi-minute
    # pause is exactly what this must never look like.
    print(f"[kvflow] {message}", file=sys.stderr, flush=True)

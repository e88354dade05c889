"""Compile kvflow's native kernels with ninja: one line per compiled unit, per-unit flags, and an
error that says which unit failed and why.

torch.utils.cpp_extension.load() builds the same way (it writes a build.ninja and runs ninja), but it
is silent for the whole build, gives every unit the same flags, and cannot precompile a header. Here:

- **Precompiled header.** Every kernel unit starts with aten_lite.h (1.5 s to parse on this VM, 11
  times). `kvflow_pch.h` (written into the build directory: `#include` of aten_lite.h and the standard
  headers the kernels share) is compiled once to `kvflow_pch.h.gch`, and each unit is compiled with
  `-include kvflow_pch.h` from the build directory, where GCC finds the .gch beside the header and
  loads it instead of parsing. The units' own `#include "aten_lite.h"` then stops at its guard.
  A compiler that rejects the .gch (another compiler, other flags) parses the header instead, with a
  warning (-Winvalid-pch): slower, never wrong.
- **Per-unit optimisation.** The pybind11 glue (bindings.cpp) is compiled at -O1: its cost is
  template instantiation, and its speed is a few argument conversions per call.
- **Progress.** ninja's status line for each finished unit is printed as `[kvflow] compiled x.cpp (3/14)`.

Measured in benchmarks/NOTES.md (session 23).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

PCH_HEADER = "kvflow_pch.h"
# What the precompiled header holds: the torch slice and the standard headers most units include.
_PCH_INCLUDES = ("<algorithm>", "<cmath>", "<cstdint>", "<cstring>", "<vector>", "<immintrin.h>")
# Units compiled without the precompiled header (they include pybind11 or more of ATen first, and a
# precompiled header must come first in a unit) and their optimisation level, when not the target's.
_UNIT_OPTIMISATION = {"bindings.cpp": "-O1"}
_NO_PCH_UNITS = frozenset({"bindings.cpp"})
# How many lines of a failed build's output the error carries.
ERROR_TAIL_LINES = 40
_STATUS = re.compile(r"^\[(\d+)/(\d+)\] (compiled|precompiled|linked) (\S+)$")


class NativeBuildError(RuntimeError):
    """A unit failed to compile or link; the message carries the compiler's last lines."""


def compile_flags(module_name: str, target_cflags: Sequence[str]) -> list[str]:
    """Flags every unit shares: torch's and Python's headers, PIC, C++20, the target's ISA and -O."""
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    return [
        f"-DTORCH_EXTENSION_NAME={module_name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(flag for path in includes for flag in ("-isystem", path)),
        "-fPIC",
        "-std=c++20",
        *target_cflags,
    ]


def link_flags(target_ldflags: Sequence[str]) -> list[str]:
    """The shared object links against torch's libraries (as cpp_extension links a Python module)."""
    from torch.utils.cpp_extension import library_paths

    torch_libs = ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    return ["-shared", *target_ldflags, *(f"-L{p}" for p in library_paths()), *torch_libs]


def write_build_file(
    build_dir: Path,
    sources: Sequence[Path],
    module_name: str,
    cflags: Sequence[str],
    ldflags: Sequence[str],
    pch_source: Path,
) -> Path:
    """build.ninja (and kvflow_pch.h) in `build_dir` for `sources` -> `<module_name>.so`."""
    build_dir.mkdir(parents=True, exist_ok=True)
    pch_lines = [f'#include "{pch_source}"', *(f"#include {h}" for h in _PCH_INCLUDES)]
    _write_if_changed(build_dir / PCH_HEADER, "\n".join(pch_lines) + "\n")
    q = shlex.quote
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {q(os.environ.get('CXX', 'c++'))}",
        f"cflags = {' '.join(q(f) for f in cflags)}",
        f"ldflags = {' '.join(q(f) for f in ldflags)}",
        "",
        "rule pch",
        "  command = $cxx -MMD -MF $out.d $cflags -x c++-header $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = precompiled $in",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $cflags $unit_flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compiled $name",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = linked $out",
        "",
        f"build {PCH_HEADER}.gch: pch {PCH_HEADER}",
    ]
    objects = []
    for source in sources:
        obj = f"{source.stem}.o"
        objects.append(obj)
        unit_flags = [_UNIT_OPTIMISATION.get(source.name, "")]
        implicit = ""
        if source.name not in _NO_PCH_UNITS:
            unit_flags += ["-Winvalid-pch", "-include", PCH_HEADER]
            implicit = f" | {PCH_HEADER}.gch"
        lines += [
            f"build {obj}: compile {_ninja_path(source)}{implicit}",
            f"  name = {source.name}",
            f"  unit_flags = {' '.join(q(f) for f in unit_flags if f)}",
        ]
    lines += [f"build {module_name}.so: link {' '.join(objects)}", f"default {module_name}.so", ""]
    path = build_dir / "build.ninja"
    _write_if_changed(path, "\n".join(lines))
    return path


def run_ninja(build_dir: Path, progress: Callable[[str], None]) -> list[str]:
    """Run ninja in `build_dir`: `progress` gets one line per unit; a failure raises NativeBuildError
    naming the unit, with the compiler's last lines and how to retry. Returns the compiler's other
    output (warnings; empty for a clean build)."""
    ninja = shutil.which("ninja")
    if ninja is None:
        raise NativeBuildError("ninja is not installed (pip install ninja), so the kernels cannot be built")
    # Without a terminal ninja prints an edge's description when the edge finishes: "[done/total] ...".
    env = {**os.environ, "NINJA_STATUS": "[%f/%t] "}
    # ninja's default job count (cores + 2) keeps both cores busy while a unit waits on its disk reads.
    with subprocess.Popen(
        [ninja],
        cwd=build_dir,  # the units' `-include kvflow_pch.h` is found (with its .gch) here
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    ) as proc:
        assert proc.stdout is not None
        other: list[str] = []
        failed_unit = ""
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            status = _STATUS.match(line)
            if status is not None:
                done, total, verb, what = status.groups()
                progress(f"{verb} {Path(what).name} ({done}/{total})")
                continue
            if line.startswith("ninja: no work to do"):
                continue
            if line.startswith("FAILED: "):
                # "FAILED: unit.o", or "FAILED: [code=1] unit.o" (ninja 1.12+)
                words = [w for w in line.removeprefix("FAILED: ").split() if not w.startswith("[")]
                failed_unit = words[0] if words else ""
            other.append(line)
        code = proc.wait()
    if code != 0:
        output = "\n".join(other[-ERROR_TAIL_LINES:])
        raise NativeBuildError(
            f"compiling the native kernels failed{f' at {failed_unit}' if failed_unit else ''} "
            f"(ninja exit {code}); the torch paths serve meanwhile. Retry with `kvflow build-kernels` "
            f"(KVFLOW_DISABLE_KERNELS=1 skips the kernels). Compiler output, last lines:\n{output}"
        )
    return other


def import_extension(path: Path, module_name: str) -> ModuleType:
    """Load the built shared object as the Python module `module_name` (torch must be imported)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"{path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_path(path: Path) -> str:
    """A path as ninja's build line reads it ($ escapes spaces, colons and itself)."""
    return re.sub(r"([ :$])", r"$\1", str(path))


def _write_if_changed(path: Path, text: str) -> None:
    """Write `text` unless `path` holds it already: ninja rebuilds what depends on a newer file."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)

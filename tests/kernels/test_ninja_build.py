"""kvflow/kernels/ninja_build.py on a two-unit extension (seconds, not the real kernels' build):
the precompiled header is made once and accepted by the unit that includes it, each unit reports a
progress line, the module imports, and a unit that fails names itself and carries the compiler's
error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvflow.kernels.ninja_build import (
    NativeBuildError,
    compile_flags,
    import_extension,
    link_flags,
    run_ninja,
    write_build_file,
)

pytestmark = pytest.mark.skipif(
    shutil.which("ninja") is None or shutil.which("c++") is None, reason="needs ninja and a C++ compiler"
)

# The shared header, precompiled: what the unit below reads through it.
SHARED_HEADER = """#ifndef TINY_SHARED_H
#define TINY_SHARED_H
#include <cstdint>
inline int64_t tiny_answer() { return 42; }
#endif
"""
UNIT = """#include "shared.h"
int64_t answer_from_unit() { return tiny_answer(); }
"""
# bindings.cpp compiles without the precompiled header (it starts with pybind11's).
BINDINGS = """#include <pybind11/pybind11.h>
#include <cstdint>
int64_t answer_from_unit();
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer_from_unit); }
"""


def _sources(tmp_path: Path, unit: str = UNIT) -> list[Path]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "shared.h").write_text(SHARED_HEADER)
    (src / "unit.cpp").write_text(unit)
    (src / "bindings.cpp").write_text(BINDINGS)
    return [src / "bindings.cpp", src / "unit.cpp"]


def _build(tmp_path: Path, name: str, sources: list[Path]) -> tuple[list[str], list[str]]:
    build_dir = tmp_path / "build"
    write_build_file(
        build_dir,
        sources,
        name,
        compile_flags(name, ["-O1"]),
        link_flags([]),
        pch_source=sources[0].parent / "shared.h",
    )
    progress: list[str] = []
    warnings = run_ninja(build_dir, progress.append)
    return progress, warnings


def test_builds_with_a_precompiled_header_and_one_line_per_unit(tmp_path: Path) -> None:
    name = "kvflow_ninja_build_test"
    progress, warnings = _build(tmp_path, name, _sources(tmp_path))
    # One line per finished edge, counted in order; the two units finish in either order.
    assert [line.rsplit(" (", 1)[1] for line in progress] == ["1/4)", "2/4)", "3/4)", "4/4)"]
    steps = [line.rsplit(" (", 1)[0] for line in progress]
    assert steps[0] == "precompiled kvflow_pch.h" and steps[3] == f"linked {name}.so"
    assert sorted(steps[1:3]) == ["compiled bindings.cpp", "compiled unit.cpp"]
    assert warnings == []  # -Winvalid-pch: the unit took the .gch, not the header's text
    assert (tmp_path / "build" / "kvflow_pch.h.gch").stat().st_size > 0
    module = import_extension(tmp_path / "build" / f"{name}.so", name)
    assert module.answer() == 42


def test_a_unit_that_fails_is_named_with_the_compilers_error(tmp_path: Path) -> None:
    broken = UNIT.replace("return tiny_answer();", "return tiny_answer() +;")
    with pytest.raises(NativeBuildError) as error:
        _build(tmp_path, "kvflow_ninja_build_broken", _sources(tmp_path, broken))
    message = str(error.value)
    assert "failed at unit.o" in message
    assert "unit.cpp" in message and "error:" in message  # the compiler's own line
    assert "kvflow build-kernels" in message and "KVFLOW_DISABLE_KERNELS=1" in message

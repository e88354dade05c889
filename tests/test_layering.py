"""The package's layers, read from the code: every import points down (docs/ARCHITECTURE.md, "Layers").

Each module's imports are read with `ast` (module level, inside functions and under TYPE_CHECKING
alike: a lower layer never imports a higher one, not even for a type hint). A module may import its
own package and any package of a lower layer; two packages of one layer never import each other,
except the plain types at the bottom, which may import each other as long as no cycle forms.

The second half checks what the layering is for: `kvflow doctor` and `kvflow bench` run on a machine
without torch (a laptop diagnosing a remote server).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "kvflow"

# Top to bottom. A name is a subpackage (kvflow/<name>/) or a top-level module (kvflow/<name>.py);
# "kvflow" is the public facade, kvflow/__init__.py.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvflow", "cli"),  # the public facade and the command line
    ("doctor",),  # diagnosis: reads bench results, starts servers through server/spawn.py
    ("server", "bench"),  # the OpenAI server; the load generator (bench imports no torch)
    ("quality",),  # quant-eval and the online quality probe: run whole models
    ("llm",),  # offline facade over the engine
    ("engine",),  # LLMEngine, scheduler, output processing, async wrapper
    ("spec_decode", "parallel"),  # proposers the engine consults; tensor-parallel ranks and their driver
    ("worker",),  # input batch, model runner
    ("kv_transfer",),  # prefill/decode disaggregation: a prompt's KV from one instance to another
    ("kv_offload",),  # the KV offload tier on disk: its files, block copies, the scheduler's restores
    ("models",),  # architectures and loading
    ("quant",),  # quantized linears and checkpoint formats, swapped in at load
    # paged attention + KV formats; layers; sampling; structured output (grammars, masks)
    ("attention", "layers", "sample", "structured"),
    ("kv_cache",),  # block bookkeeping and the cache kinds (pure Python): the KV store sizes its pools by it
    ("kv_events",),  # what the prefix cache stores and evicts, published for KV-aware routers (no torch)
    ("kernels",),  # native CPU kernels with torch fallbacks
    (  # plain types and torch-free utilities, imported by all
        "errors",
        "version",
        "config",
        "sampling_params",
        "stats",
        "request",
        "scheduler_output",
        "query_rows",
        "outputs",
        "arch_config",
        "arch_kinds",
        "compressed_config",
        "tokenizer",
        "gguf",
        "assets",
        "arg_utils",
        "reasoning",
    ),
)
PLAIN = LAYERS[-1]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _unit(module: str) -> str:
    """kvflow.engine.scheduler -> engine; kvflow.request -> request; kvflow -> kvflow."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvflow"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported kvflow module) for every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # `from kvflow import llm` imports the module kvflow.llm, not the facade kvflow.
            submodules = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
            found += [(node.lineno, name) for name in submodules or [target]]
    return [(line, name) for line, name in found if name == "kvflow" or name.startswith("kvflow.")]


def _is_module(name: str) -> bool:
    path = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def test_every_package_has_a_layer() -> None:
    units = {_unit(m) for m in _all_modules()}
    assert units - RANK.keys() == set(), "add new packages/modules to LAYERS"
    assert RANK.keys() - units == set(), "LAYERS names a package that no longer exists"


def test_imports_point_down() -> None:
    violations = []
    for module, path in _all_modules().items():
        source = _unit(module)
        for line, target_module in _imports(path, module):
            target = _unit(target_module)
            if target == source:
                continue
            ok = RANK[target] > RANK[source] or (source in PLAIN and target in PLAIN)
            if not ok:
                where = f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}"
                violations.append(f"{where}: {source} (layer {RANK[source]}) imports {target_module}")
    assert violations == [], "imports against the layer order:\n" + "\n".join(violations)


def test_plain_types_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {name: set() for name in PLAIN}
    for module, path in _all_modules().items():
        source = _unit(module)
        if source in PLAIN:
            graph[source] |= {_unit(t) for _, t in _imports(path, module) if _unit(t) in PLAIN} - {source}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle among plain types: " + " -> ".join([*path, nxt])
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in PLAIN:
        if name not in state:
            visit(name, [name])


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The reader above must see imports in functions and under TYPE_CHECKING, and relative ones."""
    path = tmp_path / "kv.py"
    path.write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            from . import block_pool
            from kvflow import llm, LLM
            if TYPE_CHECKING:
                from kvflow.engine.engine import LLMEngine
            def f():
                import kvflow.server.api
            """
        )
    )
    found = [name for _, name in _imports(path, "kvflow.kv_cache.kv")]
    assert found == [
        "kvflow.kv_cache.block_pool",
        "kvflow.llm",
        "kvflow.engine.engine",
        "kvflow.server.api",
    ]


# A finder that makes `import torch` fail, as on a machine without torch.
_NO_TORCH = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch' (hidden by the test)")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def _run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE_ROOT.parent,
    )


@pytest.mark.parametrize("package", ["kvflow.doctor", "kvflow.bench"])
def test_doctor_and_bench_import_no_torch(package: str) -> None:
    result = _run_without_torch(
        f"""
        import importlib, pkgutil, sys
        import {package} as pkg
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module("{package}." + info.name)
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_doctor_calculator_runs_without_torch() -> None:
    """`kvflow doctor MODEL --hardware h100` needs only config.json: the whole command, torch hidden."""
    config = Path(__file__).parent / "doctor" / "configs" / "llama-3-8b.json"
    result = _run_without_torch(
        f"""
        import shutil, sys, tempfile
        from pathlib import Path
        model = Path(tempfile.mkdtemp())
        shutil.copy({str(config)!r}, model / "config.json")
        from kvflow.cli import main
        code = main(["doctor", str(model), "--hardware", "h100"])
        assert "torch" not in sys.modules
        sys.exit(code)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "H100" in result.stdout or "h100" in result.stdout.lower(), result.stdout

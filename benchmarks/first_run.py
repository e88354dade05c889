"""A new user's first minute: a fresh virtualenv, the README's install command, then `kvflow demo`
twice with an empty kernel cache (the first builds the native kernels, the second finds them).

    python benchmarks/first_run.py [--venv DIR] [--keep]

Prints the install time, the first demo's time (build included, with its per-unit progress lines
counted) and the second's. The venv is made with the same interpreter; pip reads the same indexes
and caches as the user's (torch 2.13.0 CPU comes from local disk here). Run it on a quiet machine:
the build is CPU-bound on every core.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INSTALL = "pip install -e '.[test]'"  # the README's install command


def _timed(cmd: list[str] | str, env: dict[str, str], shell: bool = False) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env, shell=shell, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"{cmd!r} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return elapsed, result.stdout + result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, help="where to make the venv (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the venv and the kernel cache")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvflow-first-run-"))
    env_dir = args.venv or work / "venv"
    cache = work / "kernels"
    try:
        venv.create(env_dir, with_pip=True, clear=True)
        bin_dir = env_dir / "bin"
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "VIRTUAL_ENV": str(env_dir),
            "KVFLOW_KERNEL_CACHE": str(cache),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }
        env.pop("PYTHONPATH", None)
        install_s, _ = _timed(INSTALL, env, shell=True)
        print(f"install ({INSTALL}) in a fresh venv: {install_s:.1f} s")
        first_s, first_out = _timed([str(bin_dir / "kvflow"), "demo"], env)
        units = sum(1 for line in first_out.splitlines() if line.startswith("[kvflow] compiled "))
        lines = first_out.splitlines()
        built = next((line for line in lines if "built kvflow's native" in line), "no build line")
        print(f"first  kvflow demo (empty kernel cache): {first_s:.1f} s; {units} unit lines; {built}")
        second_s, _ = _timed([str(bin_dir / "kvflow"), "demo"], env)
        print(f"second kvflow demo (kernels cached):     {second_s:.1f} s")
        print(f"the build's share of the first run: {first_s - second_s:.1f} s")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if args.venv is not None:
                shutil.rmtree(args.venv, ignore_errors=True)


if __name__ == "__main__":
    main()

"""`LLM(tensor_parallel_size=2)` from a plain script, without an `if __name__ == "__main__":` guard
(as vLLM allows on Linux): the spawned worker must not re-run the script (kvflow/parallel/executor.py
hides it while spawning). The script runs in a subprocess, as a user would run it."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

SCRIPT = """
from kvflow import LLM, SamplingParams

llm = LLM({model!r}, tensor_parallel_size=2, max_model_len=64, num_kv_blocks=32, block_size=4)
out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
print("TOKENS", out[0].outputs[0].token_ids)
"""


def test_tensor_parallel_from_a_script_without_a_main_guard(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_checkpoint_factory("llama")
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(SCRIPT.format(model=str(model))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = [line for line in done.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(tokens) == 1  # printed once: by rank 0 only, the script ran once
    assert len(ast.literal_eval(tokens[0].removeprefix("TOKENS "))) == 4

"""`kvflow profile-steps` (kvflow/engine/step_profile.py) on the tiny Llama: a step time for every
doubling prompt length up to the token budget and every doubling decode batch up to max_num_seqs,
each measured on steps of exactly that shape; and the doctor reads the command's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvflow.doctor.step_profile import StepProfile
from kvflow.engine.engine import LLMEngine
from kvflow.engine.step_profile import profile_steps

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_shape_is_measured(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    engine = LLMEngine.from_kwargs(
        model=str(tiny_checkpoint_factory("llama")),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    profile = profile_steps(engine, repeats=1)
    assert sorted(profile["prefill_ms"]) == [8, 16, 32, 64]
    assert sorted(profile["decode_ms"]) == [1, 2, 4, 8]
    assert all(ms > 0 for curve in profile.values() for ms in curve.values())
    assert not engine.has_unfinished_requests()


def test_the_command_prints_what_the_doctor_reads(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    model = tiny_checkpoint_factory("llama")
    command = [sys.executable, "-m", "kvflow.cli", "profile-steps", str(model), "--dtype", "float32"]
    command += [
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--repeats",
        "1",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, check=True)
    profile = StepProfile.from_json(json.loads(out.stdout.strip().splitlines()[-1]))
    assert profile is not None
    assert profile.prefill.sizes == (8, 16, 32) and profile.decode.sizes == (1, 2, 4)

"""`kvflow profile-steps` (kvflow/engine/step_profile.py) on the tiny Llama: a step time for every
doubling prompt length up to the token budget and every doubling decode batch up to max_num_seqs,
each measured on steps of exactly that shape; and the doctor reads the command's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.doctor.step_profile import StepProfile
from kvflow.engine.engine import LLMEngine
from kvflow.engine.step_profile import profile_steps
from kvflow.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


def _profiled_engine(tiny_checkpoint_factory: Callable[..., Path]) -> LLMEngine:
    """The tiny Llama with a 64-token budget and 8 slots: prefill probes of 16-64 tokens, decode
    probes of 1-8 rows."""
    return LLMEngine.from_kwargs(
        model=str(tiny_checkpoint_factory("llama")),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )


def test_every_shape_is_measured(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    engine = _profiled_engine(tiny_checkpoint_factory)
    profile = profile_steps(engine, repeats=1)
    # The prefill curve starts above the chunks attended as query rows (kvflow/query_rows.py).
    assert sorted(profile["prefill_ms"]) == [16, 32, 64]
    assert sorted(profile["decode_ms"]) == [1, 2, 4, 8]
    # Decodes after prompts of half the context (the outputs wait for the last prompt), alone and 8 at once.
    assert sorted(profile["decode_context_ms"]) == sorted(profile["decode_context_keys"]) == [1, 8]
    assert all(63 < keys < 128 for keys in profile["decode_context_keys"].values())
    # Chunks after a cached prefix, a quarter and a half of the 127-token span, the prefix in whole
    # 16-token blocks: 32 after 80, 64 after 48.
    assert profile["prefill_context_keys"] == {32: 32.0 * 80, 64: 64.0 * 48}
    assert sorted(profile["prefill_context_ms"]) == [32, 64]
    curves = ("prefill_ms", "decode_ms", "decode_context_ms", "prefill_context_ms")
    assert all(ms > 0 for curve in curves for ms in profile[curve].values())
    assert not engine.has_unfinished_requests()
    parsed = StepProfile.from_json(json.loads(json.dumps(profile)))  # as the doctor reads the command's JSON
    assert parsed is not None and parsed.row_ms_per_key is not None and parsed.row_ms_per_key >= 0
    assert parsed.chunk_ms_per_key is not None and parsed.chunk_ms_per_key >= 0


def test_a_short_suffix_after_a_cached_prefix_is_counted_as_query_rows(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    """The step statistics say which prompt tokens the worker attended as single-token query rows
    and what all rows read: the doctor prices those per key read, not as a prompt chunk."""
    engine = LLMEngine.from_kwargs(
        model=str(tiny_checkpoint_factory("llama")), dtype="float32", max_model_len=128, block_size=16
    )
    prefix, params = list(range(20, 84)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    stats = []
    for request_id, prompt in (("first", prefix), ("suffix", [*prefix, 7, 8, 9, 10, 11])):
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            stats.append(engine.last_step_stats)
    first_prefill, first_decode, suffix, suffix_decode = stats
    assert (first_prefill.num_prefill_tokens, first_prefill.num_row_prefill_tokens) == (64, 0)
    assert first_prefill.row_attention_work == 0  # one prefill chunk, no rows
    assert (first_decode.num_decode_tokens, first_decode.row_attention_work) == (1, 65)
    # 64 of 69 tokens hit the cache: the 5 left are rows at positions 64..68, reading 65..69 keys.
    assert (suffix.num_prefill_tokens, suffix.num_row_prefill_tokens) == (5, 5)
    assert suffix.row_attention_work == suffix.attention_work == sum(range(65, 70))
    assert suffix_decode.row_attention_work == 70


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
    assert profile.prefill.sizes == (16, 32) and profile.decode.sizes == (1, 2, 4)
    assert profile.row_ms_per_key is None  # a 64-token context leaves no room for the long probe


def test_a_slow_stretch_during_one_probe_does_not_set_its_size(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    """Each repeat is a pass over every size, and each size the median over the passes: a slow
    stretch of the machine that takes one probe (here every 4-row step of the first 4-row probe, 5x
    as long) moves one pass of that size, not the curve. Back to back, one probe per size, one
    profile's 4-row step read 15.6 ms beside 13.5 at 8 rows (11.9-12.1 measured again, session 33)."""
    engine = _profiled_engine(tiny_checkpoint_factory)
    add_request, step = engine.add_request, engine.step
    stretch = {"on": False, "over": False}

    def add(request_id: str, *args: Any, **kwargs: Any) -> Any:
        probe_of_4 = request_id.startswith("decode-4-")
        if probe_of_4 and not stretch["over"]:
            stretch["on"] = True
        elif stretch["on"] and not probe_of_4:
            stretch["on"], stretch["over"] = False, True
        return add_request(request_id, *args, **kwargs)

    def slow_step() -> Any:
        out = step()
        stats = engine.last_step_stats
        decoding_4 = stats is not None and stats.num_decode_tokens == 4 and not stats.num_prefill_tokens
        if stretch["on"] and stats is not None and decoding_4:
            engine.last_step_stats = replace(stats, duration=5 * stats.duration)
        return out

    engine.add_request, engine.step = add, slow_step  # type: ignore[method-assign]
    profile = profile_steps(engine, repeats=3)
    assert stretch["over"]  # the stretch took the first 4-row probe and ended
    decode = profile["decode_ms"]
    assert decode[4] < 2 * decode[8], decode  # 5x in one pass of three: not the median

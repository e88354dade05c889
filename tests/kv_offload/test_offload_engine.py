"""The KV offload tier in the engine (kvflow/kv_offload/): a pool too small for the conversations
evicts their blocks to disk, second turns read them back instead of recomputing the prefill, with
greedy tokens identical to a pool that never evicted; a restarted engine keeps the hits; a damaged
block file or a vanished directory costs a recompute, never a wrong token or a crash."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import ConfigError
from kvflow.outputs import RequestOutput

BLOCK = 4
# Four conversations of 44-48 prompt tokens (11-12 blocks) and 8 output tokens: a 30-block pool
# holds about two of them, so the first turns of the early ones are evicted by the later ones.
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 1,
    "max_model_len": 128,
}
SMALL_POOL = 30
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _conversations(vocab: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(44 + i)] for i in range(n)]


def _second_prompts(firsts: list[list[int]], turn1: list[RequestOutput]) -> list[list[int]]:
    """Each conversation returning: its first prompt, its answer, and a new message."""
    return [p + list(o.outputs[0].token_ids) + [5, 6, 7, 8, 9] for p, o in zip(firsts, turn1, strict=True)]


def _two_turns(llm: LLM, firsts: list[list[int]]) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """Every conversation's first turn, then every second turn."""
    turn1 = [llm.generate(p, GREEDY)[0] for p in firsts]
    return turn1, [llm.generate(p, GREEDY)[0] for p in _second_prompts(firsts, turn1)]


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama", dtype=torch.float32)


def _reference(checkpoint: Path, **kwargs: Any) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of both turns with a pool that holds everything (no eviction, no tier)."""
    llm = LLM(str(checkpoint), num_kv_blocks=400, **{**ENGINE, **kwargs})
    firsts = _conversations(llm.get_tokenizer().vocab_size)
    turn1, turn2 = _two_turns(llm, firsts)
    return _tokens(turn1), _tokens(turn2)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    return _reference(checkpoint)


def _offload_llm(checkpoint: Path, tier: Path, **kwargs: Any) -> LLM:
    return LLM(str(checkpoint), num_kv_blocks=SMALL_POOL, kv_offload_path=str(tier), **{**ENGINE, **kwargs})


def test_second_turns_restore_from_the_tier_with_identical_tokens(
    checkpoint: Path, reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    llm = _offload_llm(checkpoint, tmp_path / "tier")
    firsts = _conversations(llm.get_tokenizer().vocab_size)
    turn1, turn2 = _two_turns(llm, firsts)
    assert (_tokens(turn1), _tokens(turn2)) == reference
    restored = [o.metrics.num_restored_tokens for o in turn2]
    # The early conversations were evicted from the pool, so their history came from disk.
    assert restored[0] > 0 and restored[1] > 0, restored
    for out in turn2:
        assert out.num_cached_tokens >= out.metrics.num_restored_tokens
        assert (out.metrics.kv_restore_time is not None) == (out.metrics.num_restored_tokens > 0)
    tier = llm.llm_engine.kv_offload_tier
    assert tier is not None and tier.stats.blocks_read == sum(restored) // BLOCK
    assert tier.stats.blocks_stored > 0 and tier.stats.write_errors == 0


def test_int8_kv_blocks_round_trip_with_their_scales(checkpoint: Path, tmp_path: Path) -> None:
    """A quantized pool's block is its data and its scales: both come back, tokens unchanged."""
    llm = _offload_llm(checkpoint, tmp_path / "tier", kv_cache_dtype="int8")
    turn1, turn2 = _two_turns(llm, _conversations(llm.get_tokenizer().vocab_size))
    assert (_tokens(turn1), _tokens(turn2)) == _reference(checkpoint, kv_cache_dtype="int8")
    assert sum(o.metrics.num_restored_tokens for o in turn2) > 0


def test_a_restarted_engine_keeps_the_hits(
    checkpoint: Path, reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    first = _offload_llm(checkpoint, tmp_path / "tier")
    firsts = _conversations(first.get_tokenizer().vocab_size)
    turn1 = [first.generate(p, GREEDY)[0] for p in firsts]
    # Push every conversation's blocks out of the pool to the tier, then stop the engine.
    first.generate(_conversations(first.get_tokenizer().vocab_size, 8)[4:], GREEDY)
    tier = first.llm_engine.kv_offload_tier
    assert tier is not None
    tier.flush()
    del first
    again = _offload_llm(checkpoint, tmp_path / "tier")
    seconds = _second_prompts(firsts, turn1)
    turn2 = [again.generate(p, GREEDY)[0] for p in seconds]
    assert _tokens(turn2) == reference[1]
    assert all(o.metrics.num_restored_tokens > 0 for o in turn2)


def test_blocks_the_pool_still_held_at_shutdown_survive_a_restart(
    checkpoint: Path, reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    """A pool large enough never evicts, so nothing reaches the tier while serving; closing the
    engine writes its cached blocks, and the restarted engine restores every second turn."""
    first = LLM(str(checkpoint), num_kv_blocks=400, kv_offload_path=str(tmp_path / "tier"), **ENGINE)
    firsts = _conversations(first.get_tokenizer().vocab_size)
    turn1 = [first.generate(p, GREEDY)[0] for p in firsts]
    tier = first.llm_engine.kv_offload_tier
    assert tier is not None and tier.stats.blocks_stored == 0  # nothing was evicted
    first.llm_engine.close()
    assert tier.stats.blocks_stored >= sum(len(p) // BLOCK for p in firsts)
    again = _offload_llm(checkpoint, tmp_path / "tier")
    turn2 = [again.generate(p, GREEDY)[0] for p in _second_prompts(firsts, turn1)]
    assert _tokens(turn2) == reference[1]
    assert all(o.metrics.num_restored_tokens > 0 for o in turn2)


def test_damaged_files_and_a_vanished_directory_cost_a_recompute(
    checkpoint: Path, reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    llm = _offload_llm(checkpoint, tmp_path / "tier")
    firsts = _conversations(llm.get_tokenizer().vocab_size)
    turn1 = [llm.generate(p, GREEDY)[0] for p in firsts]
    tier = llm.llm_engine.kv_offload_tier
    assert tier is not None
    tier.flush()
    for f in sorted((tmp_path / "tier").iterdir()):  # flip a byte in the middle of every payload
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    seconds = _second_prompts(firsts, turn1)
    turn2 = [llm.generate(p, GREEDY)[0] for p in seconds]
    assert _tokens(turn2) == reference[1]
    assert tier.stats.read_errors > 0  # each damaged block was met, dropped and recomputed
    shutil.rmtree(tmp_path / "tier")  # the directory vanishes mid-run
    turn2_again = [llm.generate(p, GREEDY)[0] for p in seconds]
    assert _tokens(turn2_again) == reference[1]
    tier.flush()
    assert tier.stats.write_errors > 0


def test_a_tier_smaller_than_a_block_is_harmless_and_bad_sizes_are_refused(
    checkpoint: Path, reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    tiny = _offload_llm(checkpoint, tmp_path / "tiny", kv_offload_size=1e-9)  # ~1 byte: nothing fits
    firsts = _conversations(tiny.get_tokenizer().vocab_size)
    turn1, turn2 = _two_turns(tiny, firsts)
    assert (_tokens(turn1), _tokens(turn2)) == reference
    tier = tiny.llm_engine.kv_offload_tier
    assert tier is not None
    tier.flush()
    assert tier.num_blocks == 0 and tier.stats.write_errors > 0
    with pytest.raises(ConfigError, match="kv_offload_size must be > 0"):
        _offload_llm(checkpoint, tmp_path / "zero", kv_offload_size=0)
    with pytest.raises(ConfigError, match="needs prefix caching"):
        _offload_llm(checkpoint, tmp_path / "nocache", enable_prefix_caching=False)

"""Speculative decoding inside the batched engine: greedy output token-for-token identical to plain
decoding across the four architectures, under batching, chunked prefill, prefix hits and preemption;
acceptance is counted; a draft that never agrees still gives correct output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import paged_decode_attention_bf16, skinny_linear_bf16
from kvflow.layers.linear import SKINNY_MAX_ROWS

# Prompts that repeat themselves, so that n-gram lookup finds drafts (random tiny models also
# tend to fall into loops, which the lookup then predicts).
PROMPTS = [
    [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12],
    [40, 41, 42, 40, 41, 42, 40, 41],
    [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9],
    [100, 101, 102, 103, 104, 105, 106, 107],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 3}


def run(
    path: Path, prompts: list[list[int]], dtype: str = "float32", **engine: Any
) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype=dtype, max_model_len=128, **engine)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_identical_with_ngram_speculation(
    tiny_checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    path = tiny_checkpoint_factory(arch)
    plain, _ = run(path, PROMPTS)
    spec, llm = run(path, PROMPTS, **SPEC)
    assert spec == plain
    stats = llm.llm_engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    llm.llm_engine.scheduler.check_integrity()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_single_stream_greedy_identical_bit_for_bit(
    tiny_checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    """In bf16, verifying k + 1 = 4 tokens runs the same batch-invariant kernels as decoding one:
    the native GEMVs (a row's sum does not depend on the other rows) and the native decode
    attention, one query row per verified token (kvflow/worker/input_batch.py)."""
    if skinny_linear_bf16() is None or paged_decode_attention_bf16() is None:
        pytest.skip("kvflow's native kernels are unavailable on this CPU: bf16 identity is not promised")
    assert SPEC["num_speculative_tokens"] + 1 <= SKINNY_MAX_ROWS
    path = tiny_checkpoint_factory(arch, dtype=torch.bfloat16)
    drafts = 0
    for prompt in PROMPTS:  # one request at a time: single-stream
        plain, _ = run(path, [prompt], dtype="bfloat16")
        spec, llm = run(path, [prompt], dtype="bfloat16", **SPEC)
        assert spec == plain
        drafts += llm.llm_engine.spec_stats.num_drafts
    # Verification really ran on multi-token rows (accepted or not, every emitted token comes
    # from one of those rows' logits).
    assert drafts > 0


@pytest.mark.parametrize(
    "engine",
    [
        {"max_num_batched_tokens": 6},  # chunked prefill, drafts cut by the token budget
        {"num_kv_blocks": 12, "block_size": 4},  # preemption
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 6, "prompt_lookup_max": 2},
    ],
)
def test_greedy_identical_under_scheduler_pressure(
    tiny_checkpoint_factory: Callable[..., Path], engine: dict[str, Any]
) -> None:
    path = tiny_checkpoint_factory("llama")
    plain, _ = run(
        path, PROMPTS, **{k: v for k, v in engine.items() if "spec" not in k and "lookup" not in k}
    )
    spec, llm = run(path, PROMPTS, **{**SPEC, **engine})
    assert spec == plain
    scheduler = llm.llm_engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.block_pool.usage == 0.0


def test_prefix_hits_and_acceptance_counters(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    path = tiny_checkpoint_factory("qwen2")
    plain, _ = run(path, PROMPTS + PROMPTS)  # the second half hits the prefix cache
    spec, llm = run(path, PROMPTS + PROMPTS, **SPEC)
    assert spec == plain
    stats = llm.llm_engine.spec_stats
    assert len(stats.accepted_per_pos) == 3 and stats.accepted_per_pos == sorted(
        stats.accepted_per_pos, reverse=True
    )
    assert 1.0 <= stats.mean_accepted_length <= 4.0
    print(
        f"ngram acceptance {stats.acceptance_rate:.0%}, mean accepted length {stats.mean_accepted_length:.2f}"
    )


def test_requests_with_penalties_or_logprobs_decode_plainly_beside_speculation(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    path = tiny_checkpoint_factory("llama")
    llm = LLM(str(path), dtype="float32", max_model_len=128, **SPEC)
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    ]
    reference = LLM(str(path), dtype="float32", max_model_len=128).generate(PROMPTS[:3], params)
    outs = llm.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert outs[2].outputs[0].logprobs is not None and len(outs[2].outputs[0].logprobs) == 24


def test_seeded_sampling_with_speculation_completes(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    path = tiny_checkpoint_factory("llama")
    llm = LLM(str(path), dtype="float32", max_model_len=128, **SPEC)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=3)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert first == again and all(len(t) == 24 for t in first)  # seeded: reproducible run to run


class OracleProposer:
    """Proposes the known greedy continuation (an always-agreeing draft), optionally corrupting the
    draft at position `wrong_at` so that exactly that many drafts are accepted per step."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], k: int, wrong_at: int | None) -> None:
        self.continuations, self.k, self.wrong_at = continuations, k, wrong_at

    def propose(self, requests: Any) -> None:
        for r in requests:
            ref = self.continuations[tuple(r.prompt_token_ids)]
            drafts = ref[r.num_output_tokens : r.num_output_tokens + self.k]
            if self.wrong_at is not None and len(drafts) > self.wrong_at:
                drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 50
            r.spec_token_ids = drafts if r.num_computed_tokens == r.num_tokens - 1 else []


@pytest.mark.parametrize(("wrong_at", "per_step"), [(None, 4), (1, 2), (0, 1)])
def test_oracle_drafts_emit_k_plus_one_tokens_per_step(
    tiny_checkpoint_factory: Callable[..., Path], wrong_at: int | None, per_step: int
) -> None:
    path = tiny_checkpoint_factory("llama")
    plain, _ = run(path, PROMPTS)
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4, **SPEC)
    llm.llm_engine.proposer = OracleProposer(  # type: ignore[assignment]
        {tuple(p): list(c) for p, c in zip(PROMPTS, plain, strict=True)}, 3, wrong_at
    )
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.llm_engine.spec_stats
    accepted = per_step - 1
    assert stats.num_accepted_tokens == accepted * stats.num_drafts or wrong_at is None
    if wrong_at is None:  # every draft accepted: K + 1 tokens per verification step (until the end)
        assert stats.acceptance_rate == 1.0
        assert stats.mean_accepted_length > 3.5
    # Token times: steps emitted `per_step` tokens at once after the first token.
    times = outs[0].metrics.token_times
    assert max(times.count(t) for t in set(times)) == per_step
    scheduler = llm.llm_engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.block_pool.usage == 0.0


def test_spec_counters_reach_prometheus() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvflow.server.metrics import EngineMetrics
    from kvflow.stats import SpecDecodeStats, StepStats

    spec = SpecDecodeStats()
    spec.record(3, 2)
    spec.record(3, 0)
    metrics = EngineMetrics("m", 128)
    metrics.observe_step(StepStats(0.0, 0.01, 0, 8, 2, 0, 0.1, 0, spec), [])
    samples = {
        (s.name, s.labels.get("position")): s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    }
    assert samples[("kvflow:spec_decode_num_drafts_total", None)] == 2
    assert samples[("kvflow:spec_decode_num_draft_tokens_total", None)] == 6
    assert samples[("kvflow:spec_decode_num_accepted_tokens_total", None)] == 2
    assert samples[("kvflow:spec_decode_num_accepted_tokens_per_pos_total", "0")] == 1
    assert samples[("kvflow:spec_decode_num_accepted_tokens_per_pos_total", "1")] == 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_model_that_is_the_target_accepts_everything(
    tiny_checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    """The target as its own draft always agrees (greedy): K + 1 tokens per step, same output."""
    path = tiny_checkpoint_factory(arch)
    plain, _ = run(path, PROMPTS)
    spec, llm = run(
        path, PROMPTS, speculative_method="draft", draft_model=str(path), num_speculative_tokens=3
    )
    assert spec == plain
    stats = llm.llm_engine.spec_stats
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length > 3.5
    llm.llm_engine.scheduler.check_integrity()


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a sliding window
def test_bf16_draft_model_on_the_native_decoder(
    tiny_checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    """In bf16 the draft's query-row steps go to its native decoder as lists (positions and block
    tables, the sliding window derived natively) and its greedy guesses come from the LM head's
    greedy GEMV: the target as its own draft must then still agree at almost every position (the
    draft decodes one row where verification decodes k + 1), and the output is the plain one."""
    if skinny_linear_bf16() is None or paged_decode_attention_bf16() is None:
        pytest.skip("kvflow's native kernels are unavailable on this CPU")
    path = tiny_checkpoint_factory(arch, dtype=torch.bfloat16)
    prompts = [p * 4 for p in PROMPTS]  # past the fixture's 32-token window
    plain, _ = run(path, prompts, dtype="bfloat16")
    spec, llm = run(
        path,
        prompts,
        dtype="bfloat16",
        speculative_method="draft",
        draft_model=str(path),
        num_speculative_tokens=3,
    )
    assert llm.llm_engine.proposer is not None and llm.llm_engine.proposer.native_decode
    assert spec == plain
    assert llm.llm_engine.spec_stats.acceptance_rate > 0.9


def test_a_different_draft_model_gives_identical_greedy_output(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    path = tiny_checkpoint_factory("llama")
    other = tiny_checkpoint_factory("llama", seed=7, num_hidden_layers=1)  # disagrees almost always
    plain, _ = run(path, PROMPTS, num_kv_blocks=20, block_size=4)
    spec, llm = run(
        path, PROMPTS, speculative_method="draft", draft_model=str(other), num_kv_blocks=20, block_size=4
    )
    assert spec == plain
    assert llm.llm_engine.spec_stats.num_drafts > 0


def test_draft_model_with_another_vocabulary_is_refused(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    import shutil

    from fixtures.checkpoints import train_tokenizer

    from kvflow.errors import ModelLoadError

    path = tiny_checkpoint_factory("llama")
    other = tmp_path / "other-vocab"
    shutil.copytree(path, other)
    train_tokenizer(other, vocab_size=300)  # same architecture, another BPE vocabulary
    with pytest.raises(ModelLoadError, match="different vocabulary"):
        LLM(str(path), speculative_method="draft", draft_model=str(other))


def test_sampled_drafts_complete_with_their_distribution(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    path = tiny_checkpoint_factory("llama")
    llm = LLM(
        str(path), dtype="float32", max_model_len=128, speculative_method="draft", draft_model=str(path)
    )
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    outs = llm.generate(PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    # The target as its own draft: q == p, so every sampled draft is accepted (min(1, p/q) = 1).
    assert llm.llm_engine.spec_stats.acceptance_rate > 0.95

"""The native decode forward (kvflow/kernels/decode_forward.cpp) against the Python layers.

The native path promises the Python path's numbers bit for bit (same kernels, same ATen ops, the
same bf16 roundings in its own element-wise code), so the check is exact: the same greedy tokens
and the same logprobs, float for float, over batches whose decode steps have 1 to 12 rows (the
GEMV, oneDNN and dequantize-and-GEMM sizes), for every architecture switch, weight format and KV
format the native path takes. The Python path itself is checked against transformers elsewhere
(test_hf_equivalence.py, test_bf16_path.py), so this closes the chain for the native one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import native_decoder_classes
from kvflow.worker.input_batch import build_decode_rows, build_input_batch

pytestmark = pytest.mark.skipif(
    native_decoder_classes() is None,
    reason="native kernels unavailable (no AVX512-BF16 or AVX2, or no compiler)",
)

NUM_PROMPTS = 12  # decode steps shrink from 12 rows to 1 as requests finish one by one
# int4's native layout packs 128 inputs per line: the default 64-wide fixture takes torch's kernel.
WIDE = {"hidden_size": 128, "intermediate_size": 256}

VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama-gqa-rope-scaling": ("llama", {}, {}),
    "qwen2-qkv-bias-tied": ("qwen2", {}, {}),
    "qwen3-qk-norm": ("qwen3", {}, {}),
    "mistral-sliding-window-mqa": ("mistral", {}, {}),
    "kv-int8": ("llama", {}, {"kv_cache_dtype": "int8"}),
    "kv-fp8": ("llama", {}, {"kv_cache_dtype": "fp8_e4m3"}),
    "kv-int4": ("qwen2", {}, {"kv_cache_dtype": "int4"}),
    "weights-int8": ("qwen2", {}, {"quantization": "int8", "quantize_lm_head": True}),
    "weights-int4-g32": ("llama", WIDE, {"quantization": "int4", "quantization_group_size": 32}),
    "weights-int4-g128-kv-int8": (
        "qwen3",
        WIDE,
        {"quantization": "int4", "quantization_group_size": 128, "kv_cache_dtype": "int8"},
    ),
}


def _prompts(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    # Lengths past the fixture's 32-token sliding window; one prompt per output length 3..14.
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 70))] for _ in range(NUM_PROMPTS)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True, logprobs=3)
        for i in range(NUM_PROMPTS)
    ]
    return prompts, params


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_decode_matches_python_path_bit_for_bit(
    variant: str, tiny_checkpoint_factory: Callable[..., Path]
) -> None:
    arch, shape, engine_args = VARIANTS[variant]
    path = tiny_checkpoint_factory(arch, dtype=torch.bfloat16, **shape)
    runs = {}
    for eager in (True, False):
        llm = LLM(
            str(path), dtype="bfloat16", enforce_eager=eager, max_num_batched_tokens=1024, **engine_args
        )
        assert llm.llm_engine.model_runner.native_decode is not eager
        prompts, params = _prompts(llm.llm_engine.arch.vocab_size)
        runs[eager] = llm.generate(prompts, params)
    for python, native in zip(runs[True], runs[False], strict=True):
        assert native.outputs[0].token_ids == python.outputs[0].token_ids
        assert native.outputs[0].logprobs == python.outputs[0].logprobs  # Logprob floats, exactly


def test_decode_only_steps_run_natively_and_prefill_steps_do_not(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    path = tiny_checkpoint_factory("llama", dtype=torch.bfloat16)
    llm = LLM(str(path), dtype="bfloat16")
    model = llm.llm_engine.model_runner.model
    rows: list[int] = []

    class Spy:  # stands in for the bound native decoder, records each call's row count
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:  # everything else: the decoder's
            return getattr(self.inner, name)

        def forward(self, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
            rows.append(hidden.shape[0])
            return self.inner.forward(hidden, *args)

        def forward_rows(self, hidden: torch.Tensor | None, token_ids: list[int], *args: Any) -> torch.Tensor:
            rows.append(len(token_ids))
            return self.inner.forward_rows(hidden, token_ids, *args)

    model._native_decoder = Spy(model._native_decoder)
    out = llm.generate([[5] * 40], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6
    assert rows == [1] * 5  # the prefill step sampled the first token; each later token is one native step


def test_profiled_forward_gives_the_same_numbers_and_a_time_per_piece(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    path = tiny_checkpoint_factory("qwen3", dtype=torch.bfloat16)  # q/k norms: every piece runs
    llm = LLM(str(path), dtype="bfloat16")
    runner = llm.llm_engine.model_runner
    model = runner.model
    steps: list[tuple[Any, ...]] = []
    original = runner.execute_model

    def spy(scheduler_output: Any) -> Any:  # each step's model inputs, as the Python path builds them
        batch = build_input_batch(scheduler_output, runner.block_size, runner.sliding_window)
        steps.append((batch.input_ids, batch.attn_metadata, runner.kv_store))
        return original(scheduler_output)

    runner.execute_model = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[3] * 20, [7] * 9], params)
    runner.execute_model = original  # type: ignore[method-assign]
    prefill, decode = steps[0], steps[-1]
    assert not decode[1].prefills and decode[0].numel() == 2
    with torch.inference_mode():
        # Replaying a step rewrites its K/V rows with the same values: both calls see one pool.
        plain = model(*decode)
        profiled, piece_us = model.profile_native_decode(*decode)
        with pytest.raises(ValueError, match="decode-only"):
            model.profile_native_decode(*prefill)
    assert torch.equal(profiled, plain)
    assert list(piece_us) == [
        "input_norm",
        "qkv_proj",
        "rope_kv_write",
        "attention",
        "o_proj",
        "residual_post_norm",
        "gate_up_proj",
        "silu_and_mul",
        "down_proj",
        "residual",
        "final_norm",
    ]
    assert all(t >= 0.0 for t in piece_us.values()) and sum(piece_us.values()) > 0.0


def test_enforce_eager_is_a_cli_flag() -> None:
    from kvflow.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--enforce-eager"])
    assert args.enforce_eager is True
    assert build_parser().parse_args(["generate", "--prompt", "x"]).enforce_eager is False


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a 32-token sliding window
def test_decode_rows_give_the_metadata_path_numbers(
    arch: str, tiny_checkpoint_factory: Callable[..., Path]
) -> None:
    """A decode-only step reaches the native decoder as plain lists (DecodeRows): it derives the RoPE
    rows, K/V slots and key slots itself. Bit for bit the hidden states of the model's forward over
    build_input_batch's tensors, for plain decode rows and speculative verification rows (n-gram
    drafts on a repetitive prompt), before and past the sliding window."""
    path = tiny_checkpoint_factory(arch, dtype=torch.bfloat16)
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 3, "speculative_auto_disable": False}
    llm = LLM(str(path), dtype="bfloat16", **spec)
    runner = llm.llm_engine.model_runner
    model = runner.model
    compared: list[int] = []  # rows of each compared step
    original = runner.execute_model

    def compare(scheduler_output: Any) -> Any:
        rows = build_decode_rows(scheduler_output)
        if rows is not None and rows.token_ids:
            batch = build_input_batch(scheduler_output, runner.block_size, runner.sliding_window)
            # Replaying a step rewrites its K/V rows with the same values: both calls see one pool.
            via_rows = model.forward_decode_rows(rows.token_ids, rows.positions, rows.block_tables)
            via_metadata = model(batch.input_ids, batch.attn_metadata, runner.kv_store)
            assert torch.equal(via_rows, via_metadata)
            assert rows.logits_indices == batch.logits_indices.tolist()
            compared.append(len(rows.token_ids))
        return original(scheduler_output)

    runner.execute_model = compare  # type: ignore[method-assign]
    prompts = [[5, 6, 7, 8] * 6, [9] * 3]
    with torch.inference_mode():
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert compared and max(compared) > len(prompts)  # some step verified drafts


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"quantization": "int8", "quantize_lm_head": True},
        {"quantization": "int4", "quantize_lm_head": True},
    ],
    ids=["bf16-head", "int8-head", "int4-head"],
)
def test_greedy_head_gives_the_argmax_of_the_logits(
    engine_args: dict[str, Any], tiny_checkpoint_factory: Callable[..., Path]
) -> None:
    """Greedy rows take their token inside the LM head's GEMV (greedy_tokens): the argmax of
    compute_logits, first index on ties, for 1 to 40 rows (GEMV sizes and past max_gemv_rows), and
    the same greedy outputs as the eager path, which samples from the logits."""
    path = tiny_checkpoint_factory("qwen2", dtype=torch.bfloat16, **WIDE)
    llm = LLM(str(path), dtype="bfloat16", **engine_args)
    model = llm.llm_engine.model_runner.model
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 3, 8, 40):
            hidden = torch.randn(rows, model.config.hidden_size, generator=gen).to(torch.bfloat16)
            tokens = model.greedy_tokens(hidden)
            assert tokens is not None
            assert torch.equal(tokens, model.compute_logits(hidden).float().argmax(dim=-1))
    prompts, _ = _prompts(llm.llm_engine.arch.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) for i in range(len(prompts))]
    eager = LLM(str(path), dtype="bfloat16", enforce_eager=True, **engine_args)
    assert eager.llm_engine.model_runner.model.greedy_tokens(hidden) is None
    for fused, reference in zip(llm.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert fused.outputs[0].token_ids == reference.outputs[0].token_ids


def _checkpoint_format(kind: str, factory: Callable[..., Path], tmp_path: Path) -> Path:
    """A GGUF file (Q4_K_M: Q4_K / Q6_K / fallback types mixed inside qkv; Q8_0: its tied head on the
    Q8_0 tiles, greedy folded into the GEMV) or an FP8 block-scaled checkpoint of a tiny model."""
    if kind == "fp8-block":
        from quant.test_fp8_checkpoints import _write_pair

        return _write_pair(factory("llama"), tmp_path, "block")[0]
    from fixtures.gguf_files import q4_k_m, uniform, write_gguf

    arch, rule = ("llama", q4_k_m) if kind == "gguf-q4_k_m" else ("qwen2", uniform("Q8_0"))
    path = tmp_path / f"{kind}.gguf"
    write_gguf(factory(arch, hidden_size=256, intermediate_size=512), path, rule)
    return path


@pytest.mark.parametrize("kind", ["gguf-q4_k_m", "gguf-q8_0", "fp8-block"])
def test_native_decode_on_checkpoint_formats_matches_python_path(
    kind: str, tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    pytest.importorskip("gguf")
    path = _checkpoint_format(kind, tiny_checkpoint_factory, tmp_path)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(path), dtype="bfloat16", enforce_eager=eager, max_num_batched_tokens=1024)
        assert llm.llm_engine.model_runner.native_decode is not eager
        prompts, params = _prompts(llm.llm_engine.arch.vocab_size)
        runs[eager] = llm.generate(prompts, params)
    for python, native in zip(runs[True], runs[False], strict=True):
        assert native.outputs[0].token_ids == python.outputs[0].token_ids
        assert native.outputs[0].logprobs == python.outputs[0].logprobs

"""`kvflow quant-eval`: the quality and speed cost of a quantized path against the unquantized one.

Over the same text, teacher-forced: KL, top-1 agreement and each path's perplexity (defined in
kvflow/quality/teacher_forcing.py); plus each path's single-stream decode tokens/s and weight bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.config import ScoringPath
from kvflow.llm import LLM
from kvflow.quality.teacher_forcing import QualityTotals, window_log_probs, windows
from kvflow.sampling_params import SamplingParams

DEFAULT_WINDOW = 512
DECODE_PROBE_TOKENS = 64
DECODE_PROBE_PROMPT = 16  # a short prompt: the probe measures decode steps, not prefill


@dataclass(frozen=True)
class PathStats:
    label: str
    perplexity: float
    decode_tokens_per_s: float
    weight_bytes: int


def model_bytes(llm: LLM) -> int:
    model = llm.llm_engine.model_runner.model
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def decode_rate(llm: LLM, prompt_ids: list[int]) -> float:
    """Single-stream decode tokens/s after a short prompt."""
    prompt_ids = prompt_ids[:DECODE_PROBE_PROMPT]
    budget = min(DECODE_PROBE_TOKENS, llm.llm_engine.max_model_len - len(prompt_ids))
    params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
    out = llm.generate([prompt_ids], params)[0]
    t = out.metrics
    return (len(t.token_times) - 1) / t.decode_time if t.decode_time else 0.0


def compare(
    reference: LLM,
    candidate: LLM,
    token_ids: list[int],
    window: int,
    kv_cache_dtype: str = "auto",
    path: ScoringPath = "prefill",
    label: str = "quantized",
) -> dict[str, Any]:
    """The candidate runs with its own weights and, if given, a quantized KV cache; both score every
    position along `path` (teacher_forcing.py: prefill chunks, or decode rows as generation does)."""
    ref_model = reference.llm_engine.model_runner.model
    cand_model = candidate.llm_engine.model_runner.model
    totals = QualityTotals()
    for chunk in windows(token_ids, window):
        if len(chunk) < 2:
            continue
        inputs, targets = chunk[:-1], torch.tensor(chunk[1:])
        reference_lp = window_log_probs(ref_model, inputs, path=path)
        totals.add(reference_lp, window_log_probs(cand_model, inputs, kv_cache_dtype, path), targets)
    if totals.positions == 0:
        raise ValueError("the text is too short to evaluate (needs at least 2 tokens)")
    figures = totals.snapshot()
    probe = token_ids[:DECODE_PROBE_PROMPT]
    started = time.perf_counter()
    paths = [
        PathStats(label, figures[key], decode_rate(llm, probe), model_bytes(llm))
        for label, key, llm in (
            ("reference", "perplexity_reference", reference),
            (label, "perplexity_served", candidate),
        )
    ]
    return {
        "path": path,
        "positions": totals.positions,
        "mean_kl": figures["mean_kl"],
        "top1_agreement": figures["top1_agreement"],
        "paths": [p.__dict__ for p in paths],
        "elapsed_s": time.perf_counter() - started,
    }

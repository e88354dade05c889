"""`kvflow quant-eval`: the quality and speed cost of a quantized path against the unquantized one.

Over the same text (teacher forcing):
    KL          mean over positions of KL(p_ref || p_quant) of the next-token distributions (nats)
    top-1       share of positions where both put the highest probability on the same token
    perplexity  exp(mean negative log-likelihood of the actual next token), for each path
Plus decode tokens/s of a single stream and the bytes of each model's weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.llm import LLM
from kvflow.quant.scoring import window_log_probs, windows
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
    reference: LLM, candidate: LLM, token_ids: list[int], window: int, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    """The candidate runs with its own weights and, if given, a quantized KV cache."""
    ref_model = reference.llm_engine.model_runner.model
    cand_model = candidate.llm_engine.model_runner.model
    kl_sum = agree = nll_ref = nll_cand = 0.0
    count = 0
    for chunk in windows(token_ids, window):
        if len(chunk) < 2:
            continue
        inputs, targets = chunk[:-1], torch.tensor(chunk[1:])
        ref = window_log_probs(ref_model, inputs)
        cand = window_log_probs(cand_model, inputs, kv_cache_dtype)
        kl_sum += float((ref.exp() * (ref - cand)).sum())
        agree += float((ref.argmax(-1) == cand.argmax(-1)).sum())
        nll_ref -= float(ref.gather(1, targets[:, None]).sum())
        nll_cand -= float(cand.gather(1, targets[:, None]).sum())
        count += len(inputs)
    if count == 0:
        raise ValueError("the text is too short to evaluate (needs at least 2 tokens)")
    probe = token_ids[:DECODE_PROBE_PROMPT]
    started = time.perf_counter()
    paths = [
        PathStats(
            "reference", math.exp(nll_ref / count), decode_rate(reference, probe), model_bytes(reference)
        ),
        PathStats(
            "quantized", math.exp(nll_cand / count), decode_rate(candidate, probe), model_bytes(candidate)
        ),
    ]
    return {
        "positions": count,
        "mean_kl": kl_sum / count,
        "top1_agreement": agree / count,
        "paths": [p.__dict__ for p in paths],
        "elapsed_s": time.perf_counter() - started,
    }

"""Prompt logprobs (vLLM's `prompt_logprobs`) against transformers on the same weights: every prompt
token after the first gets its logprob and rank under the model given the tokens before it, however
the prompt is chunked, cached or preempted (the engine skips the prefix cache for these requests)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvflow import LLM, SamplingParams

TOP_N = 3
PROMPT = list(range(3, 75))  # 72 prompt tokens: several 16-token chunks


def reference_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: row p - 1 = log-softmax of the logits that score prompt token p."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_match_transformers(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    model_dir = tiny_checkpoint_factory("llama")
    expected = reference_logprobs(model_dir, PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_N, ignore_eos=True)
    # 16-token chunks; 6 blocks of 16 hold one request, not two at full length: the second request
    # (the same prompt, a prefix-cache hit were it allowed) waits or is preempted and recomputed.
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16, num_kv_blocks=6)
    outputs = llm.generate([PROMPT, PROMPT], [params, dataclasses.replace(params, max_tokens=20)])
    for out in outputs:
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
        for position in range(1, len(PROMPT)):
            entry, row = entries[position], expected[position - 1]
            token = PROMPT[position]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == 1 + int((row > row[token]).sum())
            top = row.topk(TOP_N).indices.tolist()
            assert set(top) <= set(entry)  # the top-n, plus the prompt token itself
            assert len(entry) <= TOP_N + 1

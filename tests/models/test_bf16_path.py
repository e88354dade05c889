"""The bfloat16 serving path (oneDNN blocked weights, and on AVX512-BF16 CPUs the native decode
GEMV and paged decode attention) against transformers in float32 on the same bf16 weights.

bf16 rounds activations to 8 bits of mantissa, so logprobs differ from float32 by up to a few
tenths of a nat on these random models; the bound is calibrated per prompt on transformers' own
bf16 error against the same float32 reference (kvflow must stay within 1.5x of it). A wrong slot,
head or row in a kernel shows up as errors of order 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

ERROR_RATIO = 1.5  # kvflow-bf16 error / transformers-bf16 error, both against float32
ERROR_SLACK = 0.02  # nats, for prompts where transformers' bf16 error happens to be tiny
NUM_NEW_TOKENS = 8


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_engine_tracks_float32_reference(
    arch: str, tiny_checkpoint_factory: Callable[..., Path]
) -> None:
    path = tiny_checkpoint_factory(arch, dtype=torch.bfloat16)
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (1, 3, 40, 120)]
    # Batched decode (several sequences per step) and single-stream decode take different kernels.
    llm = LLM(str(path), dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params) + llm.generate(prompts[2:3], params)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for prompt, out in zip([*prompts, prompts[2]], outputs, strict=True):
        tokens = out.outputs[0].token_ids
        ids = torch.tensor([prompt + tokens])  # teacher-forced on kvflow's tokens
        with torch.no_grad():
            ref = torch.log_softmax(ref_model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            hf = torch.log_softmax(hf_bf16(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        positions = [
            (s, t, lp.logprob) for s, pos in enumerate(out.outputs[0].logprobs or []) for t, lp in pos.items()
        ]
        assert len(positions) >= NUM_NEW_TOKENS * 5
        kvflow_error = max(abs(lp - float(ref[s, t])) for s, t, lp in positions)
        hf_error = max(abs(float(hf[s, t]) - float(ref[s, t])) for s, t, _ in positions)
        assert kvflow_error <= ERROR_RATIO * hf_error + ERROR_SLACK, (len(prompt), kvflow_error, hf_error)

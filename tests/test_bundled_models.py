"""The checkpoints shipped in kvflow/assets load, generate, and match transformers token for token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.reference import hf_greedy

from kvflow import LLM, SamplingParams
from kvflow.assets import bundled_model_dir

transformers = pytest.importorskip("transformers")

PROMPT = "def read_config(path):\n"
NUM_TOKENS = 6


@pytest.mark.parametrize("name", ["target", "draft"])
def test_bundled_model_matches_transformers(name: str) -> None:
    path = bundled_model_dir(name)
    llm = LLM(str(path), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    out = llm.generate([PROMPT], params)[0]
    prompt_ids = out.prompt_token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref, _ = hf_greedy(model, prompt_ids, NUM_TOKENS)
    assert out.outputs[0].token_ids[: len(ref)] == ref
    assert transformers.AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"] == prompt_ids


def test_bundled_draft_shares_the_target_vocabulary() -> None:
    target = (bundled_model_dir("target") / "tokenizer.json").read_text()
    draft = (bundled_model_dir("draft") / "tokenizer.json").read_text()
    assert target == draft


def test_demo_runs_on_the_bundled_model() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "demo", "--max-tokens", "4", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr
    assert "tiny-target" in result.stderr and "TTFT" in result.stderr
    assert "continuous batching" in result.stderr

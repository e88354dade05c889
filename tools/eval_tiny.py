"""Quality figures of a trained target/draft pair (tools/train_tiny.py), for kvflow/assets/README.md.

    python tools/eval_tiny.py --target DIR --draft DIR [--windows 64] [--seq-len 256] [--json OUT]
                              [--cache-dir DIR]

Reports, on held-out text (standard-library files and pydoc topics never trained on):
- perplexity of the target, of the draft, and of a unigram baseline with the same tokenizer
  (add-one smoothed token frequencies of the training stream): exp(mean next-token cross-entropy);
- draft/target greedy agreement: the fraction of held-out positions where both models' argmax
  next token is the same (teacher-forced), the number speculative decoding builds on;
- greedy continuations, by kvflow, of three held-out function signatures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny

EVAL_SEED = 1234  # fixed held-out windows, independent of the training seed
NUM_SIGNATURES = 3
CONTINUATION_TOKENS = 48


def heldout_windows(stream: np.ndarray, count: int, seq_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(EVAL_SEED)
    return train_tiny.sample_windows(torch.from_numpy(stream), count, seq_len, generator)


@torch.no_grad()
def model_logits(model_dir: Path, windows: torch.Tensor) -> torch.Tensor:
    """float32 logits [N, T, V] of a checkpoint over windows[:, :-1] (evaluated in float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return torch.cat([model(input_ids=b[:, :-1]).logits.float() for b in windows.split(16)])


def perplexity(logits: torch.Tensor, windows: torch.Tensor) -> float:
    return math.exp(F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item())


def unigram_perplexity(train_stream: np.ndarray, windows: torch.Tensor, vocab_size: int) -> float:
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0  # add-one
    log_probs = np.log(counts / counts.sum())
    targets = windows[:, 1:].flatten().numpy()
    return math.exp(-float(log_probs[targets].mean()))


def _is_signature(line: str) -> bool:
    return line.lstrip().startswith("def ") and line.rstrip().endswith(":")


def heldout_signatures(count: int) -> list[str]:
    """The first `def` line of the first held-out standard-library files, in a fixed order."""
    corpus = train_tiny.collect_corpus()
    found = []
    for doc in sorted(corpus.heldout, key=lambda d: d.name):
        lines = [ln.strip() for ln in doc.text.splitlines() if _is_signature(ln)]
        if doc.name.startswith(train_tiny.STDLIB_PREFIX) and lines:
            found.append(lines[0])
        if len(found) == count:
            break
    return found


def continuations(target_dir: Path, prompts: list[str]) -> list[str]:
    from kvflow import LLM, SamplingParams

    llm = LLM(str(target_dir), dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=CONTINUATION_TOKENS)
    return [o.outputs[0].text for o in llm.generate([p + "\n" for p in prompts], params)]


def default_cache_dir() -> Path:
    """The tokenized corpus is a cache (about 33 MB, keyed by tokenizer and Python), not an asset:
    it lives in the user's cache directory, never in the package or in git."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvflow" / "eval-cache"


def evaluate(target: Path, draft: Path, num_windows: int, seq_len: int, cache: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    cache.mkdir(parents=True, exist_ok=True)
    train_stream, heldout_stream = train_tiny.load_or_build_streams(
        cache, tokenizer, None, train_tiny.collect_corpus
    )
    windows = heldout_windows(heldout_stream, num_windows, seq_len)
    target_logits = model_logits(target, windows)
    draft_logits = model_logits(draft, windows)
    agreement = (target_logits.argmax(-1) == draft_logits.argmax(-1)).float().mean().item()
    signatures = heldout_signatures(NUM_SIGNATURES)
    return {
        "heldout_tokens": int(windows[:, 1:].numel()),
        "perplexity": {
            "target": perplexity(target_logits, windows),
            "draft": perplexity(draft_logits, windows),
            "unigram": unigram_perplexity(train_stream, windows, tokenizer.get_vocab_size()),
        },
        "draft_target_greedy_agreement": agreement,
        "continuations": dict(zip(signatures, continuations(target, signatures), strict=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: ~/.cache/kvflow/eval-cache")
    args = ap.parse_args()
    cache = args.cache_dir or default_cache_dir()
    result = evaluate(args.target, args.draft, args.windows, args.seq_len, cache)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

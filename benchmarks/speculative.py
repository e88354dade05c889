"""Speculative decoding: tokens/s with and without, acceptance, and what auto-disable did.

    python benchmarks/speculative.py [--max-tokens 128] [--skip-qwen] [--draft DIR] [--batches 1 8]

On the bundled trained pair (kvflow/assets: random weights cannot measure acceptance) at batch 1
and 8, for two workloads:
  repetitive      the prompt already holds the code the output continues (a stdlib function,
                  then its first lines again): n-gram lookup can copy from the prompt
  non-repetitive  the first lines of held-out stdlib functions: nothing to copy
and methods: plain, ngram (k=3), ngram with auto-disable, draft (the bundled draft, k=3).
Then the cost side on the Qwen2.5-0.5B-shaped random checkpoint with a 2-layer random draft of
the same shape family (acceptance ~0: what a useless draft costs, and what auto-disable saves).
Output tokens/s = generated tokens / wall time of `generate` (greedy, ignore_eos, all at once), the
median of --repeats generates (one batch-1 generate is ~0.1 s: a single one is noisy).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import CACHE_DIR, QWEN25_05B, build_checkpoint

from kvflow import LLM, SamplingParams
from kvflow.assets import bundled_model_dir

K = 3


def stdlib_functions(count: int) -> list[str]:
    """Sources of small stdlib functions (json, textwrap, shlex, ...): held-out-like code."""
    import argparse as argparse_mod
    import difflib
    import json as json_mod
    import shlex
    import textwrap

    sources: list[str] = []
    for module in (textwrap, shlex, json_mod.decoder, json_mod.encoder, difflib, argparse_mod):
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 200 < len(src) < 1200:
                sources.append(src)
    return sources[:count]


def workloads(n: int) -> dict[str, list[str]]:
    sources = stdlib_functions(2 * n)
    repetitive = []
    for src in sources[:n]:
        head = "\n".join(src.splitlines()[:3]) + "\n"
        repetitive.append(f"# original\n{src}\n# copy\n{head}")
    fresh = ["\n".join(src.splitlines()[:2]) + "\n" for src in sources[n : 2 * n]]
    return {"repetitive": repetitive, "non-repetitive": fresh}


def run(model: Path, prompts: list[str], max_tokens: int, repeats: int, **engine: Any) -> dict[str, Any]:
    max_len = min(2048, json.loads((model / "config.json").read_text())["max_position_embeddings"])
    llm = LLM(str(model), dtype="bfloat16", max_model_len=max_len, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.llm_engine.spec_stats = type(llm.llm_engine.spec_stats)()
    # The engines of earlier rows are garbage now: collect them here, not inside a timed run (one
    # batch-1 generate takes ~0.1 s, so a collection inside it moves its rate by several percent).
    gc.collect()
    rates = []
    for _ in range(repeats):  # greedy: every repeat emits the same tokens
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    stats = llm.llm_engine.spec_stats
    return {
        "tok_s": statistics.median(rates),
        "acceptance": stats.acceptance_rate if stats.num_drafts else None,
        "mean_len": stats.mean_accepted_length if stats.num_drafts else None,
        "disabled_steps": llm.llm_engine.spec_controller.num_disabled_steps,
        "ids": [o.outputs[0].token_ids for o in outs],
    }


def table(
    title: str,
    model: Path,
    draft: Path | None,
    prompts: dict[str, list[str]],
    batches: list[int],
    max_tokens: int,
    repeats: int,
) -> None:
    methods: dict[str, dict[str, Any]] = {
        "plain": {},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": K},
        "ngram+auto": {
            "speculative_method": "ngram",
            "num_speculative_tokens": K,
            "speculative_auto_disable": True,
        },
    }
    if draft is not None:
        methods["draft"] = {
            "speculative_method": "draft",
            "draft_model": str(draft),
            "num_speculative_tokens": K,
        }
        methods["draft+auto"] = {**methods["draft"], "speculative_auto_disable": True}
    print(f"\n{title}")
    columns = ("tok/s", "vs plain", "accept", "len", "off")
    widths = (9, 10, 8, 6, 6)
    print(
        f"{'workload':<16}{'batch':>6} {'method':<12}"
        + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
    )
    for name, all_prompts in prompts.items():
        for batch in batches:
            subset = all_prompts[:batch]
            base = None
            for label, engine in methods.items():
                r = run(model, subset, max_tokens, repeats, **engine)
                base = base or r
                same = "" if r["ids"] == base["ids"] else "  OUTPUT DIFFERS"
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
                mean_len = "-" if r["mean_len"] is None else f"{r['mean_len']:.2f}"
                print(f"{name:<16}{batch:>6} {label:<12}{r['tok_s']:>9.1f}{r['tok_s'] / base['tok_s']:>9.2f}x"
                      f"{acc:>8}{mean_len:>6}{r['disabled_steps']:>6}{same}")  # fmt: skip


def qwen_draft(target: Path) -> Path:
    """A 2-layer random draft with the target's tokenizer and vocabulary (the cost side only)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = CACHE_DIR / "qwen2.5-0.5b-shape-draft-2-layers"
    if not (out / "config.json").exists():
        torch.manual_seed(1)
        config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": 2}, dtype=torch.bfloat16)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (target / name).exists():
                shutil.copy(target / name, out / name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--draft", type=Path, help="draft for the bundled target (default: the bundled draft)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes of the bundled pair")
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per row (the median is shown)")
    args = ap.parse_args()
    prompts = workloads(8)
    print(json.dumps({k: len(v) for k, v in prompts.items()}))
    target, draft = bundled_model_dir("target"), args.draft or bundled_model_dir("draft")
    table(
        f"bundled target, draft {draft}", target, draft, prompts, args.batches, args.max_tokens, args.repeats
    )
    if not args.skip_qwen:
        qwen = build_checkpoint(torch.bfloat16)
        table("Qwen2.5-0.5B shape, random weights (cost side)", qwen, qwen_draft(qwen),
              {"non-repetitive": prompts["non-repetitive"]}, [1, 8], 64, args.repeats)  # fmt: skip


if __name__ == "__main__":
    main()

"""Returning conversations with and without the KV offload tier (kvflow/kv_offload/), in one run.

    python benchmarks/kv_offload.py [--conversations 8] [--history 1024] [--rounds 2]

The Qwen2.5-0.5B-shaped random checkpoint (benchmarks/offline_throughput.py builds it once). Each
conversation's first turn has a `--history`-token prompt; the pool holds about a quarter of the
conversations, so by the time a conversation returns (its history + the answer + 32 new tokens)
the pool has evicted it. Two engines, identical but for `kv_offload_path`, take the turns
alternately (engine A's turn, then engine B's, conversation by conversation; a third, whose pool
holds everything, is the token reference): TTFT of the first and
returning turns per engine, median and p99 over the returning turns, how many of their prompt
tokens came back from the tier, and the tier's read time against the prefill it replaced. Greedy
tokens of both engines are compared (they must be identical).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import build_checkpoint  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.outputs import RequestOutput  # noqa: E402
from kvflow.stats import percentile  # noqa: E402

BLOCK = 16
NEW_TOKENS = 32  # the user's next message on a returning turn
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _ttft_ms(out: RequestOutput) -> float:
    assert out.metrics.ttft is not None
    return out.metrics.ttft * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--history", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2, help="returning turns per conversation")
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = build_checkpoint(torch.bfloat16)
    blocks_per_conversation = -(-(args.history + args.rounds * (NEW_TOKENS + 8) + 8) // BLOCK)
    pool = max(blocks_per_conversation + 4, blocks_per_conversation * args.conversations // 4)
    common = {"block_size": BLOCK, "num_kv_blocks": pool, "max_num_seqs": 1, "max_model_len": 4096}
    with tempfile.TemporaryDirectory() as tier_dir:
        engines = {
            "pool only": LLM(str(path), **common),
            "pool + tier": LLM(str(path), kv_offload_path=tier_dir, **common),
            # Holds every conversation: its returning turns are pool hits on the KV computed in the
            # earlier turns, as the tier's restores are (the token reference for the tier).
            "pool for all": LLM(
                str(path), **{**common, "num_kv_blocks": blocks_per_conversation * args.conversations + 8}
            ),
        }
        vocab = engines["pool only"].get_tokenizer().vocab_size
        rng = random.Random(0)
        prompts = [
            [rng.randrange(100, vocab) for _ in range(args.history)] for _ in range(args.conversations)
        ]
        first: dict[str, list[float]] = {name: [] for name in engines}
        returning: dict[str, list[float]] = {name: [] for name in engines}
        restored: list[int] = []
        restore_ms: list[float] = []
        tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
        history = {name: [list(p) for p in prompts] for name in engines}
        for turn in range(args.rounds + 1):
            for c in range(args.conversations):
                extra = [rng.randrange(100, vocab) for _ in range(NEW_TOKENS)] if turn else []
                for name, llm in engines.items():
                    prompt = history[name][c] + extra
                    out = llm.generate(prompt, GREEDY)[0]
                    answer = list(out.outputs[0].token_ids)
                    history[name][c] = prompt + answer
                    tokens[name].append(answer)
                    (returning if turn else first)[name].append(_ttft_ms(out))
                    if turn and name == "pool + tier":
                        restored.append(out.metrics.num_restored_tokens)
                        restore_ms.append(1e3 * (out.metrics.kv_restore_time or 0.0))
        tier = engines["pool + tier"].llm_engine.kv_offload_tier
        assert tier is not None
        print(
            f"{args.conversations} conversations, {args.history}-token histories, {args.rounds} returning "
            f"turns each; pool {pool} blocks of {BLOCK} (~{pool / blocks_per_conversation:.1f} conversations)"
        )
        for name in engines:
            r = returning[name]
            print(
                f"  {name:12s} first-turn TTFT p50 {statistics.median(first[name]):7.1f} ms   returning TTFT "
                f"p50 {statistics.median(r):7.1f} ms  p99 {percentile(r, 99):7.1f} ms"
            )
        ratio = statistics.median(returning["pool only"]) / statistics.median(returning["pool + tier"])
        print(f"  returning-turn TTFT p50, pool only / pool + tier: {ratio:.2f}x")
        print(
            f"  restored prompt tokens per returning turn: median {statistics.median(restored):.0f}; "
            f"tier read time per restore: median {statistics.median(restore_ms):.1f} ms; tier: "
            f"{tier.stats.blocks_stored} blocks written, {tier.stats.blocks_read} read, "
            f"{tier.stats.bytes_read / max(tier.stats.read_seconds, 1e-9) / 1e9:.2f} GB/s read"
        )
        # Recomputing a history in one prefill rounds its answer tokens' K/V differently (bf16 GEMM)
        # than the decode steps that first computed them, so "pool only" may part ways with both.
        same = tokens["pool for all"] == tokens["pool + tier"]
        print(
            f"  greedy tokens, pool + tier vs pool for all (both reuse the first turns' KV): identical {same}"
        )
        print(
            "  greedy tokens, pool only vs pool for all: identical",
            tokens["pool only"] == tokens["pool for all"],
        )
        tier.close()


if __name__ == "__main__":
    main()

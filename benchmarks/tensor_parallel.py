"""Tensor parallelism on this machine: TP=1 with T threads against TP=2 with T/2 threads per rank.

On the Qwen2.5-0.5B-shaped random checkpoint (benchmarks/offline_throughput.py builds it), bf16, in
one run: prefill tokens/s of one PROMPT_LEN-token prompt (one chunk) and single-stream decode
tokens/s (median inter-token gap); for TP=2 also where the step goes: time in all-reduce (rank 0's,
which includes waiting for the slower rank) and its share of the step, the gather of the sampled
rows' logits, the step message, and the bytes each moves per token. With --compare-gloo the TP=2
run is repeated with gloo's all-reduce instead of the shared-memory one, to show why the latter.

Both configurations share one memory bus here, so TP=2 cannot beat TP=1 by more than the compute
it adds; on two sockets or two GPUs the same numbers predict the scaling: a rank streams 1/N of the
weights, and the all-reduce cost per step (printed) is what is added.

    python benchmarks/tensor_parallel.py                 # the measured run (a few minutes)
    python benchmarks/tensor_parallel.py --quick         # proves the script works (short prompt)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import QWEN25_05B, build_checkpoint  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402


@dataclass
class Result:
    label: str
    prefill_tok_s: float
    decode_tok_s: float
    comm: dict[str, float]


def _engine(path: Path, prompt_len: int, decode_len: int, **kwargs: Any) -> LLM:
    return LLM(
        str(path),
        dtype="bfloat16",
        max_model_len=prompt_len + decode_len + 8,
        max_num_batched_tokens=prompt_len,  # the prompt in one chunk
        enable_prefix_caching=False,
        **kwargs,
    )


def _comm_snapshot(llm: LLM) -> dict[str, float]:
    parallel = llm.llm_engine.parallel
    if parallel is None:
        return {}
    s = parallel.ctx.comm.stats
    return {
        "all_reduce_calls": s.all_reduce_calls,
        "all_reduce_s": s.all_reduce_seconds,
        "all_reduce_bytes": s.all_reduce_bytes,
        "gather_s": s.gather_seconds,
        "gather_bytes": s.gather_bytes,
        "broadcast_s": parallel.broadcast_seconds,
        "broadcast_bytes": parallel.broadcast_bytes,
        "steps": parallel.broadcast_calls,
    }


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def measure(label: str, path: Path, prompt_len: int, decode_len: int, **kwargs: Any) -> Result:
    llm = _engine(path, prompt_len, decode_len, **kwargs)
    vocab = QWEN25_05B["vocab_size"]
    rng = random.Random(0)
    warm = [rng.randrange(vocab) for _ in range(prompt_len)]
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    before = _comm_snapshot(llm)
    started = time.perf_counter()
    prefill = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0].metrics
    prefill_wall = time.perf_counter() - started
    prefill_comm = _delta(_comm_snapshot(llm), before)
    assert prefill.prefill_time is not None
    # Decode alone: a run of decode_len tokens minus a run of 1 token (its prefill) on the same prompt.
    short = [rng.randrange(vocab) for _ in range(16)]
    walls, comms = [], []
    for max_tokens in (1, decode_len):
        before = _comm_snapshot(llm)
        started = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([short], params)[0]
        walls.append(time.perf_counter() - started)
        comms.append(_delta(_comm_snapshot(llm), before))
    decode_wall = walls[1] - walls[0]
    decode_comm = _delta(comms[1], comms[0]) if comms[0] else {}
    itl = statistics.median(out.metrics.itl)
    comm: dict[str, float] = {}
    if decode_comm:
        steps = decode_comm["steps"]
        comm = {
            "decode_all_reduce_ms_per_step": 1e3 * decode_comm["all_reduce_s"] / steps,
            "decode_all_reduces_per_step": decode_comm["all_reduce_calls"] / steps,
            "decode_all_reduce_share": decode_comm["all_reduce_s"] / decode_wall,
            "decode_gather_ms_per_step": 1e3 * decode_comm["gather_s"] / steps,
            "decode_step_message_us": 1e6 * decode_comm["broadcast_s"] / steps,
            "decode_step_message_bytes": decode_comm["broadcast_bytes"] / steps,
            "decode_all_reduce_bytes_per_token": decode_comm["all_reduce_bytes"] / steps,
            "decode_gather_bytes_per_token": decode_comm["gather_bytes"] / steps,
            "prefill_all_reduce_share": prefill_comm["all_reduce_s"] / prefill_wall,
            "prefill_all_reduce_bytes_per_token": prefill_comm["all_reduce_bytes"] / prompt_len,
        }
    parallel = llm.llm_engine.parallel
    if parallel is not None:
        parallel.shutdown()
    return Result(label, prompt_len / prefill.prefill_time, 1.0 / itl, comm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 2, help="TP=1's threads (TP=2: half each)"
    )
    ap.add_argument("--compare-gloo", action="store_true", help="also TP=2 with gloo's all-reduce")
    ap.add_argument(
        "--quick", action="store_true", help="a 64-token prompt, 16 tokens: proves the script runs"
    )
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.decode_len = 64, 16
    path = build_checkpoint(torch.bfloat16)
    per_rank = max(1, args.threads // 2)
    print(f"checkpoint {path}; prompt {args.prompt_len} tokens, decode {args.decode_len} tokens")
    torch.set_num_threads(args.threads)
    runs = [measure(f"TP=1 x {args.threads} threads", path, args.prompt_len, args.decode_len)]
    tp2 = {"tensor_parallel_size": 2, "cpu_threads_per_rank": per_rank}
    runs.append(measure(f"TP=2 x {per_rank} thread(s), shm", path, args.prompt_len, args.decode_len, **tp2))
    if args.compare_gloo:
        gloo = {**tp2, "all_reduce_backend": "gloo"}
        runs.append(
            measure(f"TP=2 x {per_rank} thread(s), gloo", path, args.prompt_len, args.decode_len, **gloo)
        )
    base = runs[0]
    print(f"{'':32} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs TP=1':>15}")
    for r in runs:
        ratio = r.decode_tok_s / base.decode_tok_s
        print(f"{r.label:32} {r.prefill_tok_s:14.1f} {r.decode_tok_s:13.2f} {ratio:14.2f}x")
    for r in runs[1:]:
        c = r.comm
        print(
            f"{r.label}: decode step: {c['decode_all_reduces_per_step']:.0f} all-reduces, "
            f"{c['decode_all_reduce_ms_per_step']:.2f} ms ({c['decode_all_reduce_share']:.1%} of the step), "
            f"logits gather {c['decode_gather_ms_per_step']:.2f} ms, step message "
            f"{c['decode_step_message_us']:.0f} us ({c['decode_step_message_bytes']:.0f} B);"
            f" per token per rank: "
            f"all-reduce {c['decode_all_reduce_bytes_per_token'] / 1024:.1f} KiB, logits "
            f"{c['decode_gather_bytes_per_token'] / 1024:.1f} KiB; prefill: all-reduce "
            f"{c['prefill_all_reduce_share']:.1%} of the step, "
            f"{c['prefill_all_reduce_bytes_per_token'] / 1024:.1f} KiB per token"
        )
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in runs], indent=2))


if __name__ == "__main__":
    main()

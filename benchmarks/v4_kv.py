"""DeepSeek-V4's compressed attention against V3's MLA on a CPU: KV bytes a request holds and decode
step time at 4k, 32k and 128k context, side by side in one run.

    python benchmarks/v4_kv.py [--contexts 4096,32768,131072] [--steps 16] [--rounds 2] [--threads 2]

Two random-weight checkpoints of the same width (hidden 512, 4 layers, 8 experts top-2 + a shared
one, bf16), built once in ~/.cache/kvflow-bench:
- V4 shape (V4_SHAPE): CSA, HCA, CSA, HCA layers (rates 4 / 128, window 128, top-512 of the CSA
  entries by an indexer of 8 heads x 64), one K=V head of 256 per token, 8 query heads of 256;
- V3 shape (V3_SHAPE): MLA with a 256-value latent per token (kv_lora_rank 224 + 32 rotary), 8 heads.
So one cached vector per token (V3) or per window token / entry (V4) has the same width.
For each context: one request, its prefill, then `--steps` decode steps timed one by one (the median
reported). The KV it holds is what the allocator gave it (blocks per cache group x bytes per block,
kvflow's own accounting). At contexts above --real-prefill-max (32k by default) the prefill's
forward is skipped and the pool's pages are filled with random values instead (a V3-shape 128k
prefill is quadratic: about an hour on 2 cores): the blocks, tables and compressor states are
allocated as a real prefill would, and a decode step's cost does not depend on the cached values.
The share of a V4 decode step spent in the indexer (scoring every index key and choosing the top k,
kvflow/models/deepseek_v4.py _StepEntries._select and _index_keys) is timed with wrappers.
Engines alternate round by round; each timed run waits for a quiet machine first.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from fixtures.checkpoints import build_checkpoint  # noqa: E402
from offline_throughput import CACHE_DIR  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.models import deepseek_v4  # noqa: E402

WIDTH = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    q_lora_rank=128,
    moe_intermediate_size=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    max_position_embeddings=140_000,
    initializer_range=0.02,
)
V4_SHAPE = dict(
    WIDTH,
    head_dim=256,
    partial_rotary_factor=0.125,  # 32 rotary dims
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    hc_mult=4,
    sliding_window=128,
    o_groups=4,
    o_lora_rank=128,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=512,
    swiglu_limit=10.0,
)
V3_SHAPE = dict(
    WIDTH,
    num_key_value_heads=8,
    kv_lora_rank=224,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    first_k_dense_replace=0,
    n_group=2,
    topk_group=1,
    rope_interleave=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
MODELS = {"v4": ("deepseek_v4", V4_SHAPE), "v3": ("deepseek_v3", V3_SHAPE)}
MAX_CHUNK = 2048  # prefill chunk (max_num_batched_tokens)
QUIET_LOAD = 0.3  # 1-minute load average per core below which the machine counts as quiet
QUIET_WAIT_S = 120


def checkpoint(name: str) -> Path:
    arch, shape = MODELS[name]
    path = CACHE_DIR / f"v4-kv-{name}"
    if not (path / "config.json").exists():
        build_checkpoint(path, arch, dtype=torch.bfloat16, **shape)
    return path


def wait_quiet() -> None:
    deadline = time.time() + QUIET_WAIT_S
    while os.getloadavg()[0] / (os.cpu_count() or 1) > QUIET_LOAD and time.time() < deadline:
        time.sleep(5)


@contextmanager
def timed(obj: Any, attr: str, bucket: dict[str, float]) -> Iterator[None]:
    """Accumulate the wall time of obj.attr's calls into bucket[attr]."""
    original = getattr(obj, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            bucket[attr] = bucket.get(attr, 0.0) + time.perf_counter() - start

    setattr(obj, attr, wrapper)
    try:
        yield
    finally:
        setattr(obj, attr, original)


def _fill_pool_randomly(llm: LLM) -> None:
    """Random finite bf16 values in every page (a float32 state read from them stays finite)."""
    store = llm.llm_engine.model_runner.kv_store
    tensors = store.compressed_pages.tensors if store.compressed_pages is not None else []
    tensors += [t for layer in store.latent_layers for t in layer.tensors]
    gen = torch.Generator().manual_seed(0)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen) * 0.5)


def run(name: str, context: int, steps: int, real_prefill_max: int) -> dict[str, Any]:
    llm = LLM(
        str(checkpoint(name)),
        dtype="bfloat16",
        max_model_len=context + steps + 8,
        max_num_batched_tokens=MAX_CHUNK,
    )
    engine = llm.llm_engine
    model = engine.model_runner.model
    rng = random.Random(context)
    prompt = [rng.randrange(3, 500) for _ in range(context)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    synthetic = context > real_prefill_max
    original_forward = model.forward
    if synthetic:  # the prefill's forward skipped: hidden states of zeros, the pool filled after
        model.forward = lambda ids, meta, store: torch.zeros(
            ids.shape[0], model.config.hidden_size, dtype=model.dtype
        )
    wait_quiet()
    start = time.perf_counter()
    while engine.scheduler.requests["r"].num_output_tokens == 0:
        engine.step()
    prefill_s = time.perf_counter() - start
    if synthetic:
        model.forward = original_forward
        _fill_pool_randomly(llm)
    manager = engine.scheduler.kv_cache_manager
    per_block = manager.kv_cache_config.bytes_per_block
    held: dict[str, int] = {}
    bucket: dict[str, float] = {}
    step_s: list[float] = []
    entries = deepseek_v4._StepEntries
    with timed(entries, "_select", bucket), timed(entries, "_index_keys", bucket):
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
            if not held:  # after the first decode step: the prompt's window blocks are released
                for group in manager.groups:
                    blocks = len(group.held_blocks("r")) * per_block
                    held[group.spec.kind] = held.get(group.spec.kind, 0) + blocks
    del llm, engine
    gc.collect()
    return {
        "prefill_s": prefill_s,
        "synthetic": synthetic,
        "step_ms": 1e3 * statistics.median(step_s),
        "held": held,
        "indexer_share": sum(bucket.values()) / sum(step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--real-prefill-max", type=int, default=32768)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        order = ["v4", "v3"] if r % 2 == 0 else ["v3", "v4"]
        for context in contexts:
            for name in order:
                out = run(name, context, args.steps, args.real_prefill_max)
                results.setdefault((name, context), []).append(out)
                print(
                    f"round {r} {name} ctx {context}: prefill {out['prefill_s']:.1f} s"
                    f"{' (synthetic)' if out['synthetic'] else ''}, step {out['step_ms']:.2f} ms",
                    flush=True,
                )
    print("\ncontext  model  KV held after the first decode step (MiB, by kind)  step ms (median)")
    for context in contexts:
        for name in ("v4", "v3"):
            runs = results[(name, context)]
            held = runs[0]["held"]
            kinds = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in held.items())
            step = statistics.median(r["step_ms"] for r in runs)
            share = statistics.median(r["indexer_share"] for r in runs) if name == "v4" else None
            extra = f"  indexer {100 * share:.0f}% of the step" if share is not None else ""
            print(f"{context:>7}  {name}  total {sum(held.values()) / 2**20:.2f}: {kinds}  {step:.2f}{extra}")
        v4 = sum(results[("v4", context)][0]["held"].values())
        v3 = sum(results[("v3", context)][0]["held"].values())
        s4 = statistics.median(r["step_ms"] for r in results[("v4", context)])
        s3 = statistics.median(r["step_ms"] for r in results[("v3", context)])
        print(f"{context:>7}  V4 / V3: KV {v4 / v3:.3f}, decode step {s4 / s3:.2f}")


if __name__ == "__main__":
    main()

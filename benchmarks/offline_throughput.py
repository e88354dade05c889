"""Offline throughput: kvflow vs transformers on a Qwen2.5-0.5B-shaped random checkpoint, in one run.

    python benchmarks/offline_throughput.py [--num-requests 64] [--dtype bfloat16] [--skip-hf]
                                            [--batch-invariant]

Workload (fixed seed): prompt lengths uniform in 128..512 tokens, output lengths uniform in
64..256, greedy, ignore_eos. kvflow gets every request at once (continuous batching);
transformers runs `generate` on batches of 8, left-padded, each batch to its longest output
(only the requested tokens are counted for it). Also: single-stream decode tokens/s against the
bandwidth roofline (bytes of weights read per token / memory bandwidth measured in this run).
Prints ratios measured in this run: the machine's bandwidth drifts, so compare within a run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.kernels import on_huge_pages  # noqa: E402

# Qwen2.5-0.5B's shape (its config.json on the hub), with random weights.
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
)
CACHE_DIR = Path.home() / ".cache" / "kvflow-bench"
SHARED_QWEN2_TOKENIZER = REPO.parent / "shared" / "assets" / "tokenizers" / "qwen2"
HF_BATCH_SIZE = 8


def build_checkpoint(dtype: torch.dtype) -> Path:
    """Random Qwen2.5-0.5B-shaped checkpoint, built once and cached."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = CACHE_DIR / f"qwen2.5-0.5b-shape-{str(dtype).split('.')[-1]}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B, dtype=dtype)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    if SHARED_QWEN2_TOKENIZER.is_dir():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(SHARED_QWEN2_TOKENIZER / name, out / name)
    else:  # any byte-level BPE will do: prompts are token ids
        sys.path.insert(0, str(REPO / "tests"))
        from fixtures.checkpoints import train_tokenizer

        train_tokenizer(out)
    return out


def measure_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Read bandwidth: a float32 sum over 1 GiB (decode only reads weights), median of N runs.
    (A copy reads and writes; on this machine it reports less than the read rate decode sees.)
    The buffer is on transparent huge pages, as kvflow's decode weights are (kvflow/kernels/
    huge_pages.cpp): on 4 KiB pages the same sum reads ~5-10% slower here, and a roofline from it
    would credit the weights' page size to the kernels."""
    src = on_huge_pages(torch.ones(nbytes // 4, dtype=torch.float32))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def weight_bytes_per_token(path: Path, dtype: torch.dtype) -> int:
    """Decode reads every linear weight plus the LM head once per step; the embedding table is
    only gathered (one row), so a tied checkpoint's matrix counts once, as the head."""
    cfg = json.loads((path / "config.json").read_text())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    params = layers * per_layer + cfg["vocab_size"] * h
    return params * torch.empty(0, dtype=dtype).element_size()


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(128, 512))] for _ in range(n)]
    outputs = [rng.randint(64, 256) for _ in range(n)]
    return prompts, outputs


def run_kvflow(llm: LLM, prompts: list[list[int]], out_lens: list[int]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(
    path: Path, dtype: torch.dtype, prompts: list[list[int]], out_lens: list[int]
) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    elapsed, useful = 0.0, 0
    for b in range(0, len(prompts), HF_BATCH_SIZE):
        batch, lens = prompts[b : b + HF_BATCH_SIZE], out_lens[b : b + HF_BATCH_SIZE]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                pad_token_id=0,
            )
        elapsed += time.perf_counter() - t
        useful += sum(lens)
    return elapsed, useful


def single_stream_decode(llm: LLM, vocab: int, prompt_len: int = 128, out_len: int = 128) -> float:
    """Decode tokens/s of one request alone (the median inter-token gap, prefill excluded)."""
    prompt = [random.Random(1).randrange(vocab) for _ in range(prompt_len)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))[0]
    return 1.0 / statistics.median(out.metrics.itl)


def batch_decode(llm: LLM, vocab: int, num_seqs: int = 8, prompt_len: int = 128, out_len: int = 64) -> float:
    """Aggregate decode tokens/s of `num_seqs` requests decoding together (median gap, x num_seqs)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_seqs)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    gaps = [g for o in outs for g in o.metrics.itl[num_seqs:]]  # skip steps shared with prefill
    return num_seqs / statistics.median(gaps)


def prefill_rate(llm: LLM, vocab: int, prompt_len: int = 512) -> float:
    """Prompt tokens/s of one 512-token prompt in one chunk (prompt_len / prefill time)."""
    prompt = [random.Random(3).randrange(vocab) for _ in range(prompt_len)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert out.metrics.prefill_time is not None
    return prompt_len / out.metrics.prefill_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--skip-hf", action="store_true", help="skip transformers (it takes minutes)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--batch-invariant", action="store_true", help="kvflow's batch-invariant mode (its cost)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    path = build_checkpoint(dtype)
    vocab = QWEN25_05B["vocab_size"]
    prompts, out_lens = workload(args.num_requests, vocab)
    print(f"checkpoint {path} ({args.dtype}), {torch.get_num_threads()} threads, {len(prompts)} requests")

    llm = LLM(
        str(path),
        dtype=args.dtype,
        max_model_len=4096,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        batch_invariant=args.batch_invariant,
    )
    run_kvflow(llm, prompts[:2], [4, 4])  # warm-up (oneDNN primitive creation)
    bandwidth = measure_bandwidth_gbs()
    roofline = bandwidth * 1e9 / weight_bytes_per_token(path, dtype)
    decode_tps = single_stream_decode(llm, vocab)
    print(f"memory bandwidth (read): {bandwidth:.1f} GB/s -> decode roofline {roofline:.1f} tokens/s")
    print(f"kvflow single-stream decode: {decode_tps:.1f} tokens/s = {decode_tps / roofline:.0%} of roofline")

    print(f"kvflow batch-8 decode: {batch_decode(llm, vocab):.1f} tokens/s")
    print(f"kvflow prefill (512-token prompt): {prefill_rate(llm, vocab):.1f} tokens/s")

    kv_time, kv_tokens = run_kvflow(llm, prompts, out_lens)
    kv_tps = kv_tokens / kv_time
    print(f"kvflow: {kv_tokens} output tokens in {kv_time:.1f} s = {kv_tps:.1f} output tokens/s")
    if not args.skip_hf:
        del llm
        hf_time, hf_tokens = run_transformers(path, dtype, prompts, out_lens)
        hf_tps = hf_tokens / hf_time
        print(f"transformers: {hf_tokens} output tokens in {hf_time:.1f} s = {hf_tps:.1f} output tokens/s")
        print(f"ratio kvflow / transformers: {kv_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()

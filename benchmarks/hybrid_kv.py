"""Cache kinds on a CPU: what a hybrid model's request holds in the pool, and what its decode costs.

    python benchmarks/hybrid_kv.py [--parts gpt_oss,qwen3_next] [--rounds 2] [--threads 2]

Two random-weight checkpoints, built once and cached in ~/.cache/kvflow-bench:
- gpt-oss shape (GPT_OSS_SHAPE): 24 layers alternating sliding (window 128) / full attention with
  sinks, 16 query heads / 2 KV heads of 64, 32 experts top-4, hidden = expert size = 768, Qwen2's
  tokenizer and vocabulary (151,936; llama.cpp's converter needs a pre-tokenizer it knows): 1.63G
  parameters, 3.3 GB in bf16. Parts:
    (a) the pool bytes one 32k-context request holds, by cache kind, against caching every layer
        in full (kvflow's own accounting: KVCacheConfig.bytes_held_by_kind and the startup line),
        checked against the blocks a real 8k request holds in each group;
    (b) single-stream decode tokens/s at 8k context (and at an empty one), kvflow against
        llama.cpp on the same weights (convert_hf_to_gguf.py --outtype bf16: its GptOss converter
        takes bf16 experts as well as the released MXFP4 ones, warning that bf16 is slower;
        llama-bench -p 0 -n 64 -d 8192, with its default -fa auto and with -fa 0: ENGINES; kvflow:
        prefill 8,192 tokens, then 64 decode steps timed, prefill excluded), engines rotated round
        by round, the read-bandwidth probe of benchmarks/vs_llamacpp.py before and after each
        engine's run, and each engine's share of the bandwidth roofline (bytes a decode step reads:
        attention weights, the router, 4 of 32 experts, the LM head, K/V of 8,192 tokens in the
        full layers and 128 in the sliding ones).
    Then one profiled kvflow request (module hooks): where its 8k prefill and its decode steps go,
    by layer kind.
- Qwen3-Next shape (QWEN3_NEXT_SHAPE): 12 layers, 3 Gated DeltaNet (linear attention, 16 key /
  32 value heads of 128) to 1 gated full attention (16 heads / 2 KV heads of 256), hidden 2048, 8
  experts top-2 plus a shared expert of 512, vocabulary 32,768 (the fixture tokenizer; no llama.cpp
  run): 0.86G parameters, 1.7 GB in bf16. Parts:
    (c) decode step time at 1k..32k context (flat in the linear layers, growing in the full ones),
        split by layer kind with module hooks (and the state gather / scatter of
        kvflow/attention/state_pool.py inside the linear layers), against the bytes-read model;
    (d) prefix caching's state checkpoints: the interval kvflow picks, the bytes of one checkpoint,
        the prefill time of a cold 8k prompt with prefix caching on (checkpoints written) against
        off, and the TTFT of the same 8k prompt repeated (restored from its last checkpoint)
        against cold.
Prints one table per part and the ratios measured in this run (the machine's bandwidth drifts:
compare within a run). Each timed run first waits for the machine to be quiet (wait_quiet) and
reports what other processes used during it. Not in CI: it builds llama.cpp (10-25 minutes on 2
cores, once; shared with vs_llamacpp.py); part (b) runs about 25 minutes, (c) and (d) about an
hour (a 32k prefill of the Qwen3-Next shape alone is 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from offline_throughput import CACHE_DIR, SHARED_QWEN2_TOKENIZER, measure_bandwidth_gbs  # noqa: E402
from vs_llamacpp import UNSTEADY_SPREAD, build_llamacpp, convert, runnable_llamacpp  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.attention.state_pool import PagedStateLayer  # noqa: E402

BF16_BYTES = 2
GEN_LEN = 64  # decode tokens timed after the prompt (llama-bench -n 64)
DEPTH = 8192  # the context gpt-oss decodes at (llama-bench -d 8192)
# ... and at an empty context, where no K/V is read: what the engines' weight paths alone give.
DEPTHS = (DEPTH, 0)
# llama.cpp twice: its default (-fa auto, which runs flash attention on this CPU) and -fa 0. Its CPU
# flash-attention decode at 8k context was 5.8 tokens/s here against 15.6 without it (llama-bench
# -fa 0,1 -d 8192 -n 32), so its default alone would flatter kvflow.
LLAMA_FLASH_ATTN = {"llama.cpp": "auto", "llama.cpp -fa off": "0"}
ENGINES = ("kvflow", *LLAMA_FLASH_ATTN)
LONG_CONTEXT = 32768  # the request whose pool bytes part (a) reports
# Prefill chunk (max_num_batched_tokens): llama.cpp's default logical batch (-b 2048) too.
PREFILL_CHUNK = 2048
# The machine is shared (other sessions run tests on it), and llama.cpp's threads spin at barriers:
# one core taken by another process cut its 2-thread decode of this gpt-oss shape from ~20 to 2-3
# tokens/s here. So each timed run first waits until the other processes leave the cores alone,
# and reports what they used during it (others_meter; a run they took more than NOISY_CORES in is
# marked `!` and left out of the quiet medians).
QUIET_CORES = 0.15  # other processes' CPU (kernel threads included), in cores: below it, quiet
QUIET_WINDOW_S = 2.0
QUIET_MAX_WAIT_S = 1800.0
NOISY_CORES = 0.1

# gpt-oss-20b's config.json with the width scaled down (2880 -> 768) so that kvflow (which holds
# its bf16 linears twice once packed) and llama.cpp's copy fit in 24 GiB together, and 2 KV heads
# (20b has 8) as the benchmark's issue asks; the rest as released: window 128, 32 experts top-4,
# biased SwiGLU clamped at 7, YaRN x32 from 4,096 positions.
GPT_OSS_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 24,
    "hidden_size": 768,
    "intermediate_size": 768,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "vocab_size": 151936,  # Qwen2's tokenizer (151,665 tokens) padded as Qwen2 pads it
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,  # transformers' default (the fixtures' 0.2 is for tiny models)
    "bos_token_id": 151643,
    "eos_token_id": 151643,  # <|endoftext|>; unused, every run ignores EOS
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}
# One 32k request (2,048 full-attention blocks, and a sliding group's window plus one prefill
# chunk, 137 blocks, while it prefills) with room to spare, in blocks of 16 tokens.
GPT_OSS_POOL_BLOCKS = 2304

# Qwen3-Next-80B-A3B's layer shapes (hidden 2048, linear heads 16 key / 32 value of 128, full
# attention 16 heads / 2 KV heads of 256, experts of 512 and a shared expert of 512) at 12 of its
# 48 layers and 8 of its 512 experts (top-2 of 8 for its top-10 of 512), so that a 32k prefill
# per context point fits the run.
QWEN3_NEXT_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 12,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "intermediate_size": 512,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "vocab_size": 32768,
    "max_position_embeddings": 65536,
    "initializer_range": 0.02,
}
SWEEP_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_GEN = 32  # decode steps timed at each context
QWEN3_NEXT_MAX_LEN = 32768 + 256  # the longest sweep prompt and its decode, in whole blocks
# The longest sweep request (2,064 full-attention blocks, 3 linear groups x 65 state blocks) or an
# 8k prompt with its state checkpoints, with room to spare.
QWEN3_NEXT_POOL_BLOCKS = 4096
PREFIX_PROMPT = 8192


# ------------------------------------------------------------------------------- checkpoints


def gpt_oss_checkpoint() -> Path:
    out = CACHE_DIR / "gpt-oss-shape-h768-bf16"
    if not (out / "config.json").exists():
        if not (SHARED_QWEN2_TOKENIZER / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{SHARED_QWEN2_TOKENIZER}/tokenizer.json (llama.cpp's converter needs it)"
            )
        _build(out, "gpt_oss", GPT_OSS_SHAPE)
        # llama.cpp's converter recognises a BPE pre-tokenizer by the hash of its output: Qwen2's
        # is known, the fixtures' is not. Prompts are random token ids either way.
        shutil.copy(SHARED_QWEN2_TOKENIZER / "tokenizer.json", out / "tokenizer.json")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|endoftext|>",
            "bos_token": None,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def qwen3_next_checkpoint() -> Path:
    out = CACHE_DIR / "qwen3-next-shape-h2048-bf16"
    if not (out / "config.json").exists():
        _build(out, "qwen3_next", QWEN3_NEXT_SHAPE)
    return out


def _build(out: Path, arch: str, shape: dict[str, Any]) -> None:
    from fixtures.checkpoints import build_checkpoint

    print(f"building {out.name} (random weights, once) ...", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_checkpoint(tmp, arch, dtype=torch.bfloat16, **shape)
    tmp.rename(out)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


# ---------------------------------------------------------------------------- measurement


class KindTimer:
    """Wall seconds spent inside modules (or methods), summed per label, through forward hooks.
    kvflow runs these models' steps on the Python path, synchronously on the CPU, so a module's
    wall time is its cost; nested labels (a state read inside a linear layer) overlap their parent."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def watch(self, module: torch.nn.Module, label: str) -> None:
        starts: list[float] = []

        def pre(_module: Any, _args: Any) -> None:
            starts.append(time.perf_counter())

        def post(_module: Any, _args: Any, _out: Any) -> None:
            self.seconds[label] += time.perf_counter() - starts.pop()
            self.calls[label] += 1

        handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        self._undo += [h.remove for h in handles]

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Time every call of owner.name (a class's method, or an instance's) under `label`."""
        original = getattr(owner, name)
        had_own = name in vars(owner)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original) if had_own else delattr(owner, name))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def watch_layers(llm: LLM, timer: KindTimer) -> None:
    """Hooks on each decoder layer's attention (labelled by its cache kind), its MLP / experts, and
    the LM head with sampling's greedy pick."""
    model = llm.llm_engine.model_runner.model
    kinds = model.config.cache_layer_kinds
    for i, layer in enumerate(model.layers):
        attention = "linear_attn" if getattr(layer, "linear_attn", None) is not None else "self_attn"
        timer.watch(layer.get_submodule(attention), kinds[i])
        timer.watch(layer.get_submodule("mlp"), "experts (MoE)")
    timer.wrap(model, "compute_logits", "LM head")
    timer.wrap(model, "greedy_tokens", "LM head")


@contextmanager
def profiled(llm: LLM, with_states: bool = False) -> Iterator[KindTimer]:
    timer = KindTimer()
    watch_layers(llm, timer)
    if with_states:
        timer.wrap(PagedStateLayer, "read", "state gather (read)")
        timer.wrap(PagedStateLayer, "write", "state scatter (write)")
    try:
        yield timer
    finally:
        timer.close()


def prefill_then_decode(
    llm: LLM, prompt: list[int], num_decode: int, on_first_token: Callable[[], None] | None = None
) -> dict[str, Any]:
    """One request alone: its prompt prefilled, then `num_decode` decode steps, each step timed.
    `on_first_token` runs between the two (a bandwidth probe, a timer reset), outside every timing."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, ignore_eos=True)
    start = time.perf_counter()
    rid = engine.add_request(None, prompt, params)
    while not any(out.request_id == rid for out in engine.step()):
        pass
    prefill = time.perf_counter() - start
    if on_first_token is not None:
        on_first_token()
    steps, held = [], (0, [0])
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if rid in engine.scheduler.requests:  # outside the timing: the blocks each group holds now
            held = _blocks_held(llm, rid)
    tps = len(steps) / sum(steps)
    return {"prefill_s": prefill, "steps": steps, "decode_tps": tps, "computed": held[0], "blocks": held[1]}


def _blocks_held(llm: LLM, rid: str) -> tuple[int, list[int]]:
    """A running request's computed tokens and the (non-null) blocks of each of its groups."""
    engine = llm.llm_engine
    tables = engine.scheduler.kv_cache_manager.block_tables(rid)
    return engine.scheduler.requests[rid].num_computed_tokens, [sum(1 for b in t if b != 0) for t in tables]


def _summary(values: list[float], fmt: str = "{:.2f}", scale: float = 1.0, unit: str = "") -> str:
    v = [x * scale for x in values]
    return f"{fmt.format(statistics.median(v))}{unit} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _share(bytes_per_token: int, tokens_per_s: float, before: float, after: float) -> tuple[float, bool]:
    """Share of the bandwidth roofline at the mean of the two probes; steady if they agree."""
    bandwidth = (before + after) / 2
    steady = abs(before - after) / bandwidth <= UNSTEADY_SPREAD
    return bytes_per_token / (bandwidth * 1e9) * tokens_per_s, steady


def _busy_ticks() -> int:
    """Busy CPU time of the whole machine since boot, in clock ticks (/proc/stat's first line:
    user nice system idle iowait irq softirq steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


def _own_ticks() -> float:
    """This process's CPU time and its finished children's (llama-bench), in clock ticks."""
    t = os.times()
    return (t.user + t.system + t.children_user + t.children_system) * os.sysconf("SC_CLK_TCK")


@contextmanager
def others_meter() -> Iterator[dict[str, float]]:
    """CPU the other processes used while the block ran, in cores: result["cores"]."""
    result: dict[str, float] = {}
    busy, own, start = _busy_ticks(), _own_ticks(), time.perf_counter()
    try:
        yield result
    finally:
        ticks = (_busy_ticks() - busy) - (_own_ticks() - own)
        wall = time.perf_counter() - start
        result["cores"] = max(0.0, ticks / os.sysconf("SC_CLK_TCK") / max(wall, 1e-9))


def wait_quiet() -> str:
    """Block until the other processes use under QUIET_CORES for two windows in a row (or
    QUIET_MAX_WAIT_S passed); says how long it waited and what the others used."""
    start, calm, cores = time.perf_counter(), 0, 0.0
    while calm < 2 and time.perf_counter() - start < QUIET_MAX_WAIT_S:
        with others_meter() as others:
            time.sleep(QUIET_WINDOW_S)
        cores = others["cores"]
        calm = calm + 1 if cores < QUIET_CORES else 0
    waited = time.perf_counter() - start
    state = "quiet" if calm >= 2 else "NOT quiet"
    return f"{state} after {waited:.0f} s wait, others {cores:.2f} cores"


# ------------------------------------------------------------------------------------ gpt-oss


def gpt_oss_decode_bytes(cfg: dict[str, Any], context: int) -> dict[str, int]:
    """Bytes one gpt-oss decode step reads at `context` tokens, by part (bf16 weights and K/V; the
    embedding row and the norms are left out, the float32 sinks counted)."""
    h, d, hq, hkv = (
        cfg["hidden_size"],
        cfg["head_dim"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    inter, e, k, layers = (
        cfg["intermediate_size"],
        cfg["num_local_experts"],
        cfg["num_experts_per_tok"],
        cfg["num_hidden_layers"],
    )
    qkv = h * (hq + 2 * hkv) * d + (hq + 2 * hkv) * d
    attention = (qkv + hq * d * h + h) * BF16_BYTES + hq * 4
    router = (h * e + e) * BF16_BYTES
    expert = (h * 2 * inter + 2 * inter + inter * h + h) * BF16_BYTES
    kinds = cfg["layer_types"]
    window = cfg["sliding_window"]
    kv_token = 2 * hkv * d * BF16_BYTES
    kv = sum(kv_token * (min(context, window) if kind == "sliding_attention" else context) for kind in kinds)
    return {
        "attention weights": layers * attention,
        "router": layers * router,
        f"{k} of {e} experts": layers * k * expert,
        "LM head": cfg["vocab_size"] * h * BF16_BYTES,
        f"K/V at {context}": kv,
    }


def gpt_oss_engine(checkpoint: Path) -> LLM:
    llm = LLM(
        str(checkpoint),
        dtype="bfloat16",
        max_model_len=LONG_CONTEXT,
        num_kv_blocks=GPT_OSS_POOL_BLOCKS,
        max_num_batched_tokens=PREFILL_CHUNK,
        enable_prefix_caching=False,  # every round prefills its 8k prompt, as llama-bench fills its depth
    )
    # Warm-up, as llama-bench's own: oneDNN primitives, the pool's pages, and every expert routed to
    # at least once (a 512-token prompt reaches all 32), then a decode run.
    llm.generate([random_prompt(512, 151643, seed=7)], SamplingParams(max_tokens=GEN_LEN, ignore_eos=True))
    return llm


def report_pool_bytes(llm: LLM, measured: tuple[int, list[int]] | None = None) -> None:
    """Part (a): one request's pool bytes by kind, at 32k and at the 8k of part (b)."""
    engine = llm.llm_engine
    c = engine.kv_cache_config
    print(f"\n(a) KV pool, gpt-oss shape: {engine.kv_pool_summary}")
    print(f"    startup line: {engine.kv_groups_summary}")
    layers = c.layers_by_kind()
    print(f"    {'context':>8} {'kind':<18} {'layers':>6} {'blocks':>7} {'held':>10} {'all layers full':>16}")
    for tokens in (LONG_CONTEXT, DEPTH + 1):
        held = c.bytes_held_by_kind(tokens)
        full = math.ceil(tokens / c.block_size) * c.page_bytes * sum(layers.values())
        for kind, num_bytes in held.items():
            blocks = num_bytes // c.bytes_per_block
            print(f"    {tokens:>8} {kind:<18} {layers[kind]:>6} {blocks:>7} {_mib(num_bytes):>10}")
        total = sum(held.values())
        cells = f"{sum(layers.values()):>6} {'':>7} {_mib(total):>10} {_mib(full):>16}"
        print(f"    {tokens:>8} {'total':<18} {cells}")
        ratio = f"{total / full:.3f}x caching every layer in full ({full / total:.2f}x less)"
        print(f"    {'':>8} -> kvflow holds {ratio}")
    if measured is not None:
        computed, measured_blocks = measured
        predicted = [g.spec.num_blocks_held(computed) for g in c.groups]
        kinds = [g.spec.kind for g in c.groups]
        print(
            f"    blocks the {DEPTH}-token prompt's request held at {computed} computed tokens (its last "
            f"decode step), per group {kinds}: measured {measured_blocks}, spec {predicted}"
        )


def llama_bench_at_depth(
    bin_dir: Path, gguf: Path, threads: int, depth: int, flash_attn: str
) -> dict[str, Any]:
    """llama-bench's tg64 after `depth` tokens (the depth filled once, 2 repetitions averaged)."""
    exe = str(bin_dir / "llama-bench")
    args = ["-m", str(gguf), "-t", str(threads), "-r", "2", "-o", "json", "-p", "0", "-n", str(GEN_LEN)]
    args += ["-fa", flash_attn, "-d", str(depth)]
    done = subprocess.run([exe, *args], capture_output=True, text=True, check=True)
    return {"tps": json.loads(done.stdout)[0]["avg_ts"]}


def kvflow_at_depth(llm: LLM, seed: int, vocab: int, depth: int) -> dict[str, Any]:
    """64 decode steps after a `depth`-token prompt (one token for depth 0: kvflow needs a prompt,
    llama-bench's tg starts from one token too)."""
    run = prefill_then_decode(llm, random_prompt(max(1, depth), vocab, seed), GEN_LEN)
    return {"tps": run["decode_tps"], **run}


def bracketed(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """run() on a quiet machine between two bandwidth probes (as benchmarks/vs_llamacpp.py does:
    the probes bracket the whole run, the depth fill included, for both engines alike), with the
    CPU the other processes used meanwhile."""
    quiet = wait_quiet()
    with others_meter() as others:
        before = measure_bandwidth_gbs()
        start = time.perf_counter()
        result = run()
        span = time.perf_counter() - start
        after = measure_bandwidth_gbs()
    return {
        **result,
        "bw_before": before,
        "bw_after": after,
        "span_s": span,
        "quiet": quiet,
        **_others(others),
    }


def _others(others: dict[str, float]) -> dict[str, Any]:
    return {"others": others["cores"], "noisy": others["cores"] > NOISY_CORES}


def run_gpt_oss(rounds: int, threads: int) -> None:
    checkpoint = gpt_oss_checkpoint()
    cfg = json.loads((checkpoint / "config.json").read_text())
    llama = build_llamacpp()
    gguf = convert(checkpoint, llama, "bf16")
    llama = runnable_llamacpp(llama, gguf, threads)
    llm = gpt_oss_engine(checkpoint)
    vocab = 151643  # the tokenizer's real tokens (llama-bench draws from its whole vocabulary)
    results: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    print(f"\n(b) gpt-oss: single-stream decode, {GEN_LEN} tokens after {DEPTHS} tokens ({threads} threads)")
    for r in range(rounds):
        order = ENGINES[r % len(ENGINES) :] + ENGINES[: r % len(ENGINES)]  # each engine first in turn
        print(f"  round {r + 1}", flush=True)
        for depth in DEPTHS:
            per_token = sum(gpt_oss_decode_bytes(cfg, depth).values())
            for engine in order:
                if engine == "kvflow":
                    res = bracketed(functools.partial(kvflow_at_depth, llm, r, vocab, depth))
                else:
                    fa = LLAMA_FLASH_ATTN[engine]
                    res = bracketed(functools.partial(llama_bench_at_depth, llama, gguf, threads, depth, fa))
                res["share"], res["steady"] = _share(per_token, res["tps"], res["bw_before"], res["bw_after"])
                results[(engine, depth)].append(res)
                print(f"    {engine:<17} @{depth:<5} {_gpt_oss_line(res)}", flush=True)
    first = results[("kvflow", DEPTH)][0]
    report_pool_bytes(llm, (first["computed"], first["blocks"]))
    decode_bytes = gpt_oss_decode_bytes(cfg, DEPTH)
    per_token = sum(decode_bytes.values())
    print(f"\n(b) bytes one decode step reads at {DEPTH} context (the roofline's numerator):")
    for part, num_bytes in decode_bytes.items():
        print(f"    {part:<22} {_mib(num_bytes):>10}  {num_bytes / per_token * 100:4.1f}%")
    print(f"    {'total':<22} {_mib(per_token):>10}")
    _print_gpt_oss_summary(results, rounds)
    profile_gpt_oss(llm, vocab)


def _gpt_oss_line(res: dict[str, Any]) -> str:
    probes = f"probes {res['bw_before']:.1f}/{res['bw_after']:.1f} GB/s {res['span_s']:.0f} s apart"
    mark = ("" if res["steady"] else " ~") + (" !" if res["noisy"] else "")
    line = f"{res['tps']:6.2f} tokens/s | {probes} -> {res['share'] * 100:.0f}% of roofline{mark}"
    if "prefill_s" in res and res["prefill_s"] > 1:
        line += f" | prefill {res['prefill_s']:.1f} s"
    return line + f" | {res['quiet']}; others during the run {res['others']:.2f} cores"


def _print_gpt_oss_summary(results: dict[tuple[str, int], list[dict[str, Any]]], rounds: int) -> None:
    print(f"\n(b) over {rounds} rounds, median [min-max] (~: probes apart by > {UNSTEADY_SPREAD:.0%};")
    print(f"    !: other processes took > {NOISY_CORES} cores during the run):")
    for depth in DEPTHS:
        for name in ENGINES:
            runs = results[(name, depth)]
            steady = [r["share"] for r in runs if r["steady"]]
            line = (
                f"    {name:<17} @{depth:<5} {_summary([r['tps'] for r in runs])} tokens/s, roofline share "
            )
            line += _summary([r["share"] for r in runs], "{:.0f}", 100, "%")
            if steady:
                line += f" (steady {len(steady)}: {_summary(steady, '{:.0f}', 100, '%')})"
            print(line)
    for depth in DEPTHS:
        for peer in ENGINES[1:]:
            pairs = list(zip(results[("kvflow", depth)], results[(peer, depth)], strict=True))
            ratios = [x["tps"] / y["tps"] for x, y in pairs]
            quiet = [x["tps"] / y["tps"] for x, y in pairs if not (x["noisy"] or y["noisy"])]
            line = f"    kvflow / {peer} decode@{depth}: {_summary(ratios, unit='x')} (paired in each round)"
            if quiet and len(quiet) < len(ratios):
                line += f"; quiet pairs {len(quiet)}: {_summary(quiet, unit='x')}"
            print(line)
    for name in ENGINES:
        at = zip(results[(name, DEPTHS[0])], results[(name, DEPTHS[1])], strict=True)
        slowdown = [x["tps"] / y["tps"] for x, y in at]
        print(f"    {name:<17} decode@{DEPTHS[0]} / decode@{DEPTHS[1]}: {_summary(slowdown, unit='x')}")


def profile_gpt_oss(llm: LLM, vocab: int) -> None:
    """One more 8k request with hooks on: its prefill and its decode steps by layer kind."""
    with profiled(llm) as timer:
        marks: dict[str, dict[str, float]] = {}

        def split() -> None:
            marks["prefill"] = dict(timer.seconds)
            timer.reset()

        run = prefill_then_decode(llm, random_prompt(DEPTH, vocab, seed=99), GEN_LEN, split)
        marks["decode"] = dict(timer.seconds)
    steps = len(run["steps"])
    total = {"prefill": run["prefill_s"], "decode": sum(run["steps"])}
    what = f"one profiled request: {DEPTH}-token prefill, then {steps} decode steps"
    print(f"\n(b) where kvflow's time goes ({what})")
    for phase, seconds in marks.items():
        per = 1.0 if phase == "prefill" else 1000.0 / steps
        unit = "s" if phase == "prefill" else "ms/step"
        parts = {
            **seconds,
            "rest (embedding, norms, rope, scheduler, inputs)": total[phase] - sum(seconds.values()),
        }
        print(f"    {phase}: {total[phase] * per:.2f} {unit}")
        for label, s in parts.items():
            print(f"      {label:<50} {s * per:8.2f} {unit}  {s / total[phase] * 100:4.1f}%")


# ---------------------------------------------------------------------------------- Qwen3-Next


def qwen3_next_engine(checkpoint: Path, prefix_caching: bool) -> LLM:
    llm = LLM(
        str(checkpoint),
        dtype="bfloat16",
        max_model_len=QWEN3_NEXT_MAX_LEN,
        num_kv_blocks=QWEN3_NEXT_POOL_BLOCKS,
        max_num_batched_tokens=PREFILL_CHUNK,
        enable_prefix_caching=prefix_caching,
    )
    llm.generate([[1] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # oneDNN primitives, pool pages
    return llm


def qwen3_next_decode_bytes(cfg: dict[str, Any], context: int) -> dict[str, int]:
    """Bytes one decode step reads at `context`: active weights (bf16), each linear layer's state
    read and written once (float32 recurrent, bf16 conv inputs), the full layers' K/V."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hk, hv, dk, dv = (
        cfg["linear_num_key_heads"],
        cfg["linear_num_value_heads"],
        cfg["linear_key_head_dim"],
        cfg["linear_value_head_dim"],
    )
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    num_full = cfg["layer_types"].count("full_attention")
    num_linear = layers - num_full
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    linear = (
        h * (2 * key_dim + 2 * value_dim)
        + h * 2 * hv
        + conv_dim * cfg["linear_conv_kernel_dim"]
        + value_dim * h
    )
    full = h * (2 * hq * d + 2 * hkv * d) + hq * d * h
    expert = 3 * h * cfg["moe_intermediate_size"]
    moe = (
        h * cfg["num_experts"]
        + cfg["num_experts_per_tok"] * expert
        + 3 * h * cfg["shared_expert_intermediate_size"]
        + h
    )
    state = hv * dk * dv * 4 + conv_dim * (cfg["linear_conv_kernel_dim"] - 1) * BF16_BYTES
    return {
        "linear-attention weights": num_linear * linear * BF16_BYTES,
        "full-attention weights": num_full * full * BF16_BYTES,
        "experts (top-k + shared)": layers * moe * BF16_BYTES,
        "LM head": cfg["vocab_size"] * h * BF16_BYTES,
        "linear states (read + write)": num_linear * 2 * state,
        f"full K/V at {context}": num_full * context * 2 * hkv * d * BF16_BYTES,
    }


def run_qwen3_next(rounds: int) -> None:
    checkpoint = qwen3_next_checkpoint()
    cfg = json.loads((checkpoint / "config.json").read_text())
    vocab = cfg["vocab_size"]
    off = qwen3_next_engine(checkpoint, prefix_caching=False)
    print(f"\n(c) Qwen3-Next shape: {off.llm_engine.kv_pool_summary}\n    {off.llm_engine.kv_groups_summary}")
    sweep_rows = decode_sweep(off, cfg, vocab)
    _print_sweep(sweep_rows, cfg)
    on = qwen3_next_engine(checkpoint, prefix_caching=True)
    prefix_caching_costs(on, off, vocab, rounds)


def decode_sweep(llm: LLM, cfg: dict[str, Any], vocab: int) -> list[dict[str, Any]]:
    rows = []
    with profiled(llm, with_states=True) as timer:
        for context in SWEEP_CONTEXTS:
            probes: list[float] = []
            prefill_parts: dict[str, float] = {}

            def start(probes: list[float] = probes, prefill_parts: dict[str, float] = prefill_parts) -> None:
                prefill_parts.update(timer.seconds)
                probes.append(measure_bandwidth_gbs())
                timer.reset()

            quiet = wait_quiet()
            prompt = random_prompt(context, vocab, context)
            with others_meter() as others:
                run = prefill_then_decode(llm, prompt, SWEEP_GEN, start)
                probes.append(measure_bandwidth_gbs())
            row = {
                "context": context,
                "parts": dict(timer.seconds),
                "probes": probes,
                **run,
                **_others(others),
            }
            rows.append(row)
            med = statistics.median(run["steps"]) * 1000
            row["prefill_parts"] = prefill_parts
            print(
                f"    context {context:>6}: prefill {run['prefill_s']:6.1f} s ({_split(prefill_parts)}), "
                f"decode step {med:6.1f} ms (probes {probes[0]:.1f}/{probes[1]:.1f} GB/s) | {quiet}; "
                f"others during the run {others['cores']:.2f} cores",
                flush=True,
            )
    return rows


_SHORT = {
    "linear_attention": "linear",
    "state gather (read)": "state read",
    "state scatter (write)": "state write",
    "full_attention": "full attn",
    "sliding_attention": "sliding attn",
    "experts (MoE)": "experts",
    "LM head": "head",
}


def _split(seconds: dict[str, float]) -> str:
    """Seconds by label, short: 'linear 4.1 s (state read 0.1, write 0.1), full attn 1.0 s, ...'."""
    order = list(_SHORT)
    labels = sorted(seconds, key=lambda label: order.index(label) if label in order else len(order))
    cells = [f"{_SHORT.get(label, label)} {seconds[label]:.1f} s" for label in labels]
    return ", ".join(cells)


def _print_sweep(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    labels = ["linear_attention", "state gather (read)", "state scatter (write)", "full_attention"]
    labels += ["experts (MoE)", "LM head"]
    short = ["linear", " of which read", " write", "full attn", "experts", "head", "rest"]
    print(
        f"\n(c) decode step vs context, ms (median [min-max] of {SWEEP_GEN} steps; parts: mean ms per step)"
    )
    print(
        f"    {'context':>7} {'step':>22} "
        + " ".join(f"{s:>14}" for s in short)
        + f" {'model':>7} {'share':>6}"
    )
    for row in rows:
        n = len(row["steps"])
        parts = [row["parts"].get(label, 0.0) / n * 1000 for label in labels]
        top = parts[0] + parts[3] + parts[4] + parts[5]  # the nested read / write are inside `linear`
        rest = statistics.mean(row["steps"]) * 1000 - top
        bytes_model = sum(qwen3_next_decode_bytes(cfg, row["context"]).values())
        bandwidth = statistics.mean(row["probes"])
        roofline_ms = bytes_model / (bandwidth * 1e9) * 1000
        step = _summary(row["steps"], "{:.1f}", 1000)
        share = roofline_ms / statistics.median(row["steps"]) / 1000
        cells = " ".join(f"{p:>14.2f}" for p in [*parts, rest])
        print(f"    {row['context']:>7} {step:>22} {cells} {roofline_ms:>7.1f} {share * 100:>5.0f}%")
    first, last = rows[0], rows[-1]
    growth = statistics.median(last["steps"]) / statistics.median(first["steps"])
    full_growth = last["parts"].get("full_attention", 0.0) / max(
        first["parts"].get("full_attention", 0.0), 1e-9
    )
    linear_growth = last["parts"].get("linear_attention", 0.0) / max(
        first["parts"].get("linear_attention", 0.0), 1e-9
    )
    print(
        f"    {last['context']} / {first['context']} context: step {growth:.2f}x, full-attention layers "
        f"{full_growth:.2f}x, linear-attention layers {linear_growth:.2f}x"
    )
    print(
        "    model: bytes read (qwen3_next_decode_bytes) / the mean of the two probes; share = model / step"
    )
    for part, num_bytes in qwen3_next_decode_bytes(cfg, last["context"]).items():
        print(f"      {part:<30} {_mib(num_bytes):>10}")


def _quiet_prefill(llm: LLM, prompt: list[int], label: str, writes: list[tuple[float, int]]) -> Any:
    """One prompt to its first token on a quiet machine, with the state writes timed (appended to
    `writes` as (seconds, calls)); its timeline (RequestTimeline)."""
    quiet = wait_quiet()
    with others_meter() as others, profiled(llm, with_states=True) as timer:
        metrics = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0].metrics
    writes.append((timer.seconds["state scatter (write)"], timer.calls["state scatter (write)"]))
    print(
        f"    {label:<13} prefill {metrics.prefill_time:6.2f} s ({_split(timer.seconds)}) | {quiet}; others "
        f"during the run {others['cores']:.2f} cores",
        flush=True,
    )
    return metrics


def prefix_caching_costs(on: LLM, off: LLM, vocab: int, rounds: int) -> None:
    """Part (d): checkpoint interval and bytes; cold 8k prefill with checkpoints vs without; TTFT of
    the same prompt repeated vs cold."""
    c = on.llm_engine.kv_cache_config
    linear = [g for g in c.groups if g.spec.kind == "linear_attention"]
    spec = linear[0].spec
    interval = getattr(spec, "checkpoint_interval", None)
    pages = getattr(spec, "pages_per_state", 0)
    num_linear_layers = sum(len(g.layer_ids) for g in linear)
    full_groups = sum(1 for g in c.groups if g.spec.kind == "full_attention")
    pool_bytes = pages * len(linear) * c.bytes_per_block
    state_bytes = getattr(spec, "state_bytes", 0) * num_linear_layers
    span_kv = (interval or 0) // c.block_size * full_groups * c.bytes_per_block
    boundaries = (
        spec.checkpoint_boundaries(0, PREFIX_PROMPT) if hasattr(spec, "checkpoint_boundaries") else []
    )
    print(
        f"\n(d) prefix caching with linear-attention states ({PREFIX_PROMPT}-token prompt, {rounds} rounds)"
    )
    print(
        f"    checkpoint interval {interval} tokens (CacheConfig.linear_state_checkpoint_interval default); "
        f"one checkpoint = {pages} blocks x {len(linear)} linear groups = {_mib(pool_bytes)} of pool "
        f"({_mib(state_bytes)} of state over {num_linear_layers} layers), against {_mib(span_kv)} of "
        f"full-attention KV for the {interval} tokens it covers; a {PREFIX_PROMPT}-token prompt writes "
        f"{len(boundaries)} at {boundaries}"
    )
    cold_on, cold_off, warm, ttft_cold, hits = [], [], [], [], []
    writes_on: list[tuple[float, int]] = []
    writes_off: list[tuple[float, int]] = []
    writes_warm: list[tuple[float, int]] = []
    for r in range(rounds):
        prompt = random_prompt(PREFIX_PROMPT, vocab, 1000 + r)
        print(f"  round {r + 1}", flush=True)
        if r % 2 == 0:  # the order alternates round by round, so a drift favours neither
            first = _quiet_prefill(on, prompt, "on, cold", writes_on)
            other = _quiet_prefill(
                off, random_prompt(PREFIX_PROMPT, vocab, 2000 + r), "off, cold", writes_off
            )
        else:
            other = _quiet_prefill(
                off, random_prompt(PREFIX_PROMPT, vocab, 2000 + r), "off, cold", writes_off
            )
            first = _quiet_prefill(on, prompt, "on, cold", writes_on)
        again = _quiet_prefill(on, prompt, "on, repeated", writes_warm)
        assert first.prefill_time and other.prefill_time and first.ttft and again.ttft
        cold_on.append(first.prefill_time)
        cold_off.append(other.prefill_time)
        ttft_cold.append(first.ttft)
        warm.append(again.ttft)
        hits.append(again.num_cached_prompt_tokens)
        print(
            f"    cold prefill on {first.prefill_time:.2f} s / off {other.prefill_time:.2f} s; repeated TTFT "
            f"{again.ttft:.2f} s (hit {again.num_cached_prompt_tokens} tokens) vs cold {first.ttft:.2f} s",
            flush=True,
        )
    ratio_on_off = [a / b for a, b in zip(cold_on, cold_off, strict=True)]
    ratio_warm = [a / b for a, b in zip(warm, ttft_cold, strict=True)]
    per_checkpoint = [(a - b) / max(1, len(boundaries)) for a, b in zip(cold_on, cold_off, strict=True)]
    print(f"\n(d) over {rounds} rounds, median [min-max]:")
    print(f"    cold {PREFIX_PROMPT} prefill, prefix caching on (checkpoints written): {_summary(cold_on)} s")
    print(f"    cold {PREFIX_PROMPT} prefill, prefix caching off:                     {_summary(cold_off)} s")
    each = _summary(per_checkpoint, "{:.0f}", 1000, " ms")
    print(f"    on / off: {_summary(ratio_on_off, '{:.3f}', unit='x')}; per checkpoint written {each}")
    extra = [(a[0] - b[0]) / max(1, len(boundaries)) for a, b in zip(writes_on, writes_off, strict=True)]
    calls = f"{writes_on[0][1]} state writes on, {writes_off[0][1]} off"
    each = _summary(extra, "{:.1f}", 1000, " ms")
    print(f"    state scatter time per checkpoint (on - off, {calls}): {each}")
    hit = f"hit {sorted(set(hits))} tokens"
    print(f"    repeated prompt TTFT {_summary(warm)} s ({hit}) vs cold {_summary(ttft_cold)} s:")
    print(f"    warm / cold: {_summary(ratio_warm, '{:.3f}', unit='x')}")


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="gpt_oss,qwen3_next")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if "gpt_oss" in parts:
        run_gpt_oss(args.rounds, args.threads)
    gc.collect()  # the gpt-oss engine (6.5 GB) is gone before the Qwen3-Next ones load
    if "qwen3_next" in parts:
        run_qwen3_next(args.rounds)


if __name__ == "__main__":
    main()

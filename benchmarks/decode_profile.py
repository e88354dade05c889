"""Where one decode step's time goes: kernels against everything else.

    python benchmarks/decode_profile.py [--quantization none|int8|int4] [--group-size 32]
                                        [--quantize-lm-head] [--context 512] [--batch 1]
                                        [--enforce-eager]

On the Qwen2.5-0.5B-shaped random checkpoint (benchmarks/offline_throughput.py builds it),
`--batch` requests (1: single stream) decode together after `--context`-token prompts; the last
decode step's exact inputs are captured and replayed, each piece timed (median of `--repeats`):
    engine step     LLMEngine.step(): schedule -> input batch -> forward -> logits -> sample -> outputs
                    (the median gap between one request's tokens)
    forward         the model over the 24 layers (embedding to final norm)
    kernels         every layer's linears (GEMVs) and its decode attention, called alone on the
                    same inputs: the work that cannot shrink without fewer bytes
    attention       of which the 24 decode attentions alone
    layer glue      native decode: the layers' norms, RoPE + KV write, SiLU and residual adds, timed
                    in place inside the native forward (model.profile_native_decode);
                    --enforce-eager: forward - kernels (norms, RoPE, KV write, SiLU, residuals,
                    Python, dispatch)
    LM head         the head's GEMV over the vocabulary; greedy rows with a native head: the GEMV
                    with each row's argmax folded in (model.greedy_tokens), as the engine runs it
    sample          the sampler on those logits (0 where the head gave greedy tokens)
    step overhead   engine step - forward - LM head - sample: scheduler, batch build, detokenize
Native decode also prints each piece of a layer timed in place (microseconds per layer), the
linears' weight bytes over their time as a share of the read bandwidth: kernels called alone run
with warmer caches than inside a step (attention alone ~12 us per layer, ~21 in place at context
512), so the in-place split is the one that adds up to the forward.
Also prints the bandwidth roofline of this step (weight bytes read / read bandwidth measured now).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import QWEN25_05B, build_checkpoint, measure_bandwidth_gbs  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def random_prompts(context: int, batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(QWEN25_05B["vocab_size"]) for _ in range(context)] for _ in range(batch)]


def capture_decode_inputs(llm: LLM, context: int, batch: int) -> tuple[Any, ...]:
    """Run `batch` requests to their decode phase together; return the last decode step of all
    `batch` rows as the model's forward takes it: (input_ids, meta, store), built by
    build_input_batch from that step's schedule (the engine hands a decode-only step to the native
    decoder as plain lists; forward over these tensors gives the same numbers)."""
    from kvflow.worker.input_batch import build_input_batch

    runner = llm.llm_engine.model_runner
    captured: list[tuple[Any, ...]] = []
    original = runner.execute_model

    def spy(scheduler_output: Any) -> Any:
        scheduled = scheduler_output.scheduled
        if scheduler_output.num_batched_tokens == batch and all(s.is_decode for s in scheduled):
            b = build_input_batch(scheduler_output, runner.block_size, runner.sliding_window)
            captured[:] = [(b.input_ids, b.attn_metadata, runner.kv_store)]
        return original(scheduler_output)

    runner.execute_model = spy  # type: ignore[method-assign]
    # Enough tokens that all `batch` requests decode together: the first one decodes from the step
    # after its prefill, while the others' prompts take `prefill_steps` more steps.
    budget = llm.llm_engine.scheduler.scheduler_config.max_num_batched_tokens
    prefill_steps = -(-context * batch // max(1, budget - batch))
    params = SamplingParams(temperature=0.0, max_tokens=32 + prefill_steps, ignore_eos=True)
    llm.generate(random_prompts(context, batch, 0), params)
    runner.execute_model = original  # type: ignore[method-assign]
    return captured[0]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step streams: every layer's linear weights plus the LM head (not the
    embedding table, of which one row is read)."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or "cos_cache" in name or "sin_cache" in name or "_packed" in name:
            continue
        total += t.numel() * t.element_size()
    return total


def profile(
    llm: LLM, context: int, batch: int, repeats: int, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Each piece timed `rounds` times, the pieces interleaved round by round (the machine's
    bandwidth drifts within minutes), medians across rounds."""
    engine = llm.llm_engine
    model = engine.model_runner.model
    runner = engine.model_runner
    input_ids, meta, store = capture_decode_inputs(llm, context, batch)
    prompts = random_prompts(context, batch, 1)
    with torch.inference_mode():
        hidden = model(input_ids, meta, store)
        logits = model.compute_logits(hidden)
        # What the engine runs for greedy rows: the native head's GEMV with the argmax folded in, and
        # no sampler call; without a native head, the logits and the sampler.
        greedy = model.greedy_tokens(hidden) is not None
    head = model.greedy_tokens if greedy else model.compute_logits
    native = runner.native_decode
    pieces: dict[str, Callable[[], float]] = {
        "engine step": lambda: engine_step_us(llm, prompts, repeats),
        "forward": lambda: median_us(lambda: model(input_ids, meta, store), repeats),
        "kernels": lambda: layer_kernels_us(model, hidden, meta, store, repeats),
        "attention": lambda: layer_kernels_us(model, hidden, meta, store, repeats, attention_only=True),
        "LM head": lambda: median_us(lambda: head(hidden), repeats),
        "sample": lambda: 0.0 if greedy else sample_us(runner, logits, repeats),
    }
    samples: dict[str, list[float]] = {name: [] for name in pieces}
    in_place_samples: dict[str, list[float]] = {}  # the native forward's pieces (none on the Python path)
    with torch.inference_mode():
        for _ in range(rounds):
            for name, measure in pieces.items():
                samples[name].append(measure())
            if native:
                for name, us in native_pieces_us(model, input_ids, meta, store, repeats).items():
                    in_place_samples.setdefault(name, []).append(us)
    times = {name: statistics.median(values) for name, values in samples.items()}
    in_place = {name: statistics.median(values) for name, values in in_place_samples.items()}
    if native:
        not_glue = ("attention", "final_norm", *LINEAR_PIECES)
        times["layer glue"] = sum(us for name, us in in_place.items() if name not in not_glue)
    else:
        times["layer glue"] = times["forward"] - times["kernels"]
    times["step overhead"] = times["engine step"] - times["forward"] - times["LM head"] - times["sample"]
    return times, in_place


# The native forward's linear pieces and the decoder layer's module each one reads.
LINEAR_PIECES = {
    "qkv_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}


def native_pieces_us(
    model: Any, input_ids: torch.Tensor, meta: Any, store: Any, repeats: int
) -> dict[str, float]:
    """Each piece of the native forward timed in place, microseconds per step (all layers), the
    median over `repeats` forwards."""
    runs = [model.profile_native_decode(input_ids, meta, store)[1] for _ in range(repeats)]
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


def linear_bytes(model: Any, module_path: str) -> int:
    """Bytes one step reads for this projection over all layers (as weight_bytes counts them)."""
    return sum(weight_bytes(layer.get_submodule(module_path)) for layer in model.layers)


def layer_kernels_us(
    model: Any, hidden: torch.Tensor, meta: Any, store: Any, repeats: int, attention_only: bool = False
) -> float:
    """Every layer's linears and decode attention, called back to back on inputs of the right shape
    (all layers in one sweep, so weights come from DRAM as in a real step, not from cache)."""
    from kvflow.attention.paged_attention import _decode_attention

    cfg = model.config
    x = hidden.new_zeros(hidden.shape)
    q = torch.randn(x.shape[0], cfg.num_attention_heads, cfg.head_dim, dtype=hidden.dtype)
    o_in = x.new_zeros(x.shape[0], cfg.num_attention_heads * cfg.head_dim)
    d_in = x.new_zeros(x.shape[0], cfg.intermediate_size)

    def sweep() -> None:
        for i, layer in enumerate(model.layers):
            if attention_only:
                _decode_attention(q, store.layer(i), meta)
                continue
            layer.self_attn.qkv_proj(x)
            _decode_attention(q, store.layer(i), meta)
            layer.self_attn.o_proj(o_in)
            layer.mlp.gate_up_proj(x)
            layer.mlp.down_proj(d_in)

    return median_us(sweep, repeats)


def engine_step_us(llm: LLM, prompts: list[list[int]], repeats: int) -> float:
    """Median gap between a request's tokens while the `len(prompts)` requests decode together
    (= one engine step)."""
    params = SamplingParams(temperature=0.0, max_tokens=repeats, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return statistics.median(gap for out in outs for gap in out.metrics.itl) * 1e6


def sample_us(runner: Any, logits: torch.Tensor, repeats: int) -> float:
    from kvflow.sample.sampler import SamplingBatch

    rows = logits.shape[0]
    batch = SamplingBatch(
        params=[SamplingParams(temperature=0.0)] * rows,
        prompt_token_ids=[[1, 2, 3]] * rows,
        output_token_ids=[[4]] * rows,
        generators=[None] * rows,
        banned_token_ids=[[]] * rows,
    )
    return median_us(lambda: runner.sampler(logits, batch), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (rows per step)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--enforce-eager", action="store_true", help="the Python layer path (the reference)")
    args = ap.parse_args()
    path = build_checkpoint(torch.bfloat16)
    llm = LLM(
        str(path),
        dtype="bfloat16",
        max_model_len=4096,
        quantization=args.quantization,
        quantization_group_size=args.group_size,
        quantize_lm_head=args.quantize_lm_head,
        enforce_eager=args.enforce_eager,
    )
    times, in_place = profile(llm, args.context, args.batch, args.repeats, args.rounds)
    bandwidth = measure_bandwidth_gbs()
    nbytes = weight_bytes(llm.llm_engine.model_runner.model)
    roofline_us = nbytes / (bandwidth * 1e9) * 1e6
    head = "quantized" if args.quantize_lm_head else "bf16"
    print(
        f"{args.quantization} (group {args.group_size}, head {head}), context {args.context}, "
        f"{args.batch} sequence(s), "
        f"{'Python layers (--enforce-eager)' if args.enforce_eager else 'native decode'}, "
        f"{torch.get_num_threads()} threads, medians of {args.rounds} interleaved rounds"
    )
    step = times["engine step"]
    pieces = ("engine step", "forward", "kernels", "attention", "layer glue", "LM head", "sample")
    pieces += ("step overhead",)
    for key in pieces:
        print(f"  {key:<14} {times[key] / 1e3:8.2f} ms  {times[key] / step:6.1%} of the step")
    layers = QWEN25_05B["num_hidden_layers"]
    print(f"  layer glue per layer: {times['layer glue'] / layers:.0f} us")
    if in_place:
        model = llm.llm_engine.model_runner.model
        print(f"  in place, per layer (us; linears: weight bytes / time, share of {bandwidth:.1f} GB/s):")
        cells = []
        for name, step_us in in_place.items():
            cell = f"{name} {step_us / (1 if name == 'final_norm' else layers):.1f}"
            if name in LINEAR_PIECES:
                gbs = linear_bytes(model, LINEAR_PIECES[name]) / (step_us * 1e3)
                cell += f" ({gbs / bandwidth:.0%})"
            cells.append(cell)
        print("    " + " | ".join(cells) + " (final_norm: once per step)")
    print(
        f"  weights read per step {nbytes / 1e6:.0f} MB at {bandwidth:.1f} GB/s -> roofline "
        f"{roofline_us / 1e3:.2f} ms; the step runs at {roofline_us / step:.0%} of it"
    )


if __name__ == "__main__":
    main()

"""Whole-model single-stream decode on each 2026 weight format against its own bandwidth roofline
and against kvflow's int8 / int4 in the same run (issue 37's last benchmark).

    python benchmarks/weight_formats_decode.py [--rounds 3] [--context 512] [--tokens 64]
                                               [--formats bf16,int8,int4,fp8,nvfp4,mxfp4]

The Qwen2.5-0.5B-shaped random checkpoint (offline_throughput.py), its layer projections in:
    bf16    the checkpoint itself
    int8    kvflow's own per-channel int8 (quantization="int8")
    int4    kvflow's own int4, groups of 32 (quantization="int4")
    fp8     DeepSeek / Qwen3-FP8's format: e4m3 weights, 128 x 128 block scales (quant_method fp8)
    nvfp4   compressed-tensors nvfp4-pack-quantized, written by compressed-tensors' own compressor
    mxfp4   a GGUF file whose projections are ggml MXFP4 (e2m1, e8m0 scale per 32), the rest bf16
The embedding and LM head stay bf16 in every format (as the FP8 and NVFP4 releases ship them).

Per round, the engines decode in turn (alternated, so drift hits all alike): one request, a
`--context`-token prompt, then `--tokens` tokens; tokens/s = 1 / median inter-token gap. The
roofline = bandwidth (a float32 sum over 1 GiB on huge pages, measured each round) / bytes a
decode step reads: every tensor of the model's modules except the embedding table (the kernels'
tiles, scales, row factors; the bf16 head) plus the KV cache of the context. Printed: each format's
share of its roofline, and its speed relative to int8 and int4 in the same round.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from offline_throughput import CACHE_DIR, build_checkpoint, measure_bandwidth_gbs  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402

FP8_BLOCK = 128  # DeepSeek-V3's and Qwen3-FP8's weight_block_size
FP8_MAX = 448.0  # e4m3's largest finite value
E2M1_MAX = 6.0
NVFP4_GROUP = 16
LAYER_PROJECTION = (".self_attn.", ".mlp.")


def _derived(source: Path, name: str, write: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
             quantization_config: dict[str, Any]) -> Path:  # fmt: skip
    """A copy of `source` with its layer projections rewritten by `write`, cached."""
    out = CACHE_DIR / f"{source.name}-{name}"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    tensors = load_file(source / "model.safetensors")
    rewritten: dict[str, torch.Tensor] = {}
    for tensor_name, w in tensors.items():
        if any(p in tensor_name for p in LAYER_PROJECTION) and tensor_name.endswith("proj.weight"):
            base = tensor_name.removesuffix(".weight")
            rewritten.update({f"{base}.{k}": v.contiguous() for k, v in write({"weight": w}).items()})
        else:
            rewritten[tensor_name] = w
    save_file(rewritten, tmp / "model.safetensors")
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp / "config.json").write_text(json.dumps(config))
    tmp.rename(out)
    return out


def _fp8_block(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w = t["weight"].float()
    n, k, b = *w.shape, FP8_BLOCK
    pad = torch.zeros(-(-n // b) * b, -(-k // b) * b)
    pad[:n, :k] = w
    blocks = pad.reshape(pad.shape[0] // b, b, pad.shape[1] // b, b)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:n, :k].to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}


def _nvfp4(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    w = t["weight"].float()
    n, k = w.shape
    global_scale = (FP8_MAX * E2M1_MAX / w.abs().max()).reshape(1)
    groups = w.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP).abs().amax(-1)
    scale = (groups / E2M1_MAX * global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}
    return dict(NVFP4PackedCompressor.compress(state, preset_name_to_scheme("NVFP4A16", ["Linear"])))


def _nvfp4_config() -> dict[str, Any]:
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"]).model_dump(mode="json")
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}  # fmt: skip


def _mxfp4_gguf(source: Path) -> Path:
    from fixtures.gguf_files import write_gguf

    out = CACHE_DIR / "gguf" / f"{source.name}-mxfp4-projections.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        write_gguf(source, tmp, lambda name: "MXFP4" if name.startswith("blk.") else "BF16")
        tmp.rename(out)
    return out


def build_engines(formats: list[str], context: int, tokens: int) -> dict[str, LLM]:
    source = build_checkpoint(torch.bfloat16)
    paths: dict[str, tuple[Path, dict[str, Any]]] = {
        "bf16": (source, {}),
        "int8": (source, {"quantization": "int8"}),
        "int4": (source, {"quantization": "int4", "quantization_group_size": 32}),
    }
    if "fp8" in formats:
        config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        paths["fp8"] = (_derived(source, "fp8-block128", _fp8_block, config), {})
    if "nvfp4" in formats:
        paths["nvfp4"] = (_derived(source, "nvfp4", _nvfp4, _nvfp4_config()), {})
    if "mxfp4" in formats:
        paths["mxfp4"] = (_mxfp4_gguf(source), {})
    return {
        f: LLM(
            str(paths[f][0]),
            dtype="bfloat16",
            max_model_len=context + tokens + 8,
            enable_prefix_caching=False,
            **paths[f][1],
        )
        for f in formats
    }


def decode_bytes(llm: LLM, context: int) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes of `context` tokens)."""
    model = llm.llm_engine.model_runner.model
    seen: set[int] = set()
    weights = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name or t is None or id(t) in seen:
            continue
        seen.add(id(t))
        weights += t.numel() * t.element_size()
    arch = llm.llm_engine.arch
    kv = context * arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * 2  # bf16 K and V
    return weights, kv


def decode_rate(llm: LLM, vocab: int, context: int, tokens: int) -> float:
    prompt = [random.Random(1).randrange(vocab) for _ in range(context)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))[0]
    return 1.0 / statistics.median(out.metrics.itl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--formats", default="bf16,int8,int4,fp8,nvfp4,mxfp4")
    args = ap.parse_args()
    formats = args.formats.split(",")
    engines = build_engines(formats, args.context, args.tokens)
    vocab = next(iter(engines.values())).llm_engine.arch.vocab_size
    head_check = engines[formats[0]].llm_engine.model_runner.model
    print(f"(the head is read from {type(getattr(head_check, 'lm_head', None)).__name__})")
    for llm in engines.values():  # warm-up: kernel choices, page faults
        decode_rate(llm, vocab, 32, 8)
    rates: dict[str, list[float]] = {f: [] for f in formats}
    shares: dict[str, list[float]] = {f: [] for f in formats}
    sizes = {f: decode_bytes(engines[f], args.context) for f in formats}
    for r in range(args.rounds):
        bandwidth = measure_bandwidth_gbs()
        for f in formats:
            rate = decode_rate(engines[f], vocab, args.context, args.tokens)
            rates[f].append(rate)
            shares[f].append(rate / (bandwidth * 1e9 / sum(sizes[f])))
        print(
            f"round {r + 1}: {bandwidth:.1f} GB/s; " + ", ".join(f"{f} {rates[f][-1]:.1f}/s" for f in formats)
        )
    print(f"\nsingle-stream decode after {args.context} tokens, median of {args.rounds} rounds")
    print(
        f"{'format':<8}{'weights MB':>11}{'KV MB':>7}{'tok/s':>8}{'roofline':>10}{'/ int8':>8}{'/ int4':>8}"
    )
    for f in formats:
        weights, kv = sizes[f]
        rate = statistics.median(rates[f])
        rel = {
            base: statistics.median(a / b for a, b in zip(rates[f], rates[base], strict=True))
            for base in ("int8", "int4")
            if base in rates
        }
        cells = "".join(f"{rel[b]:>7.2f}x" if b in rel else f"{'-':>8}" for b in ("int8", "int4"))
        share = statistics.median(shares[f])
        print(f"{f:<8}{weights / 1e6:>11.1f}{kv / 1e6:>7.1f}{rate:>8.1f}{share:>10.0%}{cells}")


if __name__ == "__main__":
    main()

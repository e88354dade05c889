"""kvflow against llama.cpp on the same weights, side by side, engines alternated round by round.

    python benchmarks/vs_llamacpp.py [--rounds 3] [--pairs bf16,int8,int4,q8_0,q4_0,q4_k_m]
                                     [--threads 2] [--batch 8]

On the Qwen2.5-0.5B-shaped random checkpoint (benchmarks/offline_throughput.py builds it):
- llama.cpp is built once from the llama-cpp-python sdist pip downloads (CMake Release,
  GGML_NATIVE=ON), cached in ~/.cache/kvflow-bench/llama.cpp; the checkpoint is converted with
  that copy's convert_hf_to_gguf.py and quantized with its llama-quantize (bf16, q8_0, q4_0).
  Where that build dies on q8_0 (ggml's AMX kernels did on an AMX Xeon VM: NOTES.md,
  session 16), the same build without the AMX instructions serves (`runnable_llamacpp`).
- Precision pairs: bf16 vs bf16; int8 (LM head int8 too) vs q8_0; int4 group 32 (LM head int4
  too) vs q4_0 (group 32; llama.cpp keeps this shape's tied head in q8_0).
- The same GGUF file on both engines (kvflow loads the .gguf and computes on its blocks,
  kvflow/quant/gguf_linear.py): q8_0, q4_0 and q4_k_m as llama-quantize wrote them (for this
  shape q4_k_m is mostly Q5_0 and Q8_0: rows of 896 are not a multiple of 256, so llama-quantize
  falls back from Q4_K / Q6_K there; ffn_down keeps Q4_K / Q6_K).
- Per pair and round, each engine measures, alternately:
    prefill      tokens/s of one 512-token prompt (llama-bench pp512)
    decode@512   single-stream decode tokens/s after a 512-token prompt (llama-bench tg64 -d 512;
                 kvflow: 64 tokens after the prompt, (n - 1) / decode time, the same average)
    decode xB    aggregate decode tokens/s of B (--batch, 8) sequences of 512-token prompts decoding together
                 (llama-batched-bench S_TG; kvflow: tokens after the first over the decode span)
- Each engine's single-stream decode is also reported as a share of its bandwidth roofline (bytes
  of weights read per token / read bandwidth). The read bandwidth (a float32 sum over 1 GiB) is
  measured just before and just after that engine's decode run and the share uses their mean:
  this machine's bandwidth moves between ~45 and ~80 GB/s within seconds, so one probe per round
  (as before session 9) could be tens of seconds away from the run it divided. A run whose two
  probes differ by more than UNSTEADY_SPREAD is marked `~` and left out of the "steady" median.
Prints each round's ratios kvflow / llama.cpp (paired within the round), then medians [min-max].
Not in CI: it builds llama.cpp (about 10 minutes on 2 cores, once) and runs for several minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import CACHE_DIR, QWEN25_05B, build_checkpoint, measure_bandwidth_gbs  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402

LLAMA_DIR = CACHE_DIR / "llama.cpp"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")
PROMPT_LEN = 512
GEN_LEN = 64
BATCH = 8  # sequences of the batched decode run, unless --batch says otherwise
UNSTEADY_SPREAD = 0.15  # |before - after| / mean of the two bandwidth probes around a decode run

T = TypeVar("T")


@dataclass(frozen=True)
class Pair:
    name: str
    gguf_type: str  # llama.cpp's file type
    kvflow_args: dict[str, Any]
    kvflow_reads_gguf: bool = False  # kvflow loads the same .gguf file, not the safetensors checkpoint


PAIRS = {
    "bf16": Pair("bf16 vs bf16", "bf16", {}),
    "int8": Pair("int8+head vs q8_0", "q8_0", {"quantization": "int8", "quantize_lm_head": True}),
    "int4": Pair(
        "int4 g32+head vs q4_0",
        "q4_0",
        {"quantization": "int4", "quantization_group_size": 32, "quantize_lm_head": True},
    ),
    "q8_0": Pair("same q8_0.gguf", "q8_0", {}, kvflow_reads_gguf=True),
    "q4_0": Pair("same q4_0.gguf", "q4_0", {}, kvflow_reads_gguf=True),
    "q4_k_m": Pair("same q4_k_m.gguf", "q4_k_m", {}, kvflow_reads_gguf=True),
    # llama-quantize writes MXFP4 for MoE experts only: this file's projections are MXFP4 by the gguf
    # package (weight_formats_decode.py), embedding and head bf16; both engines read it.
    "mxfp4": Pair("same mxfp4-projections.gguf", "mxfp4-projections", {}, kvflow_reads_gguf=True),
}


# ------------------------------------------------------------------------------------ llama.cpp


def llamacpp_source() -> Path:
    """llama.cpp's source from the llama-cpp-python sdist (its vendored llama.cpp), fetched once."""
    if (LLAMA_DIR / "CMakeLists.txt").exists():
        return LLAMA_DIR
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                "llama-cpp-python",
                "-d",
                tmp,
            ],
            check=True,
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        shutil.rmtree(LLAMA_DIR, ignore_errors=True)
        shutil.copytree(vendored, LLAMA_DIR)
    return LLAMA_DIR


def build_llamacpp(build: str = "build", isa_off: str = "") -> Path:
    """llama.cpp's tools built once into LLAMA_DIR / `build` (CMake Release, GGML_NATIVE on, plus
    `isa_off`: -mno-* compiler flags); returns their bin directory."""
    llama = llamacpp_source()
    bin_dir = llama / build / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
    ]
    flags += ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    # GCC lets an explicit -mno-X win over what -march=native implies, whatever their order.
    flags += [f"-DCMAKE_C_FLAGS={isa_off}", f"-DCMAKE_CXX_FLAGS={isa_off}"] if isa_off else []
    print(f"building llama.cpp into {build} (about 10 minutes on 2 cores, once) ...", flush=True)
    subprocess.run(["cmake", "-B", build, *flags], cwd=llama, check=True, capture_output=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", build, "-j", jobs, "--target", *TARGETS], cwd=llama, check=True)
    return bin_dir


def runnable_llamacpp(bin_dir: Path, gguf: Path, threads: int) -> Path:
    """`bin_dir`, or an AMX-free build where the native one dies on `gguf` (a quantized file).

    ggml's AMX kernels for q8_0 / q4_0 (ggml-cpu/amx/mmq.cpp, picked at -march=native on Sapphire
    and Granite Rapids) raised SIGILL at their first `tileloadd` on the AMX Xeon VM of
    benchmarks/NOTES.md session 16, although the kernel grants the tile state (ARCH_REQ_XCOMP_PERM)
    and oneDNN's AMX GEMMs run in the same VM. `--repack 0` would avoid them too, but it also turns
    off the interleaved q4_0 layout that is llama.cpp's fast AVX-512 path, so the fair peer is the
    same native build without the AMX instructions (its VNNI / AVX512-BF16 kernels).
    """
    if _smoke(bin_dir, gguf, threads):
        return bin_dir
    print(f"llama.cpp ({bin_dir.parent.name}) died on {gguf.name}: using a build without AMX", flush=True)
    fallback = build_llamacpp("build-noamx", "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    if not _smoke(fallback, gguf, threads):
        raise RuntimeError(f"llama.cpp's AMX-free build dies on {gguf} too")
    return fallback


def _smoke(bin_dir: Path, gguf: Path, threads: int) -> bool:
    """Whether llama-bench runs a short prompt and a few decode steps on `gguf` without dying."""
    args = ["-m", str(gguf), "-t", str(threads), "-r", "1", "-p", "64", "-n", "4"]
    cmd = [str(bin_dir / "llama-bench"), *args]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def convert(checkpoint: Path, bin_dir: Path, gguf_type: str) -> Path:
    """The checkpoint as GGUF of `gguf_type` (bf16 converted, the rest quantized from it), cached."""
    out = CACHE_DIR / "gguf" / f"{checkpoint.name}-{gguf_type}.gguf"
    if out.exists():
        return out
    if gguf_type == "mxfp4-projections":
        from weight_formats_decode import _mxfp4_gguf

        return _mxfp4_gguf(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    bf16 = out.with_name(f"{checkpoint.name}-bf16.gguf")
    if not bf16.exists():
        # Its converter tries sentencepiece before the BPE vocabulary (our tokenizer.json).
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "sentencepiece"], check=True)
        env = {**os.environ, "PYTHONPATH": str(LLAMA_DIR / "gguf-py")}
        cmd = [sys.executable, str(LLAMA_DIR / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "bf16"]
        subprocess.run([*cmd, "--outfile", str(bf16)], check=True, env=env, capture_output=True)
    if gguf_type != "bf16":
        quantize = bin_dir / "llama-quantize"
        subprocess.run([str(quantize), str(bf16), str(out), gguf_type], check=True, capture_output=True)
    return out


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict[str, float]:
    """pp512 and tg64 after a 512-token context, tokens/s (llama-bench's own averages); the decode
    run between two bandwidth probes."""
    exe = str(bin_dir / "llama-bench")
    common = ["-m", str(gguf), "-t", str(threads), "-r", "2", "-o", "json"]
    prefill = json.loads(_run([exe, *common, "-p", str(PROMPT_LEN), "-n", "0"]))
    decode, bandwidth = bracketed(
        lambda: json.loads(_run([exe, *common, "-p", "0", "-n", str(GEN_LEN), "-d", str(PROMPT_LEN)]))
    )
    return {
        "prefill": prefill[0]["avg_ts"],
        "decode@512": decode[0]["avg_ts"],
        "bytes": prefill[0]["model_size"],
        **bandwidth,
    }


def bracketed(run: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """run()'s result and the read bandwidth (GB/s) measured just before and just after it."""
    before = measure_bandwidth_gbs()
    result = run()
    return result, {"bw_before": before, "bw_after": measure_bandwidth_gbs()}


def llama_batched(bin_dir: Path, gguf: Path, threads: int, batch: int) -> float:
    """S_TG of llama-batched-bench: decode tokens/s of `batch` sequences together after their prompts."""
    exe = str(bin_dir / "llama-batched-bench")
    ctx = batch * (PROMPT_LEN + GEN_LEN)
    args = ["-m", str(gguf), "-t", str(threads), "-c", str(ctx), "-b", str(ctx), "-ub", str(PROMPT_LEN)]
    text = _run([exe, *args, "-npp", str(PROMPT_LEN), "-ntg", str(GEN_LEN), "-npl", str(batch)])
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] == str(PROMPT_LEN) and cells[2] == str(batch):
            return float(cells[7])  # PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | ...
    raise RuntimeError(f"no result row in llama-batched-bench output:\n{text}")


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return done.stdout


# --------------------------------------------------------------------------------------- kvflow


def kvflow_engine(checkpoint: Path, args: dict[str, Any], batch: int) -> LLM:
    # The whole batch's prompts prefill in one step, as llama-batched-bench processes them.
    return LLM(
        str(checkpoint),
        dtype="bfloat16",
        max_model_len=PROMPT_LEN + GEN_LEN + 8,
        max_num_batched_tokens=batch * PROMPT_LEN,
        enable_prefix_caching=False,
        **args,
    )


def kvflow_bench(llm: LLM, seed: int, batch_size: int) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = QWEN25_05B["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(PROMPT_LEN)] for _ in range(batch_size + 2)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prefill = llm.generate([prompts[0]], one)[0].metrics
    assert prefill.prefill_time is not None
    params = SamplingParams(temperature=0.0, max_tokens=GEN_LEN + 1, ignore_eos=True)
    single, bandwidth = bracketed(lambda: llm.generate([prompts[1]], params)[0].metrics)
    assert single.decode_time is not None
    batch = [o.metrics for o in llm.generate(prompts[2:], params)]
    start = min(m.first_token_time for m in batch if m.first_token_time is not None)
    span = max(m.token_times[-1] for m in batch) - start
    return {
        "prefill": PROMPT_LEN / prefill.prefill_time,
        "decode@512": (len(single.token_times) - 1) / single.decode_time,
        "decode xB": sum(len(m.token_times) - 1 for m in batch) / span,
        **bandwidth,
    }


def kvflow_weight_bytes(llm: LLM) -> int:
    """Bytes a decode step reads: the layers' and the head's weights (not the embedding table, of
    which one row is read, nor oneDNN's blocked copies, which decode at batch 1 does not read)."""
    model = llm.llm_engine.model_runner.model
    return sum(
        t.numel() * t.element_size()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if "embed_tokens" not in name and "_cache" not in name
    )


# ----------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", default="bf16,int8,int4")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences of the batched decode run")
    args = ap.parse_args()
    pairs = [PAIRS[p] for p in args.pairs.split(",")]
    checkpoint = build_checkpoint(torch.bfloat16)
    llama = build_llamacpp()
    ggufs = {p.name: convert(checkpoint, llama, p.gguf_type) for p in pairs}
    llama = runnable_llamacpp(llama, convert(checkpoint, llama, "q8_0"), args.threads)
    engines = {
        p.name: kvflow_engine(ggufs[p.name] if p.kvflow_reads_gguf else checkpoint, p.kvflow_args, args.batch)
        for p in pairs
    }
    for llm in engines.values():  # warm-up: oneDNN primitives, first-touch of the pools
        llm.generate([[1] * 16], SamplingParams(max_tokens=4, ignore_eos=True))
    ratios: dict[tuple[str, str], list[float]] = {}
    shares: dict[tuple[str, str], list[tuple[float, bool]]] = {}  # (share, steady)
    for r in range(args.rounds):
        print(f"\nround {r + 1}", flush=True)
        for pair in pairs:
            ours = kvflow_bench(engines[pair.name], seed=r, batch_size=args.batch)
            theirs = llama_bench(llama, ggufs[pair.name], args.threads)
            theirs["decode xB"] = llama_batched(llama, ggufs[pair.name], args.threads, args.batch)
            roof = {"kvflow": kvflow_weight_bytes(engines[pair.name]), "llama.cpp": theirs["bytes"]}
            probes = []
            for engine, result in (("kvflow", ours), ("llama.cpp", theirs)):
                before, after = result["bw_before"], result["bw_after"]
                bandwidth = (before + after) / 2
                steady = abs(before - after) / bandwidth <= UNSTEADY_SPREAD
                share = roof[engine] / (bandwidth * 1e9) * result["decode@512"]
                shares.setdefault((pair.name, engine), []).append((share, steady))
                mark = "" if steady else "~"
                probes.append(f"{engine} {before:.1f}/{after:.1f} GB/s -> {share * 100:.0f}%{mark}")
            cells = []
            for metric in ("prefill", "decode@512", "decode xB"):
                ratio = ours[metric] / theirs[metric]
                ratios.setdefault((pair.name, metric), []).append(ratio)
                label = metric.replace("xB", f"x{args.batch}")
                cells.append(f"{label} {ours[metric]:.1f}/{theirs[metric]:.1f} = {ratio:.2f}x")
            print(f"  {pair.name:<22} " + " | ".join(cells), flush=True)
            print(f"  {'':<22} decode@512 between probes: {', '.join(probes)}", flush=True)
    print(f"\nkvflow / llama.cpp over {args.rounds} rounds, median [min-max] ({args.threads} threads):")
    for pair in pairs:
        cells = [_summary(ratios[(pair.name, m)], "x") for m in ("prefill", "decode@512", "decode xB")]
        batched = f"decode x{args.batch}"
        print(f"  {pair.name:<22} prefill {cells[0]} | decode@512 {cells[1]} | {batched} {cells[2]}")
        share_cells = []
        for e in ("kvflow", "llama.cpp"):
            runs = shares[(pair.name, e)]
            steady_shares = [share for share, ok in runs if ok]
            cell = f"{e} {_summary([share for share, _ in runs], '%', 100)}"
            if steady_shares:
                cell += f" (steady {len(steady_shares)}: {_summary(steady_shares, '%', 100)})"
            share_cells.append(cell)
        print(f"  {'':<22} single-stream decode at share of the bandwidth roofline: {', '.join(share_cells)}")


def _summary(values: list[float], unit: str, scale: float = 1.0) -> str:
    v = [x * scale for x in values]
    fmt = "{:.0f}" if unit == "%" else "{:.2f}"
    return f"{fmt.format(statistics.median(v))}{unit} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


if __name__ == "__main__":
    main()

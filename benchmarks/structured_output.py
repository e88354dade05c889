"""Structured output's cost: decode ITL and output tok/s of 8 concurrent requests with no constraint,
a JSON schema and a regex (one run, interleaved rounds); grammar compile time of a small and a
50-property schema, cold and cached; the TTFT a cached schema adds.

    python benchmarks/structured_output.py                       # the bundled tiny model
    python benchmarks/structured_output.py --model qwen0.5b      # Qwen2.5-0.5B-shaped random weights
                                          [--concurrency 8] [--output-len 64] [--rounds 3]

In-process engine (no HTTP): each scenario submits `--concurrency` requests at once and steps the
engine until they finish. Every request decodes exactly `--output-len` tokens (checked): the
constraints cannot close sooner (`scenarios`) and EOS is ignored, so the mask is computed and
applied on every token and the batch shape matches the unconstrained run. ITL is the
median gap between consecutive tokens of a request (its timeline), over all requests of the scenario.
Targets (the issue): constrained ITL within 5% of unconstrained; a cached schema adds < 1 ms TTFT.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grammar_engines import SMALL_SCHEMA, large_schema  # noqa: E402

from kvflow.assets import bundled_model_dir  # noqa: E402
from kvflow.engine.engine import LLMEngine  # noqa: E402
from kvflow.outputs import RequestOutput  # noqa: E402
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from kvflow.structured import grammar_spec  # noqa: E402
from kvflow.structured.backend import GrammarBackend  # noqa: E402


def scenarios(output_len: int) -> dict[str, StructuredOutputsParams | None]:
    """The constraints cannot close before `output_len` tokens (at least that many array items, or
    regex repetitions, each a token or more), so every request runs to max_tokens, masked at every
    token, and the batch keeps the unconstrained run's shape."""
    json_schema: dict[str, Any] = {
        "type": "array",
        "minItems": output_len,
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}},
            "required": ["id", "name"],
            "additionalProperties": False,
        },
    }
    regex = f"[a-z]{{3}}(-[a-z0-9]{{2,6}}){{{output_len},}}"
    return {
        "none": None,
        "json_schema": StructuredOutputsParams(json=json_schema),
        "regex": StructuredOutputsParams(regex=regex),
    }


PROMPT = "Write the records:"
TTFT_SAMPLES = 10


def model_path(name: str) -> Path:
    if name == "bundled":
        return bundled_model_dir()
    if name == "qwen0.5b":
        from offline_throughput import build_checkpoint

        return build_checkpoint(torch.bfloat16)
    return Path(name)


def run_batch(engine: LLMEngine, params: list[SamplingParams]) -> list[RequestOutput]:
    ids = [engine.add_request(f"b-{uuid.uuid4().hex[:8]}", PROMPT, p) for p in params]
    finals: dict[str, RequestOutput] = {}
    while len(finals) < len(ids):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


def scenario(
    engine: LLMEngine, constraint: StructuredOutputsParams | None, n: int, output_len: int
) -> tuple[list[float], float]:
    """Per-token gaps (s) of every request, and output tokens per second of the whole batch.
    Every request must run to `output_len` tokens (the comparison assumes equal batch shapes)."""
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True, structured_outputs=constraint
        )
        for i in range(n)
    ]
    start = time.perf_counter()
    outputs = run_batch(engine, params)
    wall = time.perf_counter() - start
    gaps: list[float] = []
    tokens = 0
    for out in outputs:
        times = out.metrics.token_times
        gaps += [b - a for a, b in itertools.pairwise(times)]
        tokens += len(out.outputs[0].token_ids)
    if tokens != n * output_len:
        raise RuntimeError(
            f"expected {n * output_len} output tokens, got {tokens}: a constraint closed early"
        )
    return gaps, tokens / wall


def compile_times(engine: LLMEngine, repeats: int) -> dict[str, float]:
    """Cold: a fresh compile of the grammar, first mask included (llguidance builds its lexer lazily;
    the backend pays for it at compile time). Cached: the engine's path for a known schema (a copy
    of the compiled matcher)."""
    tok = engine.tokenizer
    backend = GrammarBackend(tok.backend.to_str(), tok.eos_token_ids)
    result: dict[str, float] = {}
    for name, schema in (("small", SMALL_SCHEMA), ("large_50_props", large_schema())):
        spec = grammar_spec(StructuredOutputsParams(json=schema))
        cold, cached = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            matcher = backend.compile(spec)  # includes the first mask
            cold.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            matcher.deep_copy()
            cached.append((time.perf_counter() - start) * 1e3)
        result[f"{name}_cold_ms"] = statistics.median(cold)
        result[f"{name}_cached_ms"] = statistics.median(cached)
    return result


def ttft_added_by_cached_schema(engine: LLMEngine) -> tuple[float, float, float]:
    """Median TTFT (ms) of single requests without a constraint and with an already-compiled schema,
    and the median grammar wait of the latter."""
    schema = StructuredOutputsParams(json=large_schema())
    run_batch(engine, [SamplingParams(max_tokens=1, structured_outputs=schema)])  # compile once
    plain, cached, waits = [], [], []
    for _ in range(TTFT_SAMPLES):  # interleaved: drift hits both alike
        (out,) = run_batch(engine, [SamplingParams(max_tokens=1)])
        plain.append(out.metrics.ttft * 1e3)
        (out,) = run_batch(engine, [SamplingParams(max_tokens=1, structured_outputs=schema)])
        cached.append(out.metrics.ttft * 1e3)
        waits.append(out.metrics.grammar_compile_time * 1e3)
    return statistics.median(plain), statistics.median(cached), statistics.median(waits)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bundled", help="bundled | qwen0.5b | a checkpoint directory")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine = LLMEngine.from_kwargs(model=str(model_path(args.model)), dtype=args.dtype, max_model_len=1024)

    cases = scenarios(args.output_len)
    for constraint in cases.values():  # warm-up: kernels, the grammar backend, the compile cache
        scenario(engine, constraint, args.concurrency, 8)
    gaps: dict[str, list[float]] = {name: [] for name in cases}
    rates: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.rounds):  # interleaved rounds, order rotated: drift hits every scenario alike
        for name in names[r % len(names) :] + names[: r % len(names)]:
            constraint = cases[name]
            g, rate = scenario(engine, constraint, args.concurrency, args.output_len)
            gaps[name] += g
            rates[name].append(rate)

    print(
        f"model={args.model} concurrency={args.concurrency} output_len={args.output_len} rounds={args.rounds}"
    )
    base_itl = statistics.median(gaps["none"])
    print(f"{'scenario':<12} {'ITL p50 ms':>11} {'ITL p90 ms':>11} {'vs none':>8} {'out tok/s':>10}")
    for name in cases:
        ordered = sorted(gaps[name])
        p50, p90 = statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]
        print(
            f"{name:<12} {p50 * 1e3:>11.2f} {p90 * 1e3:>11.2f} {p50 / base_itl:>8.3f} "
            f"{statistics.median(rates[name]):>10.1f}"
        )
    print("grammar compile (ms, median):")
    for key, value in compile_times(engine, repeats=5).items():
        print(f"  {key:<24} {value:8.3f}")
    plain, cached, wait = ttft_added_by_cached_schema(engine)
    print(
        f"TTFT p50: no constraint {plain:.2f} ms, cached 50-property schema {cached:.2f} ms "
        f"(added {cached - plain:+.2f} ms; grammar wait {wait:.3f} ms)"
    )


if __name__ == "__main__":
    main()

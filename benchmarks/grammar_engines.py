"""Which grammar engine kvflow builds structured output on: llguidance vs xgrammar, measured.

For each engine, on a real byte-level BPE vocabulary (the Qwen2 tokenizer in ../shared/assets, 151k
tokens): tokenizer setup once; grammar compile time of a small and a 50-property JSON schema (cold:
a fresh compiler; median of several); per-token mask fill time while walking a valid document
token by token (fill, then consume the document's own next token), median and p99.

    python benchmarks/grammar_engines.py [--tokenizer ../shared/assets/tokenizers/qwen2] [--repeats 5]

Prints one table; the choice and the reason are in benchmarks/NOTES.md ("Structured output").
xgrammar is optional here (it is not a kvflow dependency): its row is skipped when it does not import.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "assets" / "tokenizers" / "qwen2"
SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
NUM_LARGE_PROPERTIES = 50  # the "large schema"


def large_schema() -> dict[str, Any]:
    """50 properties cycling through string / integer bounds / enum / nested array of objects."""
    props: dict[str, Any] = {}
    for i in range(NUM_LARGE_PROPERTIES):
        kind = i % 4
        if kind == 0:
            props[f"field_{i}"] = {"type": "string", "maxLength": 20}
        elif kind == 1:
            props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
        elif kind == 2:
            props[f"choice_{i}"] = {"enum": ["red", "green", "blue"]}
        else:
            props[f"items_{i}"] = {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["id"],
                },
            }
    return {"type": "object", "properties": props, "required": list(props)}


def large_document() -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for name in large_schema()["properties"]:
        if name.startswith("field"):
            doc[name] = "hello world"
        elif name.startswith("count"):
            doc[name] = 42
        elif name.startswith("choice"):
            doc[name] = "green"
        else:
            doc[name] = [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "tags": []}]
    return doc


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median wall ms of `repeats` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_llguidance(tokenizer_dir: Path, repeats: int) -> dict[str, float]:
    import llguidance
    import llguidance.numpy as llnp

    text = (tokenizer_dir / "tokenizer.json").read_text()
    setup_ms, tok = timed(lambda: llguidance.LLTokenizer(text), 1)

    def compile_schema(schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    small_ms, _ = timed(lambda: compile_schema(SMALL_SCHEMA), repeats)
    large_ms, template = timed(lambda: compile_schema(large_schema()), repeats)
    copy_ms, _ = timed(template.deep_copy, repeats)

    doc_ids = tok.tokenize_str(json.dumps(large_document(), separators=(",", ":")))
    bitmask = llnp.allocate_token_bitmask(1, tok.vocab_size)
    matcher = template.deep_copy()

    def consume(token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    fills = mask_fill_us(doc_ids, lambda: llnp.fill_next_token_bitmask(matcher, bitmask, 0), consume)
    return results(setup_ms, small_ms, large_ms, copy_ms, fills)


def bench_xgrammar(tokenizer_dir: Path, repeats: int) -> dict[str, float]:
    import transformers
    import xgrammar

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    setup_ms, info = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(hf), 1)

    def compile_schema(schema: dict[str, Any]) -> Any:
        # A fresh compiler each time: its own cache would make every repeat after the first a hit.
        compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    small_ms, _ = timed(lambda: compile_schema(SMALL_SCHEMA), repeats)
    large_ms, compiled = timed(lambda: compile_schema(large_schema()), repeats)
    cached_ms, _ = timed(lambda: xgrammar.GrammarMatcher(compiled), repeats)

    doc_ids = hf.encode(json.dumps(large_document(), separators=(",", ":")))
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    matcher = xgrammar.GrammarMatcher(compiled)

    def consume(token: int) -> None:
        assert matcher.accept_token(token)

    fills = mask_fill_us(doc_ids, lambda: matcher.fill_next_token_bitmask(bitmask, 0), consume)
    return results(setup_ms, small_ms, large_ms, cached_ms, fills)


def mask_fill_us(doc_ids: list[int], fill: Any, consume: Any) -> list[float]:
    """Walk a valid document: before each of its tokens, time one mask fill (us), then consume it."""
    fills = []
    for token in doc_ids:
        start = time.perf_counter()
        fill()
        fills.append((time.perf_counter() - start) * 1e6)
        consume(token)
    return fills


def results(
    setup_ms: float, small_ms: float, large_ms: float, cached_ms: float, fills: list[float]
) -> dict[str, float]:
    return {
        "setup_ms": setup_ms,
        "small_ms": small_ms,
        "large_ms": large_ms,
        "cached_ms": cached_ms,
        "first_fill_us": fills[0],  # llguidance builds its lexer lazily: the first mask pays for it
        "fill_mean_us": statistics.fmean(fills),
        "fill_p50_us": statistics.median(fills),
        "fill_p99_us": percentile(fills, 0.99),
        "tokens": len(fills),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    np.set_printoptions(precision=3)
    rows: dict[str, dict[str, float]] = {"llguidance": bench_llguidance(args.tokenizer, args.repeats)}
    try:
        rows["xgrammar"] = bench_xgrammar(args.tokenizer, args.repeats)
    except ImportError as exc:
        print(f"xgrammar skipped: {exc}")
    cols = [
        "setup_ms",
        "small_ms",
        "large_ms",
        "cached_ms",
        "first_fill_us",
        "fill_mean_us",
        "fill_p50_us",
        "fill_p99_us",
        "tokens",
    ]
    print(f"{'engine':<12}" + "".join(f"{c:>14}" for c in cols))
    for name, row in rows.items():
        print(f"{name:<12}" + "".join(f"{row[c]:>14.2f}" for c in cols))


if __name__ == "__main__":
    main()

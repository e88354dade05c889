"""Measured step-time curves (`kvflow profile-steps`, kvflow/engine/step_profile.py) for the
simulator's step cost: what a step of n prompt tokens, or of b decode rows, costs on this machine.

Why: the two-coefficient cost (kvflow/doctor/step_cost.py) is fitted to the server's step means by
kind, so it extrapolates from the step shapes the run had. A run with one running slot has 1-row
decodes and one-prompt prefills; a what-if that lets 8 run prefills 8 prompts in one step, and the
straight line through two small shapes put that step at twice its measured time (the max_num_seqs
what-if's TTFT was off by 69%: benchmarks/NOTES.md, session 23). The curves are measured over the
shapes instead (doubling sizes), and interpolated:

    shape(rows, tokens) = P(tokens + rows) for a step with prompt tokens (a decode row is one more
                          token in the same forward), D(rows) for a decode-only step
    P, D                  piecewise linear through the measured points; beyond the last point the
                          last segment's slope (never negative)
    row_ms_per_key        decode steps at a long context against D: what a query row pays per key
                          it re-reads (kvflow/query_rows.py), the cost of a short chunk after a
                          cached prefix
    chunk_ms_per_key      a prefill chunk after a cached prefix against P: what a prompt chunk pays
                          per key of the context before it (a prompt's later chunks attend its
                          earlier ones: a smaller token budget makes more of them)
The profile runs in one process with no server around it; the server's steps cost more (its
thread, the HTTP side, outputs). That difference is added per step kind, fitted to the server's
measured means (kvflow/doctor/calibrate.py), and its growth with the rows a step delivers is
measured through a server (kvflow/doctor/served_decode.py):
    served_growth(b)      the served b-row decode step's excess over D(b), less the 1-row excess
                          (made non-decreasing in b: more rows never cost less), added to every
                          step by its query rows (decodes and short prompt chunks: a cached prefix's
                          8-token suffix, one token delivered, pays it too, step_cost.py); 0
                          without the served probe
    between_growth(b)     the clients' TPOT beyond the served b-row step, less that at 1 row (the
                          API thread delivering b tokens), added after every step by its rows
    delivery_growth(n)    the clients' TTFT beyond the server's when one step delivers n first
                          tokens, less that for 1: added to a request's TTFT and e2e (and to when its
                          client sends the next) by the tokens its first and last steps delivered,
                          less that for the tokens the diagnosed run's own steps delivered with its
                          clients' first tokens (StepCost.delivery_ms: its offset holds those)
    served_arrival_stall  the served decode steps during which a request arrived, over the other
                          decode steps of their rows: the stalls the simulator draws for arrivals
                          where the diagnosed run recorded too few of its own
                          (kvflow/doctor/arrival_stalls.py, kvflow/doctor/calibrate.py)
Attention beyond the probes' own short contexts is not in the curves: a query row's is
row_ms_per_key, a prefill chunk's chunk_ms_per_key (the server's steps fit what they pay beyond it,
kvflow/doctor/calibrate.py).

    split_prefill_ms,     the same prefill and decode curves (and the prefill chunks and decode
    split_decode_ms       steps at a context) on half the cores (OMP_NUM_THREADS): one instance of a
                          machine split in two, as the disaggregation what-if runs a prefill and a
                          decode instance (kvflow/doctor/disaggregation.py).
                          How prefill and decode scale with cores is the machine's and the model's:
                          a 2-core Xeon on a 0.5B shape prefilled 1.43x slower on one core, a
                          2-core Zen 2 on the planted tiny model 1.7-2.0x (a constant from the one
                          machine under-predicted the pair's TTFT by 13-31% on the other:
                          benchmarks/NOTES.md, session 27).

Measured once per model, machine, dtype and quantization, cached in ~/.cache/kvflow/doctor/
step-profile/ (`kvflow doctor --profile-steps` measures; later runs read the cache). A run at another
moment scales it to its own speed (kvflow/doctor/calibrate.py: profile_speed): a VM's speed moves by
a third over minutes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
from bisect import bisect_left
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvflow.doctor.quant_speed import cache_dir as quant_cache_dir
from kvflow.doctor.quant_speed import machine_key, model_key
from kvflow.doctor.served_decode import ARRIVAL_KEY, SERVED_PROBE_CONTEXT, measure_served_decode
from kvflow.query_rows import MAX_QUERY_ROWS_PER_CHUNK

logger = logging.getLogger(__name__)

PROFILE_TIMEOUT_S = 900.0
# `kvflow profile-steps` runs of one pass each, on all the cores and on half of them in turn; each
# point the median over them. Why in turn: the half-core curves are measured against the whole
# machine's (the disaggregation what-if's split), and a VM's speed moves by a fifth over minutes. One
# run of three passes on all the cores, then one on half, read the 256-token prefill on half the
# cores 1.71x and 1.52x the whole machine's in two profiles of the planted prefill_chunks model, and
# the 8-row decode 1.53x and 1.06x; the disaggregated pair's TTFT on one diagnosis moved 224 -> 201
# ms between them, and came out 14-21% low in three verify runs (session 38). Seven: the median of
# three read the planted prefill_chunks model's 512-token prefill at 1.97x, 2.25x and 2.39x its
# 256-token one in three profiles, and the 2.39 one put the budget what-ifs' predictions 10-18%
# lower on the same diagnoses (the prompt fit's factor fell to 0.86 and priced the 128-token chunks
# at 38-41 ms where 46-53 were measured); two profiles of seven passes read 1.97x and 1.96x, in about
# 2 minutes where three took 50 s (session 39).
PROFILE_PASSES = 7
# The shapes probed: decode batches up to this many rows, prompts up to this many tokens (or the
# model's context): what-ifs reach past the server's own settings.
PROFILE_MAX_NUM_SEQS = 32
PROFILE_MAX_TOKENS = 1024
# The context of the decode probes (kvflow/engine/step_profile.py: a 16-token prompt, 12 outputs): the
# keys a probed decode row attends, on average.
DECODE_PROBE_CONTEXT = 16 + 12 / 2
# What the profile measures (in the cache key, so that a doctor whose profile gained a probe measures
# again rather than reading an older profile without it): 2 added the decode steps at a long context,
# 3 the served decode steps, 4 the curves on half the cores, 5 the served probe's medians over sweeps,
# 6 the served turnover probe and five sweeps, 7 the arrival probe in its place (the steps during
# which a request arrived, not those after a finish), 8 the decode curves' medians over passes, 9 the
# prefill chunks at a context, 10 the passes on all the cores and on half of them in turn, 11 the
# decode steps at a context on half the cores kept, 12 seven passes, 13 eleven served sweeps, (14:
# fixed heap thresholds, reverted; files of that format are not this profile) 15 the served suffix
# probe.
PROFILE_FORMAT = 15
# The profile's keys for its curves on half the cores (module docstring).
SPLIT_KEYS = {"prefill_ms": "split_prefill_ms", "decode_ms": "split_decode_ms"}
# ... and for its prefill chunks and decode steps at a context.
SPLIT_CONTEXT_KEYS = {
    "prefill_context_ms": "split_prefill_context_ms",
    "prefill_context_keys": "split_prefill_context_keys",
    "decode_context_ms": "split_decode_context_ms",
    "decode_context_keys": "split_decode_context_keys",
}


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear ms over sizes (sorted); the last slope beyond the last point."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def __call__(self, n: float) -> float:
        xs, ys = self.sizes, self.ms
        if len(xs) == 1:
            return ys[0]
        if n <= xs[0]:
            return ys[0]
        if n > xs[-1]:  # beyond the last point: its segment's slope, never falling
            return ys[-1] + max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) * (n - xs[-1])
        i = bisect_left(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) / (x1 - x0) * (n - x0)

    def scaled(self, factor: float) -> Curve:
        return Curve(self.sizes, tuple(ms * factor for ms in self.ms))

    def slope(self, n: float) -> float:
        """ms per unit of size around n (for what a share of a step's tokens cost)."""
        if len(self.sizes) == 1:
            return 0.0
        i = max(1, min(bisect_left(self.sizes, n), len(self.sizes) - 1))
        dx = self.sizes[i] - self.sizes[i - 1]
        return max((self.ms[i] - self.ms[i - 1]) / dx, 0.0)


@dataclass(frozen=True)
class StepProfile:
    prefill: Curve  # ms of a step of n prompt tokens
    decode: Curve  # ms of a step of b decode rows
    # ms per key a query row reads beyond the decode probes' context, from decode steps at a long
    # context (a row re-reads its context: kvflow/query_rows.py); None: a profile without that probe.
    row_ms_per_key: float | None = None
    # By decode rows, less their value at 1 row (module docstring): the served decode steps' excess
    # over `decode`, and the clients' TPOT beyond the served step. None: no served probe.
    served_excess: Curve | None = None
    served_between: Curve | None = None
    # By the tokens a step delivers, less its value at 1: the clients' TTFT beyond the server's.
    served_delivery: Curve | None = None
    # The prefill and decode curves on half the cores; None: not measured (one core, or an older
    # profile).
    split: tuple[Curve, Curve] | None = None
    # The served 1-row decode step's excess over the profiled one (what the growth curves start
    # from); None without the served probe.
    served_base_excess: float | None = None
    # The served arrival probe's stalls, ms: a decode step during which a request arrived over the
    # other decode steps of its rows (kvflow/doctor/served_decode.py); empty without the probe.
    served_arrival_stall: tuple[float, ...] = ()
    # ms per key a prefill chunk attends beyond a fresh prompt of its size (the context before it),
    # from chunks after a cached prefix (_chunk_ms_per_key); on half the cores, from the same probes
    # there. None: a profile without that probe.
    chunk_ms_per_key: float | None = None
    split_chunk_ms_per_key: float | None = None
    # row_ms_per_key on half the cores (_row_ms_per_key of the decode steps at a context there); None:
    # not measured. Why: one thread reads keys slower than two, and a short prompt suffix after a
    # fetched prefix is that many query rows re-reading it (kvflow/query_rows.py): on the planted
    # prefill_chunks pair's decode instance, steps taking in a 3-8-token suffix after 192-528 fetched
    # tokens ran 1.54x their price with the whole machine's (median), the pair's ITL p99 came out
    # 2-20% low (sessions 38-39), and the engine alone on one thread paid 14.3 ms for a 6-token
    # suffix after 400 tokens where a 1-row step took 7.4.
    split_row_ms_per_key: float | None = None
    # The served suffix step over the served 1-row decode step at the same cached prefix, by prefix
    # tokens (kvflow/doctor/served_decode.py: the suffix probe); None without it. A ratio of two
    # served steps measured together: the run's speed and the server's excess are in both.
    suffix_ratio: Curve | None = None

    def suffix_over_decode(self, rows: int, keys_per_row: float) -> float | None:
        """What a step of `rows` prompt query rows alone (a short suffix after a cached prefix, no
        decode row), each reading `keys_per_row` keys, costs over a 1-row decode step at that
        context: the probe's ratio at that context for its MAX_QUERY_ROWS_PER_CHUNK rows, and along
        the line from 1 (one row is a decode step's work) to it for other counts; None without the
        probe."""
        if self.suffix_ratio is None:
            return None
        at_probe = self.suffix_ratio(keys_per_row)
        return max(1.0 + (at_probe - 1.0) * (rows - 1) / (MAX_QUERY_ROWS_PER_CHUNK - 1), 1.0)

    def scaled(self, factor: float) -> StepProfile:
        """Every time in the profile x `factor`: the same machine running that much slower (a VM's
        speed moves by a third over minutes: the profile cached at one moment, a run at another)."""

        def times(curve: Curve | None) -> Curve | None:
            return None if curve is None else curve.scaled(factor)

        def ms(value: float | None) -> float | None:
            return None if value is None else value * factor

        halves = None if self.split is None else (self.split[0].scaled(factor), self.split[1].scaled(factor))
        return replace(
            self,
            prefill=self.prefill.scaled(factor),
            decode=self.decode.scaled(factor),
            row_ms_per_key=ms(self.row_ms_per_key),
            served_excess=times(self.served_excess),
            served_between=times(self.served_between),
            served_delivery=times(self.served_delivery),
            split=halves,
            served_base_excess=ms(self.served_base_excess),
            served_arrival_stall=tuple(v * factor for v in self.served_arrival_stall),
            chunk_ms_per_key=ms(self.chunk_ms_per_key),
            split_chunk_ms_per_key=ms(self.split_chunk_ms_per_key),
            split_row_ms_per_key=ms(self.split_row_ms_per_key),
        )

    def on_half_cores(self) -> StepProfile | None:
        """This profile for one instance on half the cores: the split curves in place of the
        whole machine's, the rest kept (what serving adds is the API thread's, not the forward's);
        None without split curves."""
        if self.split is None:
            return None
        prefill, decode = self.split
        chunk, row = self.split_chunk_ms_per_key, self.split_row_ms_per_key
        return replace(
            self,
            prefill=prefill,
            decode=decode,
            split=None,
            chunk_ms_per_key=self.chunk_ms_per_key if chunk is None else chunk,
            split_chunk_ms_per_key=None,
            row_ms_per_key=self.row_ms_per_key if row is None else row,
            split_row_ms_per_key=None,
        )

    def served_growth(self, rows: int) -> float:
        """What serving adds to a step of `rows` query rows beyond what it adds to a 1-row step."""
        return _at(self.served_excess, rows)

    def delivery_growth(self, tokens: float) -> float:
        """How much later a client reads a token its step delivered with `tokens - 1` others than one
        delivered alone (the API thread writes them one after another, the client parses them)."""
        return _at(self.served_delivery, tokens)

    def between_growth(self, rows: int) -> float:
        """What passes after a step of `rows` decode rows before the next (output delivery) beyond
        what passes after a 1-row step."""
        return _at(self.served_between, rows)

    def shape_ms(self, rows: int, tokens: int) -> float:
        """A step of `rows` query rows and `tokens` prefill-chunk tokens: the prefill curve at the
        total when there is a prefill chunk (a row is one more token in the same forward), else the
        decode curve."""
        return self.prefill(tokens + rows) if tokens else self.decode(rows)

    @staticmethod
    def row_probe_attention(rows: int) -> float:
        """Keys `rows` probed decode rows read: DECODE_PROBE_CONTEXT each."""
        return rows * DECODE_PROBE_CONTEXT

    @staticmethod
    def prefill_probe_attention(tokens: int) -> float:
        """Keys a probed prompt of `tokens` tokens attended alone, T (T + 1) / 2: a chunk after a
        context attends more."""
        return tokens * (tokens + 1) / 2

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepProfile | None:
        curves = [_curve(data.get(key)) for key in SPLIT_KEYS]
        split = [_curve(data.get(key)) for key in SPLIT_KEYS.values()]
        if curves[0] is None or curves[1] is None:
            return None
        per_key = _row_ms_per_key(data, curves[1])
        excess, between, delivery, base_excess = _served_curves(data, curves[1], per_key)
        halves = (split[0], split[1]) if split[0] is not None and split[1] is not None else None
        stalls = tuple(float(ms) for ms in data.get(ARRIVAL_KEY) or ())
        served = (excess, between, delivery, halves, base_excess)
        chunk = _chunk_ms_per_key(data, curves[0])
        at_context = {key: data.get(split_key) for key, split_key in SPLIT_CONTEXT_KEYS.items()}
        split_chunk = _chunk_ms_per_key(at_context, split[0]) if split[0] is not None else None
        split_row = _row_ms_per_key(at_context, split[1]) if split[1] is not None else None
        return cls(
            curves[0],
            curves[1],
            per_key,
            *served,
            served_arrival_stall=stalls,
            chunk_ms_per_key=chunk,
            split_chunk_ms_per_key=split_chunk,
            split_row_ms_per_key=split_row,
            suffix_ratio=_suffix_ratio(data),
        )


def _suffix_ratio(data: dict[str, Any]) -> Curve | None:
    """The suffix probe's step over its 1-row decode step, by cached prefix tokens; None without it."""
    suffix, single = data.get("served_suffix_ms") or {}, data.get("served_suffix_decode_ms") or {}
    ratios = {k: float(ms) / float(single[k]) for k, ms in suffix.items() if float(single.get(k) or 0.0) > 0}
    return _curve(ratios)


def _curve(points_by_size: dict[str, float] | None) -> Curve | None:
    """{size: ms} as a Curve; None when empty."""
    points = sorted((int(k), float(v)) for k, v in (points_by_size or {}).items())
    if not points:
        return None
    return Curve(tuple(p[0] for p in points), tuple(p[1] for p in points))


def median_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """`kvflow profile-steps` outputs of one pass each as one: every curve's point the median over
    the passes that measured it (JSON keys: the sizes as strings)."""
    merged: dict[str, Any] = {}
    for key in {k for data in passes for k in data}:
        by_size: dict[str, list[float]] = {}
        for data in passes:
            for size, ms in (data.get(key) or {}).items():
                by_size.setdefault(str(size), []).append(float(ms))
        merged[key] = {size: statistics.median(values) for size, values in by_size.items()}
    return merged


def half_the_cores() -> int:
    """The threads each instance of a machine split in two gets (at least one)."""
    return max(1, (os.cpu_count() or 2) // 2)


def _profile_steps(command: list[str], threads: int | None) -> dict[str, Any]:
    """`kvflow profile-steps`' JSON, on `threads` threads (OMP_NUM_THREADS; None: the default)."""
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S, check=True, env=env
    )
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return data


def _at(growth: Curve | None, rows: float) -> float:
    return 0.0 if growth is None or rows <= 1 else max(growth(rows), 0.0)


def _doubling_rows(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _served_curves(
    data: dict[str, Any], decode: Curve, row_ms_per_key: float | None
) -> tuple[Curve | None, Curve | None, Curve | None, float | None]:
    """(the served b-row steps' excess over the profile's, at the served probe's context, which is
    longer than the decode probe's; the clients' TPOT beyond the served step; the clients' TTFT
    beyond the server's, b first tokens delivered by one step), each less its value at 1 row and
    non-decreasing in b (pooled where a noisy point falls below its neighbour: each served median
    moved by 10-20% between probes), and the 1-row excess; None without the served probe."""
    steps = {int(b): float(ms) for b, ms in (data.get("served_decode_ms") or {}).items()}
    tpots = {int(b): float(ms) for b, ms in (data.get("served_tpot_ms") or {}).items()}
    gaps = {int(b): float(ms) for b, ms in (data.get("served_ttft_gap_ms") or {}).items()}
    per_row_keys = (row_ms_per_key or 0.0) * max(SERVED_PROBE_CONTEXT - DECODE_PROBE_CONTEXT, 0.0)
    excess = {b: ms - decode(b) - b * per_row_keys for b, ms in steps.items()}
    between = {b: tpots[b] - ms for b, ms in steps.items() if b in tpots}
    return _growth(excess), _growth(between), _growth(gaps), excess.get(1)


def _growth(values: dict[int, float]) -> Curve | None:
    """`values` by rows less the 1-row value, non-decreasing; None without the 1-row point."""
    if 1 not in values or len(values) < 2:
        return None
    sizes = sorted(values)
    return Curve(tuple(sizes), tuple(_non_decreasing([values[b] - values[1] for b in sizes])))


def _non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit to `values` (pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for v in values:
        blocks.append((v, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks[-1]
            blocks[-2:] = [((m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2)]
    return [m for m, n in blocks for _ in range(n)]


def _chunk_ms_per_key(data: dict[str, Any], prefill: Curve) -> float | None:
    """The prefill chunks after a cached prefix against the prefill curve: ms per key a chunk
    attends beyond a fresh prompt of its size, the least-squares slope through zero of each probe's
    excess over its keys beyond (never negative; the probe with more keys states it more precisely,
    as in _row_ms_per_key); None without the probe.

    Why: the server's prompt steps price that attention only where the diagnosed run's own steps
    vary in it (calibrate._prompt_fit); a run whose prompts each fit one chunk had none, and the
    later chunks a smaller token budget makes were priced as fresh prompts. On the planted
    prefill_chunks run (chunks of 253 tokens after up to 253 cached, budget 256) those ran 8-27%
    above their price, and the budget what-ifs' ITL p99 came out 11% low (median over thirteen
    verify runs); the engine alone paid 0.5-1.7e-4 ms per key (kvflow/engine/step_profile.py,
    session 38), the served steps 0.8-1.1e-4."""
    at_context = {int(n): float(ms) for n, ms in (data.get("prefill_context_ms") or {}).items()}
    keys = {int(n): float(k) for n, k in (data.get("prefill_context_keys") or {}).items()}
    return _slope_through_zero(
        [(keys[n], ms - prefill(n)) for n, ms in at_context.items() if keys.get(n, 0.0) > 0]
    )


def _row_ms_per_key(data: dict[str, Any], decode: Curve) -> float | None:
    """The decode steps at a long context against the short-context curve: ms per key per row, the
    least-squares slope through zero of each probe's excess over its keys beyond the short probe's
    (never negative); None without the probe.

    A step's noise is a stall of some ms, about the same at 1 row as at 8, and the 8-row probe reads
    8x the keys beyond: it states the slope 8x as precisely, and the fit weights it so. (The median of
    the two per-probe slopes, this fit's predecessor, was their mean: one profile's 1-row probe ran
    at a slow moment, 1.56 ms against 1.16 at the short context, and read 3.6e-3 ms per key where
    its 8-row probe and four other profiles read 0.6-1.3e-4. x 1.9e-3 priced a 4-row step at a
    112-token context 0.8 ms above a short one's, and the planted kv_pool what-if's 4-row steps
    3.4 ms where 2.3-2.5 were measured: its ITL p99 52% high, session 32.)"""
    at_context = {int(b): float(ms) for b, ms in (data.get("decode_context_ms") or {}).items()}
    keys = {int(b): float(k) for b, k in (data.get("decode_context_keys") or {}).items()}
    # (keys beyond the short probe's over all rows, the step's ms beyond the short curve's)
    probes = [
        (b * (keys[b] - DECODE_PROBE_CONTEXT), ms - decode(b))
        for b, ms in at_context.items()
        if b > 0 and keys.get(b, 0.0) > 2 * DECODE_PROBE_CONTEXT  # far enough to measure a slope
    ]
    return _slope_through_zero(probes)


def _slope_through_zero(probes: list[tuple[float, float]]) -> float | None:
    """The least-squares slope through zero of (keys, ms) points, never negative (a probe with more
    keys weighs more); None without a point."""
    if not probes:
        return None
    return max(sum(k * ms for k, ms in probes) / sum(k * k for k, _ in probes), 0.0)


def profile_file(model_dir: str | Path, dtype: str, quantization: str | None) -> Path:
    """Where the profile of this model, machine, dtype and quantization is cached."""
    key = f"{model_key(model_dir)}|{machine_key()}|{dtype}|{quantization}|{PROFILE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return quant_cache_dir().parent / "step-profile" / f"{Path(model_dir).name}-{digest}.json"


def load_profile(model_dir: str | Path, dtype: str, quantization: str | None) -> StepProfile | None:
    """The profile measured earlier for this model, machine, dtype and quantization, or None."""
    try:
        return StepProfile.from_json(json.loads(profile_file(model_dir, dtype, quantization).read_text()))
    except (OSError, ValueError, KeyError):
        return None


def measure_profile(
    model_dir: str | Path, dtype: str, quantization: str | None, max_model_len: int | None
) -> StepProfile | None:
    """Run `kvflow profile-steps` (a subprocess: the doctor imports no torch) and cache it."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    longest = int(config.get("max_position_embeddings") or PROFILE_MAX_TOKENS + 1)
    context = min(max_model_len or longest, longest, PROFILE_MAX_TOKENS + 1)
    engine_flags = [
        "--dtype",
        dtype,
        "--max-model-len",
        str(context),
        "--max-num-seqs",
        str(PROFILE_MAX_NUM_SEQS),
    ]
    if quantization and quantization != "none":
        engine_flags += ["--quantization", quantization]
    command = [sys.executable, "-m", "kvflow.cli", "profile-steps", str(model_dir), *engine_flags]
    command += ["--max-num-batched-tokens", str(max(context - 1, PROFILE_MAX_NUM_SEQS))]
    command += ["--repeats", "1"]
    threads = half_the_cores()
    split = threads < (os.cpu_count() or 1)  # the same probes on half the cores
    # One pass on all the cores, then one on half, PROFILE_PASSES times (module docstring).
    whole, halves = [], []
    for _ in range(PROFILE_PASSES):
        whole.append(_profile_steps(command, None))
        if split:
            halves.append(_profile_steps(command, threads))
    data = median_passes(whole)
    if halves:
        merged = median_passes(halves)
        split_keys = {**SPLIT_KEYS, **SPLIT_CONTEXT_KEYS}
        data.update({split: merged[key] for key, split in split_keys.items() if key in merged})
    try:
        rows = _doubling_rows(PROFILE_MAX_NUM_SEQS)
        served = measure_served_decode(str(model_dir), engine_flags, rows, context)
    except (OSError, RuntimeError, ValueError, httpx.HTTPError) as exc:  # the rest of the profile stands
        logger.warning("the served decode probe failed (%s); the profile has no served steps", exc)
        served = {}
    data.update(served)
    target = profile_file(model_dir, dtype, quantization)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**data, "machine": machine_key(), "dtype": dtype}))
    return StepProfile.from_json(data)

"""`kvflow doctor --verify`: apply each what-if that is a kvflow server setting or a workload change
(prompts cut by a quarter), re-run the same benchmark against a server started with and without it,
and compare predicted with measured, metric by metric.

Both servers are started fresh by the doctor on the same machine, one after the other, with the
engine settings the diagnosed server reported; comparing against a fresh baseline (rather than the
original run) keeps machine drift out of the measured effect. The prediction, made against the
original run, is carried over to the fresh baseline as a ratio (a machine that is 10% slower now
is 10% slower with the change too).

Each fresh baseline is also diagnosed again, and the what-if predicted from it as from the original
run (`rediagnose`, kvflow/doctor/repeated_runs.py: one run is one draw of what the simulator is
fitted to); the median over the repeats is the prediction they state, their range how far one
run's can land.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.doctor.finding import Finding, WhatIf
from kvflow.doctor.offload_tier import TEMPORARY_DIR
from kvflow.doctor.repeated_runs import Rediagnose, change_key, predicted_again
from kvflow.doctor.server_settings import EngineSettings
from kvflow.doctor.verify_pd import DISAGGREGATE, FreshPair
from kvflow.server.spawn import spawn_server, stop_server

# The bar: a measured gain within 25% of the predicted one counts as confirmed.
AGREEMENT_TOLERANCE = 0.25
# Predicted metric name -> how to read the measured value from a bench result.
MEASURED = {
    "ttft_p50_ms": lambda r: r["ttft_ms"]["p50"],
    "ttft_p95_ms": lambda r: r["ttft_ms"]["p95"],
    "itl_p50_ms": lambda r: r["itl_ms"]["p50"],
    "itl_p99_ms": lambda r: r["itl_ms"]["p99"],
    "decode_ms_per_step": lambda r: r["tpot_ms"]["p50"],
    "e2e_p50_ms": lambda r: r["e2e_ms"]["p50"],
}


@dataclass(frozen=True)
class Verification:
    change: str
    metric: str
    baseline: float
    predicted: float
    measured: float
    # Relative spread of the baseline over the repeats, (max - min) / median: the noise a gain is
    # measured against (0 with one repeat: unknown).
    noise: float = 0.0
    # The changed value measured pair by pair: the median over the repeats of (changed / its own
    # baseline's carrying metric), times the carrying metric's median (compare). Each pair ran back to
    # back, so the machine's drift between pairs cancels, where the median of the changed runs
    # alone carries it (this VM's speed moves by a third over minutes). None: not computed.
    paired_measured: float | None = None
    # The prediction's interval from the diagnosed run's own noise (kvflow/doctor/noise.py: the
    # bootstrap over its requests), carried to the fresh baseline as the prediction is; None: the
    # run could not state one.
    interval: tuple[float, float] | None = None
    # The changed runs' own (lowest, highest) over the repeats: how far the value a user reads moves
    # between two runs of the same change (a bursty 16-request TTFT p50 moved 13-21 ms on one VM
    # over four runs, benchmarks/NOTES.md session 34), which a value error cannot be told apart
    # from. None with one repeat.
    measured_range: tuple[float, float] | None = None
    # The ratio the diagnosis's prediction was carried by to get `predicted` (the fresh baselines'
    # carrying metric, median, over the diagnosed run's): 1.0 uncarried. A ratio taken from one
    # diagnosed run and a few baselines holds their noise too (a tail's: ITL p99 moved 94-135 ms
    # over five baselines of one server, benchmarks/NOTES.md session 35).
    carry: float = 1.0
    # The what-if predicted again from each fresh baseline (the doctor re-run on that repeat's
    # benchmark, module docstring), not carried: each is at its own pair's speed, as the changed run
    # beside it. Empty: not re-diagnosed, or no repeat's diagnosis offered the change.
    repeated: tuple[float, ...] = ()

    @property
    def repeated_predicted(self) -> float | None:
        """The median of the repeats' predictions; None without any."""
        return statistics.median(self.repeated) if self.repeated else None

    @property
    def repeated_value_error(self) -> float | None:
        """|repeated_predicted - measured| / measured; None without repeats' predictions."""
        again = self.repeated_predicted
        return None if again is None else _relative_error(again, self.measured)

    @property
    def inside_repeated_range(self) -> bool | None:
        """The measured value between the lowest and highest of the repeats' predictions; None
        with fewer than two."""
        if len(self.repeated) < 2:
            return None
        return min(self.repeated) <= self.measured <= max(self.repeated)

    @property
    def as_diagnosed(self) -> float:
        """The prediction as the diagnosis made it (not carried)."""
        return self.predicted / self.carry if self.carry else self.predicted

    @property
    def uncarried_value_error(self) -> float:
        return _relative_error(self.as_diagnosed, self.measured)

    @property
    def inside_measured_range(self) -> bool | None:
        """The prediction between the lowest and highest changed run; None with one repeat. A value
        error outside it is the model's; inside, the repeats cannot tell it from the machine's."""
        if self.measured_range is None:
            return None
        lo, hi = self.measured_range
        return lo <= self.predicted <= hi

    @property
    def covered(self) -> bool | None:
        """The measured value inside the predicted interval; None without an interval. Over many
        checks, the share covered says whether the intervals are as wide as the errors (they hold
        the diagnosed run's sampling noise, not the machine's drift between runs)."""
        if self.interval is None:
            return None
        lo, hi = self.interval
        return lo <= self.measured <= hi

    @property
    def value_error(self) -> float:
        """|predicted - measured| / measured: the miss on the value a user reads after the change
        (a gain's error hides it: 606 -> 57 ms predicted as 72 is 3% of the gain, 26% of the value)."""
        return _relative_error(self.predicted, self.measured)

    @property
    def paired_value_error(self) -> float | None:
        """|predicted - paired_measured| / paired_measured: the miss with the drift between pairs
        taken out; None without the paired value."""
        if self.paired_measured is None:
            return None
        return _relative_error(self.predicted, self.paired_measured)

    @property
    def predicted_gain(self) -> float:
        return self.baseline - self.predicted

    @property
    def measured_gain(self) -> float:
        return self.baseline - self.measured

    @property
    def within_noise(self) -> bool:
        """Predicted and measured gains both inside the baseline's own spread: the change does not
        show above the noise, and was not predicted to (no verdict either way)."""
        band = self.noise * self.baseline
        return self.noise > 0 and abs(self.predicted_gain) <= band and abs(self.measured_gain) <= band

    @property
    def predicts_no_change(self) -> bool:
        """A predicted value equal to the baseline (to rounding: carried by a ratio, an unchanged
        value comes back a few ulps off, and a ratio of gains against it read 6e13x)."""
        return abs(self.predicted_gain) <= 1e-9 * max(abs(self.baseline), 1.0)

    @property
    def agrees(self) -> bool:
        if self.within_noise:
            return False
        if self.predicts_no_change:
            return abs(self.measured_gain) <= AGREEMENT_TOLERANCE * self.baseline
        return abs(self.measured_gain - self.predicted_gain) <= AGREEMENT_TOLERANCE * abs(self.predicted_gain)

    @property
    def verdict(self) -> str:
        return "within noise" if self.within_noise else ("agrees" if self.agrees else "missed")

    def explain(self) -> str:
        line = (
            f"{self.change}: {self.metric} {self.baseline:,.1f} -> predicted {self.predicted:,.1f}, "
            f"measured {self.measured:,.1f} (gain predicted {self.predicted_gain:,.1f}, "
            f"measured {self.measured_gain:,.1f}; value off by {self.value_error:.0%})"
        )
        if self.noise:
            line += f" [baseline spread over repeats {self.noise:.0%}]"
        paired = self.paired_value_error
        if paired is not None and self.paired_measured is not None:
            line += f" [pair by pair: measured {self.paired_measured:,.1f}, value off by {paired:.0%}]"
        if self.interval is not None:
            (lo, hi), where = self.interval, "inside" if self.covered else "outside"
            line += f" [measured {where} the predicted interval {lo:,.1f}-{hi:,.1f}]"
        if self.measured_range is not None:
            (lo, hi), where = self.measured_range, "inside" if self.inside_measured_range else "outside"
            line += f" [predicted {where} the changed runs' range {lo:,.1f}-{hi:,.1f}]"
        again, again_error = self.repeated_predicted, self.repeated_value_error
        if again is not None and again_error is not None:
            lo, hi = min(self.repeated), max(self.repeated)
            line += (
                f" [predicted again from {len(self.repeated)} fresh baselines: {again:,.1f} "
                f"({lo:,.1f}-{hi:,.1f}), off by {again_error:.0%}]"
            )
        if self.carry != 1.0:
            line += (
                f" [carried x{self.carry:.2f} from the diagnosed run; as diagnosed "
                f"{self.as_diagnosed:,.1f}, off by {self.uncarried_value_error:.0%}]"
            )
        if self.within_noise:
            return line + ": predicted and measured gains are both within the baseline's spread"
        if self.agrees:
            return line + f": within {AGREEMENT_TOLERANCE:.0%} of the prediction"
        if self.predicts_no_change:
            return line + ": predicted to do nothing, but it did"
        ratio = self.measured_gain / self.predicted_gain
        way = "smaller" if ratio < 1 else "larger"
        return line + f": missed, the measured gain is {ratio:.2f}x the predicted one ({way})"


def _relative_error(value: float, measured: float) -> float:
    """|value - measured| / measured (inf when nothing was measured)."""
    return abs(value - measured) / measured if measured else math.inf


def engine_args(settings: EngineSettings, change: dict[str, Any]) -> list[str]:
    """`kvflow serve` flags reproducing the diagnosed server, with `change` applied."""
    values: dict[str, Any] = {
        "enable_prefix_caching": settings.enable_prefix_caching,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_num_seqs": settings.max_num_seqs,
        "num_kv_blocks": settings.num_kv_blocks,
        "block_size": settings.block_size,
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "quantization": settings.quantization,
        **change,
    }
    flags = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):  # BooleanOptionalAction: --flag / --no-flag
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class FreshServer:
    """`kvflow serve MODEL FLAGS` on a free port, benchmarked as often as asked, then stopped."""

    def __init__(self, model_dir: str, flags: list[str]) -> None:
        # A setting that needs a directory of its own (the KV offload tier) gets a fresh one.
        self.tmp = tempfile.TemporaryDirectory() if TEMPORARY_DIR in flags else None
        if self.tmp is not None:
            flags = [self.tmp.name if f == TEMPORARY_DIR else f for f in flags]
        self.process, self.base = spawn_server(model_dir, flags)

    def bench(self, bench: BenchConfig) -> dict[str, Any]:
        config = replace(bench, base_url=self.base + "/v1", model=None, progress=False)
        return run_benchmark(config)

    def stop(self) -> None:
        stop_server(self.process)
        if self.tmp is not None:
            self.tmp.cleanup()


def reseeded(bench: BenchConfig, seed: int) -> BenchConfig:
    """The same benchmark with other prompts of the same lengths (a server that already saw a prompt
    would serve it from its prefix cache): the load's seed salts the token content only
    (kvflow/bench/datasets.py), and in a closed loop nothing else."""
    return replace(bench, load=replace(bench.load, seed=seed))


def with_workload(bench: BenchConfig, workload: dict[str, Any] | None) -> BenchConfig:
    """The benchmark with a what-if's workload change (input_len_scale: every prompt that much)."""
    if not workload:
        return bench
    scale = float(workload.get("input_len_scale", 1.0))
    dataset = replace(bench.dataset, input_len=max(1, round(bench.dataset.input_len * scale)))
    return replace(bench, dataset=dataset)


def bench_config_from_result(result: dict[str, Any]) -> BenchConfig:
    """Re-create the benchmark that produced `result` (its `config` section)."""
    c = result["config"]
    dataset = DatasetSpec(
        name=c["dataset_name"],
        num_requests=c["num_requests"],
        input_len=c["input_len"],
        output_len=c["output_len"],
        range_ratio=c["range_ratio"],
        prefix_len=c["prefix_len"],
        num_turns=c["num_turns"],
        max_model_len=c.get("max_model_len"),
        seed=c["seed"],
    )
    load_seed = int(c.get("load_seed", c.get("seed", 0)))  # older results: one seed for both
    if "concurrency" in c:
        load = LoadSpec(concurrency=int(c["concurrency"]), seed=load_seed)
    else:
        cap = c.get("max_concurrency")
        load = LoadSpec(
            request_rate=float(c["request_rate"]),
            burstiness=float(c.get("burstiness", 1.0)),
            max_concurrency=None if cap is None else int(cap),
            seed=load_seed,
        )
    return BenchConfig(
        base_url=c["base_url"],
        dataset=dataset,
        load=load,
        endpoint=c["endpoint"],
        tokenizer=c.get("tokenizer"),
        slo=c.get("slo") or {},
        warmup=c.get("warmup", 2),
        ignore_eos=c.get("ignore_eos", True),
        temperature=c.get("temperature", 0.0),
        # the run's /metrics scrapes stall its steps: the re-runs scrape as often (older results: the
        # bench's default)
        metrics_interval=float(c.get("metrics_interval", BenchConfig.metrics_interval)),
    )


def verifiable(findings: list[Finding]) -> list[WhatIf]:
    """What-ifs `--verify` can apply and measure, each change once (checks share some)."""
    seen: set[str] = set()
    result = []
    for finding in findings:
        for what_if in finding.what_ifs:
            key = change_key(what_if)
            measurable = any(metric in MEASURED for metric in what_if.predicted)
            if (what_if.setting or what_if.workload) and measurable and key not in seen:
                seen.add(key)
                result.append(what_if)
    return result


def compare(
    what_if: WhatIf,
    original: dict[str, Any],
    pairs: list[tuple[dict[str, Any], dict[str, Any]]],
    again: list[dict[str, float]] | None = None,
) -> list[Verification]:
    """Each predicted metric: the prediction carried from the original run to the fresh baseline
    (as a ratio of the metric it moves with, WhatIf.carried_by: the metric itself unless the
    prediction says otherwise), against what the changed runs measured (medians over the repeated
    pairs); its interval carried with it; beside it the predictions made again from each pair's
    baseline (`again`, one per pair: predicted_again)."""
    checks = []
    for metric, predicted in what_if.predicted.items():
        read = MEASURED.get(metric)
        carry = MEASURED.get(what_if.carried_by.get(metric, metric))
        if read is None or carry is None or read(original) is None:
            continue
        bases = [read(b) for b, _ in pairs if read(b) is not None]
        afters = [read(c) for _, c in pairs if read(c) is not None]
        carriers = [carry(b) for b, _ in pairs if carry(b) is not None]
        if not bases or not afters or not carriers:
            continue
        base, after = statistics.median(bases), statistics.median(afters)
        before, now = carry(original), statistics.median(carriers)
        scale = now / before if before else 1.0
        scaled = predicted * scale
        bounds = what_if.interval.get(metric)
        interval = (bounds[0] * scale, bounds[1] * scale) if bounds else None
        noise = (max(bases) - min(bases)) / base if base and len(bases) > 1 else 0.0
        # Pair by pair: each changed run against its own baseline's carrying metric, the metric the
        # prediction was carried by (not the baseline's own value where that is a noisy tail).
        ratios = [read(c) / carry(b) for b, c in pairs if read(c) is not None and carry(b)]
        paired = now * statistics.median(ratios) if ratios else None
        spread = (min(afters), max(afters)) if len(afters) > 1 else None
        repeated = tuple(p[metric] for p in again or [] if metric in p)
        checks.append(
            Verification(
                what_if.change, metric, base, scaled, after, noise, paired, interval, spread, scale, repeated
            )
        )
    return checks


def kept_run_path(keep_dir: Path, index: int, what_if: WhatIf, repeat: int, role: str) -> Path:
    """Where `verify(keep_dir=...)` keeps one run: the what-if's place in the order and its change
    (letters, digits and dashes), the repeat, and its role (baseline or changed), e.g.
    `2-max-num-batched-tokens-512-128-r0-changed.json`."""
    slug = "".join(c if c.isalnum() else "-" for c in what_if.change).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    keep_dir.mkdir(parents=True, exist_ok=True)
    return keep_dir / f"{index}-{slug[:60].rstrip('-')}-r{repeat}-{role}.json"


def _changed_server(
    model_dir: str, settings: EngineSettings, setting: dict[str, Any] | None
) -> FreshServer | FreshPair | None:
    """The server a setting change runs on: none for a workload change, the disaggregated pair for
    the disaggregation what-if, else one fresh kvflow serve with the setting."""
    if not setting:
        return None
    if setting == {"kv_role": DISAGGREGATE}:
        return FreshPair(model_dir, engine_args(settings, {}))
    return FreshServer(model_dir, engine_args(settings, setting))


def verify(
    model_dir: str,
    settings: EngineSettings,
    findings: list[Finding],
    result: dict[str, Any],
    repeats: int = 1,
    rediagnose: Rediagnose | None = None,
    keep_dir: Path | None = None,
) -> list[Verification]:
    """Apply each verifiable what-if: one fresh baseline server for all of them, one fresh server
    per setting change (workload changes run against the baseline); each repeat benchmarks baseline
    and change back to back with prompts neither server has seen, and predicts the what-if again
    from that baseline (`rediagnose`, repeated_runs.rediagnosis; none without it). With `keep_dir`,
    every run's bench result is written there (kept_run_path), so that a miss can be taken apart."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"--verify starts kvflow serve on {model_dir}: it needs the full checkpoint")
    bench = bench_config_from_result(result)
    what_ifs = verifiable(findings)
    if not what_ifs:
        return []
    checks = []
    first = bench.load.seed + 1
    seeds = iter(range(first, first + repeats * len(what_ifs)))
    baseline = FreshServer(model_dir, engine_args(settings, {}))
    try:
        for index, what_if in enumerate(what_ifs):
            changed = _changed_server(model_dir, settings, what_if.setting)
            try:
                pairs = []
                for repeat in range(repeats):
                    config = reseeded(bench, next(seeds))
                    before = baseline.bench(config)
                    after = (changed or baseline).bench(with_workload(config, what_if.workload))
                    pairs.append((before, after))
                    if keep_dir is not None:
                        for role, run in (("baseline", before), ("changed", after)):
                            path = kept_run_path(keep_dir, index, what_if, repeat, role)
                            path.write_text(json.dumps(run))
            finally:
                if changed is not None:
                    changed.stop()
            # Diagnosed after the servers stop: the doctor's replays take the cores the runs need.
            again = (
                [predicted_again(rediagnose(before), what_if) for before, _ in pairs] if rediagnose else []
            )
            checks += compare(what_if, result, pairs, again)
    finally:
        baseline.stop()
    return checks

"""`--verify`'s arithmetic without servers: medians over repeated pairs, the prediction carried to the
fresh baseline as a ratio, the 25% bar, gains within the noise, and which what-ifs it applies."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, ServerInfo, _config_dict
from kvflow.doctor.finding import Finding, WhatIf
from kvflow.doctor.verify import (
    Verification,
    bench_config_from_result,
    compare,
    kept_run_path,
    reseeded,
    verifiable,
    with_workload,
)


def result(ttft: float) -> dict[str, Any]:
    return {"ttft_ms": {"p50": ttft}}


def test_the_prediction_is_carried_to_the_fresh_baseline_and_compared_on_medians() -> None:
    what_if = WhatIf(
        "max_num_seqs 1 -> 8", "...", {"ttft_p50_ms": 50.0, "not_a_metric": 1.0}, {"max_num_seqs": 8}
    )
    # Original run 200 ms, predicted 50; the fresh baseline is 10% slower: predicted 55 there.
    pairs = [(result(220.0), result(60.0)), (result(230.0), result(70.0)), (result(210.0), result(50.0))]
    [check] = compare(what_if, result(200.0), pairs)
    assert (check.baseline, check.predicted, check.measured) == (220.0, pytest.approx(55.0), 60.0)
    assert check.noise == pytest.approx(20.0 / 220.0)
    assert check.agrees and check.verdict == "agrees"  # gain 160 against 165 predicted
    # Pair by pair: 60 / 220, 70 / 230, 50 / 210 -> the median ratio 60 / 220, at the median baseline.
    assert check.paired_measured == pytest.approx(220.0 * 60.0 / 220.0)
    # The changed runs moved 50-70 ms between repeats: the prediction (55) lies inside that range.
    assert check.measured_range == (50.0, 70.0) and check.inside_measured_range
    assert "inside the changed runs' range 50.0-70.0" in check.explain()
    # Carried x1.1 (220 / 200): as diagnosed, 50 against 60 measured.
    assert check.carry == pytest.approx(1.1)
    assert check.uncarried_value_error == pytest.approx(10.0 / 60.0)
    assert "carried x1.10 from the diagnosed run; as diagnosed 50.0, off by 17%" in check.explain()
    assert "carried" not in Verification("c", "m", 100.0, 40.0, 60.0).explain()  # 1.0: not said
    assert not Verification("c", "m", 100.0, 40.0, 60.0, measured_range=(55.0, 65.0)).inside_measured_range
    assert Verification("c", "m", 100.0, 40.0, 60.0).inside_measured_range is None  # one repeat: unknown


def test_the_what_if_predicted_again_from_each_fresh_baseline() -> None:
    """Each pair's baseline diagnosed again gives the what-if's prediction at that pair's speed (not
    carried); their median is checked against the changed runs' median, their range against the
    measured value. A repeat whose diagnosis did not offer the change (or not that metric) adds none."""
    what_if = WhatIf("max_num_seqs 1 -> 8", "...", {"ttft_p50_ms": 50.0}, {"max_num_seqs": 8})
    pairs = [(result(220.0), result(60.0)), (result(230.0), result(70.0)), (result(210.0), result(50.0))]
    again = [{"ttft_p50_ms": 58.0}, {}, {"ttft_p50_ms": 66.0, "e2e_p50_ms": 1.0}]
    [check] = compare(what_if, result(200.0), pairs, again)
    assert check.repeated == (58.0, 66.0) and check.repeated_predicted == pytest.approx(62.0)
    assert check.repeated_value_error == pytest.approx(2.0 / 60.0)
    assert check.inside_repeated_range  # 60 within 58-66
    assert "predicted again from 2 fresh baselines: 62.0 (58.0-66.0), off by 3%" in check.explain()
    [alone] = compare(what_if, result(200.0), pairs)  # not re-diagnosed
    assert alone.repeated == () and alone.repeated_predicted is None and alone.repeated_value_error is None
    assert alone.inside_repeated_range is None and "predicted again" not in alone.explain()
    [one] = compare(what_if, result(200.0), pairs, [{"ttft_p50_ms": 70.0}, {}, {}])
    assert one.repeated_value_error == pytest.approx(10.0 / 60.0) and one.inside_repeated_range is None


def test_the_predicted_interval_is_carried_with_the_prediction_and_covers_or_not() -> None:
    """A what-if's interval (the diagnosed run's noise, kvflow/doctor/noise.py) moves to the fresh
    baseline by the prediction's own ratio; the check says whether the measured value fell inside."""
    what_if = WhatIf("max_num_seqs 1 -> 8", "...", {"ttft_p50_ms": 50.0}, {"max_num_seqs": 8})
    what_if.interval["ttft_p50_ms"] = [40.0, 60.0]
    pairs = [(result(220.0), result(64.0)), (result(230.0), result(70.0)), (result(210.0), result(60.0))]
    [check] = compare(what_if, result(200.0), pairs)
    assert check.interval == (pytest.approx(44.0), pytest.approx(66.0))  # x 220 / 200
    assert check.measured == 64.0 and check.covered is True
    assert "inside the predicted interval 44.0-66.0" in check.explain()
    [outside] = compare(what_if, result(200.0), [(b, result(80.0)) for b, _ in pairs])
    assert outside.covered is False and "outside" in outside.explain()
    [none] = compare(replace(what_if, interval={}), result(200.0), pairs)
    assert none.interval is None and none.covered is None


def test_pair_by_pair_the_drift_between_pairs_cancels() -> None:
    """The change divides TTFT by 10, as predicted; the machine ran the three pairs at speeds 1, 1.3
    and 1.35 (each pair's baseline and change back to back), and each changed run has its own +-10%.
    The changed runs' median lands on the middle pair's low draw (23.4 against the 26 predicted at
    the median baseline); pair by pair the ratios are 0.11, 0.09 and 0.10, and the prediction holds."""
    what_if = WhatIf("max_num_seqs 1 -> 8", "...", {"ttft_p50_ms": 20.0}, {"max_num_seqs": 8})
    pairs = [(result(200.0), result(22.0)), (result(260.0), result(23.4)), (result(270.0), result(27.0))]
    [check] = compare(what_if, result(200.0), pairs)
    assert check.predicted == pytest.approx(26.0)  # carried to the median baseline, 260
    assert check.measured == 23.4 and check.value_error == pytest.approx(26.0 / 23.4 - 1)
    assert check.paired_measured == pytest.approx(26.0)
    assert check.paired_value_error == pytest.approx(0.0, abs=1e-12)


def test_a_prediction_moving_with_another_metric_is_carried_by_that_metric() -> None:
    """The kv_pool what-if's ITL p99 without the baseline's preemption stalls is the plain gaps' tail:
    predicted from the run's ITL p50, it is carried to the fresh baseline by the ITL p50 too. The
    fresh baseline's p99 (its stalls, 46% spread over three runs) would have doubled it."""

    def itl(p50: float, p99: float) -> dict[str, Any]:
        return {"itl_ms": {"p50": p50, "p99": p99}}

    carried = WhatIf(
        "num_kv_blocks 12 -> 36", "...", {"itl_p99_ms": 8.0}, carried_by={"itl_p99_ms": "itl_p50_ms"}
    )
    pairs = [
        (itl(4.0, 30.0), itl(3.9, 6.0)),
        (itl(4.4, 16.0), itl(4.2, 6.5)),
        (itl(4.2, 21.0), itl(4.0, 5.5)),
    ]
    [check] = compare(carried, itl(4.0, 15.0), pairs)
    assert (check.baseline, check.predicted, check.measured) == (21.0, pytest.approx(8.4), 6.0)
    # Pair by pair too, each changed tail against its own baseline's ITL p50.
    assert check.paired_measured == pytest.approx(4.2 * 6.5 / 4.4)
    [itself] = compare(replace(carried, carried_by={}), itl(4.0, 15.0), pairs)
    assert itself.predicted == pytest.approx(8.0 * 21.0 / 15.0)


def test_the_bar_is_25_percent_of_the_predicted_gain_and_noise_is_no_verdict() -> None:
    assert Verification("c", "m", 100.0, 60.0, 69.0).agrees  # gain 31 against 40: within 10
    assert not Verification("c", "m", 100.0, 60.0, 71.0).agrees  # gain 29: missed
    quiet = Verification("c", "m", 100.0, 97.0, 103.0, noise=0.1)  # both gains inside +-10 ms
    assert quiet.verdict == "within noise" and not quiet.agrees
    assert "both within the baseline's spread" in quiet.explain()
    assert "0.29x" in Verification("c", "m", 100.0, 60.0, 88.4).explain()


def test_repeats_draw_other_prompts_of_the_same_lengths_and_workload_changes_scale_prompts() -> None:
    bench = BenchConfig(
        "http://x/v1", DatasetSpec("random", 8, input_len=400, seed=3), LoadSpec(concurrency=2)
    )
    again = reseeded(bench, 11)
    assert again.dataset == bench.dataset and again.load.seed == 11  # the load's seed salts the content
    assert with_workload(bench, {"input_len_scale": 0.75}).dataset.input_len == 300


def test_a_rerun_is_the_same_benchmark_scraping_metrics_as_often() -> None:
    """A /metrics scrape holds the server's GIL while it renders, stalling a step by ~8 ms on a 2-core
    VM: a diagnosed run scraping every 0.1 s had ITL p99 12 ms where its re-runs at the default 0.5 s
    measured 4, and the what-if's prediction looked 91% off (benchmarks/NOTES.md, session 26)."""
    bench = BenchConfig(
        "http://x/v1",
        DatasetSpec("random", 12, input_len=48, output_len=64),
        LoadSpec(concurrency=4),
        warmup=1,
        metrics_interval=0.1,
    )
    result = {"config": _config_dict(bench, ServerInfo("m", None, None))}
    rerun = bench_config_from_result(result)
    assert rerun.metrics_interval == 0.1
    assert (rerun.dataset, rerun.load, rerun.warmup) == (bench.dataset, bench.load, bench.warmup)
    del result["config"]["metrics_interval"]  # a result from an older bench: the default
    assert bench_config_from_result(result).metrics_interval == BenchConfig.metrics_interval


def test_each_change_is_applied_once() -> None:
    same = {"max_num_batched_tokens": 256}
    findings = [
        Finding(2, "ttft", "t", "warning", "s", "c", what_ifs=[WhatIf("a", "e", {"ttft_p50_ms": 1.0}, same)]),
        Finding(3, "itl", "t", "warning", "s", "c", what_ifs=[
            WhatIf("a", "e", {"itl_p99_ms": 1.0}, same),
            WhatIf("cut", "e", {"ttft_p50_ms": 1.0}, workload={"input_len_scale": 0.75}),
            WhatIf("fp8 KV", "e", {"max_concurrency_at_p95": 9.0}),  # nothing --verify can apply
        ]),
    ]  # fmt: skip
    assert [w.change for w in verifiable(findings)] == ["a", "cut"]


def test_a_rerun_keeps_the_datasets_and_the_loads_seeds_apart() -> None:
    """The dataset's seed (the lengths and the content) and the load's (a salt of the content, and
    open-loop arrival times) are both recorded: one `seed` key had held whichever came last, and an
    open-loop re-run dropped its load's seed and cap on conversations in flight."""
    dataset = DatasetSpec("random", 12, input_len=48, output_len=64, range_ratio=0.5, seed=3)
    for load in (
        LoadSpec(concurrency=4, seed=11),
        LoadSpec(request_rate=2.0, burstiness=0.5, max_concurrency=3, seed=11),
    ):
        bench = BenchConfig("http://x/v1", dataset, load)
        rerun = bench_config_from_result({"config": _config_dict(bench, ServerInfo("m", None, None))})
        assert (rerun.dataset, rerun.load) == (dataset, load)
    older = {
        "config": _config_dict(
            BenchConfig("http://x/v1", dataset, LoadSpec(concurrency=4)), ServerInfo("m", None, None)
        )
    }
    older["config"].pop("load_seed")
    older["config"]["seed"] = 5  # a result from before: one seed for both, as the CLI gives
    rerun = bench_config_from_result(older)
    assert rerun.dataset.seed == 5 and rerun.load.seed == 5


def test_a_prediction_of_no_change_carried_by_a_ratio_is_still_no_change() -> None:
    """Carried to the fresh baseline by a ratio, an unchanged value comes back a few ulps off: it is
    still a prediction of no change (the report had read a measured gain 6e13x the predicted one)."""
    check = Verification("c", "itl_p99_ms", 11.4, 11.4 * (1 + 1e-15), 16.9)
    assert check.predicts_no_change and not check.agrees
    assert check.explain().endswith("predicted to do nothing, but it did")


def test_kept_runs_are_named_by_order_change_repeat_and_role(tmp_path: Path) -> None:
    """verify(keep_dir=...) writes each run where its what-if, repeat and role can be read off the
    name (a directory made on first use); two what-ifs with one change text stay apart by order."""
    what_if = WhatIf(
        "max_num_batched_tokens 512 -> 128", "...", {"itl_p99_ms": 40.0}, {"max_num_batched_tokens": 128}
    )
    path = kept_run_path(tmp_path / "prefill_chunks", 2, what_if, 0, "changed")
    assert path == tmp_path / "prefill_chunks" / "2-max-num-batched-tokens-512-128-r0-changed.json"
    assert path.parent.is_dir()
    split = WhatIf("disaggregate: a prefill and a decode instance (kv_role), half the cores each", "...")
    name = kept_run_path(tmp_path, 4, split, 3, "baseline").name
    assert name.startswith("4-disaggregate-a-prefill-and-a-decode-instance-kv-role") and name.endswith(
        "-r3-baseline.json"
    )
    assert "--" not in name and len(name) <= len("4-") + 60 + len("-r3-baseline.json")

"""How precisely one benchmark run states each latency metric, and which what-ifs predict less than
that.

A run's p50 TTFT is a statistic of its N requests: rerunning the same load draws N others. The
doctor estimates that spread from the run itself, by the bootstrap: resample the requests with
replacement BOOTSTRAP_RESAMPLES times (fewer for very large runs: BOOTSTRAP_WORK; seeded, so the
same run gives the same interval), recompute the metric each time, and take the central
NOISE_COVERAGE of the values, [lo, hi]. Its relative
half-width h = (hi - lo) / 2 / value is the run's noise on that metric (a tail metric, p99 ITL, is
noisier than a median: fewer samples decide it).

    interval of a prediction   predicted x (1 - h), predicted x (1 + h) (never below 0), h the run's
                               relative noise on the metric the prediction was carried by
                               (WhatIf.carried_by: the metric itself unless it says otherwise): the
                               noise that entered it, carried to the value after the change;
                               widened to where one run of the change lands, when the simulator
                               says (WhatIf.sampling_range: the central 90% of its replays, each
                               the run's size), the noise of the run that will measure it
    within noise               |predicted - baseline| <= h x baseline for every latency metric the
                               what-if predicts: a rerun of the same load could show as much change
                               as the prediction. Such what-ifs are not offered as fixes: the
                               finding lists them in its evidence (`what_ifs_within_noise`).

The bootstrap sees the variation between requests, not the machine drifting between runs (this VM's
bandwidth moved 25-46 GB/s between days); `--verify` measures that directly, from the baseline
repeated beside each change (3 pairs by default), and states its error against that spread.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvflow.bench.metrics import percentile
from kvflow.doctor.evidence import RequestSample, RunEvidence
from kvflow.doctor.finding import Finding, WhatIf

BOOTSTRAP_RESAMPLES = 200
# The bootstrap's cost is resamples x values (ITL: every gap of every request). Past this many value
# sorts it takes fewer resamples (never under MIN_RESAMPLES: the 90% interval's ends need a few
# dozen); past MAX_VALUES a run states its metric far more precisely than any what-if moves it, and
# it is not bootstrapped (measured: 100k gaps x 200 resamples took 2.45 s in pure Python).
BOOTSTRAP_WORK = 4_000_000
MIN_RESAMPLES = 40
MAX_VALUES = 1_000_000
NOISE_COVERAGE = 0.9  # the central 90% of the resampled values
BOOTSTRAP_SEED = 0


def _ttft(q: float) -> Callable[[Sequence[RequestSample]], float | None]:
    return lambda rs: _pct([r.ttft_ms for r in rs if r.ttft_ms is not None], q)


def _itl(q: float) -> Callable[[Sequence[RequestSample]], float | None]:
    return lambda rs: _pct([g for r in rs for g in r.itl_ms], q)


def _tpot_p50(rs: Sequence[RequestSample]) -> float | None:
    return _pct([r.tpot_ms for r in rs if r.tpot_ms is not None], 50)


def _e2e_p50(rs: Sequence[RequestSample]) -> float | None:
    return _pct([r.e2e_ms for r in rs if r.e2e_ms is not None], 50)


# The latency metrics what-ifs predict, as functions of a sample of requests (kvflow bench's
# definitions: TTFT and e2e per request, ITL over every gap, decode_ms_per_step = TPOT p50).
METRICS: dict[str, Callable[[Sequence[RequestSample]], float | None]] = {
    "ttft_p50_ms": _ttft(50),
    "ttft_p95_ms": _ttft(95),
    "itl_p99_ms": _itl(99),
    "itl_p50_ms": _itl(50),  # what some tails are carried by (the kv_pool what-if's: calibrate.py)
    "decode_ms_per_step": _tpot_p50,
    "e2e_p50_ms": _e2e_p50,
}


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def relative_noise(run: RunEvidence, metric: str) -> float | None:
    """h for `metric` on this run (module docstring), or None when the run cannot say (no requests
    with the metric, or a metric this module does not know)."""
    fn = METRICS.get(metric)
    requests = run.requests
    if fn is None or not requests:
        return None
    value = fn(requests)
    size = sum(len(r.itl_ms) for r in requests) if metric.startswith("itl") else len(requests)
    if not value or size > MAX_VALUES:
        return None
    resamples = max(MIN_RESAMPLES, min(BOOTSTRAP_RESAMPLES, BOOTSTRAP_WORK // max(size, 1)))
    rng = random.Random(BOOTSTRAP_SEED)
    draws = sorted(
        v for v in (fn([rng.choice(requests) for _ in requests]) for _ in range(resamples)) if v is not None
    )
    if not draws:
        return None
    tail = (1.0 - NOISE_COVERAGE) / 2
    lo, hi = percentile(draws, 100 * tail), percentile(draws, 100 * (1 - tail))
    return (hi - lo) / 2 / value


def hold_back_noise(run: RunEvidence, findings: list[Finding]) -> None:
    """Give every latency prediction its interval; move what-ifs whose every latency prediction is
    within the run's noise out of `what_ifs` into the finding's evidence (module docstring)."""
    noise = _Noise(run)
    for finding in findings:
        offered, held = [], []
        for what_if in finding.what_ifs:
            if _within_noise(run, what_if, noise):
                held.append(what_if)
            else:
                offered.append(what_if)
        finding.what_ifs = offered
        if held:
            finding.evidence["what_ifs_within_noise"] = [
                {"change": w.change, "predicted": w.predicted, "interval": w.interval} for w in held
            ]


class _Noise(dict[str, float | None]):
    """relative_noise of `run` per metric, each bootstrapped once and only when a what-if asks for it
    (an ITL bootstrap resamples every gap: 2.45 s at 100k gaps)."""

    def __init__(self, run: RunEvidence) -> None:
        super().__init__()
        self.run = run

    def __missing__(self, metric: str) -> float | None:
        self[metric] = value = relative_noise(self.run, metric)
        return value


def _within_noise(run: RunEvidence, what_if: WhatIf, noise: _Noise) -> bool:
    latency = {m: v for m, v in what_if.predicted.items() if m in METRICS}
    verdicts = []
    for metric, predicted in latency.items():
        # The interval: the noise of what the prediction was scaled by. A tail carried by the plain
        # gaps' ratio (the kv_pool what-if's ITL p99, once its preemption stalls are gone) had taken
        # the baseline tail's own h, 4.2 there: -15 to 25 ms around 4.7 (session 29).
        carrier = noise[what_if.carried_by.get(metric, metric)]
        low, high = (1.0 - carrier, 1.0 + carrier) if carrier is not None else (None, None)
        if (spread := what_if.sampling_range.get(metric)) is not None:
            # Where one run of the change lands (the simulator's replays): as wide at least.
            low = spread[0] if low is None else min(low, spread[0])
            high = spread[1] if high is None else max(high, spread[1])
        if low is not None and high is not None:
            what_if.interval[metric] = [max(predicted * low, 0.0), predicted * high]
        h, base = noise[metric], run.metric(metric)
        if h is None or base is None:
            continue
        verdicts.append(abs(predicted - base) <= h * base)
    # Only a what-if that predicts latency alone, all of it inside the noise, is held back.
    return bool(verdicts) and all(verdicts) and len(latency) == len(what_if.predicted)

"""Fit the step cost (kvflow/doctor/step_cost.py) to a kvflow server's measured step times by kind,
and predict a setting's effect as the difference of two simulated runs.

The server reports each kind's step count and mean time (decode_only, mixed, prefill_only) but not
what the steps held; the simulator of the measured settings says that (mean decode rows, prefill
tokens and attention work per kind). Then each kind's measured mean is one equation

    mean_k = fixed + per_token x (rows_k + work_k)

solved for the two coefficients (least squares, weighted by step counts). Simulate again with the
fitted costs, refit, a few times: the composition depends on the costs (long steps gather more
arrivals).

With the server's step records, each simulated step also draws a recorded step's departure from
its fitted cost (step_residuals): the tails (ITL p99) are made of the few long steps a mean hides.
With a measured step profile, the records' decode-only steps first say how much slower the machine
ran them than the profile's served steps took when it was measured (profile_speed), and the whole
profile is scaled by that before the per-kind extras are fitted to it.

Predictions scale the simulated change onto the measurement: the client's number is the server's
plus a delivery offset (client minus server TTFT, for TTFT and E2E), and the server's is the
simulated one times a factor the baseline fixes (what the simulator leaves out, per-step work
outside the step timer, grows with the steps): predicted = (simulated with the change) x
(measured - offset) / (simulated now) + offset. A closed loop's TTFT also puts each client's first
request's own extra on it, in both runs (Calibration.first_wave_ms).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from kvflow.bench.metrics import percentile
from kvflow.doctor.arrival_stalls import RECORD_KEYS, flagged_records
from kvflow.doctor.evidence import RequestSample, RunEvidence
from kvflow.doctor.kv_kinds import DEFAULT_BLOCK_SIZE, prefix_hit_granularity
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.noise import NOISE_COVERAGE
from kvflow.doctor.prompt_stalls import destalled_ms, prompt_arrival_stall
from kvflow.doctor.server_settings import EngineSettings
from kvflow.doctor.simulate import KINDS, SimRun, SimSettings, pooled, simulate
from kvflow.doctor.step_cost import (
    MIN_STEP_MS,
    MIN_STEP_RECORDS,
    StepCost,
    StepResiduals,
    StepShape,
    profiled_step,
)
from kvflow.doctor.step_profile import StepProfile
from kvflow.kv_cache.kv_cache_config import KVCacheConfig
from kvflow.kv_cache.specs import KVCacheSpec

FIT_ROUNDS = 4
SHAPE_SPREAD = 0.2  # prompt steps whose profiled times span less than this share: a factor only
# Prompt fits whose weighted errors differ by less than this share are a tie: the earlier in
# PROMPT_FITS is kept (two fits that both pass through the steps' means).
TIE = 1e-6
# Predictions pool replays (other seeds of the residual and client-gap draws) up to this many gaps:
# one client's 90 gaps made the planted long_prompt run's simulated ITL p99 its single largest draw,
# and a budget what-if moved it 13.7 -> 20.1 ms with nothing but the draws changed (session 26).
# A replay's tail is also one draw of which requests' prompts land in one step (clients returning
# together): with 2,000 gaps (~20 above the p99) the prediction itself moved between blocks of seeds
# by 0.61-0.85x (prefill_chunks' budget 512 -> 256) and 0.90-1.35x (512 -> 1024: offered as making ITL
# p99 35% worse where 64 replays say 5%, and 0-10% was measured); with 10,000 (~100 above it),
# 0.69-0.74x and 1.01-1.11x (session 32). A replay of 12 requests costs ~15 ms.
MIN_POOLED_GAPS = 10_000
# A replay range (Calibration.replay_range) is stated over at least this many replays: the central
# 90% of fewer is their extremes.
MIN_REPLAYS_FOR_RANGE = 5
MAX_REPLICAS = 32
TOKEN_KINDS = ("full_attention", "mla")  # kinds whose blocks hold every token of a request


def attention_ratio(model: ModelSpec) -> float:
    """Attention FLOPs per (query token x key) over linear FLOPs per token. Only layers that read
    keys count (a sliding layer as if its window held the whole context: the step cost has one
    attention term); a linear-attention layer's fixed cost per token is in the fitted per-token one."""
    per_key = model.attention_flops_per_key()  # latent attention's dims for MLA
    return per_key / max(2.0 * model.active_layer_params, 1.0)  # MoE: the experts a token runs


def sim_groups(config: KVCacheConfig) -> tuple[tuple[KVCacheSpec, ...], bool]:
    """(the groups besides the first full-attention one, whether there is one)."""
    specs = [g.spec for g in config.groups]
    token = next((i for i, spec in enumerate(specs) if spec.kind in TOKEN_KINDS), None)
    return tuple(spec for i, spec in enumerate(specs) if i != token), token is not None


def sim_settings(
    settings: EngineSettings, model: ModelSpec | None = None, kv_dtype: str | None = None
) -> SimSettings | None:
    """The simulator's view of a kvflow server's settings (None when they are not known); with the
    model, its cache groups (kvflow/doctor/kv_kinds.py) at the server's block size and KV dtype."""
    if (
        settings.server != "kvflow"
        or settings.max_num_batched_tokens is None
        or settings.max_num_seqs is None
    ):
        return None
    block_size = settings.block_size or DEFAULT_BLOCK_SIZE
    caching = bool(settings.enable_prefix_caching)
    others: tuple[KVCacheSpec, ...] = ()
    token_group, step = True, block_size
    if model is not None:
        others, token_group = sim_groups(model.kv_cache_config(kv_dtype, block_size, caching))
        # With caching on: the what-if that turns it on keeps these settings.
        step = prefix_hit_granularity(model.kv_cache_config(kv_dtype, block_size, True))
    return SimSettings(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        num_kv_blocks=settings.num_kv_blocks,
        block_size=block_size,
        enable_prefix_caching=caching,
        other_groups=others,
        token_group=token_group,
        hit_granularity=step,
    )


# A pivot below this share of its column's largest entry marks the system singular: with columns
# scaled to unit size (_least_squares) a design whose columns are dependent (a prompt fit over two
# clusters of steps, three unknowns) leaves a pivot of rounding size, ~1e-16, where an absolute
# threshold let a solution through that was the rounding's choice among infinitely many.
SINGULAR_PIVOT = 1e-9


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular (a pivot under SINGULAR_PIVOT
    of the largest entry in its column before elimination)."""
    n = len(rhs)
    m = [[*r, v] for r, v in zip(rows, rhs, strict=True)]
    scale = [max((abs(r[col]) for r in rows), default=0.0) for col in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        if scale[col] == 0.0 or abs(m[pivot][col]) <= SINGULAR_PIVOT * scale[col]:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(n):
            if i != col:
                f = m[i][col] / m[col][col]
                m[i] = [x - f * y for x, y in zip(m[i], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _least_squares(
    design: list[list[float]], target: list[float], weights: list[float]
) -> list[float] | None:
    """argmin sum w (design . x - target)^2 through the normal equations, each column scaled to
    its largest entry first (a step's ms and its keys differ by five orders of magnitude); None when
    the columns cannot be told apart."""
    k = len(design[0])
    norms = [max(abs(r[i]) for r in design) for i in range(k)]
    if min(norms) == 0.0:
        return None
    scaled = [[r[i] / norms[i] for i in range(k)] for r in design]
    ata = [
        [sum(w * r[i] * r[j] for r, w in zip(scaled, weights, strict=True)) for j in range(k)]
        for i in range(k)
    ]
    atb = [sum(w * r[i] * t for r, t, w in zip(scaled, target, weights, strict=True)) for i in range(k)]
    solved = _solve(ata, atb)
    return None if solved is None else [x / norms[i] for i, x in enumerate(solved)]


def fit(measured: dict[str, tuple[float, float]], run: SimRun, ratio: float) -> StepCost | None:
    """fixed and per_token from the measured (count, mean ms) per kind and the simulated
    composition (least squares weighted by step counts; one kind: every step costs its mean)."""
    design, target, weights = [], [], []
    for kind in KINDS:
        count, mean = measured.get(kind, (0.0, 0.0))
        stats = run.kinds[kind]
        if not count or not stats.count:
            continue
        tokens = stats.rows + stats.prefill_tokens + ratio * stats.attention
        design.append([1.0, tokens / stats.count])
        target.append(mean)
        weights.append(count**0.5)
    if not target:
        return None
    solved = _least_squares(design, target, weights) if len(target) >= 2 else None
    if solved is not None and min(solved) >= 0:
        return StepCost(solved[0], solved[1], ratio)
    return StepCost(min(target), 0.0, ratio)  # too little to separate: steps cost their floor


@dataclass(frozen=True)
class Calibration:
    cost: StepCost
    settings: SimSettings
    baseline: SimRun  # one replay (seed 0): what the fit and the fidelity tables read
    concurrency: int | None
    evidence: RunEvidence
    client_gap_ms: float
    # The run's decode steps over the step profile's (profile_speed): the profile was scaled by it.
    profile_speed: float | None = None

    @cached_property
    def replicas(self) -> int:
        """Replays pooled per prediction: enough for MIN_POOLED_GAPS gaps (a p99 over fewer is a few
        draws of the step residuals), at most MAX_REPLICAS (a large run's tail is already many)."""
        return max(1, min(MAX_REPLICAS, math.ceil(MIN_POOLED_GAPS / max(len(self.baseline.itl_ms), 1))))

    @cached_property
    def pooled_baseline(self) -> SimRun:
        """The baseline pooled as the changed runs are (what predictions divide by)."""
        return self.run()

    def run(self, **change: object) -> SimRun:
        """The same requests under `change` (SimSettings fields), or with `prompt_scale` applied:
        `replicas` replays pooled."""
        scale = float(change.pop("prompt_scale", 1.0))  # type: ignore[arg-type]
        settings = replace(self.settings, **change)  # type: ignore[arg-type]
        samples = self.evidence.requests
        if scale != 1.0:
            samples = [
                replace(
                    s,
                    prompt_tokens=max(1, round(s.prompt_tokens * scale)),
                    shared_prefix_tokens=min(s.shared_prefix_tokens, round(s.prompt_tokens * scale)),
                )
                for s in samples
            ]
        return self.replays(samples, settings)

    def replays(
        self,
        samples: list[RequestSample],
        settings: SimSettings,
        cost: StepCost | None = None,
        client_gap_ms: float | None = None,
        after_ms: list[float] | None = None,
        replicas: int | None = None,
    ) -> SimRun:
        """`samples` replayed `replicas` times (default: Calibration.replicas) under other seeds and
        pooled, with the run's clients (their concurrency, uneven returns and handoffs); the
        calibrated cost and client gap unless given (an instance of a split machine:
        kvflow/doctor/disaggregation.py)."""
        cost = self.cost if cost is None else cost
        gap = self.client_gap_ms if client_gap_ms is None else client_gap_ms
        jitter, handoff = self.evidence.client_gap_jitter_ms, self.evidence.handoff_ms
        runs = [
            simulate(
                samples,
                settings,
                cost,
                self.concurrency,
                gap,
                seed,
                after_ms,
                gap_jitter_ms=jitter,
                handoff_ms=handoff,
            )
            for seed in range(self.replicas if replicas is None else replicas)
        ]
        return pooled(runs)

    @cached_property
    def first_wave_ms(self) -> float:
        """What each client's first request paid beyond its later ones that the replays do not
        have: the client gap (client minus server TTFT) of the run's first requests whose first
        token came alone (evidence.first_alone) less its returning requests' gap, less what the
        replays add to c first tokens in one step (StepCost.delivery_ms at the run's concurrency c:
        the served probe's growth from the returning requests' delivery, and its c clients arrived
        together as the first wave did); 0 outside a closed loop of two clients or more, or without
        two such first requests.

        Why: on the planted max_num_seqs scenario's 8-slot change the first wave's clients read
        their first tokens 10.7-13.2 ms after the server sent them, the later waves' 7.2-9.7
        (sessions 36-38), and its TTFT p50 came out 10-23% low in eleven verify runs without this.
        The 1-slot run it is diagnosed on sends each first token alone; of its 7.2-9.6 ms, 2.6-5.3
        are left once the probe's growth is taken off (the whole gap, session 37, put the change 19%
        high). A first wave whose first tokens came together paid for its steps too (kv_pool's starved
        pool preempting right after them: 9-23 ms, where its change's first waves paid 4-8): no first
        request of it counts."""
        ev, clients = self.evidence, self.concurrency or 0
        first, returning = ev.client_first_alone_gap_ms, ev.client_return_gap_ms
        if clients < 2 or first is None or returning is None:
            return 0.0
        return max(first - returning - self.cost.delivery_ms(clients), 0.0)

    def read(self, metric: str, run: SimRun) -> float:
        """`metric` (a key of SIM_METRICS) of a replay of this run's requests: a TTFT with each
        client's first request's first_wave_ms on it."""
        extra, clients = self.first_wave_ms, self.concurrency or 0
        if metric.startswith("ttft") and extra > 0 and run.ttft_request:
            ttft = [
                t + extra if i < clients else t for t, i in zip(run.ttft_ms, run.ttft_request, strict=True)
            ]
            run = replace(run, ttft_ms=ttft)
        return SIM_METRICS[metric](run)

    def replay_range(self, metric: str, changed: SimRun) -> tuple[float, float] | None:
        """How far one run of the change lands around the pooled prediction, as factors of it: the
        central NOISE_COVERAGE (as the run's own noise, kvflow/doctor/noise.py) of `metric` over
        the pooled replays, each the run's own size (its clients' order, the residuals drawn); None
        with fewer than MIN_REPLAYS_FOR_RANGE replays or no value. A tail on the edge of a step
        kind moves most: the planted kv_pool change's ITL p99 read 3.1-5.4 ms over 14 replays
        around a pooled 3.8 (session 35), where its five measured runs read 3.7-6.3."""
        center = self.read(metric, changed)
        if len(changed.per_replay) < MIN_REPLAYS_FOR_RANGE or center <= 0:
            return None
        values = sorted(self.read(metric, r) for r in changed.per_replay)
        tail = 100 * (1.0 - NOISE_COVERAGE) / 2
        return percentile(values, tail) / center, percentile(values, 100 - tail) / center

    def carried_by(self, metric: str, changed: SimRun) -> str:
        """The measured metric whose simulated-to-measured ratio carries `metric` to the change:
        itself, except a tail the change rids of the baseline's preemption stalls. Those the
        simulator makes 1.7-2x longer than measured on the planted kv_pool run, and their ratio
        would scale a tail without any (predicted 1.9 ms, measured 5.0): the plain decode gaps'
        ratio (ITL p50) carries it instead."""
        preemption_gone = bool(self.pooled_baseline.num_preemptions) and not changed.num_preemptions
        plain_gaps = metric == "itl_p99_ms" and preemption_gone and self.evidence.itl_p50_ms
        return "itl_p50_ms" if plain_gaps else metric

    def predict(self, metric: str, measured: float, changed: SimRun) -> float:
        """`measured` carried to the change (see the module docstring); `metric` a key of SIM_METRICS."""
        baseline = self.pooled_baseline
        now, then = self.read(metric, baseline), self.read(metric, changed)
        if (by := self.carried_by(metric, changed)) != metric and self.evidence.itl_p50_ms:
            now, measured = SIM_METRICS[by](baseline), self.evidence.itl_p50_ms  # by is itl_p50_ms
        offset = self.client_gap_ms if metric.startswith(("ttft", "e2e")) else 0.0
        offset = min(offset, measured)
        if now <= 0:
            return max(measured - (now - then), 0.0)
        return max(then * (measured - offset) / now + offset, 0.0)

    def fit_report(self) -> dict[str, float | None]:
        """How well the simulated baseline reproduces the measured run (evidence, not a gate)."""
        run, ev = self.baseline, self.evidence
        return {
            "ttft_p50_ms_simulated": SIM_METRICS["ttft_p50_ms"](run),
            "ttft_p50_ms_server": (ev.server.get("ttft_ms") or {}).get("p50"),
            "preemptions_simulated": float(run.num_preemptions),
            "preemptions_server": ev.preemptions,
            "step_fixed_ms": self.cost.fixed_ms,
            "step_per_token_ms": self.cost.per_token_ms,
            "step_overhead_ms": self.cost.overhead_ms,
            "profile_speed": self.profile_speed,
            "first_wave_ms": self.first_wave_ms,
        }


def _p(values: list[float], q: float) -> float:
    return percentile(values, q) if values else 0.0


SIM_METRICS: dict[str, Callable[[SimRun], float]] = {
    "ttft_p50_ms": lambda r: _p(r.ttft_ms, 50),
    "ttft_p95_ms": lambda r: _p(r.ttft_ms, 95),
    "itl_p99_ms": lambda r: _p(r.itl_ms, 99),
    "itl_p50_ms": lambda r: _p(r.itl_ms, 50),
    "decode_ms_per_step": lambda r: _p(r.tpot_ms, 50),
    "e2e_p50_ms": lambda r: _p(r.e2e_ms, 50),
}


def calibrate(
    evidence: RunEvidence,
    settings: EngineSettings,
    model: ModelSpec,
    kv_dtype: str | None = None,
    profile: StepProfile | None = None,
) -> Calibration | None:
    """Fit the step cost to a kvflow run's step times; None without them (other servers, no /metrics).
    With a measured step profile, the cost's shape is the profile's and the fit adds a constant per
    step kind (kvflow/doctor/step_profile.py)."""
    sim = sim_settings(settings, model, kv_dtype)
    steps = evidence.server.get("step_time_ms") or {}
    if sim is None or not steps or not evidence.requests:
        return None
    measured = {kind: (float(v["count"]), float(v["mean"])) for kind, v in steps.items() if v.get("count")}
    ratio = attention_ratio(model)
    floor = min(mean for _, mean in measured.values())
    cost = StepCost(floor, 0.0, ratio)
    concurrency = max(1, round(evidence.concurrency)) if evidence.closed_loop else None
    # Closed loop: between the server's last token of one request and the next request's arrival
    # lie the delivery, the client and the trip back, about what the client adds to TTFT; of a
    # client's requests after its first where known (its first opened the connection: 2-4x the
    # gap; RunEvidence.client_return_gap_ms), which is also what the median request's TTFT holds.
    gap = evidence.client_return_gap_ms
    if gap is None:
        gap = max(float(evidence.server.get("client_minus_server_ttft_ms") or 0.0), 0.0)

    jitter, handoff = evidence.client_gap_jitter_ms, evidence.handoff_ms
    # The tokens the steps delivered with the first tokens that gap was read on (1: a lone client's).
    delivered = evidence.client_return_delivered or 1.0

    def replay(cost: StepCost) -> SimRun:
        return simulate(
            evidence.requests, sim, cost, concurrency, gap, gap_jitter_ms=jitter, handoff_ms=handoff
        )

    run = replay(cost)
    for _ in range(FIT_ROUNDS):
        fitted = fit(measured, run, ratio)
        if fitted is None:
            return None
        cost = replace(fitted, overhead_ms=_overhead_ms(evidence, run, cost.overhead_ms))
        run = replay(cost)
    recorded, arrivals = _step_records(evidence)
    speed = profile_speed(profile, recorded) if profile is not None else None
    if profile is not None and speed is not None:
        profile = profile.scaled(speed)
    stall = prompt_arrival_stall(recorded, arrivals, profile)
    if profile is not None:
        records = _record_fit(profile, recorded, arrivals, stall)
        for _ in range(FIT_ROUNDS):
            extras, per_key = _kind_extras(measured, run, profile, records)
            cost = replace(
                cost,
                profile=profile,
                kind_extra_ms=extras,
                attention_ms_per_key=per_key,
                client_gap_ms=gap,
                gap_delivered=delivered,
            )
            run = replay(cost)
            cost = replace(cost, overhead_ms=_overhead_ms(evidence, run, cost.overhead_ms))
            run = replay(cost)
    residuals = step_residuals(cost, recorded, arrivals, stall)
    if residuals.decode or residuals.prompt or residuals.arrival or residuals.prompt_arrival:
        cost = replace(cost, residuals=residuals)
        run = replay(cost)
        cost = replace(cost, overhead_ms=_overhead_ms(evidence, run, cost.overhead_ms))
        run = replay(cost)
    return Calibration(cost, sim, run, concurrency, evidence, gap, speed)


def profile_speed(profile: StepProfile, steps: list[tuple[float, StepShape]]) -> float | None:
    """How much slower the machine ran the diagnosed run's decode-only steps than the profile says
    the same served steps took when it was measured (median of the ratios; the profile's own
    served step: its engine step, the served 1-row excess and the growth with rows); None without
    the served probe or without MIN_STEP_RECORDS such steps.

    Why: the profile is measured once and cached, and a VM's speed moves by a third over minutes
    (the planted tiny model's 1-row step 1.04 ms in one profile, 1.34 in the next, 2.5 h apart on
    a Zen 2). The fitted per-kind extras absorb the difference at the rows the run had, additively,
    but the growth with rows a what-if adds came from the profile's moment: a profile measured on a
    slow moment put the max_num_seqs what-if's TTFT at 56 ms where 34 were measured (session 27)."""
    base_excess = profile.served_base_excess
    if base_excess is None:
        return None
    ratios = []
    for dur, shape in steps:
        if shape.prompt_tokens or not shape.decode_rows:
            continue
        served = profiled_step(profile, shape)[0] + base_excess + profile.served_growth(shape.rows)
        ratios.append(dur / max(served, MIN_STEP_MS))
    return statistics.median(ratios) if len(ratios) >= MIN_STEP_RECORDS else None


def step_residuals(
    cost: StepCost,
    steps: list[tuple[float, StepShape]],
    arrivals: Sequence[bool] = (),
    prompt_stall_ms: float = 0.0,
) -> StepResiduals:
    """The recorded steps' departures from the fitted cost: decode-only steps' in ms (a stall adds
    the same to any decode step, and decode steps are alike in size), steps with prompt tokens' as a
    fraction of the modelled step (a run's prompt steps span one chunk size to another: a 512-token
    chunk's +-10 ms added to a what-if's 8-token step would be most of it). Decode-only steps during
    which a request arrived (`arrivals[i]` for steps[i]; none flagged when empty: a window without
    the steps' times) are kept apart: their excess over the other decode steps' centre is what an
    arrival stalls the engine (StepResiduals.arrival, kvflow/doctor/arrival_stalls.py). Each kind
    centred on zero so the draws keep the fitted mean; a kind with fewer than MIN_STEP_RECORDS
    records gets none (its steps cost their mean). With fewer than MIN_STEP_RECORDS steps that held
    an arrival, the step profile's served arrival probe stands in for them where it has more (the
    same model and machine, its excesses over the decode steps of their rows:
    StepProfile.served_arrival_stall); else the run's own, however few. A run whose next requests
    arrive while its engine is idle (clients turning around together) or into a starved KV pool
    records few or none, and a what-if can make its clients come back while others decode.
    A step with prompt tokens that held an arrival departs by what it took less `prompt_stall_ms`
    (kvflow/doctor/prompt_stalls.py), which the residuals carry (StepResiduals.prompt_arrival): the
    simulator adds it to a prompt step that holds an arrival, and a drawn fraction must not add it
    a second time."""
    decode: list[float] = []
    prompt: list[float] = []
    stalled: list[float] = []
    flags = list(arrivals) or [False] * len(steps)
    for (dur, shape), held_an_arrival in zip(steps, flags, strict=True):
        modelled = cost.server_ms(shape)
        if shape.prompt_tokens:
            if held_an_arrival:
                floor = profiled_step(cost.profile, shape)[0] if cost.profile is not None else 0.0
                dur = destalled_ms(dur, prompt_stall_ms, floor)
            prompt.append(dur / max(modelled, MIN_STEP_MS) - 1.0)
        else:
            (stalled if held_an_arrival else decode).append(dur - modelled)
    probed = cost.profile.served_arrival_stall if cost.profile is not None else ()
    if len(stalled) >= MIN_STEP_RECORDS or len(probed) < MIN_STEP_RECORDS:
        probed = ()
    if len(decode) < MIN_STEP_RECORDS:
        return StepResiduals(prompt=_centred(prompt), arrival=probed, prompt_arrival=prompt_stall_ms)
    centre = statistics.mean(decode)
    recorded = tuple(max(r - centre, 0.0) for r in stalled)
    decode_departures = tuple(r - centre for r in decode)
    return StepResiduals(decode_departures, _centred(prompt), probed or recorded, prompt_stall_ms)


def _centred(departures: list[float]) -> tuple[float, ...]:
    """`departures` less their mean; none from fewer than MIN_STEP_RECORDS."""
    if len(departures) < MIN_STEP_RECORDS:
        return ()
    mean = statistics.mean(departures)
    return tuple(r - mean for r in departures)


RecordFit = tuple[float | None, tuple[float, float, float] | None]


def _record_fit(
    profile: StepProfile,
    steps: list[tuple[float, StepShape]],
    arrivals: Sequence[bool],
    prompt_stall_ms: float,
) -> RecordFit:
    """From the server's step records, once (they do not change between fit rounds): (added to
    steps of query rows alone, (factor, constant, ms per prefill key beyond the probe) of steps with a
    prefill chunk); None for a kind with fewer than MIN_STEP_RECORDS records. Query rows alone (a
    short prompt chunk's too) are the decode path's step (StepCost.server_ms). A step with a prefill
    chunk during which a request arrived (`arrivals`) is fitted less `prompt_stall_ms`
    (kvflow/doctor/prompt_stalls.py: fitted as they were, the planted kv_pool run's prompt steps
    priced its what-if's at twice what they took)."""
    # (duration, the profiled step, the keys its prefill chunks attended beyond the probe's)
    prompt: list[tuple[float, float, float]] = []
    decode: list[tuple[float, float, float]] = []
    flags = list(arrivals) or [False] * len(steps)
    for (dur, shape), held_an_arrival in zip(steps, flags, strict=True):
        if shape.suffix_only and profile.suffix_ratio is not None:
            continue  # priced off the decode step and the suffix probe (StepCost.server_ms)
        base, beyond = profiled_step(profile, shape)
        served = dur - profile.served_growth(shape.rows)  # what serving more rows added: measured
        if shape.prefill_tokens and held_an_arrival:
            served = destalled_ms(served, prompt_stall_ms, base)
        (decode if shape.decode_path else prompt).append((served, base, beyond))  # as StepCost.server_ms
    prompt_fit = _prompt_fit(prompt) if len(prompt) >= MIN_STEP_RECORDS else None
    per_key = prompt_fit[2] if prompt_fit else 0.0
    decode_add = None
    if len(decode) >= MIN_STEP_RECORDS:
        decode_add = statistics.median(dur - base - per_key * beyond for dur, base, beyond in decode)
    return decode_add, prompt_fit


def _kind_extras(
    measured: dict[str, tuple[float, float]], run: SimRun, profile: StepProfile, records: RecordFit
) -> tuple[tuple[float, float, float], float]:
    """((added to decode-only steps, factor and constant of prompt steps), ms per key attended beyond
    the probes) against the profile's shapes (step_cost.py): what the step records fitted, else from
    the per-kind means at the simulated steps' mean shapes (a prompt kind the run did not measure
    borrows the other's factor; 1 when neither was) with no constant and no attention term."""
    fitted: dict[str, float] = {}
    for kind in KINDS:
        count, mean = measured.get(kind, (0.0, 0.0))
        stats = run.kinds[kind]
        if count and stats.count:
            rows, tokens = stats.rows / stats.count, stats.prefill_tokens / stats.count
            shape = max(profile.shape_ms(round(rows), round(tokens)), 1e-6)
            mean -= profile.served_growth(round(rows))
            fitted[kind] = mean - shape if kind == "decode_only" else mean / shape
    decode_add, prompt_fit = records
    if decode_add is None:
        decode_add = fitted.get("decode_only", 0.0)
    if prompt_fit is None:
        prompt_fit = (fitted.get("mixed", fitted.get("prefill_only", 1.0)), 0.0, 0.0)
    factor, constant, per_key = prompt_fit
    return (decode_add, factor, constant), per_key


# The prompt-step fits _prompt_fit tries, (factor fitted, constant, price per key), first first:
# - all three, where the steps' shapes and keys both vary (chunks of many sizes and contexts);
# - the factor held at 1 (the profile is the compute) and a constant, what the server adds to a
#   prompt step: on the planted tiny model the served prompt steps took 1.5-4 ms more than the
#   engine alone whatever their size (32 tokens 3.2 ms served, 1.8 alone; 160-256 tokens 4.0-6.9
#   served, 2.6-3.3 alone), and a factor fitted to one-prompt steps (3.4) priced the max_num_seqs
#   what-if's eight-prompt steps at 9-12 ms, 4.0-6.9 measured over five runs (session 28);
# - the factor and the attention with no constant: two clusters of shapes (a prompt's first chunk
#   and its second, which attends the first) cannot tell a constant from the attention, and the
#   attention is what makes a later chunk dearer (a constant would charge every short prompt for it);
# - then the factor and a constant, and the constant alone.
PROMPT_FITS = (
    (True, True, True),
    (False, True, True),
    (True, False, True),
    (True, True, False),
    (False, True, False),
)


def _prompt_fit(steps: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares dur = factor x shape + constant + per_key x keys beyond the probe, over the
    prompt steps, in relative terms (weights 1 / the profiled step^2); where the steps cannot fix
    every term (shapes or keys that barely vary, two clusters of shapes, a negative coefficient),
    the best fit of fewer terms (PROMPT_FITS, the earlier on a tie), else the factor alone (the
    mean ratio)."""
    shapes = [s for _, s, _ in steps]
    varied_shape = (max(shapes) - min(shapes)) >= SHAPE_SPREAD * statistics.mean(shapes)
    keys = [k for _, _, k in steps]
    varied_keys = max(keys) > 0 and (max(keys) - min(keys)) >= SHAPE_SPREAD * max(keys)
    durations = [d for d, _, _ in steps]
    # Two shapes of step (a run whose prompts all take two chunks, the second attending the first):
    # any two terms pass through both, and which wins a tie decided what a short chunk pays. A
    # constant charges every short prompt for what the attention makes a later chunk cost: the
    # planted prefix_caching_off run's 512- and 264-token chunks gave factor 1 + 10.8 ms where the
    # served steps ran 7-12% above the profile, and its cached what-if's 8-row step was priced
    # 31.2 ms against 23.6-27.6 measured (TTFT 27-31% high, session 31); where they ran below it the
    # constant came out negative and the factor won. The factor and the attention, whichever way.
    two_shapes = varied_keys and len(set(zip(shapes, keys, strict=True))) <= 2
    # Relative residuals: a prompt step's departures are fractions of it (step_residuals), and with
    # equal weights a run's few big chunks decided what its small ones cost. On the planted
    # prefill_chunks run (chunks of 22-512 tokens) that fit, 0.82 x the profile + 14.5 ms, priced a
    # disaggregated decode instance's 1-16-token last blocks 6-12 ms above the 13-27 measured, its
    # ITL p99 27% high; relative, 1-4 ms above (session 30).
    weights = [1.0 / max(s, MIN_STEP_MS) ** 2 for s in shapes]
    best: tuple[float, tuple[float, float, float]] | None = None
    for fitted_factor, with_constant, with_keys in PROMPT_FITS:
        if (fitted_factor and with_constant and not varied_shape) or (with_keys and not varied_keys):
            continue
        if with_constant and two_shapes:
            continue
        columns = [
            [*([s] if fitted_factor else []), *([1.0] if with_constant else []), *([k] if with_keys else [])]
            for _, s, k in steps
        ]
        # With the factor held at 1 the profile (scaled to the run's speed) is the step's compute,
        # and the rest is what the server adds: the target is the steps' excess over it.
        target = durations if fitted_factor else [d - s for d, s, _ in steps]
        solved = _least_squares(columns, target, weights)
        if solved is None or min(solved) < 0 or (fitted_factor and solved[0] <= 0):
            continue
        terms = iter(solved)
        factor = next(terms) if fitted_factor else 1.0
        constant = next(terms) if with_constant else 0.0
        per_key = next(terms) if with_keys else 0.0
        # A term the full fit priced just below zero (a price per key of -3e-6 ms) is dropped, and of
        # the fits left the one closest to the steps is kept, not the first in the list: the first
        # (the factor held at 1) had put the run's big chunks 8-15% above their measured times where
        # the factor and a constant fitted them within 5%.
        error = sum(
            w * (d - (factor * s + constant + per_key * k)) ** 2
            for (d, s, k), w in zip(steps, weights, strict=True)
        )
        if best is None or error < best[0] * (1.0 - TIE):
            best = (error, (factor, constant, per_key))
    if best is not None:
        return best[1]
    return sum(durations) / max(sum(shapes), 1e-9), 0.0, 0.0


def _step_records(evidence: RunEvidence) -> tuple[list[tuple[float, StepShape]], list[bool]]:
    """The server's recorded steps, (dur_ms, what the step computed) (kvflow/bench/server_steps.py),
    and for each whether a request arrived during it (kvflow/doctor/arrival_stalls.py; empty when
    the window has not the steps' times); none from a result without the attention
    column."""
    flagged = flagged_records(evidence.server)
    if flagged is not None:
        return [(row[0], StepShape.from_record(row)) for row, _ in flagged], [f for _, f in flagged]
    steps = evidence.server.get("steps") or {}
    fields = steps.get("fields") or []
    if fields[:4] != list(RECORD_KEYS[:4]):
        return [], []
    width = 6 if fields[4:6] == list(RECORD_KEYS[4:6]) else 4
    rows = [[float(v) for v in row[:width]] for row in steps.get("rows") or []]
    return [(row[0], StepShape.from_record(row)) for row in rows], []


def _overhead_ms(evidence: RunEvidence, run: SimRun, overhead_now: float) -> float:
    """Time between steps: the client's ITL p50 beyond the simulated one (which has only the
    server's step times), kept when positive; the TPOT p50 where the run has no ITL.

    Why the median gap and not TPOT: the median gap is a plain step's cadence, where a request's
    TPOT also averages in every stall it had (its preemption's wait, the prompt chunks it shared
    steps with), which the simulator replays of its own. Fitted to TPOT, the overhead took up
    whatever those replayed stalls missed, on every step: on the planted kv_pool run (12 blocks, 4
    clients), whose replay preempted 16 times where the server had 8 (the replayed pool one block
    short until session 37, sim_blocks.py), the fit put 0.63 ms between steps where the server's
    window shows 0.08 (median), the simulated ITL p50 23% above the client's; the 36-block what-if,
    carried by that ratio, came out 0.81x (ITL p99 3.4 ms where 4.0-5.3 were measured). On the
    recorded runs (pool right either way) the ITL p50 comes within 3% / 1% (line / profile; 5% / 3%
    fitted to TPOT) and the TTFT p99's median is 4% / 5% (5% / 6%): docs/doctor.md.
    """
    if evidence.itl_p50_ms and run.itl_ms:
        return max(overhead_now + evidence.itl_p50_ms - SIM_METRICS["itl_p50_ms"](run), 0.0)
    if not evidence.tpot_p50_ms or not run.tpot_ms:
        return overhead_now
    return max(overhead_now + evidence.tpot_p50_ms - SIM_METRICS["decode_ms_per_step"](run), 0.0)

"""The doctor's simulator schedules what kvflow's scheduler schedules: the real Scheduler (pure
Python) driven step by step with the same requests, closed loop, next to kvflow/doctor/simulate.py,
must give the same step kinds, preemptions and computed tokens, on random workloads that exercise
chunking, the running cap, preemption and prefix-cache hits of recomputed blocks."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.doctor.calibrate import SIM_METRICS, Calibration, sim_groups
from kvflow.doctor.evidence import RequestSample, calculator_evidence
from kvflow.doctor.simulate import SimSettings, pooled, simulate
from kvflow.doctor.step_cost import StepCost, StepResiduals, StepShape
from kvflow.engine.scheduler import Scheduler
from kvflow.kv_cache.kv_cache_config import KVCacheConfig, build_kv_cache_config
from kvflow.outputs import ModelRunnerOutput
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

COST = StepCost(fixed_ms=1.0, per_token_ms=0.02, attention_ratio=0.0)


def run_real_scheduler(
    samples: list[RequestSample],
    settings: SimSettings,
    concurrency: int,
    kv_cache_config: KVCacheConfig | None = None,
) -> tuple[dict[str, int], int, int]:
    """(step kinds, preemptions, computed tokens) of kvflow's Scheduler on a closed loop (with the
    cache groups of `kv_cache_config`, else one full-attention group)."""
    scheduler = Scheduler(
        SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens),
        CacheConfig(block_size=settings.block_size, enable_prefix_caching=settings.enable_prefix_caching),
        # num_kv_blocks usable blocks and the null block on top, as kvflow/engine/engine.py builds
        # it; "unlimited": blocks for every token of the workload at once.
        settings.num_kv_blocks + 1
        if settings.num_kv_blocks
        else sum(s.prompt_tokens + s.output_tokens for s in samples) // settings.block_size + 64,
        max_model_len=1_000_000,
        kv_cache_config=kv_cache_config,
    )
    rng = random.Random(0)
    requests = [
        Request(str(i), [rng.randrange(10, 500) for _ in range(s.prompt_tokens)],
                SamplingParams(max_tokens=s.output_tokens, ignore_eos=True))
        for i, s in enumerate(samples)
    ]  # fmt: skip
    pending = iter(requests)
    for request in [next(pending) for _ in range(min(concurrency, len(requests)))]:
        scheduler.add_request(request)
    kinds: Counter[str] = Counter()
    preemptions = computed = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        preemptions += len(out.preempted_request_ids)
        computed += out.num_batched_tokens
        rows = sum(1 for s in out.scheduled if s.is_decode)
        tokens = sum(s.num_tokens for s in out.scheduled if not s.is_decode)
        kinds["mixed" if rows and tokens else "prefill_only" if tokens else "decode_only"] += 1
        sampled = {s.request_id: [7] for s in out.scheduled if s.do_sample}
        unfinished = {r.request_id for r in requests if not r.status.is_finished}
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        for request in requests:  # each finished client sends its next request
            if request.request_id in unfinished and request.status.is_finished:
                following = next(pending, None)
                if following is not None:
                    scheduler.add_request(following)
    return dict(kinds), preemptions, computed


@pytest.mark.parametrize("seed", range(24))
def test_the_simulator_schedules_what_kvflow_schedules(seed: int) -> None:
    rng = random.Random(seed)
    samples = [
        RequestSample(rng.randint(5, 300), rng.randint(1, 60), 0, 0.0, None, None)
        for _ in range(rng.randint(5, 20))
    ]
    settings = SimSettings(
        max_num_seqs=rng.choice([1, 2, 4, 64]),
        max_num_batched_tokens=rng.choice([32, 64, 128, 512]),
        num_kv_blocks=rng.choice([None, 30, 60, 200]),
        block_size=16,
        enable_prefix_caching=rng.random() < 0.5,
    )
    concurrency = rng.randint(1, 8)
    run = simulate(samples, settings, COST, concurrency)
    simulated = (
        {k: v.count for k, v in run.kinds.items() if v.count},
        run.num_preemptions,
        run.computed_tokens,
    )
    assert simulated == run_real_scheduler(samples, settings, concurrency)


# Models mixing cache kinds, as layer kinds (kvflow/kv_cache/kv_cache_config.py): each request holds
# blocks in every group, a sliding window's and a state's flat in its length.
MIXED_KINDS = {
    "sliding+full": ("sliding_attention", "full_attention") * 2,
    "linear+full": ("linear_attention",) * 3 + ("full_attention",),
    "sliding only": ("sliding_attention",) * 2,
}
TOKEN_BYTES = 64  # any: the pool is counted in blocks
STATE_PAGES = 3  # a linear-attention state of 3 pages


@pytest.mark.parametrize("kinds", MIXED_KINDS)
@pytest.mark.parametrize("seed", range(8))
def test_the_simulator_holds_the_blocks_of_every_cache_group(kinds: str, seed: int) -> None:
    rng = random.Random(seed)
    samples = [
        RequestSample(rng.randint(5, 300), rng.randint(1, 60), 0, 0.0, None, None)
        for _ in range(rng.randint(5, 20))
    ]
    config = build_kv_cache_config(
        MIXED_KINDS[kinds],
        block_size=16,
        token_bytes=TOKEN_BYTES,
        sliding_window=rng.choice([8, 32, 100]),
        state_bytes=STATE_PAGES * 16 * TOKEN_BYTES,
        enable_prefix_caching=False,  # with it, the simulator's hits after a preemption are approximate
    )
    others, token_group = sim_groups(config)
    settings = SimSettings(
        max_num_seqs=rng.choice([1, 2, 4, 64]),
        max_num_batched_tokens=rng.choice([32, 64, 128, 512]),
        num_kv_blocks=rng.choice([60, 120, 300]),
        block_size=16,
        enable_prefix_caching=False,
        other_groups=others,
        token_group=token_group,
    )
    concurrency = rng.randint(1, 8)
    run = simulate(samples, settings, COST, concurrency)
    simulated = (
        {k: v.count for k, v in run.kinds.items() if v.count},
        run.num_preemptions,
        run.computed_tokens,
    )
    assert simulated == run_real_scheduler(samples, settings, concurrency, config)


def test_gaps_are_charged_to_what_delayed_them() -> None:
    # One long prompt arrives while three requests decode: their gap in that step is the chunk's.
    samples = [RequestSample(8, 40, 0, 0.0, None, None) for _ in range(3)]
    samples.append(RequestSample(400, 2, 0, 0.005, None, None))
    settings = SimSettings(8, 512, None, 16, True)
    run = simulate(samples, settings, COST, concurrency=None)
    assert run.explained_ms["prefill_chunks"] == pytest.approx(3 * 400 * COST.per_token_ms)
    assert run.explained_ms["preemption"] == 0.0
    # A pool too small for all of them: preemptions, and their waits explain the long gaps.
    tight = simulate(samples[:3] * 2, SimSettings(8, 512, 8, 16, False), COST, concurrency=3)
    assert (
        tight.num_preemptions > 0 and tight.explained_ms["preemption"] > tight.explained_ms["prefill_chunks"]
    )


def test_each_client_comes_back_after_its_own_wait_elsewhere() -> None:
    """Closed loop with a per-request wait after the server is done (disaggregation's decode on the
    other instance, kvflow/doctor/disaggregation.py): with one common wait, clients whose prompts
    finished in one step come back together, and every round their prompts share a step again;
    with waits of their own (outputs of different lengths) they fall apart and each prompt has a
    step to itself more often."""
    token_ms = 10.0 / 64
    cost = StepCost(0.0, token_ms, 0.0)  # a step costs its tokens: a 64-token prompt 10 ms
    samples = [RequestSample(64, 1, 0, 0.0, None, None) for _ in range(8)]
    settings = SimSettings(4, 128, None, 16, False)  # both clients' prompts fit one step
    in_step = simulate(samples, settings, cost, concurrency=2, after_ms=[100.0] * 8)
    apart = simulate(samples, settings, cost, concurrency=2, after_ms=[100.0, 160.0] * 4)
    assert in_step.ttft_ms == pytest.approx([128 * token_ms] * 8)  # every round one 128-token step
    assert apart.ttft_ms[:2] == pytest.approx([128 * token_ms] * 2)  # the first round still shares
    assert min(apart.ttft_ms[2:]) == pytest.approx(64 * token_ms)  # then mostly alone
    assert sum(apart.ttft_ms[2:]) < sum(in_step.ttft_ms[2:])
    no_wait = simulate(samples, settings, cost, concurrency=2, after_ms=[0.0] * 8)
    assert no_wait.ttft_ms == simulate(samples, settings, cost, concurrency=2).ttft_ms  # the default


def test_clients_come_back_unevenly_and_in_the_order_they_arrive() -> None:
    """Closed loop, every request alike: with one constant gap the four clients finish in one step and
    return together, so each round's prompts share a prefill step and no decode ever waits on a
    prompt (the kv_pool what-if's ITL p99 predicted 1.9 ms where 5.0 were measured). With the run's
    measured spread of gaps (RunEvidence.client_gap_jitter_ms) they come back apart: prompts land in
    steps with the others' decodes. A client that returns sooner is admitted sooner, whatever the
    order the workload lists its request in."""
    cost = StepCost(0.5, 0.02, 0.0)
    samples = [RequestSample(48, 32, 0, 0.0, None, None) for _ in range(16)]
    settings = SimSettings(4, 512, None, 16, False)
    lockstep = simulate(samples, settings, cost, concurrency=4, client_gap_ms=3.0)
    apart = simulate(
        samples, settings, cost, concurrency=4, client_gap_ms=3.0, gap_jitter_ms=(-2.0, 0.0, 4.0)
    )
    assert lockstep.kinds["mixed"].count == 0 and lockstep.kinds["prefill_only"].count == 4
    assert apart.kinds["mixed"].count > 0
    assert max(apart.itl_ms) > max(lockstep.itl_ms)  # decodes wait on others' prompts
    assert apart.num_requests == lockstep.num_requests == 16
    again = simulate(
        samples, settings, cost, concurrency=4, client_gap_ms=3.0, gap_jitter_ms=(-2.0, 0.0, 4.0)
    )
    assert again.itl_ms == apart.itl_ms  # the same seed, the same draws


def test_an_open_loop_sends_at_its_requests_send_times_in_seconds() -> None:
    """Open loop: a request sent a second after another that takes a few ms finds the server idle.
    (The replay had read the bench's send times, in seconds, as milliseconds: every request of a
    paced run arrived within a few ms of the first and queued behind the others.)"""
    cost = StepCost(1.0, 0.02, 0.0)
    samples = [RequestSample(32, 4, 0, float(i), None, None) for i in range(4)]  # one per second
    run = simulate(samples, SimSettings(1, 512, None, 16, False), cost, concurrency=None)
    alone = cost.step_ms(StepShape(prefill_tokens=32))
    assert run.queue_ms == [0.0] * 4
    assert run.ttft_ms == pytest.approx([alone] * 4)


def test_a_request_is_scheduled_only_once_the_engine_has_it() -> None:
    """Each request reaches the scheduler one of the run's HTTP handoffs after it arrives
    (RunEvidence.handoff_ms): its TTFT, counted from its arrival as the server counts it, holds the
    handoff, and one that the engine takes in while a step runs waits for the next step, slot free
    or not."""
    cost = StepCost(1.0, 0.02, 0.0)
    step = cost.step_ms(StepShape(prefill_tokens=32))
    one = [RequestSample(32, 1, 0, 0.0, None, None)]
    settings = SimSettings(8, 512, None, 16, False)
    handed = simulate(one, settings, cost, concurrency=1, handoff_ms=(3.0,))
    assert handed.ttft_ms == pytest.approx([3.0 + step])
    assert handed.queue_ms == pytest.approx([3.0])
    # Sent 0.5 ms apart, each handed over 1 ms later: the second reaches the engine during the first's
    # step (1 ms .. 1 ms + step) and waits for it to end, queued from its arrival at 0.5 ms.
    two = [RequestSample(32, 1, 0, 0.0, None, None), RequestSample(32, 1, 0, 0.0005, None, None)]
    run = simulate(two, settings, cost, concurrency=None, handoff_ms=(1.0,))
    assert run.queue_ms == pytest.approx([1.0, 0.5 + step])
    assert run.kinds["prefill_only"].count == 2
    # Without handoffs (another server's run): scheduled at arrival, as before.
    assert simulate(one, settings, cost, concurrency=1).queue_ms == [0.0]


def test_pooled_replays_keep_per_replay_counts() -> None:
    cost = StepCost(0.5, 0.02, 0.0, residuals=StepResiduals(decode=(-0.4, 0.0, 2.0)))
    samples = [RequestSample(16, 8, 0, 0.0, None, None) for _ in range(4)]
    settings = SimSettings(2, 64, None, 16, False)
    runs = [simulate(samples, settings, cost, concurrency=2, seed=seed) for seed in range(3)]
    pool = pooled(runs)
    assert pool.num_requests == 4 and pool.replicas == 3
    assert sorted(pool.itl_ms) == sorted(g for r in runs for g in r.itl_ms)
    assert pool.kinds["decode_only"].count == sum(r.kinds["decode_only"].count for r in runs)
    assert pool.num_preemptions == 0
    # Each replay is kept, the run's own size (and a pool of pools keeps the replays, not the pools).
    assert pool.per_replay == runs and all(r.num_requests == 4 for r in pool.per_replay)
    assert pooled([pool, pooled(runs[:1])]).per_replay == [*runs, runs[0]]


def test_a_prediction_states_where_one_run_of_the_change_lands() -> None:
    """Calibration.replay_range: the central 90% of a metric over the pooled replays, as factors of
    the pooled value; None with too few replays to state one."""
    rng = random.Random(2)
    samples = [RequestSample(48, 64, 0, 0.0, None, None) for _ in range(12)]
    stalls = tuple(rng.gauss(0.0, 0.3) + (4.0 if rng.random() < 0.02 else 0.0) for _ in range(64))
    cost = StepCost(2.0, 0.05, 0.0, residuals=StepResiduals(decode=stalls))
    settings = SimSettings(4, 512, 36, 16, False)
    baseline = simulate(samples, settings, cost, concurrency=4)
    cal = Calibration(
        cost, settings, baseline, 4, replace(calculator_evidence(48, 4, 64), requests=samples), 0.0
    )
    assert cal.replicas > 10  # 12 requests of 63 gaps: many replays for MIN_POOLED_GAPS
    changed = cal.run()
    p99 = SIM_METRICS["itl_p99_ms"]
    low, high = cal.replay_range("itl_p99_ms", changed) or (0.0, 0.0)
    per_replay = sorted(p99(r) / p99(changed) for r in changed.per_replay)
    assert per_replay[0] <= low < 1.0 < high <= per_replay[-1]  # a tail over 756 gaps moves
    assert cal.replay_range("itl_p99_ms", pooled(changed.per_replay[:4])) is None  # too few


def test_a_prediction_pooled_over_the_calibrations_replicas_does_not_hang_on_its_seeds() -> None:
    """A replay's tail is a few events: which of a closed loop's prompts land in one step beside
    decodes, and a few residual draws. On a run of 12 requests (570 gaps: a p99 of ~6 gaps) the
    prediction of a budget change, pooled over the replays Calibration.replicas asks for, must not
    move with the block of seeds it drew: with 2,000 gaps pooled (4 replays) the planted
    prefill_chunks what-if 512 -> 1024 came out 0.90-1.35x the baseline's ITL p99 by its seeds alone
    and was offered as a 35% regression (session 32); here 4 replays spread 1.28x and 1.39x."""
    rng = random.Random(1)
    lengths = [(rng.randint(192, 576), rng.randint(24, 72)) for _ in range(12)]
    samples = [RequestSample(prompt, output, 0, 0.0, None, None) for prompt, output in lengths]
    stalls = tuple(rng.gauss(0.0, 0.5) + (8.0 if rng.random() < 0.03 else 0.0) for _ in range(64))
    fractions = tuple(rng.gauss(0.0, 0.25) for _ in range(32))
    cost = StepCost(15.0, 0.3, 0.0, residuals=StepResiduals(decode=stalls, prompt=fractions))
    settings = SimSettings(4, 512, None, 16, False)
    jitter = tuple(rng.uniform(-3.0, 7.0) for _ in range(8))

    def replays(budget: int, seeds: range):  # type: ignore[no-untyped-def]
        changed = replace(settings, max_num_batched_tokens=budget)
        runs = [simulate(samples, changed, cost, 4, 6.0, seed, gap_jitter_ms=jitter) for seed in seeds]
        return pooled(runs)

    baseline = simulate(samples, settings, cost, 4, 6.0, gap_jitter_ms=jitter)
    evidence = replace(calculator_evidence(384, 4, 48), requests=samples)
    cal = Calibration(cost, settings, baseline, 4, evidence, 6.0)
    n = cal.replicas
    p99 = SIM_METRICS["itl_p99_ms"]
    for budget in (256, 1024):
        blocks = [range(k * n, (k + 1) * n) for k in range(4)]
        ratios = [p99(replays(budget, seeds)) / p99(replays(512, seeds)) for seeds in blocks]
        assert max(ratios) / min(ratios) < 1.15, (budget, n, ratios)


def test_a_tail_without_preemption_is_carried_by_the_plain_gaps_ratio() -> None:
    """Predictions scale the simulated change by measured / simulated on the baseline. When the
    baseline's ITL p99 is its preemption stalls (which the simulator made 1.7-2x longer than measured
    on the planted kv_pool run) and the change has none, that ratio is not the tail's: the plain
    decode gaps' (ITL p50) carries it."""
    # 160 requests: over MIN_POOLED_GAPS gaps, so predictions divide by this one replay
    samples = [RequestSample(48, 64, 0, 0.0, None, None) for _ in range(160)]
    starved = SimSettings(4, 512, 12, 16, False)
    baseline = simulate(samples, starved, COST, concurrency=4)
    roomy = simulate(samples, replace(starved, num_kv_blocks=36), COST, concurrency=4)
    still = simulate(samples, replace(starved, num_kv_blocks=13), COST, concurrency=4)
    assert baseline.num_preemptions and still.num_preemptions and not roomy.num_preemptions
    p50, p99 = SIM_METRICS["itl_p50_ms"], SIM_METRICS["itl_p99_ms"]
    evidence = replace(calculator_evidence(48, 4, 64), requests=samples, itl_p50_ms=1.2 * p50(baseline))
    cal = Calibration(COST, starved, baseline, 4, evidence, 0.0)
    assert cal.replicas == 1
    measured_tail = 0.5 * p99(baseline)
    assert cal.predict("itl_p99_ms", measured_tail, roomy) == pytest.approx(1.2 * p99(roomy))
    assert cal.predict("itl_p99_ms", measured_tail, still) == pytest.approx(0.5 * p99(still))
    # and says so, for --verify to carry it to a fresh baseline the same way
    assert cal.carried_by("itl_p99_ms", roomy) == "itl_p50_ms"
    assert cal.carried_by("itl_p99_ms", still) == "itl_p99_ms"
    assert cal.carried_by("ttft_p50_ms", roomy) == "ttft_p50_ms"


def test_a_fetched_prompt_waits_for_the_step_boundary_after_its_kv_arrives() -> None:
    """A decode instance (SimSettings.fetch_ms_per_token, kvflow/kv_transfer/imports.py): the engine
    starts fetching a request's KV when it takes the request in, at a step boundary, and the
    scheduler steps over the request until a boundary finds the blocks there. A 1 ms fetch arriving
    mid-step therefore costs the whole step in flight, and the other request keeps decoding
    meanwhile; on an idle engine it costs the fetch alone. (Arriving with its KV, as the simulated
    pair had it, the planted pair's decode-instance TTFT came out 25 ms where 47 were measured.)"""
    cost = StepCost(10.0, 0.0, 0.0)  # every step 10 ms, whatever it computes
    fetching = SimSettings(4, 512, None, 16, True, fetch_ms_per_token=1.0 / 64)
    decoding = RequestSample(16, 50, 0, 0.0, None, None)  # steps at 0, 10, 20, ... ms
    fetched = RequestSample(72, 2, 72, 0.015, None, None)  # 64 tokens' KV (four blocks) fetched: 1 ms

    def ttft_of_fetched(settings: SimSettings) -> float:
        run = simulate([decoding, fetched], settings, cost, concurrency=None)
        assert run.itl_ms[:5] == pytest.approx([10.0] * 5)  # the decodes never wait on the fetch
        return dict(zip(run.ttft_request, run.ttft_ms, strict=True))[1]

    # Taken in at 20 ms, its KV there at 21, admitted at 30, its first token at 40.
    assert ttft_of_fetched(fetching) == pytest.approx(40.0 - 15.0)
    # In the pool: admitted at the boundary that takes it in.
    assert ttft_of_fetched(replace(fetching, fetch_ms_per_token=0.0)) == pytest.approx(30.0 - 15.0)
    alone = simulate([fetched], fetching, cost, concurrency=None)
    assert alone.ttft_ms == pytest.approx([1.0 + 10.0])  # an idle engine admits it when it arrives

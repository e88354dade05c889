"""A step-level model of kvflow's scheduler, replaying a benchmark's requests under other settings.

The what-ifs that change how requests share steps (the token budget, the running cap, the KV pool,
prefix caching) change queueing as much as step times, so a formula per setting misses: halving the
chunk of a prompt shorter than the chunk changes nothing, and a larger budget lets new prompts stall
more decodes at once. The simulator runs the same requests (their prompt, output and repeated-prefix
lengths; the same closed-loop concurrency, or the same send times in an open loop) through the rules
of kvflow/engine/scheduler.py, each step costing what kvflow/doctor/step_cost.py says:

  each step: running requests first, in admission order (a decode is 1 token, an unfinished prompt
  or a recompute a chunk of what is left), within max_num_batched_tokens; when KV blocks run out the
  most recently admitted running request is preempted (its blocks freed, recomputed later from the
  front of the queue); then, unless something was preempted, waiting requests FCFS while budget,
  max_num_seqs and free blocks allow (a prefix-cache hit, whole blocks, skips that part of a prompt).
  A request's token comes at the end of the step that computes its last pending token.

It also says what each long gap was waiting for: a preemption of the request itself, or the prompt
chunks and recomputes of other requests sharing its step (the attribution the ITL check ranks).
Cache kinds: a request holds blocks in every cache group of the model (SimSettings.other_groups,
kvflow/doctor/sim_blocks.py: a sliding window's stay about W / block_size + 1, a state's fixed), and
a prefix hit is a multiple of `hit_granularity` (a linear-attention model restores its state from a
checkpoint, taken every checkpoint_interval tokens).
A request reaches the scheduler after its HTTP handoff (RunEvidence.handoff_ms: the handler parses
and tokenizes it while the engine's steps hold the GIL), drawn from the run's own.
Not modelled: speculative decoding, HTTP delivery (predictions are differences between two simulated
runs, applied to the measured numbers, so what both share cancels).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvflow.doctor.arrival_stalls import paused_ms
from kvflow.doctor.evidence import RequestSample
from kvflow.doctor.sim_blocks import SimBlockPool, other_group_blocks
from kvflow.doctor.step_cost import MIN_STEP_MS, StepCost, StepShape, attention_work
from kvflow.kv_cache.specs import KVCacheSpec

KINDS = ("decode_only", "mixed", "prefill_only")


@dataclass(frozen=True)
class SimSettings:
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int | None  # None: never runs out
    block_size: int
    enable_prefix_caching: bool
    # The model's cache groups (kvflow/kv_cache/kv_cache_config.py) besides the first full-attention
    # one, and whether it has one (its blocks are the token table the prefix cache indexes): by
    # default a single full-attention group, as a dense model's.
    other_groups: tuple[KVCacheSpec, ...] = ()
    token_group: bool = True
    hit_granularity: int | None = None  # a prefix hit is a multiple of this; None: block_size
    # A decode instance behind a prefill instance (kvflow/kv_transfer/imports.py): a request's hit is
    # fetched from the other instance, at this many ms per token. The fetch starts when the engine
    # takes the request in (a step boundary) and runs beside the steps; the scheduler steps over the
    # request until a boundary finds its blocks arrived, so it waits out the step in flight even when
    # the fetch is quicker. 0: every hit is in the pool.
    fetch_ms_per_token: float = 0.0


@dataclass
class _Request:
    index: int
    prompt: int
    output: int
    hit: int  # prompt tokens a prefix cache serves at first admission (a prefix shared with others)
    arrival: float  # at the server (its HTTP handler's start, the server's TTFT clock)
    # When the engine takes it in: arrival + the handler's handoff (parsing, tokenizing, and the GIL
    # the engine's steps hold meanwhile); no step schedules it before, free slot or not.
    ready: float = 0.0
    fetched: float = 0.0  # when its hit has arrived from another instance (SimSettings.fetch_ms_per_token)
    # How long before it arrives its sending and receiving stall the engine (StepResiduals.arrival).
    stall_ms: float = 0.0
    computed: int = 0
    produced: int = 0
    admitted: bool = False
    recomputing: bool = False  # re-admitted after a preemption, prompt + outputs not recomputed yet
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    preempted_since_token: bool = False
    # How much later than a lone token its client read its first and its latest token (the step
    # delivered others too: StepCost.delivery_ms).
    first_delivery_ms: float = 0.0
    last_delivery_ms: float = 0.0

    @property
    def total(self) -> int:
        return self.prompt + self.produced


@dataclass
class KindStats:
    count: int = 0
    time_ms: float = 0.0
    rows: float = 0.0
    prefill_tokens: float = 0.0
    attention: float = 0.0

    def add(self, ms: float, shape: StepShape) -> None:
        """One step: its query rows (decodes and short prompt chunks), prefill-chunk tokens, keys."""
        self.count += 1
        self.time_ms += ms
        self.rows += shape.rows
        self.prefill_tokens += shape.prefill_tokens
        self.attention += shape.attention


@dataclass
class SimRun:
    ttft_ms: list[float]  # per request, server side (first token - arrival)
    queue_ms: list[float]
    itl_ms: list[float]  # every gap between consecutive tokens
    tpot_ms: list[float]
    e2e_ms: list[float]
    kinds: dict[str, KindStats]
    num_preemptions: int
    computed_tokens: int
    explained_ms: dict[str, float]  # cause -> stall excess summed over all gaps
    num_capped: int  # requests the pool could not hold at all
    replicas: int = 1  # replays pooled into these lists (pooled): the counts above are per replay
    ttft_request: list[int] = field(default_factory=list)  # each TTFT's request (its sample's index)
    # The replays a pooled run was made of, each the run's own size (empty for a single replay):
    # their spread is how far one real run of the change can land (Calibration.replay_range).
    per_replay: list[SimRun] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.ttft_ms) // self.replicas


def pooled(runs: Sequence[SimRun]) -> SimRun:
    """Replays of one workload under other seeds as one run: every request's and gap's values, the
    counts per replay (means), the kinds' steps summed (their means per step hold). A tail over few
    gaps (ITL p99 of one client's 90 gaps is its largest) is one draw of the step residuals in a
    single replay; pooled, it is the tail's expected value."""
    n = len(runs)
    kinds = {kind: KindStats() for kind in KINDS}
    for run in runs:
        for kind, stats in run.kinds.items():
            pool = kinds[kind]
            pool.count += stats.count
            pool.time_ms += stats.time_ms
            pool.rows += stats.rows
            pool.prefill_tokens += stats.prefill_tokens
            pool.attention += stats.attention
    return SimRun(
        ttft_ms=[v for r in runs for v in r.ttft_ms],
        ttft_request=[i for r in runs for i in r.ttft_request],
        queue_ms=[v for r in runs for v in r.queue_ms],
        itl_ms=[v for r in runs for v in r.itl_ms],
        tpot_ms=[v for r in runs for v in r.tpot_ms],
        e2e_ms=[v for r in runs for v in r.e2e_ms],
        kinds=kinds,
        num_preemptions=round(sum(r.num_preemptions for r in runs) / n),
        computed_tokens=round(sum(r.computed_tokens for r in runs) / n),
        explained_ms={k: sum(r.explained_ms.get(k, 0.0) for r in runs) / n for k in runs[0].explained_ms},
        num_capped=max(r.num_capped for r in runs),
        replicas=n * runs[0].replicas,
        per_replay=[one for r in runs for one in (r.per_replay or [r])],
    )


def _cacheable(sample: RequestSample, settings: SimSettings) -> int:
    if not settings.enable_prefix_caching:
        return 0
    usable = min(sample.shared_prefix_tokens, sample.prompt_tokens - 1)  # one token is always computed
    step = settings.hit_granularity or settings.block_size
    return step * (max(usable, 0) // step)


class _Scheduler:
    def __init__(self, settings: SimSettings, cost: StepCost) -> None:
        self.s, self.cost = settings, cost
        self.pool = SimBlockPool(settings.num_kv_blocks, settings.block_size, settings.enable_prefix_caching)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.num_preemptions = 0
        self.computed_tokens = 0
        self.capped: list[_Request] = []

    def shared_blocks(self, request: _Request) -> int:
        """Leading token blocks shared with other requests (a prefix cache hit): not in its table."""
        return request.hit // self.s.block_size

    def blocks_for(self, request: _Request, tokens: int) -> int:
        if not self.s.token_group:
            return 0
        return math.ceil(tokens / self.s.block_size) - self.shared_blocks(request)

    def table(self, request: _Request) -> int:
        return len(self.pool.tables.get(request.index, ()))

    def other_blocks(self, computed: int, tokens: int) -> int:
        """Blocks in the other cache groups while a step computes tokens computed .. tokens - 1."""
        return sum(other_group_blocks(spec, computed, tokens) for spec in self.s.other_groups)

    def other_need(self, request: _Request, computed: int, tokens: int) -> int:
        return self.other_blocks(computed, tokens) - len(self.pool.others.get(request.index, ()))

    def _hit_blocks(self, num_blocks: int) -> int:
        """Of `num_blocks` cached leading blocks, those a hit can use: whole hit_granularity spans
        (a linear-attention state restores from a checkpoint only)."""
        per_hit = (self.s.hit_granularity or self.s.block_size) // self.s.block_size
        return num_blocks // per_hit * per_hit

    def release(self, request: _Request) -> None:
        self.running.remove(request)
        self.pool.free(request.index)

    def preempt(self, victim: _Request) -> None:
        self.release(victim)
        victim.computed = 0
        victim.recomputing, victim.preempted_since_token = True, True
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self, now: float) -> list[tuple[_Request, int]]:
        scheduled: list[tuple[_Request, int]] = []
        budget, preempted, i = self.s.max_num_batched_tokens, False, 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.total - request.computed, budget)
            if n <= 0:
                i += 1
                continue
            end = request.computed + n
            need = self.blocks_for(request, end) - self.table(request)
            need += self.other_need(request, request.computed, end)
            while need > self.pool.num_free and request in self.running:
                if len(self.running) == 1:  # alone and out of blocks: kvflow caps its length
                    self.release(request)
                    self.capped.append(request)
                    break
                self.preempt(self.running[-1])
                preempted = True
            if request not in self.running:
                continue
            self.pool.resize_others(request.index, self.other_blocks(request.computed, end))
            self.pool.allocate(request.index, self.blocks_for(request, end) - self.table(request))
            scheduled.append((request, n))
            budget -= n
            i += 1
        if not preempted:
            self._admit(now, budget, scheduled)
        return scheduled

    def take_in(self, request: _Request, now: float) -> None:
        """The engine takes `request` in at `now` (a step boundary): it waits, and any fetch of its
        hit from another instance starts."""
        request.fetched = now + request.hit * self.s.fetch_ms_per_token
        self.waiting.append(request)

    def next_fetched(self, now: float) -> float:
        """When the next fetch still in flight at `now` arrives (inf: none is)."""
        return min((r.fetched for r in self.waiting if r.fetched > now), default=math.inf)

    def _admit(self, now: float, budget: int, scheduled: list[tuple[_Request, int]]) -> None:
        i = 0  # in arrival order, stepping over requests whose KV is still in flight (kvflow's scheduler)
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.s.max_num_seqs:
            request = self.waiting[i]
            if request.fetched > now:
                i += 1
                continue
            shared = self.shared_blocks(request)
            # Its own blocks a preemption left cached come back as hits (never the last token).
            own = []
            if request.admitted:
                own = self.pool.cached_prefix(request.index, shared, request.total - 1)
                own = own[: self._hit_blocks(shared + len(own)) - shared]
            hit = (shared + len(own)) * self.s.block_size if shared or own else 0
            n = min(request.total - hit, budget)
            new = self.blocks_for(request, hit + n) - len(own)
            others = self.other_blocks(hit, hit + n)
            if self.pool.free_needed(new, own) + others > self.pool.num_free:
                if self.running:
                    break
                del self.waiting[i]  # even an empty pool cannot hold it
                self.capped.append(request)
                continue
            del self.waiting[i]
            self.pool.resize_others(request.index, others)
            self.pool.allocate(request.index, new, own)
            request.computed, request.admitted = hit, True
            if request.first_scheduled is None:
                request.first_scheduled = now
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n


Work = dict[str, tuple[int, float]]  # cause -> (prefill tokens, their attention work)


def _step_parts(scheduled: list[tuple[_Request, int]]) -> tuple[StepShape, Work]:
    """(what the step computes, (prompt tokens, their attention) by cause)."""
    shape = StepShape()
    work: Work = {"prefill_chunks": (0, 0.0), "recompute": (0, 0.0)}
    for request, n in scheduled:
        # kvflow's rule: one pending token after an output is a decode, even when it ends a recompute.
        is_decode = request.produced > 0 and request.computed == request.total - 1
        end = request.computed + n
        shape = shape.plus_chunk(n, end, decode=is_decode)
        if not is_decode:
            cause = "recompute" if request.recomputing else "prefill_chunks"
            work[cause] = (work[cause][0] + n, work[cause][1] + attention_work(n, end))
    return shape, work


def simulate(
    samples: Sequence[RequestSample],
    settings: SimSettings,
    cost: StepCost,
    concurrency: int | None,
    client_gap_ms: float = 0.0,
    seed: int = 0,
    after_ms: Sequence[float] | None = None,
    gap_jitter_ms: Sequence[float] = (),
    handoff_ms: Sequence[float] = (),
) -> SimRun:
    """Replay `samples` (in send order): closed loop with `concurrency` clients, each sending its
    next request `client_gap_ms` after the server finished its last (delivery, the client, the new
    request's trip), plus `after_ms[i]` after sample i (what its client waits for elsewhere: its
    decode on another instance), plus one of `gap_jitter_ms` drawn (how unevenly the run's clients
    came back: RunEvidence.client_gap_jitter_ms), else open loop at the samples' send times. Each
    request reaches the scheduler one of `handoff_ms` after it arrives (the run's HTTP handoffs,
    RunEvidence.handoff_ms; none: at once). `seed` drives the draws (and the steps' departures from
    their mean cost, StepCost.residuals): the same seed, the same draws."""
    requests = [
        _Request(i, max(s.prompt_tokens, 1), max(s.output_tokens, 1), _cacheable(s, settings), 1e3 * s.send_s)
        for i, s in enumerate(samples)
    ]
    waits = list(after_ms) if after_ms is not None else [0.0] * len(requests)
    sched = _Scheduler(settings, cost)
    replay = _Replay(
        requests,
        sched,
        cost,
        concurrency,
        client_gap_ms,
        seed,
        waits,
        tuple(gap_jitter_ms),
        tuple(handoff_ms),
    )
    now = 0.0
    while len(replay.done) + len(replay.sched.capped) < len(requests):
        advanced = replay.advance(now)
        if advanced is None:
            break
        now = advanced
    return _summary(requests, replay.done, replay.kinds, replay.sched, replay.explained)


class _Replay:
    """The state of one replay: the scheduler, requests still to arrive, and what the steps did."""

    def __init__(
        self,
        requests: list[_Request],
        sched: _Scheduler,
        cost: StepCost,
        concurrency: int | None,
        client_gap_ms: float,
        seed: int,
        after_ms: list[float],
        gap_jitter_ms: tuple[float, ...] = (),
        handoff_ms: tuple[float, ...] = (),
    ) -> None:
        self.sched, self.cost, self.client_gap_ms = sched, cost, client_gap_ms
        self.after_ms = after_ms  # per request: its client's wait beyond the gap
        self.gap_jitter_ms = gap_jitter_ms
        self.handoff_ms = handoff_ms
        # Their own streams, so that two replays of one seed draw the same step residuals whatever
        # their clients' returns and handoffs drew.
        self.jitter_rng = random.Random(f"{seed}:client-gaps")
        self.handoff_rng = random.Random(f"{seed}:handoffs")
        self.stall_rng = random.Random(f"{seed}:arrival-stalls")
        self.rng = random.Random(seed)
        self.closed = concurrency is not None
        self.upcoming: deque[_Request] = deque(requests)
        if self.closed:  # the first `concurrency` clients send at once, the rest when one finishes
            for request in requests:
                request.arrival = request.ready = math.inf
            for request in requests[: max(1, concurrency or 1)]:
                self._arrive(request, 0.0)
        else:
            for request in requests:
                self._arrive(request, request.arrival)
        self.kinds = {kind: KindStats() for kind in KINDS}
        self.explained: dict[str, float] = {"preemption": 0.0, "prefill_chunks": 0.0, "recompute": 0.0}
        self.done: list[_Request] = []

    def advance(self, now: float) -> float | None:
        """Admit arrivals, then run one step (or wait for the next arrival): the new time, or None
        when nothing left can arrive."""
        sched = self.sched
        self._admit_arrivals(now)
        if not sched.running and not sched.waiting:
            upcoming = self._next_arrival_time()
            return None if math.isinf(upcoming) else upcoming  # None: every client capped
        num_capped = len(sched.capped)
        scheduled = sched.schedule(now)
        for _ in range(len(sched.capped) - num_capped):
            self._client_sends_next(now)  # a capped request's client sends its next one
        if scheduled:
            return self._step(now, scheduled)
        if not sched.running and not sched.waiting:
            return now
        upcoming = min(self._next_arrival_time(), sched.next_fetched(now))
        return None if math.isinf(upcoming) else max(now, upcoming)

    def _arrive(self, request: _Request, at: float) -> None:
        request.arrival = at
        request.ready = at + (self.handoff_rng.choice(self.handoff_ms) if self.handoff_ms else 0.0)
        stalls = self.cost.residuals.arrival
        request.stall_ms = self.stall_rng.choice(stalls) if stalls else 0.0

    def _sent(self) -> list[_Request]:
        """The upcoming requests with a send time: in a closed loop the first few (each client's next,
        in any order of arrival once jittered), in an open loop all (in order)."""
        sent = []
        for request in self.upcoming:
            if math.isinf(request.arrival):
                break
            sent.append(request)
        return sent

    def _admit_arrivals(self, now: float) -> None:
        """Requests the engine has taken in by `now` join the waiting queue, earliest first."""
        if self.closed:
            ready = [r for r in self._sent() if r.ready <= now]
        else:  # in arrival order, and none is ready before it arrives
            ready = []
            for request in self.upcoming:
                if request.arrival > now:
                    break
                if request.ready <= now:
                    ready.append(request)
        for request in sorted(ready, key=lambda r: r.ready):
            self.upcoming.remove(request)
            self.sched.take_in(request, now)

    def _next_arrival_time(self) -> float:
        """When the next request reaches the engine (its handoff done)."""
        if self.closed:
            return min((r.ready for r in self._sent()), default=math.inf)
        earliest = math.inf
        for request in self.upcoming:  # arrival order; ready >= arrival, so stop past the earliest
            if request.arrival >= earliest:
                break
            earliest = min(earliest, request.ready)
        return earliest

    def _prompt_stall_ms(self, start: float, end: float) -> float:
        """StepResiduals.prompt_arrival when a request's stall (that long before its arrival) falls
        in the step from `start` to `end` (not stalled yet), else 0. The stall before the arrival
        counts, not the arrival alone: the records flag the step the arrival lands in once stalled,
        and a starved run's admitting step, 2.6-3.4 ms unstalled, ends about when the finished
        client's next request (3.1 ms after the last token) arrives; checked on the step unstalled,
        the replay of the kv_pool run stalled few of the prompt steps its records flagged."""
        stall = self.cost.residuals.prompt_arrival
        if stall <= 0:
            return 0.0
        for r in self._sent() if self.closed else self.upcoming:
            if r.arrival - stall >= end:
                if self.closed:
                    continue
                break  # an open loop's upcoming requests are in arrival order: none later stalls it
            if r.arrival > start:
                return stall
        return 0.0

    def _stalled_ms(self, start: float, end: float) -> float:
        """How much longer a decode-only step from `start` to `end` runs for the requests arriving
        meanwhile: each stalls the engine for its stall_ms before it arrives (arrival_stalls.py)."""
        longest = max(self.cost.residuals.arrival, default=0.0)
        if longest <= 0:
            return 0.0
        # In an open loop every upcoming request has its time: only those whose stall can begin
        # before the step ends matter (arrival order). A stall pauses the step to its arrival at
        # most, and the step's work left after it is at most the whole step's.
        reach = end
        stalls = []
        for r in self._sent() if self.closed else self.upcoming:
            if not self.closed and r.arrival - longest > reach:
                break
            if r.stall_ms > 0 and r.arrival > start:
                stalls.append((r.arrival - r.stall_ms, r.arrival))
                reach = max(reach, r.arrival + end - start)
        return paused_ms(start, end, stalls)

    def _step(self, now: float, scheduled: list[tuple[_Request, int]]) -> float:
        """One engine step over `scheduled`: its cost, then each request's progress."""
        shape, work = _step_parts(scheduled)
        between_ms = self.cost.between_ms(shape)
        step_ms = self.cost.server_ms(shape) + between_ms  # StepCost.step_ms, its parts kept
        prompt = shape.prompt_tokens > 0
        step_ms = max(self.cost.with_drawn_residual(step_ms, prompt, self.rng, between_ms), MIN_STEP_MS)
        if prompt:
            # A prompt step that holds an arrival takes the stall its recorded twins were fitted
            # without (kvflow/doctor/prompt_stalls.py), so that the replay of the run puts back
            # what the fit took off.
            step_ms += self._prompt_stall_ms(now, now + step_ms - between_ms)
        else:
            step_ms += self._stalled_ms(now, now + step_ms - between_ms)
        # The server's kinds: by decodes and prompt tokens, whichever path attended them.
        kind = "mixed" if shape.decode_rows and prompt else ("prefill_only" if prompt else "decode_only")
        self.kinds[kind].add(step_ms, shape)
        now += step_ms
        self.sched.computed_tokens += sum(n for _, n in scheduled)
        prefill_ms = _prefill_ms_by_cause(self.cost, work)
        delivered = sum(request.computed + n >= request.total for request, n in scheduled)
        delivery_ms = self.cost.delivery_ms(delivered)
        for request, n in scheduled:
            request.computed += n
            self.sched.pool.mark_full(request.index, self.sched.shared_blocks(request), request.computed)
            if request.computed < request.total:
                continue
            request.recomputing = False
            _produce(request, now, prefill_ms, self.explained, self.cost, shape.decode_rows)
            request.last_delivery_ms = delivery_ms
            if request.produced == 1:
                request.first_delivery_ms = delivery_ms
            if request.produced >= request.output:
                self.sched.release(request)
                self.done.append(request)
                self._client_sends_next(now, delivery_ms + self.after_ms[request.index])
        return now

    def _client_sends_next(self, now: float, later_ms: float = 0.0) -> None:
        """A closed loop's client, its request finished at `now`, sends its next one after the gap
        (and its jitter) and `later_ms` (its delivery beyond the run's, below 0 for a step that
        delivered fewer tokens, and its wait elsewhere), never before `now`."""
        if self.closed and self.upcoming:
            jitter = self.jitter_rng.choice(self.gap_jitter_ms) if self.gap_jitter_ms else 0.0
            at = now + max(later_ms + max(self.client_gap_ms + jitter, 0.0), 0.0)
            for request in self.upcoming:  # the workload's next request, sent at once
                if math.isinf(request.arrival):
                    self._arrive(request, at)
                    return


def _prefill_ms_by_cause(cost: StepCost, work: Work) -> dict[str, float]:
    """What each cause's prompt chunks added to the step."""
    return {cause: cost.prefill_ms(w) for cause, w in work.items()}


def _produce(
    request: _Request,
    now: float,
    prefill_ms: dict[str, float],
    explained: dict[str, float],
    cost: StepCost,
    rows: int,
) -> None:
    """A token for `request` at `now`; its gap since the last token is charged to what delayed it."""
    if request.token_times:
        gap = now - request.token_times[-1]
        if request.preempted_since_token:
            # The whole wait beyond one plain decode step: queued again, then recomputed.
            causes = {"preemption": max(gap - cost.step_ms(StepShape(decode_rows=max(rows, 1))), 0.0)}
        else:
            causes = {cause: ms for cause, ms in prefill_ms.items() if ms > 0}
        for cause, ms in causes.items():
            explained[cause] += ms
    request.preempted_since_token = False
    request.token_times.append(now)
    request.produced += 1


def _summary(
    requests: list[_Request],
    done: list[_Request],
    kinds: dict[str, KindStats],
    sched: _Scheduler,
    explained: dict[str, float],
) -> SimRun:
    ttft, queue, itl, tpot, e2e = [], [], [], [], []
    ttft_request: list[int] = []
    for r in done:
        ttft.append(r.token_times[0] - r.arrival + r.first_delivery_ms)
        ttft_request.append(r.index)
        queue.append((r.first_scheduled or r.arrival) - r.arrival)
        gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
        itl += gaps
        if gaps:
            tpot.append(sum(gaps) / len(gaps))
        e2e.append(r.token_times[-1] - r.arrival + r.last_delivery_ms)
    return SimRun(
        ttft_ms=ttft,
        ttft_request=ttft_request,
        queue_ms=queue,
        itl_ms=itl,
        tpot_ms=tpot,
        e2e_ms=e2e,
        kinds=kinds,
        num_preemptions=sched.num_preemptions,
        computed_tokens=sched.computed_tokens,
        explained_ms=explained,
        num_capped=len(sched.capped),
    )

"""Scheduler driven by a simulated model loop (no torch).

The fake runner keeps a paged "KV store" (block id -> slot -> (position, token)), writes every
scheduled token through the block tables first and only then reads, like a real layer. Reading
back the attended context of each chunk and comparing it with the request's tokens checks the
whole bookkeeping: prefix hits, preemption + recompute, sliding-window release. The sampled token
is a function of the token read back at the last position, so a wrong block would also change the
outputs, which are compared with a run on an unlimited pool.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine import scheduler as scheduler_module
from kvflow.engine.scheduler import KV_CACHE_FULL, RequestUpdate, Scheduler
from kvflow.errors import InvalidRequestError, KVFlowError, PromptTooLongError
from kvflow.outputs import ModelRunnerOutput
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.scheduler_output import SchedulerOutput

VOCAB = 100


def next_token(last_token: int) -> int:
    return (last_token * 7 + 1) % VOCAB


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class FakeRunner:
    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.kv: dict[int, dict[int, tuple[int, int]]] = {}

    def _slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        block_id = block_ids[position // self.block_size]
        assert block_id != 0, f"position {position} maps to the null block"
        return block_id, position % self.block_size

    def _read_context(self, block_ids: list[int], query: int) -> list[tuple[int, int]]:
        first = 0 if self.sliding_window is None else max(0, query - self.sliding_window + 1)
        context = []
        for position in range(first, query + 1):
            block_id, slot = self._slot(block_ids, position)
            context.append(self.kv[block_id][slot])
        return context

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for s in output.scheduled:  # write phase: every layer writes the whole batch's K/V first
            assert s.num_tokens > 0
            for j, token_id in enumerate(s.token_ids):
                position = s.num_computed_tokens + j
                block_id, slot = self._slot(s.block_ids[0], position)
                self.kv.setdefault(block_id, {})[slot] = (position, token_id)
        sampled: dict[str, list[int]] = {}
        for s in output.scheduled:  # read phase: attention over each request's blocks
            all_tokens = s.prompt_token_ids + s.output_token_ids
            first, last = s.num_computed_tokens, s.num_computed_tokens + s.num_tokens - 1
            for query in (first, last):
                context = self._read_context(s.block_ids[0], query)
                start = query - len(context) + 1
                assert context == [(p, all_tokens[p]) for p in range(start, query + 1)], s.request_id
            if s.do_sample:
                assert last == len(all_tokens) - 1
                sampled[s.request_id] = [next_token(self._read_context(s.block_ids[0], last)[-1][1])]
        return ModelRunnerOutput(sampled_token_ids=sampled)


class ScriptedRunner:
    """Samples tokens from a fixed script per request (for stop-condition tests)."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = {rid: list(tokens) for rid, tokens in scripts.items()}

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            sampled_token_ids={
                s.request_id: [self.scripts[s.request_id].pop(0)] for s in output.scheduled if s.do_sample
            }
        )


Runner = FakeRunner | ScriptedRunner


def make_scheduler(
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    sliding_window: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        sliding_window=sliding_window,
        clock=FakeClock(),
    )


def make_request(
    request_id: str, prompt: list[int], eos: frozenset[int] = frozenset(), **params: object
) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(request_id, prompt, SamplingParams(**params), eos_token_ids=eos, arrival_time=0.0)  # type: ignore[arg-type]


def step(scheduler: Scheduler, runner: Runner) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    output = scheduler.schedule()
    scheduler.check_integrity()
    updates = scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_integrity()
    return output, updates


def run_to_completion(
    scheduler: Scheduler,
    runner: Runner,
    before_step: Callable[[int], None] | None = None,
    max_steps: int = 2000,
) -> list[SchedulerOutput]:
    outputs: list[SchedulerOutput] = []
    for i in range(max_steps):
        if before_step is not None:
            before_step(i)
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs.append(step(scheduler, runner)[0])
    raise AssertionError("the requests did not finish")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.req_to_blocks == {}
    assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
    assert scheduler.kv_cache_usage == 0.0
    scheduler.check_integrity()


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(max_tokens):
        last = next_token(last)
        out.append(last)
    return out


# ---------------------------------------------------------------------------------- scheduling


def test_chunked_prefill_mixes_prefill_chunks_and_decodes_in_one_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(block_size=4)
    a = make_request("a", [1, 2, 3], max_tokens=4)
    b = make_request("b", list(range(10, 30)), max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)

    plan = []
    for _ in range(4):
        output, _ = step(scheduler, runner)
        plan.append(
            [(s.request_id, s.num_computed_tokens, s.num_tokens, s.do_sample) for s in output.scheduled]
        )
    assert plan == [
        [("a", 0, 3, True), ("b", 0, 5, False)],  # a's whole prompt, b's first chunk
        [("a", 3, 1, True), ("b", 5, 7, False)],  # a decodes beside b's chunk
        [("a", 4, 1, True), ("b", 12, 7, False)],
        [("a", 5, 1, True), ("b", 19, 1, True)],  # b's last prompt token: sample
    ]
    assert (
        a.output_token_ids == reference_output(a.prompt_token_ids, 4)
        and a.status is RequestStatus.FINISHED_LENGTH_CAPPED
    )
    assert [(c.num_computed_tokens, c.num_tokens) for c in b.timeline.prefill_chunks] == [
        (0, 5),
        (5, 7),
        (12, 7),
        (19, 1),
    ]
    assert [(c.num_computed_tokens, c.num_tokens) for c in a.timeline.prefill_chunks] == [(0, 3)]
    run_to_completion(scheduler, runner)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)
    assert_all_blocks_free(scheduler)


def test_max_num_seqs_and_fcfs_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(block_size=4)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 5, max_tokens=3))
    output, _ = step(scheduler, runner)
    assert [s.request_id for s in output.scheduled] == ["r0", "r1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert scheduler.get_num_unfinished_requests() == 3
    outputs = run_to_completion(scheduler, runner)
    assert max(len(o.scheduled) for o in outputs) <= 2
    assert_all_blocks_free(scheduler)


def test_prefix_cache_hit_is_recorded_on_the_timeline() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(block_size=4)
    prefix = list(range(40, 52))
    first = make_request("first", [*prefix, 1], max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    second = make_request("second", [*prefix, 2, 3], max_tokens=2)
    scheduler.add_request(second)
    output, _ = step(scheduler, runner)
    assert [(s.num_computed_tokens, s.num_tokens) for s in output.scheduled] == [(12, 2)]
    assert second.timeline.num_cached_prompt_tokens == 12
    manager = scheduler.kv_cache_manager
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (13 + 14, 12)
    run_to_completion(scheduler, runner)
    assert second.output_token_ids == reference_output(second.prompt_token_ids, 2)
    assert_all_blocks_free(scheduler)


def test_preemption_under_a_tiny_pool_recomputes_to_identical_outputs() -> None:
    # block_size 2, 6 usable blocks; each request ends at 3 + 6 = 9 tokens -> needs 4 blocks alone,
    # the three together need 12: the newest running request is preempted and recomputed.
    scheduler = make_scheduler(num_kv_blocks=7, block_size=2, enable_prefix_caching=False)
    runner = FakeRunner(block_size=2)
    requests = [make_request(f"r{i}", [i + 1, i + 2, i + 3], max_tokens=6) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler, runner)
    preempted = [rid for o in outputs for rid in o.preempted_request_ids]
    assert preempted and "r0" not in preempted  # the oldest running request is never the victim
    assert sum(r.timeline.num_preemptions for r in requests) == len(preempted)
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, 6)
        assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    # A preempted request is not scheduled in the step that preempts it, and nothing is admitted then.
    for o in outputs:
        assert not set(o.preempted_request_ids) & {s.request_id for s in o.scheduled}
    assert_all_blocks_free(scheduler)


def test_preempted_requests_return_to_the_front_in_admission_order() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, block_size=2, enable_prefix_caching=False)  # 3 blocks
    runner = FakeRunner(block_size=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1, i + 1], max_tokens=4))
    scheduler.add_request(make_request("late", [9], max_tokens=1))
    step(scheduler, runner)  # r0, r1, r2 admitted with one block each; "late" waits (pool full)
    assert scheduler.num_running == 3
    output, _ = step(scheduler, runner)  # r0 needs a 2nd block: r2, then r1 are preempted
    assert output.preempted_request_ids == ["r2", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r2", "late"]
    assert all(r.status is RequestStatus.PREEMPTED for r in list(scheduler.waiting)[:2])


def test_a_request_that_alone_outgrows_the_pool_is_capped() -> None:
    scheduler = make_scheduler(num_kv_blocks=3, block_size=2)  # 2 usable blocks = 4 positions
    runner = FakeRunner(block_size=2)
    request = make_request("r", [1, 2, 3], max_tokens=10)
    scheduler.add_request(request)
    finished: list[RequestUpdate] = []
    for _ in range(10):
        if not scheduler.has_unfinished_requests():
            break
        finished += [u for u in step(scheduler, runner)[1] if u.request.is_finished]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED and request.stop_reason == KV_CACHE_FULL
    # Step 1 computes positions 0..2, step 2 position 3; position 4 would need a third block.
    assert request.output_token_ids == reference_output([1, 2, 3], 2)
    assert [(u.request.request_id, u.new_token_ids) for u in finished] == [("r", [])]
    assert_all_blocks_free(scheduler)


# -------------------------------------------------------------------------------- stop conditions


def run_scripted(request: Request, script: list[int], max_model_len: int = 256) -> Request:
    scheduler = make_scheduler(max_model_len=max_model_len)
    scheduler.add_request(request)
    run_to_completion(scheduler, ScriptedRunner({request.request_id: script}))
    assert_all_blocks_free(scheduler)
    return request


def test_eos_stops_with_no_stop_reason() -> None:
    r = run_scripted(make_request("r", [1], eos=frozenset({2})), [5, 2, 6])
    assert (r.output_token_ids, r.status, r.stop_reason) == ([5, 2], RequestStatus.FINISHED_STOPPED, None)
    assert r.timeline.finished_time is not None and len(r.timeline.token_times) == 2


def test_ignore_eos_and_min_tokens() -> None:
    r = run_scripted(make_request("r", [1], eos=frozenset({2}), ignore_eos=True, max_tokens=3), [2, 2, 2, 2])
    assert (r.output_token_ids, r.status) == ([2, 2, 2], RequestStatus.FINISHED_LENGTH_CAPPED)
    r = run_scripted(make_request("r", [1], eos=frozenset({2}), min_tokens=2), [2, 2, 2])
    assert (r.output_token_ids, r.status) == ([2, 2], RequestStatus.FINISHED_STOPPED)
    r = run_scripted(make_request("r", [1], stop_token_ids=[7], min_tokens=3), [7, 7, 7, 7])
    assert (r.output_token_ids, r.stop_reason) == ([7, 7, 7], 7)


def test_stop_token_ids_set_the_stop_reason() -> None:
    r = run_scripted(make_request("r", [1], stop_token_ids=[9, 8]), [3, 8, 4])
    assert (r.output_token_ids, r.status, r.stop_reason) == ([3, 8], RequestStatus.FINISHED_STOPPED, 8)


def test_eos_wins_over_max_tokens_on_the_same_token() -> None:
    r = run_scripted(make_request("r", [1], eos=frozenset({2}), max_tokens=2), [5, 2])
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_length_caps() -> None:
    r = run_scripted(make_request("r", [1, 1], max_tokens=3), [4, 4, 4, 4])
    assert (r.output_token_ids, r.status, r.stop_reason) == (
        [4, 4, 4],
        RequestStatus.FINISHED_LENGTH_CAPPED,
        None,
    )
    r = run_scripted(make_request("r", [1, 1], max_tokens=None), [4] * 10, max_model_len=5)
    assert (r.num_tokens, r.status) == (5, RequestStatus.FINISHED_LENGTH_CAPPED)


# ------------------------------------------------------------------------------------- aborts


def test_abort_waiting_and_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(block_size=4)
    running, waiting, other = (
        make_request(rid, [1, 2, 3, 4, 5], max_tokens=5) for rid in ("run", "wait", "other")
    )
    for request in (running, waiting, other):
        scheduler.add_request(request)
    step(scheduler, runner)
    assert scheduler.num_running == 1 and scheduler.kv_cache_usage > 0

    scheduler.finish_requests(["wait", "run", "no-such-id"], RequestStatus.FINISHED_ABORTED)
    assert waiting.status is running.status is RequestStatus.FINISHED_ABORTED
    assert waiting.status.finish_reason == "abort"
    assert scheduler.kv_cache_usage == 0.0
    scheduler.check_integrity()
    output, _ = step(scheduler, runner)
    assert output.finished_request_ids == ["wait", "run"]
    assert [s.request_id for s in output.scheduled] == ["other"]

    # Aborted between schedule() and update_from_output(): the update skips it.
    output = scheduler.schedule()
    scheduler.finish_requests(["other"], RequestStatus.FINISHED_ABORTED)
    num_computed = other.num_computed_tokens
    assert scheduler.update_from_output(output, runner.execute(output)) == []
    assert other.num_computed_tokens == num_computed and other.num_output_tokens == 1
    scheduler.finish_requests(["other"], RequestStatus.FINISHED_STOPPED)  # already finished: ignored
    assert other.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests(["x"], RequestStatus.RUNNING)


# ------------------------------------------------------------------------------------- admission


def test_add_request_rejects_what_can_never_run() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_model_len=20)  # 3 usable blocks
    with pytest.raises(InvalidRequestError, match="needs 4 KV blocks, the pool has 3"):
        scheduler.add_request(make_request("big", list(range(13))))
    with pytest.raises(PromptTooLongError, match="max_model_len=20"):
        scheduler.add_request(make_request("long", list(range(20))))
    with pytest.raises(InvalidRequestError, match="empty"):
        scheduler.add_request(make_request("empty", []))
    scheduler.add_request(make_request("ok", list(range(12))))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request("ok", [1]))


def test_missing_sample_from_the_runner_is_an_error() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [1, 2]))
    output = scheduler.schedule()
    with pytest.raises(KVFlowError, match="no token"):
        scheduler.update_from_output(output, ModelRunnerOutput())


def test_empty_schedule_when_idle() -> None:
    scheduler = make_scheduler()
    output = scheduler.schedule()
    assert output.is_empty and output.num_batched_tokens == 0
    assert scheduler.update_from_output(output, ModelRunnerOutput()) == []


# --------------------------------------------------------------------------- random workloads


@dataclass
class Workload:
    block_size: int
    sliding_window: int | None
    enable_prefix_caching: bool
    prompts: list[list[int]]
    max_tokens: list[int]
    arrival_steps: list[int]
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    aborts: list[tuple[int, int]] = field(default_factory=list)  # (step, request index)


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefixes = draw(
        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=16), min_size=1, max_size=3)
    )
    num_requests = draw(st.integers(2, 8))
    prompts = []
    for _ in range(num_requests):
        prefix = draw(st.sampled_from(prefixes))
        prefix = prefix[: draw(st.integers(len(prefix) // 2, len(prefix)))]
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1, max_size=10))
        prompts.append(prefix + suffix)
    min_blocks = max(-(-len(p) // block_size) for p in prompts) + 1
    return Workload(
        block_size=block_size,
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 8))),
        enable_prefix_caching=draw(st.booleans()),
        prompts=prompts,
        max_tokens=[draw(st.integers(1, 8)) for _ in prompts],
        arrival_steps=[draw(st.integers(0, 4)) for _ in prompts],
        num_kv_blocks=draw(st.integers(min_blocks, min_blocks + 6)),
        max_num_batched_tokens=draw(st.integers(1, 32)),
        max_num_seqs=draw(st.integers(1, 6)),
        aborts=draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, num_requests - 1)), max_size=2)),
    )


def run_workload(w: Workload, num_kv_blocks: int, with_aborts: bool) -> list[Request]:
    scheduler = make_scheduler(
        num_kv_blocks=num_kv_blocks,
        block_size=w.block_size,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_num_seqs=w.max_num_seqs,
        enable_prefix_caching=w.enable_prefix_caching,
        sliding_window=w.sliding_window,
    )
    runner = FakeRunner(w.block_size, w.sliding_window)
    requests = [
        make_request(f"r{i}", p, max_tokens=m)
        for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens, strict=True))
    ]

    def before_step(i: int) -> None:
        for request, arrival in zip(requests, w.arrival_steps, strict=True):
            if arrival == i:
                scheduler.add_request(request)
        if with_aborts:
            ids = [requests[j].request_id for s, j in w.aborts if s == i]
            scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        scheduler.check_integrity()

    # Arrivals can lie after the queues drain: keep stepping until every request arrived.
    last_arrival = max(w.arrival_steps)
    for i in range(2000):
        before_step(i)
        if i > last_arrival and not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner)
    else:
        raise AssertionError("the workload did not finish")
    assert all(r.is_finished for r in requests)
    assert_all_blocks_free(scheduler)
    return requests


@settings(max_examples=300, deadline=None)
@given(w=workloads())
def test_random_workloads_finish_without_leaks_and_match_an_unlimited_pool(w: Workload) -> None:
    reference = run_workload(
        w, num_kv_blocks=1 + sum(-(-(len(p) + 8) // w.block_size) for p in w.prompts), with_aborts=False
    )
    constrained = run_workload(w, num_kv_blocks=w.num_kv_blocks, with_aborts=True)
    manager_events = {
        "preempted": any(r.timeline.num_preemptions for r in constrained),
        "kv_cache_full": any(r.stop_reason == KV_CACHE_FULL for r in constrained),
        "aborted": any(r.status is RequestStatus.FINISHED_ABORTED for r in constrained),
        "prefix hit": any(r.timeline.num_cached_prompt_tokens for r in constrained),
        "sliding window": w.sliding_window is not None,
    }
    for name, happened in manager_events.items():
        event(f"{name}: {happened}")
    for ref, got in zip(reference, constrained, strict=True):
        assert ref.status is RequestStatus.FINISHED_LENGTH_CAPPED and ref.stop_reason is None
        assert ref.output_token_ids == reference_output(
            ref.prompt_token_ids, ref.sampling_params.max_tokens or 0
        )
        if got.status is RequestStatus.FINISHED_ABORTED or got.stop_reason == KV_CACHE_FULL:
            assert got.output_token_ids == ref.output_token_ids[: got.num_output_tokens]
        else:
            assert (got.output_token_ids, got.status) == (ref.output_token_ids, ref.status)


def test_bookkeeping_modules_do_not_import_torch() -> None:
    """The scheduler and KV manager run (and are tested) without torch. A stub `kvflow` package
    keeps the check about these modules: the real package __init__ exports LLM, which needs torch."""
    package_dir = Path(scheduler_module.__file__).resolve().parents[1]
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('kvflow'); pkg.__path__ = [sys.argv[1]]; sys.modules['kvflow'] = pkg\n"
        "import kvflow.engine.scheduler, kvflow.kv_cache.manager\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code, str(package_dir)], check=True)

"""`scheduling_policy="priority"` (kvflow/engine/request_queue.py), driven by the scheduler tests'
simulated model loop (no torch): a high-priority arrival behind a full queue is admitted next, FCFS
holds within a priority, KV pressure preempts the lowest priority first, and every request's tokens
still equal an unlimited pool's; fcfs keeps arrival order whatever the priority."""

from __future__ import annotations

from test_scheduler import FakeClock, FakeRunner, reference_output, run_to_completion, step

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.request_queue import RequestQueue
from kvflow.engine.scheduler import Scheduler
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams


def scheduler(num_kv_blocks: int = 64, max_num_seqs: int = 16, policy: str = "priority") -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, scheduling_policy=policy),  # type: ignore[arg-type]
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_kv_blocks=num_kv_blocks,
        max_model_len=256,
        clock=FakeClock(),
    )


def request(rid: str, prompt: list[int], priority: int, arrival: float, max_tokens: int = 8) -> Request:
    return Request(
        rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=arrival, priority=priority
    )


def test_a_high_priority_arrival_behind_a_full_queue_is_admitted_next() -> None:
    sched, runner = scheduler(max_num_seqs=1), FakeRunner(block_size=4)
    sched.add_request(request("first", [1, 2, 3], priority=5, arrival=0.0))
    step(sched, runner)  # "first" runs; the one slot is taken
    for i in range(4):
        sched.add_request(request(f"low-{i}", [4, 5, 6 + i], priority=5, arrival=1.0 + i))
    sched.add_request(request("urgent", [7, 8, 9], priority=0, arrival=9.0))
    order = []
    for output in run_to_completion(sched, runner):
        order += [s.request_id for s in output.scheduled if s.request_id not in order]
    assert order[:2] == ["first", "urgent"]
    assert order[2:] == [f"low-{i}" for i in range(4)]  # FCFS within a priority


def test_kv_pressure_preempts_the_lowest_priority_first() -> None:
    # 12 usable blocks of 4 tokens: three requests of 12 prompt tokens growing by 16 cannot all fit.
    sched, runner = scheduler(num_kv_blocks=13), FakeRunner(block_size=4)
    prompts = {"high": [10] * 12, "mid": [20] * 12, "low": [30] * 12}
    priorities = {"high": 0, "mid": 1, "low": 2}
    # Arrival order opposite to priority: under fcfs the newest ("high") would be the victim.
    for arrival, rid in enumerate(("low", "mid", "high")):
        sched.add_request(request(rid, prompts[rid], priorities[rid], float(arrival), max_tokens=16))
    victims: list[str] = []
    results: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        output, updates = step(sched, runner)
        victims += output.preempted_request_ids
        results.update(
            {
                u.request.request_id: u.request.output_token_ids
                for u in updates
                if u.request.status.is_finished
            }
        )
    assert victims and victims[0] == "low" and "high" not in victims
    for rid, prompt in prompts.items():
        assert results[rid] == reference_output(prompt, 16)


def test_fcfs_ignores_priority_order() -> None:
    queue = RequestQueue("fcfs")
    for i, priority in enumerate((3, 0, 1)):
        queue.append(request(f"r{i}", [1], priority, float(i)))
    assert [r.request_id for r in queue] == ["r0", "r1", "r2"]


def test_a_preempted_request_goes_back_to_its_place_by_priority_then_arrival() -> None:
    queue = RequestQueue("priority")
    early_low, late_high, later_high = (
        request(*args) for args in (("a", [1], 2, 0.0), ("b", [1], 0, 5.0), ("c", [1], 0, 6.0))
    )
    for r in (later_high, early_low):
        queue.append(r)
    late_high.status = RequestStatus.PREEMPTED
    queue.put_back(late_high)
    assert [r.request_id for r in queue] == ["b", "c", "a"]
    assert queue.popleft() is late_high and len(queue) == 2
    queue.remove(early_low)
    assert [r.request_id for r in queue] == ["c"]

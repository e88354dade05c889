"""The scheduler over several cache groups, driven by a simulated model loop (no torch).

A hybrid fake runner keeps, per attention group, a paged "KV store" (block id -> slot -> (position,
token)) read through that group's table and window, and per linear-attention group a "state" per
page: (tokens seen, a checksum of them), which it reads from the step's source pages, advances
token by token, writes to the checkpoint pages at their offsets and to the running state's pages.
Every read is checked against the request's tokens, so a wrong block, a window released too early,
a checkpoint restored at the wrong length or a state carried wrongly across chunks fails at once;
outputs are compared with a run on an unlimited pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.scheduler import KV_CACHE_FULL, Scheduler
from kvflow.kv_cache.kv_cache_config import KVCacheConfig, build_kv_cache_config
from kvflow.kv_cache.specs import LinearAttentionSpec, SlidingWindowSpec
from kvflow.outputs import ModelRunnerOutput
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.scheduler_output import ScheduledRequest, SchedulerOutput

VOCAB = 100
CHECKSUM_MOD = 1_000_003  # a prime: checksums of different token lists rarely collide
State = tuple[int, int]  # (tokens seen, checksum of them)
ZERO_STATE: State = (0, 0)


def next_token(last_token: int) -> int:
    return (last_token * 7 + 1) % VOCAB


def advance(state: State, token: int) -> State:
    count, checksum = state
    return count + 1, (checksum * 31 + token + 1) % CHECKSUM_MOD


def state_of(tokens: list[int]) -> State:
    state = ZERO_STATE
    for token in tokens:
        state = advance(state, token)
    return state


class HybridFakeRunner:
    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.kv: list[dict[int, dict[int, tuple[int, int]]]] = [{} for _ in config.groups]
        self.pages: dict[int, tuple[State, int]] = {}  # block id -> (state, index of the page in it)

    def _window(self, group: int) -> int | None:
        spec = self.config.groups[group].spec
        return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None

    def _attention_groups(self) -> list[int]:
        return [
            g for g, grp in enumerate(self.config.groups) if not isinstance(grp.spec, LinearAttentionSpec)
        ]

    def _slot(self, table: list[int], position: int) -> tuple[int, int]:
        block_id = table[position // self.block_size]
        assert block_id != 0, f"position {position} maps to the null block"
        return block_id, position % self.block_size

    def _read_state(self, pages: list[int]) -> State:
        entries = [self.pages[p] for p in pages]
        assert [index for _, index in entries] == list(range(len(pages))), "pages out of order"
        assert len({state for state, _ in entries}) == 1, "pages of one state disagree"
        return entries[0][0]

    def _write_state(self, pages: list[int], state: State) -> None:
        for index, page in enumerate(pages):
            self.pages[page] = (state, index)

    def _run_states(self, s: ScheduledRequest, all_tokens: list[int]) -> State | None:
        last = None
        for step in s.state_steps:
            state = ZERO_STATE if step.source is None else self._read_state(step.source)
            assert state == state_of(all_tokens[: s.num_computed_tokens]), s.request_id
            checkpoints = dict(step.checkpoints)
            for j, token in enumerate(s.token_ids, start=1):
                state = advance(state, token)
                if j in checkpoints:
                    self._write_state(checkpoints[j], state)
            self._write_state(step.state, state)
            last = state
        return last

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for s in output.scheduled:  # write phase: every attention layer writes the batch's K/V first
            for g in self._attention_groups():
                for j, token_id in enumerate(s.token_ids):
                    position = s.num_computed_tokens + j
                    block_id, slot = self._slot(s.block_ids[g], position)
                    self.kv[g].setdefault(block_id, {})[slot] = (position, token_id)
        sampled: dict[str, list[int]] = {}
        for s in output.scheduled:
            all_tokens = s.prompt_token_ids + s.output_token_ids
            last = s.num_computed_tokens + s.num_tokens - 1
            for g in self._attention_groups():
                window = self._window(g)
                for query in (s.num_computed_tokens, last):
                    first = 0 if window is None else max(0, query - window + 1)
                    for position in range(first, query + 1):
                        block_id, slot = self._slot(s.block_ids[g], position)
                        assert self.kv[g][block_id][slot] == (position, all_tokens[position]), (
                            s.request_id,
                            g,
                        )
            state = self._run_states(s, all_tokens)
            if state is not None:
                assert state == state_of(all_tokens[: last + 1])
            if s.do_sample:
                sampled[s.request_id] = [next_token(all_tokens[last])]
        return ModelRunnerOutput(sampled_token_ids=sampled)


KINDS = {
    "gpt-oss": ["sliding_attention", "full_attention"] * 2,
    "gemma3": ["sliding_attention"] * 5 + ["full_attention"],
    "qwen3-next": ["linear_attention"] * 3 + ["full_attention"],
}


@dataclass
class Workload:
    family: str
    block_size: int
    sliding_window: int
    state_bytes: int
    checkpoint_blocks: int
    enable_prefix_caching: bool
    prompts: list[list[int]]
    max_tokens: list[int]
    arrival_steps: list[int]
    extra_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    aborts: list[tuple[int, int]] = field(default_factory=list)

    def kv_cache_config(self) -> KVCacheConfig:
        return build_kv_cache_config(
            KINDS[self.family],
            block_size=self.block_size,
            token_bytes=8,
            sliding_window=self.sliding_window,
            state_bytes=self.state_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            checkpoint_interval=self.checkpoint_blocks * self.block_size,
        )


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    prefixes = draw(
        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=24), min_size=1, max_size=3)
    )
    num_requests = draw(st.integers(2, 7))
    prompts = []
    for _ in range(num_requests):
        prefix = draw(st.sampled_from(prefixes))
        prefix = prefix[: draw(st.integers(len(prefix) // 2, len(prefix)))]
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1, max_size=10))
        prompts.append(prefix + suffix)
    block_size = draw(st.sampled_from([1, 2, 4]))
    return Workload(
        family=draw(st.sampled_from(sorted(KINDS))),
        block_size=block_size,
        sliding_window=draw(st.integers(1, 10)),
        state_bytes=draw(st.integers(1, 3 * block_size * 16)),  # 1 to 3 pages of 16 bytes per token
        checkpoint_blocks=draw(st.integers(1, 4)),
        enable_prefix_caching=draw(st.booleans()),
        prompts=prompts,
        max_tokens=[draw(st.integers(1, 8)) for _ in prompts],
        arrival_steps=[draw(st.integers(0, 4)) for _ in prompts],
        extra_blocks=draw(st.integers(1, 12)),
        max_num_batched_tokens=draw(st.integers(1, 32)),
        max_num_seqs=draw(st.integers(1, 6)),
        aborts=draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, num_requests - 1)), max_size=2)),
    )


def run_workload(
    w: Workload, num_kv_blocks: int | None, with_aborts: bool
) -> tuple[list[Request], Scheduler]:
    config = w.kv_cache_config()
    budget = w.max_num_batched_tokens
    if num_kv_blocks is None:  # unlimited: every request at its longest, at once
        num_kv_blocks = 1 + sum(config.num_blocks_peak_prefill(len(p) + 8, len(p) + 8) for p in w.prompts)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=w.block_size, enable_prefix_caching=w.enable_prefix_caching),
        num_kv_blocks=num_kv_blocks,
        max_model_len=256,
        kv_cache_config=config,
    )
    runner = HybridFakeRunner(config)
    requests = [
        Request(f"r{i}", p, SamplingParams(max_tokens=m), arrival_time=0.0)
        for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens, strict=True))
    ]
    last_arrival = max(w.arrival_steps)
    for i in range(3000):
        for request, arrival in zip(requests, w.arrival_steps, strict=True):
            if arrival == i:
                scheduler.add_request(request)
        if with_aborts:
            ids = [requests[j].request_id for s, j in w.aborts if s == i]
            scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        scheduler.check_integrity()
        if i > last_arrival and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        scheduler.check_integrity()
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.check_integrity()
    else:
        raise AssertionError("the workload did not finish")
    manager = scheduler.kv_cache_manager
    assert all(r.is_finished for r in requests)
    assert manager.req_to_blocks == {} and manager.num_free_blocks == manager.block_pool.num_usable_blocks
    return requests, scheduler


@settings(max_examples=300, deadline=None)
@given(w=workloads())
def test_hybrid_workloads_finish_without_leaks_and_match_an_unlimited_pool(w: Workload) -> None:
    reference, _ = run_workload(w, None, with_aborts=False)
    config = w.kv_cache_config()
    smallest = max(config.num_blocks_peak_prefill(len(p), w.max_num_batched_tokens) for p in w.prompts)
    constrained, scheduler = run_workload(w, smallest + w.extra_blocks, with_aborts=True)
    hits = [g.num_hit_blocks for g in scheduler.kv_cache_manager.groups]
    for name, happened in {
        "family " + w.family: True,
        "preempted": any(r.timeline.num_preemptions for r in constrained),
        "kv_cache_full": any(r.stop_reason == KV_CACHE_FULL for r in constrained),
        "prefix hit": any(r.timeline.num_cached_prompt_tokens for r in constrained),
        "hit in every group": all(hits),
    }.items():
        event(f"{name}: {happened}")
    for ref, got in zip(reference, constrained, strict=True):
        assert ref.status is RequestStatus.FINISHED_LENGTH_CAPPED
        if got.status is RequestStatus.FINISHED_ABORTED or got.stop_reason == KV_CACHE_FULL:
            assert got.output_token_ids == ref.output_token_ids[: got.num_output_tokens]
        else:
            assert (got.output_token_ids, got.status) == (ref.output_token_ids, ref.status)


def test_a_state_prefix_hit_restores_and_recomputes_only_the_rest() -> None:
    """Two requests sharing a 24-token prompt prefix on a Qwen3-Next-like model: the second restores
    the state checkpoint at 16 tokens (interval 8) and computes from there."""
    w = Workload(
        family="qwen3-next",
        block_size=4,
        sliding_window=4,
        state_bytes=100,
        checkpoint_blocks=2,
        enable_prefix_caching=True,
        prompts=[[*list(range(24)), 1], [*list(range(24)), 2, 3]],
        max_tokens=[3, 3],
        arrival_steps=[0, 3],
        extra_blocks=20,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    requests, scheduler = run_workload(w, 128, with_aborts=False)
    assert requests[1].timeline.num_cached_prompt_tokens == 24
    assert [g.num_hit_blocks > 0 for g in scheduler.kv_cache_manager.groups] == [True] * 4

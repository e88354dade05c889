"""The scheduler: which tokens of which requests to compute each step (pure Python, no torch).

"Count tokens, not phases" (vLLM v1): every request has `num_computed_tokens` chasing `num_tokens`.
Each step fills a token budget (`max_num_batched_tokens`):
  1. running requests, in admission order: the next prefill chunk, or the last sampled token;
     when KV blocks run out, the most recently admitted running request is preempted (its blocks
     freed, recomputed later: prefix caching usually turns that into cache hits);
  2. then, if nothing was preempted, waiting requests in FCFS order (no skipping: a request that
     does not fit blocks those behind it, so long prompts cannot starve).
With `scheduling_policy="priority"` (vLLM's), "admission order" and "FCFS" read (priority, arrival):
both queues are kept in that order (request_queue.py), so a high-priority arrival is admitted
next and KV pressure preempts the lowest-priority running request first.
Progress guarantee: the first running request is never preempted (victims are taken from the end
and never include a request scheduled earlier in the step); alone and out of blocks, it is finished
with stop_reason "kv_cache_full". So every step either computes a token or finishes a request.

The engine calls schedule() -> runs the model -> update_from_output(), and must call
update_from_output() after every schedule(), even an empty one: it also reports the requests that
schedule() itself finished.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.request_queue import RequestQueue, priority_key
from kvflow.errors import InvalidRequestError, KVFlowError, PromptTooLongError
from kvflow.kv_cache.block_pool import IntegrityError
from kvflow.kv_cache.kv_cache_config import KVCacheConfig
from kvflow.kv_cache.manager import KVCacheManager
from kvflow.kv_offload.disk_tier import TierRead
from kvflow.kv_offload.restores import NOTHING, RestoreTracker
from kvflow.kv_transfer.imports import KVImports
from kvflow.outputs import ModelRunnerOutput
from kvflow.request import Request, RequestStatus
from kvflow.scheduler_output import ScheduledRequest, SchedulerOutput
from kvflow.stats import SpecDecodeStats

KV_CACHE_FULL = "kv_cache_full"  # stop_reason of a request that alone outgrew the KV pool


@dataclass
class RequestUpdate:
    """What one step changed for one request: tokens appended and/or it finished (see request.status)."""

    request: Request
    new_token_ids: list[int]


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        sliding_window: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_cache_config: KVCacheConfig | None = None,
        kv_offload: RestoreTracker | None = None,
    ) -> None:
        """`kv_cache_config`: the model's cache groups (kvflow/kv_cache/kv_cache_config.py); without
        one, every layer is full attention, or of one `sliding_window`. `kv_offload`: the KV offload
        tier's restores (kvflow/kv_offload/restores.py), or None without a tier."""
        self.scheduler_config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.clock = clock
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            sliding_window,
            kv_cache_config,
        )
        # WAITING or PREEMPTED, no KV blocks, in the scheduling policy's order (request_queue.py).
        self.waiting = RequestQueue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []  # RUNNING, in admission order, holding KV blocks
        self.requests: dict[str, Request] = {}  # every unfinished request (waiting or running)
        # Finished/aborted since the last schedule(): the runner drops their per-request state.
        self._finished_request_ids: list[str] = []
        # Finished inside schedule() (kv_cache_full): reported by the next update_from_output().
        self._finished_in_schedule: list[Request] = []
        # Speculative decoding acceptance since the engine last read it.
        self.spec_stats = SpecDecodeStats()
        self.kv_offload: RestoreTracker | None = None
        # Prefill/decode disaggregation, decode role: prompts whose KV comes from a prefill instance.
        self.kv_imports: KVImports | None = None
        self._kv_restores: list[tuple[int, bytes | memoryview]] = []  # this step's, for SchedulerOutput
        if kv_offload is not None:
            self.attach_kv_offload(kv_offload)

    def attach_kv_offload(self, kv_offload: RestoreTracker) -> None:
        """Use a KV offload tier from now on: record evictions, plan restores."""
        self.kv_offload = kv_offload
        self.kv_cache_manager.block_pool.evicted = []

    # ----------------------------------------------------------------------------------- admission

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError(f"request {rid!r}: the prompt is empty")
        if request.num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"request {rid!r}: the prompt has {request.num_prompt_tokens} tokens; with at least one "
                f"output token it does not fit in max_model_len={self.max_model_len}"
            )
        num_blocks = self.kv_cache_manager.num_blocks_peak_prefill(
            request.num_prompt_tokens, self.scheduler_config.max_num_batched_tokens
        )
        num_usable = self.kv_cache_manager.block_pool.num_usable_blocks
        if num_blocks > num_usable:
            raise InvalidRequestError(
                f"request {rid!r}: the prompt ({request.num_prompt_tokens} tokens) needs {num_blocks} KV "
                f"blocks, the pool has {num_usable}"
            )
        self.waiting.append(request)
        self.requests[rid] = request

    # ------------------------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []
        budget = self._schedule_running(
            self.scheduler_config.max_num_batched_tokens, now, scheduled, preempted_ids
        )
        if not preempted_ids:
            # Admitting while preempting would only hand the freed blocks to a newer request.
            self._schedule_waiting(budget, now, scheduled)
        finished_ids, self._finished_request_ids = self._finished_request_ids, []
        pool = self.kv_cache_manager.block_pool
        kv_saves, kv_restores = pool.evicted or [], self._kv_restores
        if pool.evicted is not None:
            pool.evicted = []
        self._kv_restores = []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=sum(s.num_tokens for s in scheduled),
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            kv_saves=kv_saves,
            kv_restores=kv_restores,
        )

    def _schedule_running(
        self, budget: int, now: float, scheduled: list[ScheduledRequest], preempted_ids: list[str]
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute until the previous step's token arrives
                i += 1
                continue
            num_spec = self._num_spec_tokens(request, budget)
            if self._allocate_or_preempt(request, num_new + num_spec, preempted_ids):
                scheduled.append(self._make_scheduled(request, num_new, now, num_spec))
                budget -= num_new + num_spec
                i += 1
            # else `request` left `running` (preempted or capped): index i now names the next one.
        return budget

    def _num_spec_tokens(self, request: Request, budget: int) -> int:
        """Drafts to verify with this decode step: only for a request one token behind, within the
        token budget and the context length (a draft past max_model_len could never be kept)."""
        if not request.spec_token_ids or request.num_computed_tokens != request.num_tokens - 1:
            request.spec_token_ids, request.spec_draft_probs = [], None
            return 0
        room = min(budget - 1, self.max_model_len - request.num_tokens - 1)
        request.spec_token_ids = request.spec_token_ids[: max(room, 0)]
        return len(request.spec_token_ids)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted_ids: list[str]) -> bool:
        """Allocate for `request`, preempting from the end of `running` until it fits.

        Returns False when `request` itself was preempted or finished instead.
        """
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            if len(self.running) == 1:
                # Alone and still out of blocks: it can never grow again (waiting requests hold
                # no blocks and cached free blocks count as free), so cap it instead of looping.
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED, KV_CACHE_FULL)
                self._finished_in_schedule.append(request)
                return False
            victim = self.running[-1]  # the newest (priority policy: the lowest priority, then newest)
            self._preempt(victim)
            preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.timeline.num_preemptions += 1
        # Front of the queue (fcfs): victims leave `running` newest first, so successive put_backs put
        # the older victim ahead of the newer one and admission order is preserved.
        self.waiting.put_back(request)

    def _schedule_waiting(self, budget: int, now: float, scheduled: list[ScheduledRequest]) -> None:
        manager = self.kv_cache_manager
        # Requests whose grammar still compiles (structured output) are stepped over, not waited for;
        # they keep their place in the queue.
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.scheduler_config.max_num_seqs:
            request = self.waiting.peek()
            if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
                skipped.append(self.waiting.popleft())
                continue
            # Waiting requests hold no blocks (num_computed_tokens == 0): look up the prefix cache,
            # unless the request wants prompt logprobs (each prompt position must be computed).
            hit = (
                manager.get_computed_blocks(request)
                if request.sampling_params.prompt_logprobs is None
                else None
            )
            num_hit_tokens = hit.num_tokens if hit is not None else 0
            restore = self._plan_restore(request, num_hit_tokens) if hit is not None else NOTHING
            if restore is None:  # its blocks are being read from the offload tier: step over it
                skipped.append(self.waiting.popleft())
                continue
            num_restored = len(restore.payloads) * self.block_size
            num_new = min(request.num_tokens - num_hit_tokens - num_restored, budget)
            if not manager.allocate_slots(request, num_restored + num_new, hit):
                if self.running:
                    break  # FCFS: wait for running requests to free blocks
                # Even an empty pool cannot hold this chunk (its earlier outputs outgrew the pool).
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED, KV_CACHE_FULL)
                self._finished_in_schedule.append(request)
                continue
            self.waiting.popleft()
            if restore.payloads:
                self._commit_restore(request, num_hit_tokens, restore)
            if request.timeline.first_scheduled_time is None:  # first admission
                request.timeline.num_cached_prompt_tokens = num_hit_tokens + num_restored
            request.num_computed_tokens = num_hit_tokens + num_restored
            request.status = RequestStatus.RUNNING
            self._admit(request)
            scheduled.append(self._make_scheduled(request, num_new, now))
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.put_back(request)

    def _admit(self, request: Request) -> None:
        """Into `running`: at the end (fcfs), or in priority order, so that `running` is served
        highest priority first and preempted from its lowest-priority end."""
        if self.waiting.policy == "fcfs":
            self.running.append(request)
            return
        keys = [priority_key(r) for r in self.running]
        self.running.insert(bisect.bisect_right(keys, priority_key(request)), request)

    def _plan_restore(self, request: Request, num_hit_tokens: int) -> TierRead | None:
        """Blocks past the pool's hit from the request's prefill instance (decode role), else from
        the offload tier (none without either; None: being read). Capped like a pool hit: the last
        prompt token is always computed."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        first_block = num_hit_tokens // self.block_size
        if request.remote_prefill is not None and self.kv_imports is not None:
            rid, hashes = request.request_id, request.block_hashes
            return self.kv_imports.plan(rid, request.remote_prefill, hashes, first_block, max_blocks)
        if self.kv_offload is None:
            return NOTHING
        return self.kv_offload.plan(request.request_id, request.block_hashes, first_block, max_blocks)

    def _commit_restore(self, request: Request, num_hit_tokens: int, restore: TierRead) -> None:
        """Hand the restored blocks' bytes to this step (they land in the blocks just allocated)."""
        if request.remote_prefill is not None and self.kv_imports is not None:
            self.kv_imports.commit(request.request_id)
        elif self.kv_offload is not None:
            self.kv_offload.commit(request.request_id)
        table = self.kv_cache_manager.block_table(request.request_id)
        first = num_hit_tokens // self.block_size
        self._kv_restores.extend(
            zip(table[first : first + len(restore.payloads)], restore.payloads, strict=True)
        )
        request.timeline.num_restored_tokens += len(restore.payloads) * self.block_size
        request.timeline.kv_restore_time = (request.timeline.kv_restore_time or 0.0) + restore.seconds

    def wait_for_restores(self, timeout: float) -> None:
        """With nothing else to run, wait for a tier read instead of spinning."""
        if self.kv_offload is not None:
            self.kv_offload.wait(timeout)
        if self.kv_imports is not None:
            self.kv_imports.wait(timeout)

    def _make_scheduled(
        self, request: Request, num_new: int, now: float, num_spec: int = 0
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        # A decode step feeds only the last sampled token (plus drafts to verify); anything else
        # (prompt chunks, recompute after preemption) is prefill, even a 1-token final prompt chunk.
        is_decode = request.num_output_tokens > 0 and start == request.num_tokens - 1
        request.timeline.record_scheduled(now, num_new, start, is_prefill=not is_decode)
        spec, request.spec_token_ids = request.spec_token_ids[:num_spec], []
        draft_probs, request.spec_draft_probs = request.spec_draft_probs, None
        if draft_probs is not None and spec:
            draft_probs = draft_probs[: len(spec)]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end] + spec,
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.block_tables(request.request_id),
            state_steps=self.kv_cache_manager.state_steps(request.request_id),
            do_sample=end == request.num_tokens,
            is_decode=is_decode,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            num_spec_tokens=len(spec),
            spec_draft_probs=draft_probs if spec else None,
        )

    # -------------------------------------------------------------------------------------- update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance the scheduled requests; one update per request that got tokens or finished."""
        updates = [RequestUpdate(request, []) for request in self._finished_in_schedule]
        self._finished_in_schedule = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since schedule()
            token_ids = runner_output.sampled_token_ids.get(request.request_id)
            if scheduled.num_spec_tokens:
                # The last token and the accepted drafts now have K/V; rejected drafts' slots are
                # rolled back (overwritten by later steps) and blocks only they needed are freed.
                num_accepted = len(token_ids or [1]) - 1
                self.spec_stats.record(scheduled.num_spec_tokens, num_accepted)
                request.num_computed_tokens = scheduled.num_computed_tokens + 1 + num_accepted
                self.kv_cache_manager.trim(request, request.num_computed_tokens + 1)
            else:
                request.num_computed_tokens += scheduled.num_tokens
            if scheduled.do_sample:
                updates.append(RequestUpdate(request, self._append_tokens(request, token_ids)))
        return updates

    def _append_tokens(self, request: Request, token_ids: list[int] | None) -> list[int]:
        if not token_ids:
            raise KVFlowError(f"the model runner sampled no token for request {request.request_id!r}")
        new_token_ids: list[int] = []
        for token_id in token_ids:  # one at a time: a stop condition discards the tokens after it
            request.append_output_token_ids([token_id])
            new_token_ids.append(token_id)
            if self._check_stop(request, token_id):
                break
        request.timeline.record_tokens(self.clock(), len(new_token_ids))
        return new_token_ids

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Finish `request` if `token_id` (just appended) ends it; EOS/stop ids wait for min_tokens."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                self._finish(request, RequestStatus.FINISHED_STOPPED, None)
                return True
            if token_id in params.stop_token_ids:
                self._finish(request, RequestStatus.FINISHED_STOPPED, token_id)
                return True
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
            request.num_tokens >= self.max_model_len
        ):
            self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED, None)
            return True
        return False

    # ------------------------------------------------------------------------------------- finish

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish waiting or running requests from outside (aborts, stop strings).

        Unknown or already finished ids are ignored. `request.stop_reason` is kept as is: the engine
        sets it to the matched stop string before calling this.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, status, request.stop_reason)

    def _finish(self, request: Request, status: RequestStatus, stop_reason: str | int | None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
        else:
            self.waiting.remove(request)  # waiting requests hold no blocks
        request.status = status
        request.stop_reason = stop_reason
        request.timeline.finished_time = self.clock()
        if self.kv_offload is not None:
            self.kv_offload.discard(request.request_id)
        if self.kv_imports is not None:
            self.kv_imports.discard(request.request_id)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)

    # -------------------------------------------------------------------------------------- queries

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def check_integrity(self) -> None:
        """KV invariants plus: the queues partition the unfinished requests; running ones hold
        blocks covering their computed tokens, waiting ones hold none."""
        manager = self.kv_cache_manager
        manager.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        if running_ids & waiting_ids or len(running_ids) + len(waiting_ids) != len(self.requests):
            raise IntegrityError(
                f"queues overlap or miss requests: running={running_ids} waiting={waiting_ids}"
            )
        if set(manager.req_to_blocks) != running_ids:
            raise IntegrityError(
                f"requests holding blocks {set(manager.req_to_blocks)} != running {running_ids}"
            )
        for request in self.running:
            if (
                request.status is not RequestStatus.RUNNING
                or self.requests.get(request.request_id) is not request
            ):
                raise IntegrityError(f"{request} is in the running list")
            if not manager.covers(request):
                raise IntegrityError(f"{request}: blocks do not cover its computed tokens")
        for request in self.waiting:
            if (
                request.status
                not in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_GRAMMAR)
                or request.num_computed_tokens
            ):
                raise IntegrityError(f"{request} is in the waiting queue")

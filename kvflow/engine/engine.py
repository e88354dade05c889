"""LLMEngine: add_request / step / abort_request, the streaming API the server builds on.

step() = schedule -> execute -> update -> outputs. Each call returns the `RequestOutput`s of
requests that produced tokens or finished in that step (with `delta_text` for streaming).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from kvflow.attention.kv_store import KVStore, kv_cache_config_for
from kvflow.config import ConfigError, EngineConfig, KVEventsConfig
from kvflow.engine.model_setup import (
    LoadedModel,
    load_checkpoint,
    log_kv_groups,
    log_kv_pool,
    num_kv_blocks_for,
)
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.scheduler import RequestUpdate, Scheduler
from kvflow.errors import InvalidRequestError, PromptTooLongError
from kvflow.kv_events.event_log import KVEventLog
from kvflow.kv_events.publisher import ZmqEventPublisher
from kvflow.kv_offload.block_bytes import BlockBytes, OffloadIO
from kvflow.kv_offload.disk_tier import DiskKVTier
from kvflow.kv_offload.fingerprint import tier_fingerprint, transfer_fingerprint
from kvflow.kv_offload.restores import RestoreTracker
from kvflow.kv_transfer.endpoint import KVTransferEndpoint
from kvflow.kv_transfer.imports import KVImports
from kvflow.outputs import ModelRunnerOutput, RequestOutput, TokenLogprobs
from kvflow.parallel.errors import WorkerDiedError
from kvflow.parallel.executor import TensorParallelDriver
from kvflow.query_rows import is_query_row_chunk
from kvflow.reasoning import get_reasoning_parser
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.scheduler_output import SchedulerOutput
from kvflow.spec_decode.controller import SpecController
from kvflow.spec_decode.factory import build_proposer
from kvflow.stats import SpecDecodeStats, StepStats
from kvflow.structured import StructuredOutputManager
from kvflow.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

Prompt = str | list[int]
# With only requests that wait (a grammar compiling, blocks read from the KV offload tier), how long
# one step blocks for either to finish: short enough that the async engine's commands (new requests,
# aborts) are still read promptly.
IDLE_WAIT_S = 0.01


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Tensor parallelism: ranks 1..N-1 started or joined first; they load their shards with ours.
        tp = config.parallel_config.tensor_parallel_size
        self.parallel = TensorParallelDriver(config) if tp > 1 else None
        try:
            self._init(config)
        except BaseException:
            if self.parallel is not None:
                self.parallel.shutdown()
            raise

    def _init(self, config: EngineConfig) -> None:
        loaded = load_checkpoint(config, self.parallel)
        self.tokenizer = loaded.tokenizer
        self.arch = loaded.arch
        self.max_model_len = loaded.max_model_len
        self.dtype = loaded.dtype
        cache, a = config.cache_config, loaded.arch
        # The cache groups of this process's share of the model (its rank's KV heads under TP).
        self.kv_cache_config, state_layout = kv_cache_config_for(loaded.model.config, loaded.dtype, cache)
        if state_layout is not None and config.speculative_config.enabled:
            raise ConfigError(
                f"speculative decoding is not supported for {a.architecture}: its linear-attention "
                "layers keep a recurrent state, which cannot be rolled back past rejected draft tokens"
            )
        if a.compressed is not None and config.speculative_config.enabled:
            raise ConfigError(
                f"speculative decoding is not supported for {a.architecture}: its compressors keep a "
                "pending tail, which cannot be rolled back past rejected draft tokens"
            )
        num_blocks = self._size_kv_pool(loaded)
        # +1: block 0 is the null block (padding and released sliding-window blocks point to it).
        kv_store = KVStore(
            a.num_hidden_layers,
            num_blocks + 1,
            cache.block_size,
            loaded.model.config.num_key_value_heads,  # this rank's heads under tensor parallelism
            a.head_dim,
            loaded.dtype,
            cache.kv_cache_dtype,
            latent=a.kv_latent,
            kv_cache_config=self.kv_cache_config,
            state_layout=state_layout,
            index_dim=a.kv_index_dim,
            compressed=a.compressed is not None,
        )
        self.scheduler = Scheduler(
            config.scheduler_config,
            cache,
            num_blocks + 1,
            self.max_model_len,
            kv_cache_config=self.kv_cache_config,
        )
        self.model_runner = self._make_model_runner(loaded, kv_store)
        self.kv_offload_tier = self._attach_kv_offload(kv_store)
        self.kv_event_publisher = self._attach_kv_events()
        self.kv_transfer = self._attach_kv_transfer(kv_store)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.proposer = build_proposer(
            config.speculative_config,
            self.tokenizer,
            loaded.dtype,
            self.max_model_len,
            num_blocks,
            cache.block_size,
            config.model_config.enforce_eager,
            config.model_config.batch_invariant,
        )
        self.spec_stats = SpecDecodeStats()  # cumulative since start (kvflow generate prints it)
        self.spec_controller = SpecController(config.speculative_config.speculative_auto_disable)
        self._propose_seconds = 0.0  # the proposal made for the next step
        self._pending_outputs: list[RequestOutput] = []
        self._request_counter = itertools.count()
        self.last_step_stats: StepStats | None = None
        self.reasoning = get_reasoning_parser(config.model_config.reasoning_parser)
        self.structured = StructuredOutputManager(self.tokenizer, self.reasoning)

    def _size_kv_pool(self, loaded: LoadedModel) -> int:
        """Usable KV blocks (the null block comes on top) for the configured memory; logs the pool."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        kv_config = self.kv_cache_config
        bytes_per_token = kv_config.bytes_per_block // cache.block_size
        num_blocks = num_kv_blocks_for(cache, sched.max_num_seqs, self.max_model_len, kv_config)
        model_dtype = dataclasses.replace(cache, kv_cache_dtype="auto")
        model_dtype_config, _ = kv_cache_config_for(loaded.model.config, loaded.dtype, model_dtype)
        self.kv_pool_summary = log_kv_pool(
            num_blocks,
            cache.block_size,
            bytes_per_token,
            self.max_model_len,
            cache.kv_cache_dtype,
            model_dtype_config.bytes_per_block // cache.block_size,
            kv_config.num_blocks_held(self.max_model_len),
        )
        self.kv_groups_summary = log_kv_groups(kv_config, self.max_model_len)
        if self.parallel is not None:
            heads, all_heads = loaded.model.config.num_key_value_heads, loaded.arch.num_key_value_heads
            per_rank = (
                f"per rank of {self.parallel.world_size} (tensor parallel): {heads} of {all_heads} KV "
                f"heads per layer, {heads / all_heads:.3g}x the bytes per token of one process"
            )
            self.kv_pool_summary += f"; {per_rank}"
            logger.info("KV cache pool above is %s", per_rank)
        self.kv_bytes_per_token = bytes_per_token
        self.num_kv_blocks = num_blocks
        return num_blocks

    def _attach_kv_offload(self, kv_store: KVStore) -> DiskKVTier | None:
        """The KV offload tier (`kv_offload_path`), wired to the scheduler (restores) and the runner
        (block copies); None without one."""
        cache = self.config.cache_config
        if cache.kv_offload_path is None:
            return None
        if self.parallel is not None:
            raise ConfigError(
                "kv_offload_path with tensor parallelism is not supported yet: each rank holds a part of "
                "every block; run the tier with tensor_parallel_size 1"
            )
        blocks = BlockBytes(kv_store)
        fingerprint = tier_fingerprint(
            self.config.model_config.model, self._kv_byte_settings(), blocks.layout
        )
        tier = DiskKVTier(cache.kv_offload_path, int(cache.kv_offload_size * 2**30), fingerprint)
        self.model_runner.kv_offload = OffloadIO(blocks, tier)
        self.scheduler.attach_kv_offload(RestoreTracker(tier))
        return tier

    def _kv_byte_settings(self) -> dict[str, Any]:
        """The settings that change a block's K/V bytes for the same tokens (the offload tier's and
        the KV transfer's fingerprints include them)."""
        cache = self.config.cache_config
        return {
            "dtype": str(self.dtype),
            "kv_cache_dtype": cache.kv_cache_dtype,
            "block_size": cache.block_size,
            "quantization": dataclasses.asdict(self.config.quant_config),
        }

    def _attach_kv_transfer(self, kv_store: KVStore) -> KVTransferEndpoint | None:
        """Prefill/decode disaggregation (`kv_role` prefill or decode); None when colocated."""
        cache = self.config.cache_config
        if cache.kv_role == "both":
            return None
        if self.parallel is not None:
            raise ConfigError(
                "kv_role prefill/decode with tensor parallelism is not supported yet: each rank holds a part "
                "of every block; run each instance with tensor_parallel_size 1"
            )
        blocks = BlockBytes(kv_store, purpose=f"kv_role {cache.kv_role}")
        fingerprint = transfer_fingerprint(
            self.config.model_config.model, self._kv_byte_settings(), blocks.layout
        )
        endpoint = KVTransferEndpoint(cache, blocks, fingerprint, engine_id=uuid.uuid4().hex)
        if endpoint.client is not None:
            self.scheduler.kv_imports = KVImports(endpoint.client.fetch_async)
            if self.model_runner.kv_offload is None:  # fetched blocks land in the pool as restores do
                self.model_runner.kv_offload = OffloadIO(blocks, None)
        return endpoint

    def accept_kv_transfer(self, request: Request, params: dict[str, Any] | None) -> None:
        """Attach a request's `kv_transfer_params` (server side, before `add_processed_request`);
        InvalidRequestError when this instance's kv_role cannot honour them."""
        if params is None:
            return
        if self.kv_transfer is None:
            # A colocated instance computes the prompt itself and answers without params: vLLM
            # without a KV connector does the same, and a router then decodes with a local prefill.
            return
        self.kv_transfer.accept(request, params)

    def _attach_kv_events(self) -> ZmqEventPublisher | None:
        """The KV event publisher (`kv_events_config`), with the block pool recording for it; None
        without one. Under tensor parallelism the driver's pool is the only one: one stream."""
        cache = self.config.cache_config
        if cache.kv_events_config is None:
            return None
        config = KVEventsConfig.from_json(cache.kv_events_config)
        if not config.publishes:
            return None
        publisher = ZmqEventPublisher(config)
        self.scheduler.kv_cache_manager.block_pool.kv_events = KVEventLog(cache.block_size)
        logger.info("KV events: publishing on %s (replay: %s)", config.endpoint, config.replay_endpoint)
        return publisher

    def close(self) -> None:
        """Flush and close what runs beside the steps: the offload tier's writes (the pool's cached
        blocks first, so that a restart finds them), the KV event publisher's sends. The engine must
        not step afterwards."""
        if self.kv_offload_tier is not None:
            self._save_pool_to_tier()
            self.kv_offload_tier.close()  # the blocks queued for the tier reach the disk
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()

    def _save_pool_to_tier(self) -> None:
        """Every block of the prefix-cache index the tier lacks, written before the process goes:
        the tier otherwise holds only what was evicted, and a restart would recompute the prefixes
        the pool still held. Most recently used last, so that a tier too small keeps those (its
        LRU drops the oldest writes first)."""
        io, tier = self.model_runner.kv_offload, self.kv_offload_tier
        assert tier is not None
        if io is None:
            return
        pool = self.scheduler.kv_cache_manager.block_pool
        # Free cached blocks in eviction order (least recently used first), then the ones in use.
        cached = [b for b in pool.free_block_queue.values() if b.block_hash is not None]
        cached += [b for b in pool.blocks[1:] if b.ref_cnt > 0 and b.block_hash is not None]
        start, saved = time.monotonic(), 0
        for block in cached:
            assert block.block_hash is not None
            if not tier.refresh(block.block_hash):
                tier.store(block.block_hash, io.blocks.read(block.block_id))
                saved += 1
        if saved:
            logger.info(
                "KV offload tier: %d cached blocks of the pool queued to disk at shutdown (%.2f s)",
                saved,
                time.monotonic() - start,
            )

    def _make_model_runner(self, loaded: LoadedModel, kv_store: KVStore) -> ModelRunner:
        """This process's runner; under tensor parallelism the driver's, which steps the other ranks too."""
        m = self.config.model_config
        if self.parallel is not None:
            return self.parallel.model_runner(loaded.model, kv_store, self.tokenizer.eos_token_ids, m.seed)
        return ModelRunner(
            loaded.model, kv_store, self.tokenizer.eos_token_ids, m.seed, m.enforce_eager, m.batch_invariant
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _tokenize(self, prompt: Prompt, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        vocab = self.arch.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return None, ids

    def make_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).

        `add_special_tokens=False` for text that already carries them (a rendered chat template).
        `priority`: lower first, under scheduling_policy "priority" (refused, unless 0, under fcfs).
        Raises InvalidRequestError / PromptTooLongError."""
        params = sampling_params or SamplingParams()
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority}: this engine schedules first come, first served; start it with "
                "--scheduling-policy priority"
            )
        grammar = self.structured.prepare(params)  # a bad schema / regex / grammar raises here
        if params.prompt_logprobs is not None and self.parallel is not None:
            # The workers compute the LM head's shards only for the rows rank 0 samples (the step
            # message carries no prompt-logprob rows): an extra gather on rank 0 would wait forever.
            raise InvalidRequestError("prompt_logprobs is not supported with tensor parallelism yet")
        text, prompt_ids = self._tokenize(prompt, add_special_tokens)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens; with at least one output token it does not fit "
                f"in max_model_len={self.max_model_len}"
            )
        request = Request(
            request_id if request_id is not None else f"req-{next(self._request_counter)}",
            prompt_ids,
            params,
            self.tokenizer.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            prompt=text,
            priority=priority,
        )
        request.structured_state = grammar
        return request

    def add_processed_request(self, request: Request) -> str:
        """Queue a request built by `make_request`; returns its id. Nothing is left behind when it
        raises (its detokenizer is built first, then the scheduler takes it)."""
        if request.request_id in self.output_processor.states:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.output_processor.add_request(request)
        try:
            self.scheduler.add_request(request)
        except BaseException:
            del self.output_processor.states[request.request_id]
            raise
        request.timeline.added_time = time.monotonic()
        if request.structured_state is not None:
            self.structured.submit(request)  # compiles off this thread; the scheduler skips it till then
        return request.request_id

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Validate, tokenize and queue a request; returns its id. Raises InvalidRequestError."""
        return self.add_processed_request(
            self.make_request(request_id, prompt, sampling_params, arrival_time, priority=priority)
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._finish(ids, RequestStatus.FINISHED_ABORTED)

    def _finish(
        self,
        request_ids: list[str],
        status: RequestStatus,
        stop_reason: str | None = None,
        error: str | None = None,
    ) -> None:
        states = [self.output_processor.states[i] for i in request_ids if i in self.output_processor.states]
        self.scheduler.finish_requests(request_ids, status)
        for request_id in request_ids:
            self.structured.drop(request_id)
        for state in states:
            if stop_reason is not None:  # a stop string wins over a length cap hit by the same token
                state.request.status = status
                state.request.stop_reason = stop_reason
            output = self.output_processor.finish(state.request, error)
            if output is not None:
                self._pending_outputs.append(output)

    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        if self.structured.num_pending:
            self._poll_grammars()
        scheduler_output = self.scheduler.schedule()
        if self.scheduler.kv_imports is not None:  # decode role: prompts whose KV never arrived
            for request_id, reason in self.scheduler.kv_imports.take_failures():
                self._finish(
                    [request_id], RequestStatus.FINISHED_ABORTED, error=f"KV transfer failed: {reason}"
                )
        if self.structured.num_pending and scheduler_output.is_empty:
            self.structured.wait_for_compile(IDLE_WAIT_S)  # nothing else to run: don't spin
        if scheduler_output.is_empty and self.scheduler.waiting:
            self.scheduler.wait_for_restores(IDLE_WAIT_S)
        grammar_bitmask = self.structured.fill_bitmask(scheduler_output, self.scheduler.requests)
        if grammar_bitmask is not None:  # filled in the mask thread while the forward pass runs
            scheduler_output = dataclasses.replace(scheduler_output, grammar_bitmask=grammar_bitmask)
        # Even an empty schedule goes through update: it reports requests the scheduler finished
        # itself (e.g. one that outgrew the whole KV pool).
        try:
            runner_output = self.model_runner.execute_model(scheduler_output)
        except Exception as exc:  # the whole batch failed: fail its requests, keep the engine serving
            runner_output = self._fail_step(scheduler_output, exc)
            if isinstance(exc, WorkerDiedError):  # ...unless a tensor-parallel rank is gone: no step can run
                raise
        if grammar_bitmask is not None:
            grammar_bitmask.future.exception()  # the matchers are the mask thread's until it is done
        self._fail_requests(runner_output.failed)
        for request_id, (first, entries) in runner_output.prompt_logprobs.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.output_processor.add_prompt_logprobs(request, first, entries)
        num_emitted = 0
        exported: list[Request] = []
        for update in self.scheduler.update_from_output(scheduler_output, runner_output):
            num_emitted += len(update.new_token_ids)
            self._process_update(update, runner_output.logprobs.get(update.request.request_id))
            if update.request.structured_state is not None and update.new_token_ids:
                self._advance_grammar(update)
            if update.request.kv_export and update.request.is_finished:
                exported.append(update.request)
        if exported:
            self._export_kv(exported)
        if self.proposer is not None:
            self._record_spec_step(scheduler_output, start, num_emitted)
            self._propose()
        outputs, self._pending_outputs = self._pending_outputs, []
        self.last_step_stats = self._step_stats(scheduler_output, start)
        self._publish_kv_events()
        return outputs

    def _export_kv(self, requests: list[Request]) -> None:
        """Prefill role: finished prompts' KV copied out for their decode instance (before the next
        step can evict it); the answer goes on each one's final output as kv_transfer_params."""
        assert self.kv_transfer is not None
        pool = self.scheduler.kv_cache_manager.block_pool
        answers = {}
        for request in requests:
            if request.status is not RequestStatus.FINISHED_ABORTED:
                answers[request.request_id] = self.kv_transfer.export(
                    request, pool, self.config.cache_config.block_size
                )
        for output in self._pending_outputs:
            if output.request_id in answers:
                output.kv_transfer_params = answers[output.request_id]

    def _publish_kv_events(self) -> None:
        """The step's prefix-cache changes as one batch: blocks cached by its allocations, blocks
        evicted for them, blocks dropped after a failure."""
        event_log = self.scheduler.kv_cache_manager.block_pool.kv_events
        if self.kv_event_publisher is not None and event_log is not None:
            self.kv_event_publisher.publish(event_log.take())

    def _poll_grammars(self) -> None:
        """Requests whose grammar finished compiling become schedulable; failed compiles end theirs."""
        for request, error in self.structured.poll():
            self._finish([request.request_id], RequestStatus.FINISHED_ABORTED, error=error)

    def _advance_grammar(self, update: RequestUpdate) -> None:
        """The matcher follows the request's new output tokens; a finished grammar ends the request
        (stop), as vLLM does, without spending a step on an EOS it would force anyway."""
        request = update.request
        error = self.structured.accept(request, update.new_token_ids)
        if request.is_finished or request.request_id not in self.output_processor.states:
            return
        if error is not None:
            self._finish([request.request_id], RequestStatus.FINISHED_ABORTED, error=error)
        elif request.structured_state.is_terminated:
            self._finish([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _record_spec_step(self, scheduler_output: SchedulerOutput, start: float, num_emitted: int) -> None:
        """Decode-only steps feed the speculation controller (a prefill chunk would blur the timing)."""
        scheduled = scheduler_output.scheduled
        if scheduled and all(s.is_decode for s in scheduled):
            speculative = any(s.num_spec_tokens for s in scheduled)
            seconds = time.monotonic() - start + self._propose_seconds
            self.spec_controller.record(len(scheduled), seconds, speculative, num_emitted)
        self._propose_seconds = 0.0

    def _propose(self) -> None:
        assert self.proposer is not None
        running = self.scheduler.running
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        if not self.spec_controller.should_propose(len(decoding)):
            for request in running:
                request.spec_token_ids, request.spec_draft_probs = [], None
            return
        started = time.monotonic()
        self.proposer.propose(running)
        self.structured.check_drafts(running)  # constrained requests: drafts cut where the grammar says no
        self._propose_seconds = time.monotonic() - started

    def _process_update(self, update: RequestUpdate, logprobs: list[TokenLogprobs] | None) -> None:
        rid = update.request.request_id
        try:
            output, stop_str = self.output_processor.process(update, logprobs)
        except Exception as exc:  # one request's processing failed: only that request ends
            logger.exception("processing the output of request %s failed", rid)
            self._finish([rid], RequestStatus.FINISHED_ABORTED, error=f"{type(exc).__name__}: {exc}")
            return
        if stop_str is not None:
            self._finish([rid], RequestStatus.FINISHED_STOPPED, stop_reason=stop_str)
        elif output is not None:
            self._pending_outputs.append(output)

    def _fail_requests(self, failed: dict[str, str]) -> None:
        """End the requests whose own part of the step failed (the runner isolated them); finished
        before the update, they are skipped by it and the rest of the batch advances."""
        for request_id, error in failed.items():
            logger.warning("request %s failed in the model step: %s", request_id, error)
            self._finish([request_id], RequestStatus.FINISHED_ABORTED, error=error)

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> ModelRunnerOutput:
        logger.exception(
            "the model step failed; failing the %d requests in it", len(scheduler_output.scheduled)
        )
        ids = [s.request_id for s in scheduler_output.scheduled]
        self._finish(
            ids, RequestStatus.FINISHED_ABORTED, error=f"model step failed: {type(exc).__name__}: {exc}"
        )
        # Blocks allocated for this step were indexed for prefix reuse but hold no valid K/V.
        self.scheduler.kv_cache_manager.block_pool.evict_free_cached_blocks()
        return ModelRunnerOutput()

    def _step_stats(self, scheduler_output: SchedulerOutput, start: float) -> StepStats:
        num_decode = sum(s.num_tokens for s in scheduler_output.scheduled if s.is_decode)
        # Keys each chunk's queries attend (causal: n tokens after c computed see n x (c + (n + 1) / 2)),
        # in total and by the query rows (kvflow/query_rows.py); one pass, once per step.
        attention, row_attention, row_prefill = 0.0, 0.0, 0
        for s in scheduler_output.scheduled:
            n = len(s.token_ids)
            keys = n * (s.num_computed_tokens + (n + 1) / 2)
            attention += keys
            if is_query_row_chunk(n):
                row_attention += keys
                row_prefill += 0 if s.is_decode else n
        spec, self.scheduler.spec_stats = self.scheduler.spec_stats, SpecDecodeStats()
        self.spec_stats.merge(spec)
        return StepStats(
            start_time=start,
            duration=time.monotonic() - start,
            num_prefill_tokens=scheduler_output.num_batched_tokens - num_decode,
            num_decode_tokens=num_decode,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.scheduler.kv_cache_usage,
            num_preemptions=len(scheduler_output.preempted_request_ids),
            spec=spec if spec.num_drafts else None,
            attention_work=attention,
            num_row_prefill_tokens=row_prefill,
            row_attention_work=row_attention,
        )

    @property
    def fatal_error(self) -> str | None:
        """Why no step can run any more (a tensor-parallel rank is gone), else None."""
        return None if self.parallel is None else self.parallel.dead_reason

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

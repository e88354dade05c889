"""Everything the checks read: the model, the roofline, the measured run, the server's settings, and
the quantities derived from them once (prefill cost per token, the simulator calibrated on the run,
the KV pool), each with where it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from kvflow.doctor.calibrate import Calibration, calibrate
from kvflow.doctor.deployment import Deployment, plan_deployment
from kvflow.doctor.evidence import RunEvidence
from kvflow.doctor.kv_kinds import DEFAULT_BLOCK_SIZE, prefix_hit_granularity
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import Roofline
from kvflow.doctor.server_settings import EngineSettings
from kvflow.doctor.step_profile import StepProfile
from kvflow.kv_cache.kv_cache_config import KVCacheConfig

# Servers that allocate KV per token when they do not say otherwise (Diagnosis.block_size).
TOKEN_GRANULAR_SERVERS = ("llama.cpp", "sglang")
# Prefix caching counts as effective when it serves at least half of the repeated tokens.
EFFECTIVE_CACHE_FRACTION = 0.5


@dataclass
class Diagnosis:
    model: ModelSpec
    roofline: Roofline
    run: RunEvidence
    settings: EngineSettings
    measured: bool  # False in calculator mode (no benchmark)
    # Decode tokens/s per weight format measured on this machine (kvflow quant-eval, cached), if any.
    quant_speeds: dict[str, float] = field(default_factory=dict)
    # TPOT p50 per weight format served on this machine to one client (kvflow/doctor/quant_served.py).
    quant_served_tpot_ms: dict[str, float] = field(default_factory=dict)
    # The engine's measured step-time curves for this model and machine (kvflow profile-steps), if any.
    step_profile: StepProfile | None = None

    @cached_property
    def deployment(self) -> Deployment:
        """The fewest devices and the layouts that hold the weights and the planned requests' KV
        (kvflow/doctor/deployment.py): the running capacity at p95 length, decoding at the run's
        context."""
        run = self.run
        return plan_deployment(
            self.roofline,
            self.running_capacity,
            max(1, round(run.request_len_p95)),
            max(1, round(run.decode_context)),
        )

    # ------------------------------------------------------------------------------- the server

    @cached_property
    def calibration(self) -> Calibration | None:
        """The simulator fitted to this run's step times (kvflow servers with /metrics only)."""
        if not self.measured:
            return None
        return calibrate(self.run, self.settings, self.model, self.roofline.kv_dtype, self.step_profile)

    @property
    def decode_batch(self) -> int:
        batch = max(1, round(self.run.concurrency))
        if self.settings.max_num_seqs is not None:
            batch = min(batch, self.settings.max_num_seqs)
        return batch

    @property
    def running_capacity(self) -> int:
        """Requests the server runs at once for this load: the clients, capped by max_num_seqs."""
        wanted = math.ceil(self.run.concurrency)
        return min(wanted, self.settings.max_num_seqs) if self.settings.max_num_seqs else wanted

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len or self.model.arch.max_position_embeddings

    @property
    def block_size(self) -> int:
        """The server's KV allocation unit in tokens: what it reports, else llama.cpp's and SGLang's
        (KV cells per token; SGLang's default page_size is 1) or kvflow's and vLLM's 16."""
        if self.settings.block_size:
            return self.settings.block_size
        return 1 if self.settings.server in TOKEN_GRANULAR_SERVERS else DEFAULT_BLOCK_SIZE

    # ------------------------------------------------------------------------------- prefill

    @cached_property
    def prefill_slope(self) -> tuple[float | None, str]:
        """(ms per uncached prompt token, how it was measured): the marginal cost of a prompt token,
        what caching or cutting tokens saves."""
        if not self.measured:
            return None, "not measured"
        if self.calibration is not None:
            return self.calibration.cost.per_token_ms, "fitted to the server's step times by kind"
        from_steps = self._prefill_ms_per_token_from_steps()
        if from_steps is not None:
            return from_steps, "the server's step times by kind"
        busy = self.run.prefill_busy_ms_per_token()
        if busy is not None:
            return busy, "client: time with a prompt in prefill / prompt tokens (batched prompts share it)"
        return None, "not measured"

    def measured_prefill_ms_per_token(self) -> float | None:
        return self.prefill_slope[0]

    def _prefill_ms_per_token_from_steps(self) -> float | None:
        """(prefill_only steps beyond a bare step + mixed steps beyond a decode-only step) / prefill
        tokens computed, recomputes after preemption included (they are prefill work too)."""
        run = self.run
        decode_step = run.step_time_ms("decode_only")
        steps = run.server.get("step_time_ms") or {}
        if not steps or decode_step is None:
            return None
        prefill_tokens = self.prefill_tokens_computed()
        if prefill_tokens is None or prefill_tokens <= 0:
            return None
        total = 0.0
        for kind in ("prefill_only", "mixed"):
            mean = run.step_time_ms(kind)
            if mean is not None:
                total += run.step_count(kind) * max(mean - decode_step, 0.0)
        return total / prefill_tokens if total > 0 else None

    def prefill_tokens_computed(self) -> float | None:
        """Prompt tokens computed over the run (cache hits excluded), recomputes included when the
        server counts every step's tokens: computed - decode tokens (one per output after the first,
        and the token that ends each recompute is sampled, not decoded)."""
        server = self.run.server
        prompt, hits = self.run.counter("prompt_tokens"), self.run.counter("prefix_cache_hits") or 0.0
        if prompt is None:
            return None
        computed, generated = self.run.counter("computed_tokens"), self.run.counter("generation_tokens")
        finished = self.run.counter("requests_finished") or float(self.run.num_requests)
        if computed is not None and generated is not None:
            decode = generated - finished - (self.run.preemptions or 0.0)
            return max(computed - decode, prompt - hits)
        return prompt - hits if server else None

    def step_in_progress_ms(self) -> float:
        """What a request arriving at a random moment waits for the step in progress to end: the
        mean residual of the step times, E[T^2] / (2 E[T]) over the server's steps by kind. Part of
        every queue time, set by how long steps are (their prefill chunks), not by a queue."""
        run = self.run
        weights = [(run.step_count(k), run.step_time_ms(k)) for k in ("decode_only", "mixed", "prefill_only")]
        busy = sum(n * t for n, t in weights if t is not None)
        if busy <= 0:
            return 0.0
        return sum(n * t * t for n, t in weights if t is not None) / (2 * busy)

    def roofline_prefill_ms_per_token(self) -> float:
        n = max(1, round(self.run.prompt_p50))
        return 1e3 * self.roofline.prefill(n).seconds / n

    def roofline_decode_ms(self, weight_dtype: str | None = None, kv_dtype: str | None = None) -> float:
        roof = self.roofline
        if weight_dtype or kv_dtype:
            roof = replace(
                roof, weight_dtype=weight_dtype or roof.weight_dtype, kv_dtype=kv_dtype or roof.kv_dtype
            )
        return 1e3 * roof.decode_step(self.runnable_batch, round(self.run.decode_context)).seconds

    # ------------------------------------------------------------------------------- prefix reuse

    def prefix_cache_effective(self) -> bool:
        share, hit = self.run.shared_prefix_share, self.run.prefix_hit_rate
        if self.settings.enable_prefix_caching is False:
            return False
        if share and hit is not None:
            return hit >= EFFECTIVE_CACHE_FRACTION * share
        return bool(self.settings.enable_prefix_caching)

    def uncached_repeat_tokens(self) -> float:
        """Repeated prompt tokens per request the server still computes."""
        run = self.run
        if not run.shared_prefix_p50 or self.prefix_cache_effective():
            return 0.0
        return run.shared_prefix_p50

    def cacheable_tokens(self) -> float:
        """Of the uncached repeated tokens, the whole blocks a prefix cache can serve (with linear
        attention, whole checkpoint intervals: kvflow/doctor/kv_kinds.py prefix_hit_granularity)."""
        step = prefix_hit_granularity(self.model.kv_cache_config(self.roofline.kv_dtype, self.block_size))
        return step * math.floor(self.uncached_repeat_tokens() / step)

    def uncached_prompt_tokens(self) -> float:
        """Prompt tokens per request (p50) the server computes once caching does what it can."""
        cached_now = self.run.prompt_p50 * (self.run.prefix_hit_rate or 0.0)
        return max(self.run.prompt_p50 - cached_now - self.cacheable_tokens(), 0.0)

    # ------------------------------------------------------------------------------- memory

    @property
    def kv_pool_known(self) -> bool:
        return self.settings.kv_pool_tokens is not None

    @cached_property
    def kv_config(self) -> KVCacheConfig:
        """The server's cache groups (its KV dtype and block size; kvflow/doctor/kv_kinds.py)."""
        return self.model.kv_cache_config(self.roofline.kv_dtype, self.block_size)

    def kv_bytes_per_request(self, num_tokens: int) -> int:
        """Pool bytes one request of `num_tokens` tokens holds: its blocks in every cache group."""
        return self.kv_config.bytes_held(max(num_tokens, 1))

    def kv_pool_bytes(self) -> float:
        tokens = self.settings.kv_pool_tokens
        if tokens is not None:  # blocks (tokens / block size) x a block's bytes in every layer slot
            return tokens / self.block_size * self.kv_config.bytes_per_block
        return self.roofline.default_kv_pool_bytes()

    def max_concurrency(self) -> int:
        """Whole requests of p95 length the pool holds at once."""
        length = max(1, round(self.run.request_len_p95))
        return math.floor(self.roofline.max_concurrency(self.kv_pool_bytes(), length, self.block_size))

    @property
    def runnable_batch(self) -> int:
        """The decode batch that can actually run: the observed one, capped by what the KV pool holds
        (calculator mode: a concurrency beyond the card is not run at all)."""
        return (
            max(1, min(self.decode_batch, self.max_concurrency())) if not self.measured else self.decode_batch
        )

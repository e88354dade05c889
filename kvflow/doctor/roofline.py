"""Roofline time of each phase and the memory budget (formulas in docs/doctor.md).

prefill(n new tokens, context c) = max(FLOPs / peak FLOP/s, bytes / bandwidth)
    FLOPs = 2 x layer params x n + 2 x LM-head params (logits of the last position only, as
            vLLM and kvflow compute them) + attention: 4 x n x keys x q_heads x head_dim per layer,
            keys = c (full), min(c, window) (sliding), none for linear attention (a fixed cost
            per token: ModelSpec.attention_flops)
    bytes = weight bytes + n tokens' K/V written per attention layer + the keys read (c per full
            layer, min(c, window) per sliding one) + linear-attention states read and written
decode step(batch b, context c) = max(FLOPs / peak, bytes / bandwidth)
    FLOPs = 2 x (layer + LM-head params) x b + attention of b queries over c
    bytes = weight bytes read per step + b x cache bytes a sequence's step moves (by kind,
            kvflow/doctor/kv_kinds.py: L tokens per full layer, the window per sliding one, 2 x the
            state per linear-attention one)
max concurrency at length L = KV pool bytes / KV bytes a request of L tokens holds (its blocks in
    every cache group: kvflow/doctor/kv_kinds.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.doctor.hardware import Hardware
from kvflow.doctor.kv_kinds import DEFAULT_BLOCK_SIZE
from kvflow.doctor.model_spec import ModelSpec

# Accelerators cannot give all their memory to weights + KV (activations, CUDA graphs, allocator
# slack): vLLM's default gpu_memory_utilization.
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class PhaseTime:
    seconds: float
    compute_s: float
    memory_s: float
    uncertainty: float = 0.0  # the hardware figures' relative spread

    @property
    def bound(self) -> str:
        """compute / memory, or "either" when the two times differ by less than the figures behind
        them are known: a measured machine's drift must not flip the verdict."""
        lo, hi = sorted((self.compute_s, self.memory_s))
        if hi <= lo * (1.0 + 2.0 * self.uncertainty):
            return "either"
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class Roofline:
    model: ModelSpec
    hardware: Hardware
    weight_dtype: str
    kv_dtype: str

    @property
    def flops_per_s(self) -> float:
        return self.hardware.flops_for(self.weight_dtype)

    def prefill(self, num_tokens: int, context_len: int | None = None) -> PhaseTime:
        m = self.model
        c = context_len if context_len is not None else num_tokens
        flops = (
            2.0 * m.active_layer_params * num_tokens
            + 2.0 * m.embedding_params
            + m.attention_flops(num_tokens, c)
        )
        weights = m.decode_weight_bytes(self.weight_dtype, num_tokens)  # MoE: the experts touched
        nbytes = weights + m.prefill_kv_bytes(num_tokens, c, self.kv_dtype)
        return self._time(flops, nbytes)

    def prefill_ms_per_token(self, num_tokens: int = 512) -> float:
        return 1e3 * self.prefill(num_tokens).seconds / num_tokens

    def decode_step(self, batch: int, context_len: int) -> PhaseTime:
        return self._time(self.decode_flops(batch, context_len), self.decode_bytes(batch, context_len))

    def decode_flops(self, batch: int, context_len: int) -> float:
        m = self.model  # a MoE model's tokens multiply only their top_k experts (active parameters)
        return 2.0 * m.matmul_params * batch + m.attention_flops(batch, context_len)

    def decode_bytes(self, batch: int, context_len: int) -> float:
        m = self.model  # a MoE step reads the experts its `batch` tokens touch
        kv_bytes = batch * m.decode_kv_bytes(context_len, self.kv_dtype)
        return m.decode_weight_bytes(self.weight_dtype, batch) + kv_bytes

    def _time(self, flops: float, nbytes: float) -> PhaseTime:
        compute = flops / self.flops_per_s
        memory = nbytes / self.hardware.bandwidth_bytes_s
        return PhaseTime(max(compute, memory), compute, memory, self.hardware.uncertainty)

    # ---------------------------------------------------------------------------------- memory

    def default_kv_pool_bytes(self) -> float:
        """What a server would give the KV pool on this hardware when no engine config says."""
        hw = self.hardware
        usable = hw.memory_bytes * (
            GPU_MEMORY_UTILIZATION if "NVIDIA" in hw.name or "AMD" in hw.name else 0.5
        )
        return max(0.0, usable - self.model.weight_bytes(self.weight_dtype))

    def max_concurrency(
        self, kv_pool_bytes: float, request_len: int, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> float:
        """Requests of `request_len` tokens the pool holds: its bytes over what one request's blocks
        take in every cache group (the allocator's count, kvflow/kv_cache/kv_cache_config.py)."""
        return kv_pool_bytes / self.model.kv_bytes_per_request(request_len, self.kv_dtype, block_size)

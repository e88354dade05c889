"""What tensor parallelism over N ranks does to one model (the calculator's --tensor-parallel-size;
kvflow/parallel/ shards the same way, Megatron-style as vLLM):

per-rank weights = (layer linears with the KV projections) / N + the KV projections a rank holds
                   (when N > KV heads each rank keeps a whole KV head: replicated)
                   + (embedding + LM head) / N + norms (replicated)
per-rank KV bytes/token = 2 x layers x max(1, kv_heads / N) x head_dim x bytes (a decode step reads
                   that share of what a sequence's step reads, by cache kind: kvflow/doctor/kv_kinds.py)
all-reduce bytes per token and rank = (2 x layers + 1) x hidden x activation bytes
                   (o_proj and down_proj of every layer, and the vocab-parallel embedding)
logits gather per sampled token and rank = ceil(V / N) x activation bytes (to rank 0, which samples)
decode step per rank = max(FLOPs / N / peak, per-rank bytes read / bandwidth), the hardware figures
                   being one rank's (one GPU, or one CPU socket with its memory per rank); the
                   all-reduces add their latency, which only a measurement gives
                   (benchmarks/tensor_parallel.py prints it per step).
Torch-free like the rest of the doctor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.arch_config import ArchConfig
from kvflow.doctor.model_spec import DTYPE_BYTES, ModelSpec, weight_bytes_per_param
from kvflow.doctor.roofline import PhaseTime, Roofline


@dataclass(frozen=True)
class TensorParallelEstimate:
    tensor_parallel_size: int
    kv_heads_per_rank: int
    kv_replicated: bool
    weight_bytes_per_rank: float
    weight_bytes_single: float
    kv_bytes_per_token_per_rank: float
    all_reduces_per_step: int
    all_reduce_bytes_per_token: float
    logits_gather_bytes_per_token: float
    decode_single: PhaseTime
    decode_per_rank: PhaseTime
    batch: int
    context_len: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "kv_replicated": self.kv_replicated,
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "weight_bytes_single": self.weight_bytes_single,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token_per_rank,
            "all_reduces_per_step": self.all_reduces_per_step,
            "all_reduce_bytes_per_token": self.all_reduce_bytes_per_token,
            "logits_gather_bytes_per_token": self.logits_gather_bytes_per_token,
            "decode_ms_single": 1e3 * self.decode_single.seconds,
            "decode_ms_per_rank": 1e3 * self.decode_per_rank.seconds,
            "decode_bound_per_rank": self.decode_per_rank.bound,
            "batch": self.batch,
            "context_len": self.context_len,
        }

    def text(self) -> str:
        n = self.tensor_parallel_size
        kv = f"{self.kv_heads_per_rank} KV head(s) per rank" + (" (replicated)" if self.kv_replicated else "")
        single, rank = self.decode_single, self.decode_per_rank
        return "\n".join(
            [
                f"tensor parallel x{n}: weights {self.weight_bytes_per_rank / 2**30:.2f} GiB per rank "
                f"(one process: {self.weight_bytes_single / 2**30:.2f} GiB); {kv}, KV "
                f"{self.kv_bytes_per_token_per_rank / 1024:.1f} KiB per token per rank",
                f"  per token and rank: {self.all_reduces_per_step} all-reduces of "
                f"{self.all_reduce_bytes_per_token / self.all_reduces_per_step:.0f} B = "
                f"{self.all_reduce_bytes_per_token / 1024:.1f} KiB, logits gather "
                f"{self.logits_gather_bytes_per_token / 1024:.1f} KiB per sampled token",
                f"  decode step (batch {self.batch}, context {self.context_len}): "
                f"{1e3 * rank.seconds:.2f} ms per rank ({rank.bound}-bound) vs {1e3 * single.seconds:.2f} ms "
                f"in one process: at most {single.seconds / rank.seconds:.2f}x, before the all-reduce "
                "latency (benchmarks/tensor_parallel.py measures it)",
            ]
        )


def splits_heads(arch: ArchConfig, n: int) -> bool:
    """n ranks split the attention heads evenly, and the KV heads (each rank a share, or each KV head
    on n / KV heads ranks)."""
    kv = arch.num_key_value_heads
    return arch.num_attention_heads % n == 0 and (kv % n == 0 or n % kv == 0)


def kv_heads_per_rank(arch: ArchConfig, n: int) -> int:
    """KV heads one of n ranks holds (a whole one, replicated, when n > KV heads)."""
    return max(1, arch.num_key_value_heads // n)


def estimate(
    model: ModelSpec, roofline: Roofline, tensor_parallel_size: int, batch: int, context_len: int
) -> TensorParallelEstimate:
    a = model.arch
    n = tensor_parallel_size
    if a.moe is not None or a.mla is not None:
        raise ValueError(
            "tensor-parallel estimates cover dense llama-family models (kvflow shards only those)"
        )
    if not splits_heads(a, n) or a.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size {n} does not split {a.num_attention_heads} heads / "
            f"{a.num_key_value_heads} KV heads / intermediate {a.intermediate_size} (kvflow refuses it too)"
        )
    layers, h, d = a.num_hidden_layers, a.hidden_size, a.head_dim
    kv_rank = kv_heads_per_rank(a, n)
    kv_proj = 2 * h * a.num_key_value_heads * d + (2 * a.num_key_value_heads * d if a.qkv_bias else 0)
    kv_proj_rank = 2 * h * kv_rank * d + (2 * kv_rank * d if a.qkv_bias else 0)
    norms = 2 * h + (2 * d if a.qk_norm else 0)
    linears = model.layer_params - layers * (norms + kv_proj)
    linears_rank = linears / n + layers * kv_proj_rank
    base = weight_bytes_per_param(model.dtype)
    per_param = model.layer_bytes_per_param(roofline.weight_dtype)
    replicated = (layers * norms + model.norm_params) * base
    embed_rank = (model.embedding_params + model.lm_head_params) / n * base
    weights_rank = linears_rank * per_param + embed_rank + replicated
    # A decode step reads the LM head once; tied, it is the embedding's storage (decode_weight_bytes).
    decode_embed_rank = model.embedding_params / n * base
    decode_weights_rank = linears_rank * per_param + decode_embed_rank + replicated
    kv_rank_bytes = model.kv_bytes_per_token(roofline.kv_dtype) * kv_rank / a.num_key_value_heads
    act = DTYPE_BYTES.get(model.dtype, 2.0) if model.dtype not in ("int8", "int4") else 2.0
    all_reduces = 2 * layers + 1
    decode_flops = roofline.decode_flops(batch, context_len) / n
    # Each rank holds its KV heads' share of every attention layer's cache (by kind: kv_kinds.py).
    kv_share = kv_rank / a.num_key_value_heads
    decode_bytes = (
        decode_weights_rank + batch * model.decode_kv_bytes(context_len, roofline.kv_dtype) * kv_share
    )
    hw = roofline.hardware
    compute, memory = decode_flops / roofline.flops_per_s, decode_bytes / hw.bandwidth_bytes_s
    per_rank = PhaseTime(max(compute, memory), compute, memory, hw.uncertainty)
    return TensorParallelEstimate(
        tensor_parallel_size=n,
        kv_heads_per_rank=kv_rank,
        kv_replicated=a.num_key_value_heads < n,
        weight_bytes_per_rank=weights_rank,
        weight_bytes_single=model.weight_bytes(roofline.weight_dtype),
        kv_bytes_per_token_per_rank=kv_rank_bytes,
        all_reduces_per_step=all_reduces,
        all_reduce_bytes_per_token=all_reduces * h * act,
        logits_gather_bytes_per_token=-(-a.vocab_size // n) * act,
        decode_single=roofline.decode_step(batch, context_len),
        decode_per_rank=per_rank,
        batch=batch,
        context_len=context_len,
    )

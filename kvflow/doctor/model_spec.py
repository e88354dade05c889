"""What a model costs, from its config.json alone: parameters, weight bytes, KV bytes per token, FLOPs.

Counting (formulas in docs/doctor.md):
    embedding        vocab x hidden
    per layer        q: hidden x (q_heads x head_dim), k and v: hidden x (kv_heads x head_dim) each
                     (GQA/MQA: kv_heads < q_heads), o: (q_heads x head_dim) x hidden, biases when the
                     architecture has them, MLP: 3 x hidden x intermediate (gate, up, down), 2 RMSNorms
                     (+ q/k norms for Qwen3)
    final norm       hidden
    LM head          vocab x hidden, unless tied to the embedding (then stored once)
    KV per token     2 (K, V) x layers x kv_heads x head_dim x bytes per element
Matmul FLOPs per token = 2 x (parameters that multiply activations) = 2 x (all but the embedding
table, which is a gather; with tied embeddings the LM head still multiplies, so it counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvflow.arch_config import ArchConfig, load_hf_config, parse_arch_config

# Bytes per element of each storage format; int4 adds one 16-bit scale (and for asymmetric
# quantization one zero point) per group: at group size 128, 0.5 + 4/128 bytes per weight.
DTYPE_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,  # kvflow's --kv-cache-dtype spelling
    "int8": 1.0,
    "int4": 0.5,
}
INT4_GROUP_SIZE = 128
GROUP_OVERHEAD_BYTES = 4.0  # bf16 scale + bf16 zero point per group
INT8_CHANNEL_OVERHEAD = 2.0  # one bf16 scale per output channel (negligible, counted per row)


def weight_bytes_per_param(dtype: str) -> float:
    if dtype == "int4":
        return DTYPE_BYTES["int4"] + GROUP_OVERHEAD_BYTES / INT4_GROUP_SIZE
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: ArchConfig
    embedding_params: int
    layer_params: int  # all decoder layers together
    lm_head_params: int  # 0 when tied (the embedding's storage is reused)
    norm_params: int  # the final norm
    dtype: str  # the checkpoint's weight dtype

    @classmethod
    def from_config(cls, config: dict[str, object], name: str = "model") -> ModelSpec:
        arch = parse_arch_config(dict(config))
        h, q, kv, d = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        attn = h * q * d + 2 * h * kv * d + q * d * h
        if arch.qkv_bias:
            attn += q * d + 2 * kv * d
        if arch.o_bias:
            attn += h
        mlp = 3 * h * arch.intermediate_size + (2 * arch.intermediate_size + h if arch.mlp_bias else 0)
        norms = 2 * h + (2 * d if arch.qk_norm else 0)
        embedding = arch.vocab_size * h
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return cls(
            name=name,
            arch=arch,
            embedding_params=embedding,
            layer_params=arch.num_hidden_layers * (attn + mlp + norms),
            lm_head_params=0 if arch.tie_word_embeddings else embedding,
            norm_params=h,
            dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        path = Path(model_dir)
        return cls.from_config(load_hf_config(path), name=path.name)

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.layer_params + self.lm_head_params + self.norm_params

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: layers + LM head (tied or not); the embedding is a gather."""
        return self.layer_params + self.embedding_params  # the LM head has the embedding's shape

    def weight_bytes(self, dtype: str | None = None, quantize_embeddings: bool = False) -> float:
        """Bytes of all weights; quantization applies to the linear layers (embedding and LM head stay
        in the model dtype unless `quantize_embeddings`), as kvflow and GPTQ/AWQ checkpoints do."""
        base = weight_bytes_per_param(self.dtype)
        per_param = weight_bytes_per_param(dtype or self.dtype)
        embed_like = self.embedding_params + self.lm_head_params
        embed_bytes = embed_like * (per_param if quantize_embeddings else base)
        return self.layer_params * per_param + embed_bytes + self.norm_params * base

    def decode_weight_bytes(self, dtype: str | None = None) -> float:
        """Weight bytes read per decode step: every layer and the LM head; of the embedding table
        only the rows gathered (negligible), so a tied model reads its table once, as the LM head."""
        base = weight_bytes_per_param(self.dtype)
        per_param = weight_bytes_per_param(dtype or self.dtype)
        return self.layer_params * per_param + self.embedding_params * base + self.norm_params * base

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        a = self.arch
        return (
            2
            * a.num_hidden_layers
            * a.num_key_value_heads
            * a.head_dim
            * weight_bytes_per_param(kv_dtype or self.dtype)
        )

    def kv_tokens_held(self, context_len: int) -> int:
        """Tokens whose K/V a request of `context_len` tokens keeps: capped at the sliding window."""
        window = self.arch.sliding_window
        return min(context_len, window) if window is not None else context_len

    def attention_flops(self, num_tokens: int, context_len: int) -> float:
        """QK^T and PV for `num_tokens` queries over `context_len` keys: 4 x layers x n x c x q_heads x d
        (2 FLOPs per multiply-add, two matmuls); the window caps the keys each query sees."""
        a = self.arch
        keys = self.kv_tokens_held(context_len)
        return 4.0 * a.num_hidden_layers * num_tokens * keys * a.num_attention_heads * a.head_dim

"""What one token (or one state) of each cache kind costs in bytes, from the model's shapes and the KV
dtype alone (pure Python): one source for the engine's pool (kvflow/attention/kv_store.py) and the
doctor's calculator (kvflow/doctor/kv_kinds.py), so that they cannot disagree.

Per attention layer and token, Hkv KV heads of d dims (kvflow/attention/kv_layer.py's formats):
    plain dtypes    2 x Hkv x d x bytes per element                  (K and V)
    int8 / fp8      2 x Hkv x (d + 2)          an fp16 scale per token, head and K / V
    int4            2 x Hkv x (d / 2 + 4)      an fp16 scale and zero point per token, head and K / V
    MLA latent      (C + dr) x bytes; int8 / fp8 (C + 2) + (dr + 2); int4 (C/2 + 4) + (dr/2 + 4)
                    (the latent and its rotary key are quantized as two parts; latent_kv_layer.py)
                    + DeepSeek-V3.2's indexer key, Di values (a third part: Di + 2 in int8 / fp8)
A linear-attention (Gated DeltaNet) layer keeps per request a state of
    Hv x dk x dv x 4 (the recurrent state, float32 whatever the KV dtype)
  + conv_dim x (kernel - 1) x model-dtype bytes (the short convolution's last inputs)
laid over the K/V data of its pages (token_data_bytes per token: quantized pools' scales unused).
"""

from __future__ import annotations

from kvflow.arch_config import ArchConfig
from kvflow.kv_cache.compressed_kinds import build_compressed_kv_cache_config
from kvflow.kv_cache.kv_cache_config import KVCacheConfig, build_kv_cache_config

# Bytes per element of a plain (unquantized) KV dtype.
PLAIN_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZED_8BIT = ("int8", "fp8", "fp8_e4m3")  # the doctor's and the engine's spellings of fp8
QUANTIZED = (*QUANTIZED_8BIT, "int4")
SCALE_BYTES = 2  # one fp16 scale (or zero point) per token and head
RECURRENT_BYTES = 4  # the delta-rule state is accumulated and kept in float32 (attention/state_pool.py)
INT4_PER_BYTE = 2  # int4 packs two values per byte


def plain_bytes(kv_dtype: str, model_dtype: str) -> int:
    """Bytes per element of an unquantized KV cache: its own dtype (bfloat16 / float16), else the
    model's ("auto"); bf16 when neither is known."""
    return PLAIN_BYTES.get(kv_dtype) or PLAIN_BYTES.get(model_dtype, PLAIN_BYTES["bfloat16"])


def part_bytes(width: int, kv_dtype: str, model_dtype: str) -> int:
    """One part (K or V of one head, or one latent part) of `width` values of one token."""
    if kv_dtype in QUANTIZED_8BIT:
        return width + SCALE_BYTES
    if kv_dtype == "int4":
        return width // INT4_PER_BYTE + 2 * SCALE_BYTES
    return width * plain_bytes(kv_dtype, model_dtype)


def token_bytes(arch: ArchConfig, kv_dtype: str, model_dtype: str) -> int:
    """One token's K/V (or latent, with V3.2's indexer key) in one attention layer, scales included:
    a page is block_size x it. `arch`: with tensor parallelism, one rank's (its KV heads)."""
    if arch.mla is not None:
        return latent_token_bytes(arch, kv_dtype, model_dtype) + index_key_bytes(arch, kv_dtype, model_dtype)
    return 2 * arch.num_key_value_heads * part_bytes(arch.head_dim, kv_dtype, model_dtype)


def latent_token_bytes(arch: ArchConfig, kv_dtype: str, model_dtype: str) -> int:
    """One token's MLA latent [c_kv | k_pe] in one layer (0 without latent attention)."""
    m = arch.mla
    if m is None:
        return 0
    if kv_dtype in QUANTIZED:
        return part_bytes(m.kv_lora_rank, kv_dtype, model_dtype) + part_bytes(
            m.qk_rope_head_dim, kv_dtype, model_dtype
        )
    return m.latent_dim * plain_bytes(kv_dtype, model_dtype)


def index_key_bytes(arch: ArchConfig, kv_dtype: str, model_dtype: str) -> int:
    """One token's DeepSeek-V3.2 indexer key in one layer (0 without an indexer)."""
    if arch.mla is None or arch.mla.indexer is None:
        return 0
    return part_bytes(arch.mla.indexer.head_dim, kv_dtype, model_dtype)


def token_data_bytes(arch: ArchConfig, kv_dtype: str, model_dtype: str) -> int:
    """token_bytes without the scales: what a page offers a linear-attention state."""
    elements = 2 * arch.num_key_value_heads * arch.head_dim
    if kv_dtype in QUANTIZED_8BIT:
        return elements
    if kv_dtype == "int4":
        return elements // INT4_PER_BYTE
    return elements * plain_bytes(kv_dtype, model_dtype)


def state_bytes(arch: ArchConfig, model_dtype: str) -> int:
    """One linear-attention layer's state per request (0 without such layers)."""
    lin = arch.linear
    if lin is None:
        return 0
    recurrent = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim * RECURRENT_BYTES
    return recurrent + lin.conv_dim * (lin.conv_kernel_size - 1) * plain_bytes("auto", model_dtype)


def model_kv_cache_config(
    arch: ArchConfig,
    kv_dtype: str,
    model_dtype: str,
    block_size: int,
    enable_prefix_caching: bool = True,
    checkpoint_interval: int | None = None,
) -> KVCacheConfig:
    """The cache groups of a model whose layers are `arch.cache_layer_kinds` (kv_cache_config.py;
    DeepSeek-V4's: compressed_kinds.py)."""
    if arch.compressed is not None:  # vectors of head_dim / index_head_dim values (+ scales)
        c = arch.compressed
        return build_compressed_kv_cache_config(
            c,
            block_size=block_size,
            vector_bytes=part_bytes(c.head_dim, kv_dtype, model_dtype),
            index_key_bytes=part_bytes(c.index_head_dim, kv_dtype, model_dtype),
            enable_prefix_caching=enable_prefix_caching,
            checkpoint_interval=checkpoint_interval,
        )
    return build_kv_cache_config(
        arch.cache_layer_kinds,
        block_size=block_size,
        token_bytes=token_bytes(arch, kv_dtype, model_dtype),
        token_data_bytes=token_data_bytes(arch, kv_dtype, model_dtype),
        sliding_window=arch.sliding_window,
        state_bytes=state_bytes(arch, model_dtype),
        enable_prefix_caching=enable_prefix_caching,
        checkpoint_interval=checkpoint_interval,
    )

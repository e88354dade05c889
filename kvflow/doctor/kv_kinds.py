"""KV bytes by cache kind, from config.json alone: the engine's own cache groups, built without torch.

The engine sizes its pool with kvflow/attention/kv_store.py `kv_cache_config_for`; both take their
byte sizes per kind from kvflow/kv_cache/cache_bytes.py (the formulas are there) and their groups from
kvflow/kv_cache/kv_cache_config.py, so the calculator, the startup log and the allocator agree
(docs/ARCHITECTURE.md, "Cache kinds").

What a request of L tokens holds is what the allocator gives it: blocks per group (a sliding or
state group's flat in L) x bytes per block (every layer slot of the pool: a short group's padding
included). What a decode step reads is per layer (`decode_step_kv_bytes_by_kind`).
"""

from __future__ import annotations

from kvflow.arch_config import ArchConfig
from kvflow.compressed_config import CSA, CSA_STATE, HCA, HCA_STATE
from kvflow.doctor import v4_spec
from kvflow.kv_cache.cache_bytes import (
    index_key_bytes,
    latent_token_bytes,
    model_kv_cache_config,
    part_bytes,
    state_bytes,
    token_bytes,
)
from kvflow.kv_cache.compressed_kinds import state_bytes as compressor_state_bytes
from kvflow.kv_cache.kv_cache_config import KVCacheConfig
from kvflow.kv_cache.specs import LinearAttentionSpec

FULL, SLIDING, MLA, LINEAR = "full_attention", "sliding_attention", "mla", "linear_attention"
DEFAULT_BLOCK_SIZE = 16  # kvflow's CacheConfig.block_size default (and vLLM's)


def kv_cache_config(
    arch: ArchConfig,
    kv_dtype: str,
    model_dtype: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    enable_prefix_caching: bool = True,
) -> KVCacheConfig:
    """The engine's groups for this model and KV dtype (kv_store.py kv_cache_config_for, torch-free)."""
    return model_kv_cache_config(arch, kv_dtype, model_dtype, block_size, enable_prefix_caching)


def prefix_hit_granularity(config: KVCacheConfig) -> int:
    """Tokens a prefix hit is a multiple of: a block, or with linear-attention layers the state's
    checkpoint interval (a hit of P tokens restores the state checkpointed after exactly P; the
    interval is a block multiple, so it is the common multiple)."""
    step = config.block_size
    for group in config.groups:
        spec = group.spec
        if isinstance(spec, LinearAttentionSpec) and spec.checkpoint_interval:
            step = max(step, spec.checkpoint_interval)
    return step


def layers_by_kind(arch: ArchConfig) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind in arch.cache_layer_kinds:
        out[kind] = out.get(kind, 0) + 1
    return out


def keys_read(arch: ArchConfig, kind: str, context_len: int) -> int:
    """Keys a query at the end of `context_len` tokens attends in one layer of `kind`: all of them
    (full, MLA), the window (sliding: keys q - W < k <= q), DeepSeek-V3.2's top index_topk (its
    indexer scores all of them: indexer_keys_scored), none (linear attention keeps a state)."""
    if kind == SLIDING:
        return min(context_len, arch.sliding_window or context_len)
    if kind == MLA and arch.mla is not None and arch.mla.indexer is not None:
        return min(context_len, arch.mla.indexer.topk)
    return 0 if kind == LINEAR else context_len


def indexer_keys_scored(arch: ArchConfig, context_len: int) -> int:
    """Cached indexer keys one query scores in one layer: every position (V3.2), else none."""
    return context_len if arch.mla is not None and arch.mla.indexer is not None else 0


def decode_step_kv_bytes_by_kind(
    arch: ArchConfig, kv_dtype: str, model_dtype: str, context_len: int
) -> dict[str, float]:
    """Cache bytes one sequence's decode step moves, by kind: a full (MLA) layer reads its L tokens'
    K/V (latents), a sliding layer the min(L, W) of its window, a linear layer reads its state and
    writes it back (2 x state); V3.2 reads every indexer key and the latents of its top index_topk.
    The new token's own K/V write (1 / L of the reads) is left out."""
    if arch.compressed is not None:
        return _v4_decode_bytes(arch, kv_dtype, model_dtype, context_len)
    per_token = token_bytes(arch, kv_dtype, model_dtype)
    if arch.mla is not None:
        per_token = latent_token_bytes(arch, kv_dtype, model_dtype)
    out: dict[str, float] = {}
    for kind, n in layers_by_kind(arch).items():
        if kind == LINEAR:
            out[kind] = 2.0 * n * state_bytes(arch, model_dtype)
        else:
            keys = n * keys_read(arch, kind, context_len) * per_token
            index = n * indexer_keys_scored(arch, context_len) * index_key_bytes(arch, kv_dtype, model_dtype)
            out[kind] = float(keys + index)
    return out


def _v4_decode_bytes(arch: ArchConfig, kv_dtype: str, model_dtype: str, context_len: int) -> dict[str, float]:
    """DeepSeek-V4: the window's vectors, the selected CSA entries, every index key, every HCA entry
    (kvflow/doctor/v4_spec.py keys_read), each compressor's state read and written."""
    c = arch.compressed
    assert c is not None
    vector = part_bytes(c.head_dim, kv_dtype, model_dtype)
    index_key = part_bytes(c.index_head_dim, kv_dtype, model_dtype)
    out: dict[str, float] = {}
    for kind, n in layers_by_kind(arch).items():
        if kind in (CSA_STATE, HCA_STATE):
            out[kind] = 2.0 * n * compressor_state_bytes(c, CSA if kind == CSA_STATE else HCA)
            continue
        read = v4_spec.keys_read(c, kind, context_len) * vector
        read += v4_spec.index_keys_scored(c, kind, context_len) * index_key
        out[kind] = float(n * read)
    return out


def prefill_kv_bytes(
    arch: ArchConfig, kv_dtype: str, model_dtype: str, num_tokens: int, context_len: int
) -> float:
    """A prefill of `num_tokens` new tokens over `context_len`: every attention layer writes their
    K/V and reads its keys (decode_step_kv_bytes_by_kind's reads); a linear layer reads and writes its
    state once for the chunk."""
    attention_layers = sum(n for kind, n in layers_by_kind(arch).items() if kind != LINEAR)
    written: float = num_tokens * attention_layers * token_bytes(arch, kv_dtype, model_dtype)
    if arch.compressed is not None:  # each layer's window vector, and its share of the entries
        c = arch.compressed
        vector = part_bytes(c.head_dim, kv_dtype, model_dtype)
        index_key = part_bytes(c.index_head_dim, kv_dtype, model_dtype)
        per_token = arch.num_hidden_layers * vector + c.num_hca_layers * vector / c.hca_rate
        per_token += c.num_csa_layers * (vector + index_key) / c.csa_rate
        written = num_tokens * per_token
    return written + sum(decode_step_kv_bytes_by_kind(arch, kv_dtype, model_dtype, context_len).values())

"""Start-up: checkpoint directory -> tokenizer, model, dtype, context length and KV pool size.

Kept apart from the step loop so `engine.py` reads as add_request / step / abort only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvflow.arch_config import ArchConfig, load_arch_config
from kvflow.config import DEFAULT_KV_CACHE_MEMORY_BYTES, CacheConfig, ConfigError, EngineConfig
from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_file import is_gguf_path
from kvflow.kv_cache.cache_bytes import token_bytes
from kvflow.kv_cache.kv_cache_config import KVCacheConfig
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.models.loader import load_model
from kvflow.parallel.executor import TensorParallelDriver
from kvflow.tokenizer import Tokenizer

logger = logging.getLogger("kvflow")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model_dir: Path
    arch: ArchConfig
    tokenizer: Tokenizer
    model: LlamaFamilyForCausalLM
    dtype: torch.dtype
    max_model_len: int


def resolve_dtype(requested: str, checkpoint_dtype: str | None) -> torch.dtype:
    """auto = the checkpoint's dtype, except float16 -> bfloat16: fp16 matmuls are a slow path on
    CPUs (benchmarks/NOTES.md) while bf16 has the same width and a wider range."""
    if requested != "auto":
        return _DTYPES[requested]
    if checkpoint_dtype in (None, "float32"):
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return torch.bfloat16
    raise ModelLoadError(f"config.json: unsupported torch_dtype {checkpoint_dtype!r}")


def load_checkpoint(config: EngineConfig, parallel: TensorParallelDriver | None = None) -> LoadedModel:
    """`parallel`: load rank 0's shard of the model (the workers load theirs at the same time)."""
    mc = config.model_config
    model_dir = Path(mc.model).expanduser()
    if not model_dir.exists():
        raise ModelLoadError(
            f"model {str(model_dir)!r} does not exist (a checkpoint directory or a GGUF file)"
        )
    if not model_dir.is_dir() and not is_gguf_path(model_dir):
        raise ModelLoadError(
            f"model {str(model_dir)!r} is a file but not a GGUF file: give a Hugging Face checkpoint "
            "directory or a .gguf file"
        )
    arch = load_arch_config(model_dir)
    max_model_len = mc.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    tokenizer = Tokenizer.for_model(model_dir, mc.tokenizer)
    dtype = resolve_dtype(mc.dtype, arch.torch_dtype)
    if parallel is None:
        model = load_model(model_dir, arch, dtype, max_model_len, config.quant_config)
    else:
        model = parallel.load_model(model_dir, arch, dtype, max_model_len)
    if arch.mla is not None:
        log_latent_kv(arch, dtype, config.cache_config.kv_cache_dtype)
    return LoadedModel(model_dir, arch, tokenizer, model, dtype, max_model_len)


def log_latent_kv(arch: ArchConfig, dtype: torch.dtype, kv_cache_dtype: str) -> str:
    """Latent attention's KV bytes per token against MHA of the same shape: every head caching a K of
    qk_nope + qk_rope dims and a V of v_head_dim (what the up-projections would produce)."""
    assert arch.mla is not None
    m, n = arch.mla, arch.num_hidden_layers
    latent = n * token_bytes(arch, kv_cache_dtype, str(dtype).removeprefix("torch."))
    mha = round(n * arch.num_attention_heads * (m.qk_head_dim + m.v_head_dim) * dtype.itemsize)
    index = "" if m.indexer is None else f" + {m.indexer.head_dim} indexer-key"
    line = (
        f"latent attention (MLA) KV: {latent} bytes/token ({n} layers x ({m.kv_lora_rank} + "
        f"{m.qk_rope_head_dim}{index}) values, {kv_cache_dtype}); MHA of the same shape "
        f"({arch.num_attention_heads} heads, K {m.qk_head_dim} + V {m.v_head_dim}, {dtype}) would need "
        f"{mha} bytes/token: {100 * latent / mha:.1f}% of it"
    )
    logger.info(line)
    return line


def num_kv_blocks_for(
    cache: CacheConfig, max_num_seqs: int, max_model_len: int, kv_cache_config: KVCacheConfig
) -> int:
    """Usable blocks in the pool (the null block comes on top)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = cache.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
    by_memory = budget // kv_cache_config.bytes_per_block
    # More blocks than max_num_seqs full-length requests can hold would never be used.
    by_demand = max_num_seqs * kv_cache_config.num_blocks_peak_prefill(max_model_len, max_model_len)
    blocks = by_memory if cache.kv_cache_memory_bytes is not None else min(by_memory, by_demand)
    if blocks < 1:
        raise ConfigError(
            f"kv_cache_memory_bytes={budget} holds no block of {cache.block_size} tokens "
            f"({kv_cache_config.bytes_per_block} bytes per block over every layer)"
        )
    return int(blocks)


def log_kv_groups(kv_cache_config: KVCacheConfig, max_model_len: int) -> str:
    """Each cache group's bytes for one request at max_model_len, against caching every layer in
    full (what a model file without cache kinds would hold)."""
    c = kv_cache_config
    held = c.bytes_held_by_kind(max_model_len)
    layers = c.layers_by_kind()
    parts = []
    for kind, num_bytes in held.items():
        groups = sum(1 for g in c.groups if g.spec.kind == kind)
        parts.append(f"{kind} {layers[kind]} layers in {groups} group(s): {num_bytes / 2**20:.1f} MiB")
    total = sum(held.values())
    every_layer_full = math.ceil(max_model_len / c.block_size) * c.page_bytes * sum(layers.values())
    line = (
        f"KV cache groups ({c.num_layer_slots} layer slots, {c.bytes_per_block} bytes per block): one "
        f"request at max_model_len={max_model_len} holds {total / 2**20:.1f} MiB: " + "; ".join(parts)
    )
    if c.is_hybrid:
        line += f" (every layer caching every token: {every_layer_full / 2**20:.1f} MiB)"
    logger.info(line)
    return line


def log_kv_pool(
    num_blocks: int,
    block_size: int,
    bytes_per_token: int,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    model_dtype_bytes_per_token: int | None = None,
    blocks_per_request: int | None = None,
) -> str:
    """`bytes_per_token`: of a block's tokens in every layer slot; `blocks_per_request`: blocks one
    request of max_model_len holds over all cache groups (default: one per block_size tokens)."""
    tokens = num_blocks * block_size
    per_request = blocks_per_request or math.ceil(max_model_len / block_size)
    line = (
        f"KV cache pool: {num_blocks} blocks x {block_size} tokens = {tokens} tokens, "
        f"{bytes_per_token} bytes/token, {tokens * bytes_per_token / 2**20:.1f} MiB; "
        f"max concurrent requests at max_model_len={max_model_len}: {num_blocks / per_request:.2f}"
    )
    if kv_cache_dtype != "auto" and model_dtype_bytes_per_token:
        gain = model_dtype_bytes_per_token / bytes_per_token
        line += f"; {kv_cache_dtype} KV: {gain:.2f}x the tokens of the model dtype in the same memory"
    logger.info(line)
    return line

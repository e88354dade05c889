"""DeepSeek-V4's attention and residual switches (config.json -> plain values; pure Python).

Per layer (`layer_types`, or the older per-layer `compress_ratios` of 0 / 4 / 128), always a sliding
window of `sliding_window` uncompressed tokens (one K=V vector of head_dim per token), plus:
    sliding_attention             nothing else
    compressed_sparse_attention   CSA: every `m` tokens pooled into one entry (overlapping windows of
                                  2m, stride m) and a lightning indexer with its own compressor of
                                  index_head_dim; each query attends its top `index_topk` entries
    heavily_compressed_attention  HCA: every `m'` tokens pooled into one entry, attended densely
Sliding-only layers rotate with `rope_theta`; compressed layers, their compressors and the indexer
with `compress_rope_theta` (YaRN when rope_parameters asks, attention factor 1: the reference does
not scale cos/sin). The rotary dims are the trailing qk_rope_head_dim of each head, pairs
interleaved. Outside attention: `hc_mult` residual streams mixed by Sinkhorn-normalised
hyper-connections; routed experts scored by sqrt(softplus) (or sigmoid / softmax), the first
layers (`mlp_layer_types` == hash_moe, or `num_hash_layers`) routed by a token-id table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.errors import ModelLoadError

V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
SLIDING_ONLY, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
V4_LAYER_TYPES = (SLIDING_ONLY, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING_ONLY}  # the legacy compress_ratios' 0; 4 / 128 map by compress_rates
# transformers' defaults (DeepseekV4Config) for what a config.json may omit.
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_COMPRESS_ROPE_THETA = 160000.0
# The cache kinds of a V4 layer (kvflow/kv_cache/compressed_kinds.py sizes and groups them).
WINDOW, CSA_ENTRIES, CSA_INDEX, HCA_ENTRIES = (
    "sliding_attention",
    "csa_entries",
    "csa_index_keys",
    "hca_entries",
)
CSA_STATE, HCA_STATE = "csa_state", "hca_state"
COMPRESSED_KINDS = (WINDOW, CSA_ENTRIES, CSA_INDEX, HCA_ENTRIES, CSA_STATE, HCA_STATE)


def cache_layers(c: CompressedAttentionConfig) -> list[tuple[int, str]]:
    """(model layer, kind) of every cache layer, in cache-layer order: per model layer its window,
    then (compressed layers) its entries, its index keys (CSA) and its compressor state."""
    out: list[tuple[int, str]] = []
    for layer, kind in enumerate(c.layer_types):
        out.append((layer, WINDOW))
        if kind == CSA:
            out += [(layer, CSA_ENTRIES), (layer, CSA_INDEX), (layer, CSA_STATE)]
        elif kind == HCA:
            out += [(layer, HCA_ENTRIES), (layer, HCA_STATE)]
    return out


def layer_cache_ids(c: CompressedAttentionConfig) -> list[dict[str, int]]:
    """Per model layer: kind -> its cache layer's index."""
    ids: list[dict[str, int]] = [{} for _ in c.layer_types]
    for index, (layer, kind) in enumerate(cache_layers(c)):
        ids[layer][kind] = index
    return ids


@dataclass(frozen=True)
class CompressedAttentionConfig:
    head_dim: int  # the one K=V head and every query head
    rope_dim: int  # trailing rotary dims of each head
    q_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # V4_LAYER_TYPES per layer
    csa_rate: int
    hca_rate: int
    index_num_heads: int
    index_head_dim: int
    index_topk: int
    o_groups: int
    o_lora_rank: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by tid2eid[token id]

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of layer `layer` (0: a sliding-only layer)."""
        kind = self.layer_types[layer]
        return self.csa_rate if kind == CSA else self.hca_rate if kind == HCA else 0

    @property
    def num_csa_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == CSA)

    @property
    def num_hca_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == HCA)


def _positive(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelLoadError(f"{source}: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < 1:
        raise ModelLoadError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return int(value)


def _layer_types(cfg: dict[str, Any], num_layers: int, rates: dict[str, int], source: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        by_rate = {**_RATIO_TO_TYPE, rates[CSA]: CSA, rates[HCA]: HCA}
        ratios = list(cfg["compress_ratios"])[:num_layers]
        unknown = sorted({r for r in ratios if r not in by_rate})
        if unknown:
            raise ModelLoadError(f"{source}: compress_ratios {unknown} match no layer kind ({by_rate})")
        types = [by_rate[r] for r in ratios]
    if types is None:  # transformers' default: 2 HCA, then CSA / HCA alternating
        types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(0, num_layers - 2))]
    types = list(types)[:num_layers]
    if len(types) != num_layers or set(types) - set(V4_LAYER_TYPES):
        raise ModelLoadError(
            f"{source}: layer_types must be one of {V4_LAYER_TYPES} for each of {num_layers} layers"
        )
    return tuple(types)


def _hash_layers(cfg: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        n = int(cfg.get("num_hash_layers", DEFAULT_NUM_HASH_LAYERS))
        return tuple(i < n for i in range(num_layers))
    types = list(types)[:num_layers]
    if len(types) != num_layers or set(types) - {"hash_moe", "moe"}:
        raise ModelLoadError(
            f"{source}: mlp_layer_types must be hash_moe / moe for each of {num_layers} layers"
        )
    return tuple(t == "hash_moe" for t in types)


def compressed_attention_config(
    cfg: dict[str, Any], num_layers: int, source: str
) -> CompressedAttentionConfig:
    head_dim = _positive(cfg, "head_dim", source)
    rope_dim = cfg.get("qk_rope_head_dim")
    if rope_dim is None:
        rope_dim = round(head_dim * float(cfg.get("partial_rotary_factor") or 64 / 512))
    rope_dim = int(rope_dim)
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ModelLoadError(
            f"{source}: qk_rope_head_dim {rope_dim} must be even and at most head_dim {head_dim}"
        )
    if _positive(cfg, "num_key_value_heads", source, 1) != 1:
        raise ModelLoadError(
            f"{source}: DeepSeek-V4 attention has one shared K=V head (num_key_value_heads=1)"
        )
    rates = dict(DEFAULT_COMPRESS_RATES)
    rates.update({k: int(v) for k, v in (cfg.get("compress_rates") or {}).items() if k in rates})
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(legacy) is not None:
            rates[kind] = int(cfg[legacy])
    if min(rates.values()) < 1:
        raise ModelLoadError(f"{source}: compress_rates must be positive, got {rates}")
    heads = _positive(cfg, "num_attention_heads", source)
    groups = _positive(cfg, "o_groups", source, 8)
    if heads % groups:
        raise ModelLoadError(f"{source}: o_groups={groups} does not divide {heads} attention heads")
    index_dim = _positive(cfg, "index_head_dim", source, 128)
    if rope_dim > index_dim:
        raise ModelLoadError(
            f"{source}: index_head_dim {index_dim} is smaller than qk_rope_head_dim {rope_dim}"
        )
    return CompressedAttentionConfig(
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=_positive(cfg, "q_lora_rank", source),
        sliding_window=_positive(cfg, "sliding_window", source, 128),
        layer_types=_layer_types(cfg, num_layers, rates, source),
        csa_rate=rates[CSA],
        hca_rate=rates[HCA],
        index_num_heads=_positive(cfg, "index_n_heads", source, 64),
        index_head_dim=index_dim,
        index_topk=_positive(cfg, "index_topk", source, 512),
        o_groups=groups,
        o_lora_rank=_positive(cfg, "o_lora_rank", source, 1024),
        hc_mult=_positive(cfg, "hc_mult", source, 4),
        hc_sinkhorn_iters=_positive(cfg, "hc_sinkhorn_iters", source, 20),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        hash_layers=_hash_layers(cfg, num_layers, source),
    )

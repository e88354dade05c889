"""DeepSeek-V4's compressed attention, from config.json alone: parameters, and per cache kind the
keys a query reads and the FLOPs it spends (kvflow/compressed_config.py has the layer kinds).

Parameters of one layer (H heads of d, q_lora r_q, o_groups G of o_lora r_o, hidden D):
    attention     wq_a D r_q + q_norm r_q + wq_b r_q H d + wkv D d + norm d
                  + wo_a H d r_o + wo_b G r_o D + one sink per head
    compressor    wkv, wgate: 2 x D x s d (s = 2 series for CSA, 1 for HCA) + ape m x s d + norm d
    indexer (CSA) wq_b r_q n_I d_I + weights_proj D n_I + its compressor at d_I (2 series)
    residual      2 hyper-connections: (2 + hc) hc x (hc D + 1) + 3 each; 2 RMSNorms of D
and the model's head collapses the streams: hc x (hc D + 1) + 1.
Per decode query at context L, per layer kind:
    window        min(L, W) K=V vectors                                   4 H d FLOPs each
    CSA entries   min(L // m, index_topk) selected entries                4 H d FLOPs each
    index keys    every L // m of them scored                             2 n_I (d_I + 1) FLOPs each
    HCA entries   all L // m'                                             4 H d FLOPs each
(QK^T and PV with V = K: 2 FLOPs per multiply-add, two products per head and key.)
"""

from __future__ import annotations

from kvflow.arch_config import ArchConfig
from kvflow.compressed_config import (
    CSA,
    CSA_ENTRIES,
    CSA_INDEX,
    HCA,
    HCA_ENTRIES,
    WINDOW,
    CompressedAttentionConfig,
)

CSA_SERIES, HCA_SERIES = 2, 1  # CSA's two overlapping series (Ca, Cb), HCA's one
HC_SCALES = 3  # pre, post and comb scales of one hyper-connection


def _compressor_params(hidden: int, width: int, rate: int, series: int) -> int:
    return 2 * hidden * series * width + rate * series * width + width


def v4_attention_params(arch: ArchConfig, layer: int) -> int:
    c = arch.compressed
    assert c is not None
    h, heads, d = arch.hidden_size, arch.num_attention_heads, c.head_dim
    params = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * d + h * d + d
    params += heads * d * c.o_lora_rank + c.o_groups * c.o_lora_rank * h + heads
    kind = c.layer_types[layer]
    if kind == CSA:
        params += _compressor_params(h, d, c.csa_rate, CSA_SERIES)
        params += c.q_lora_rank * c.index_num_heads * c.index_head_dim + h * c.index_num_heads
        params += _compressor_params(h, c.index_head_dim, c.csa_rate, CSA_SERIES)
    elif kind == HCA:
        params += _compressor_params(h, d, c.hca_rate, HCA_SERIES)
    return params


def hyper_connection_params(arch: ArchConfig) -> int:
    """One layer's two hyper-connections and two norms."""
    c = arch.compressed
    assert c is not None
    hc, h = c.hc_mult, arch.hidden_size
    mixes = (2 + hc) * hc
    return 2 * (mixes * hc * h + mixes + HC_SCALES) + 2 * h


def hyper_head_params(c: CompressedAttentionConfig, hidden: int) -> int:
    return c.hc_mult * c.hc_mult * hidden + c.hc_mult + 1


def keys_read(c: CompressedAttentionConfig, kind: str, context_len: int) -> int:
    """K=V vectors (window, entries) one query at the end of `context_len` tokens attends in one
    layer's cache layer of `kind`; index keys and states are not attended (index_keys_scored)."""
    if kind == WINDOW:
        return min(context_len, c.sliding_window)
    if kind == CSA_ENTRIES:
        return min(context_len // c.csa_rate, c.index_topk)
    if kind == HCA_ENTRIES:
        return context_len // c.hca_rate
    return 0


def index_keys_scored(c: CompressedAttentionConfig, kind: str, context_len: int) -> int:
    return context_len // c.csa_rate if kind == CSA_INDEX else 0


def index_flops_per_key(c: CompressedAttentionConfig) -> float:
    return 2.0 * c.index_num_heads * (c.index_head_dim + 1)

"""What a request's KV cache is made of, per cache kind: the JSON section `kv` and the words the KV
check and the report use. Numbers come from the engine's groups (Diagnosis.kv_config,
kvflow/doctor/kv_kinds.py): a kind's bytes are its groups' blocks x bytes per block, so a short
group's padded layer slots count where the pool spends them."""

from __future__ import annotations

from typing import Any

from kvflow.compressed_config import CSA_ENTRIES, CSA_INDEX, CSA_STATE, HCA_ENTRIES, HCA_STATE
from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.kv_kinds import FULL, LINEAR, MLA, SLIDING, layers_by_kind, state_bytes

KIND_WORDS = {
    FULL: "full-attention",
    MLA: "latent-attention (MLA)",
    SLIDING: "sliding-window",
    LINEAR: "linear-attention",
    # DeepSeek-V4 (kvflow/compressed_config.py): a layer's window is SLIDING, and per compressed layer:
    CSA_ENTRIES: "CSA-entry",
    CSA_INDEX: "CSA indexer-key",
    HCA_ENTRIES: "HCA-entry",
    CSA_STATE: "CSA compressor-state",
    HCA_STATE: "HCA compressor-state",
}
# Kinds whose bytes grow with the request's length (V4's entries at L / rate).
GROWING = (FULL, MLA, CSA_ENTRIES, CSA_INDEX, HCA_ENTRIES)
GB, MB, KB = 1e9, 1e6, 1e3


def fmt_bytes(n: float) -> str:
    if n >= GB:
        return f"{n / GB:,.2f} GB"
    return f"{n / MB:,.1f} MB" if n >= MB else f"{n / KB:,.1f} KB"


def has_flat_kinds(d: Diagnosis) -> bool:
    """The model has layers whose cache does not grow with L (sliding windows, linear attention)."""
    return any(kind not in GROWING for kind in d.model.arch.cache_layer_kinds)


def kv_section(d: Diagnosis, num_tokens: int) -> dict[str, Any]:
    """The JSON `kv` section (docs/doctor.md): a request of `num_tokens` tokens by cache kind."""
    a, config = d.model.arch, d.kv_config
    by_kind = config.bytes_held_by_kind(max(num_tokens, 1))
    model_dtype = d.model.dtype
    return {
        "request_len": num_tokens,
        "kv_cache_dtype": d.roofline.kv_dtype,
        "block_size": config.block_size,
        "bytes_per_block": config.bytes_per_block,
        "num_groups": len(config.groups),
        "layers_by_kind": layers_by_kind(a),
        "bytes_per_request": sum(by_kind.values()),
        "bytes_per_request_by_kind": by_kind,
        "sliding_window": a.sliding_window if SLIDING in by_kind else None,
        # One linear-attention layer's state (float32 recurrent + conv inputs), whatever the KV dtype.
        "state_bytes_per_layer": state_bytes(a, model_dtype) if LINEAR in by_kind else None,
    }


def _kind_part(d: Diagnosis, kind: str, nbytes: int, layers: int) -> str:
    config = d.kv_config
    slots = sum(config.num_layer_slots for g in config.groups if g.spec.kind == kind)
    padded = f", {slots - layers} padded layer slots of its last group" if slots > layers else ""
    words = f"{fmt_bytes(nbytes)} in {layers} {KIND_WORDS.get(kind, kind)} layers"
    if kind == SLIDING:
        return words + f" (window {d.model.arch.sliding_window}, flat in L{padded})"
    if kind in (LINEAR, CSA_STATE, HCA_STATE):
        return words + f" (a fixed-size float32 state, flat in L{padded})"
    c = d.model.arch.compressed
    if c is not None and kind in (CSA_ENTRIES, CSA_INDEX, HCA_ENTRIES):
        rate = c.hca_rate if kind == HCA_ENTRIES else c.csa_rate
        return words + f" (one per {rate} tokens{padded})"
    return words + (f" ({padded[2:]})" if padded else "")


def split_phrase(d: Diagnosis, num_tokens: int) -> str:
    """'a 32,768-token request holds 0.81 GB, of which 0.81 GB in 12 full-attention layers, ...'
    for a model with flat kinds; '' for one whose every layer grows with L."""
    if not has_flat_kinds(d):
        return ""
    by_kind = d.kv_config.bytes_held_by_kind(max(num_tokens, 1))
    layers = layers_by_kind(d.model.arch)
    order = sorted(by_kind, key=lambda kind: (kind not in GROWING, kind))  # growing kinds first
    parts = [_kind_part(d, kind, by_kind[kind], layers[kind]) for kind in order]
    return f"a {num_tokens:,}-token request holds {fmt_bytes(sum(by_kind.values()))}, of which " + ", ".join(
        parts
    )


def state_note(d: Diagnosis, kv_dtype: str, num_tokens: int) -> str:
    """For the KV-dtype what-if: what the dtype leaves as it is (linear-attention states)."""
    layers = layers_by_kind(d.model.arch).get(LINEAR)
    if not layers:
        return ""
    config = d.model.kv_cache_config(kv_dtype, d.block_size)
    state = config.bytes_held_by_kind(max(num_tokens, 1)).get(LINEAR, 0)
    return (
        f"; only the attention K/V shrink: the {layers} linear-attention layers' state is float32 "
        f"whatever the KV dtype ({fmt_bytes(state)} of every request)"
    )

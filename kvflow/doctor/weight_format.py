"""The weight format a checkpoint ships in, as bytes per parameter by role, read from the checkpoint.

A checkpoint's bytes are not config.json's torch_dtype times the parameters once it is quantized:
DeepSeek-V3 ships FP8 with block scales (671B parameters, ~675 GB, not 1.34 TB of bf16), gpt-oss
its experts in MXFP4, GGUF files mix types per tensor. Per role (the decoder layers' dense parts,
routed experts, the embedding table, the LM head), bytes per parameter:
    fp8 block (quant_method fp8, weight_block_size [bn, bk])   1 + 4 / (bn bk)   (fp32 scale per block;
        scale_fmt ue8m0: 1 + 1 / (bn bk); expert_dtype fp4, DeepSeek-V4's routed experts: 0.5 + 1 / 32)
    compressed-tensors float-quantized (FP8 per channel)       1 + 4 / K         (fp32 scale per row)
    GPTQ / AWQ / compressed-tensors pack-quantized, b bits, group g
                                                  b / 8 + (2 + b / 8) / g        (fp16 scale, packed zero)
    compressed-tensors NVFP4 (4 bits, fp8 scale per 16)       0.5 + 1 / 16
    mxfp4 (gpt-oss's experts: e2m1 values, an e8m0 scale per 32)   0.5 + 1 / 32 = 4.25 bits
    GGUF                                                      each tensor's own bytes, summed per role
Quantized checkpoints keep the embedding (and, in these formats, the LM head) in their torch_dtype;
GGUF stores them in whatever type the file says. Norms and biases are negligible and stay in the
float dtype. Torch-free: the doctor runs where only config.json (or a GGUF file) is.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

FP32_SCALE_BYTES = 4.0
E8M0_SCALE_BYTES = 1.0  # scale_fmt ue8m0: a power-of-two scale in one byte
FP16_BYTES = 2.0
MXFP4_BYTES = 0.5 + 1 / 32  # e2m1 nibbles + one e8m0 byte per 32
NVFP4_BYTES = 0.5 + 1 / 16  # e2m1 nibbles + one fp8 scale per 16


@dataclass(frozen=True)
class WeightFormat:
    name: str  # the doctor's name for it, as a --weight-dtype value would be (e.g. "fp8-block")
    layer_bytes: float  # per parameter of the layers' dense parts (attention, dense MLPs, shared experts)
    expert_bytes: float  # per parameter of routed experts
    embedding_bytes: float
    head_bytes: float
    detail: str  # what the checkpoint says, for the report


def _float_bytes(config: dict[str, Any]) -> float:
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4.0 if dtype == "float32" else 2.0


def weight_format_from_config(config: dict[str, Any]) -> WeightFormat | None:
    """The format config.json's quantization_config names, or None for plain float weights."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    base = _float_bytes(config)
    hidden = int(config.get("hidden_size") or 1)
    if method == "fp8":
        bn, bk = (qc.get("weight_block_size") or [1, hidden])[:2]
        ue8m0 = str(qc.get("scale_fmt", "float")).lower() == "ue8m0"  # DeepSeek-V4: 1-byte scales
        per = 1.0 + (E8M0_SCALE_BYTES if ue8m0 else FP32_SCALE_BYTES) / (int(bn) * int(bk))
        scale = "ue8m0" if ue8m0 else "fp32"
        # DeepSeek-V4's routed experts in FP4 (V4.1 names it in quantization_config, V4 beside it).
        if str(qc.get("expert_dtype", config.get("expert_dtype", "fp8"))).lower() == "fp4":
            detail = f"FP8 e4m3, {scale} scale per {bn}x{bk} block; FP4 experts (4.25 bits)"
            return WeightFormat("fp8-block+fp4-experts", per, MXFP4_BYTES, base, base, detail)
        return WeightFormat("fp8-block", per, per, base, base, f"FP8 e4m3, {scale} scale per {bn}x{bk} block")
    if method == "mxfp4":  # gpt-oss: experts only, attention / router / embedding / head stay bf16
        return WeightFormat(
            "mxfp4", base, MXFP4_BYTES, base, base, "MXFP4 experts (4.25 bits), the rest bf16"
        )
    if method in ("gptq", "awq"):
        bits = int(qc.get("bits") or qc.get("w_bit") or 4)
        group = int(qc.get("group_size") or qc.get("q_group_size") or 128)
        per = _int_bytes(bits, group if group > 0 else hidden)
        return WeightFormat(
            f"{method}-int{bits}", per, per, base, base, f"{method.upper()} {bits}-bit, group {group}"
        )
    if method == "compressed-tensors":
        return _compressed_tensors(qc, base, hidden)
    return None


def _int_bytes(bits: int, group: int) -> float:
    return bits / 8 + (FP16_BYTES + bits / 8) / group


def _compressed_tensors(qc: dict[str, Any], base: float, hidden: int) -> WeightFormat | None:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups or not isinstance(groups[0], dict):
        return None
    weights = groups[0].get("weights") or {}
    bits = int(weights.get("num_bits", 8))
    fmt = str(qc.get("format", ""))
    if weights.get("type") == "float" and bits == 4:
        return WeightFormat("nvfp4", NVFP4_BYTES, NVFP4_BYTES, base, base, "NVFP4 (fp8 scale per 16)")
    if weights.get("type") == "float":
        per = 1.0 + FP32_SCALE_BYTES / hidden
        return WeightFormat("fp8-channel", per, per, base, base, f"compressed-tensors {fmt}, FP8 per channel")
    group = int(weights.get("group_size") or hidden)
    per = _int_bytes(bits, group)
    return WeightFormat(f"int{bits}-g{group}", per, per, base, base, f"compressed-tensors {fmt} {bits}-bit")


def gguf_weight_format(tensors: dict[str, tuple[str, tuple[int, ...], int]]) -> WeightFormat:
    """From a GGUF tensor table {name: (ggml type, shape, bytes)}: each role's bytes / parameters."""
    totals: dict[str, list[float]] = {role: [0.0, 0.0] for role in ("layer", "expert", "embedding", "head")}
    by_type: Counter[str] = Counter()
    for name, (type_name, shape, nbytes) in tensors.items():
        if len(shape) < 2:
            continue  # norms, biases, rope_freqs: negligible
        role = (
            "embedding" if name == "token_embd.weight"
            else "head" if name == "output.weight"
            else "expert" if "_exps." in name
            else "layer"
        )  # fmt: skip
        totals[role][0] += nbytes
        totals[role][1] += math.prod(shape)
        by_type[type_name] += nbytes

    def per(role: str, fallback: float) -> float:
        nbytes, params = totals[role]
        return nbytes / params if params else fallback

    layer = per("layer", 2.0)
    embedding = per("embedding", layer)
    total = sum(by_type.values())
    mix = ", ".join(f"{t} {100 * b / total:.0f}%" for t, b in by_type.most_common())
    return WeightFormat(
        "gguf", layer, per("expert", layer), embedding, per("head", embedding), f"GGUF tensor table: {mix}"
    )

"""Deployment sizing (calculator mode): when the weights and the planned KV do not fit one device, the
fewest devices that hold them and the parallel layouts that do, each with its memory per device and
its decode roofline. Torch-free, like the rest of the doctor.

Layouts (vLLM's flags in brackets):
    TP t x PP p   tensor parallel inside a node [--tensor-parallel-size t], pipeline stages across
                  devices or nodes [--pipeline-parallel-size p]. t divides the attention heads (and
                  the KV heads divide t or t divides them); t <= NODE_DEVICES (TP all-reduces twice per
                  layer: it stays on the node's NVLink / Infinity Fabric).
    EP e          MoE only: attention and the dense parts data-parallel on every device, the routed
                  experts split over e devices [--data-parallel-size e --enable-expert-parallel];
                  e divides the experts.
Per device:
    weights  TP x PP: (layer parts of the largest stage) / t + the embedding or LM head it holds / t
                      (vocab-parallel) + the final norm; the few KV projections a rank replicates when
                      t > KV heads are not added (under 1% of a layer).
             EP:      everything but the routed experts, plus experts / e.
    KV       the planned requests' KV (concurrency x a request of p95 length, every cache group):
             TP x PP: the stage's layers' share, times the KV heads a rank holds / KV heads (a
                      latent-attention cache, DeepSeek's MLA, is one latent per token: every rank
                      holds it whole); EP: the requests of one data-parallel rank (ceil(C / e)).
    fits     weights + KV <= memory x GPU_MEMORY_UTILIZATION (vLLM's default 0.9).
Decode step (batch = the planned concurrency, the roofline's max(FLOPs / peak, bytes / bandwidth)):
    TP x PP   each token passes the p stages one after another, so its step reads all the weights
              once, split t ways: (decode weight bytes / t + KV bytes x the rank's head share);
              pipeline stages add memory, not speed, for one batch.
    EP        a rank reads the dense parts whole, its share of the experts the whole batch touches,
              and its own requests' KV.
The all-reduces (TP), stage hand-offs (PP) and all-to-alls (EP) add latency the roofline does not
count: only a measurement gives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import GPU_MEMORY_UTILIZATION, PhaseTime, Roofline
from kvflow.doctor.tensor_parallel import kv_heads_per_rank, splits_heads

# Accelerators per node (HGX H100 / H200, MI300X platforms): tensor parallelism stays inside one.
NODE_DEVICES = 8
TP_SIZES = (1, 2, 4, 8)
EP_SIZES = (2, 4, 8, 16, 32, 64)
MAX_DEVICES = 64  # the search's ceiling: a deployment beyond 8 nodes is out of the calculator's scope
# Tensor x pipeline layouts listed per device count (the fastest decodes; plus an expert-parallel one
# for MoE), and the device counts listed: the fewest, then whole nodes.
LAYOUTS_PER_COUNT = 2
COUNTS_LISTED = 3


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int  # 1: none (the experts are tensor-parallel like the other linears)
    weight_bytes_per_device: float
    kv_bytes_per_device: float
    usable_bytes_per_device: float
    decode: PhaseTime

    @property
    def devices(self) -> int:
        if self.expert_parallel > 1:
            return self.expert_parallel
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def nodes(self) -> int:
        return math.ceil(self.devices / NODE_DEVICES)

    @property
    def bytes_per_device(self) -> float:
        return self.weight_bytes_per_device + self.kv_bytes_per_device

    @property
    def fits(self) -> bool:
        return self.bytes_per_device <= self.usable_bytes_per_device

    @property
    def name(self) -> str:
        if self.expert_parallel > 1:
            return f"EP {self.expert_parallel} (data-parallel attention)"
        return f"TP {self.tensor_parallel} x PP {self.pipeline_parallel}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "devices": self.devices,
            "nodes": self.nodes,
            "tensor_parallel_size": self.tensor_parallel,
            "pipeline_parallel_size": self.pipeline_parallel,
            "expert_parallel_size": self.expert_parallel,
            "weight_bytes_per_device": self.weight_bytes_per_device,
            "kv_bytes_per_device": self.kv_bytes_per_device,
            "bytes_per_device": self.bytes_per_device,
            "usable_bytes_per_device": self.usable_bytes_per_device,
            "decode_ms_per_step": 1e3 * self.decode.seconds,
            "decode_bound": self.decode.bound,
        }


@dataclass(frozen=True)
class Deployment:
    device: str
    weight_bytes: float
    kv_bytes: float  # the planned requests' KV, all of it
    usable_bytes_per_device: float
    concurrency: int
    request_len: int
    min_devices: int | None  # None: nothing up to MAX_DEVICES fits
    layouts: list[Layout]  # the ones worth listing: fewest devices first, fastest first per count

    @property
    def fits_one_device(self) -> bool:
        return self.min_devices == 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "usable_bytes_per_device": self.usable_bytes_per_device,
            "concurrency": self.concurrency,
            "request_len": self.request_len,
            "min_devices": self.min_devices,
            "layouts": [layout.as_dict() for layout in self.layouts],
            "summary": self.text(),
        }

    def text(self) -> str:
        need = (
            f"weights {self.weight_bytes / 1e9:,.1f} GB + KV {self.kv_bytes / 1e9:,.1f} GB for "
            f"{self.concurrency} request(s) of {self.request_len:,} tokens; {self.device}: "
            f"{self.usable_bytes_per_device / 1e9:,.1f} GB usable per device"
        )
        if self.min_devices is None:
            return f"deployment: {need}: no layout of up to {MAX_DEVICES} devices holds it"
        lines = [f"deployment: {need}: at least {self.min_devices} device(s)"]
        for layout in self.layouts:
            lines.append(
                f"  {layout.name}: {layout.devices} devices ({layout.nodes} node(s)), "
                f"{layout.weight_bytes_per_device / 1e9:,.1f} GB weights + "
                f"{layout.kv_bytes_per_device / 1e9:,.1f} GB KV per device, decode "
                f"{1e3 * layout.decode.seconds:,.2f} ms/step ({layout.decode.bound}-bound)"
            )
        return "\n".join(lines)


def plan_deployment(roofline: Roofline, concurrency: int, request_len: int, context_len: int) -> Deployment:
    """Every layout up to MAX_DEVICES for `concurrency` requests of `request_len` tokens (decode at
    `context_len`); the fitting ones with the fewest devices and a few larger whole-node counts."""
    m = roofline.model
    usable = roofline.hardware.memory_bytes * GPU_MEMORY_UTILIZATION
    kv_total = concurrency * m.kv_bytes_per_request(request_len, roofline.kv_dtype)
    candidates = [
        _tp_pp(roofline, usable, kv_total, t, p, concurrency, context_len)
        for t in TP_SIZES
        if splits_heads(m.arch, t)
        for p in range(1, m.arch.num_hidden_layers + 1)
        if t * p <= MAX_DEVICES
    ]
    if m.moe_layer is not None:
        candidates += [
            _ep(roofline, usable, e, concurrency, request_len, context_len)
            for e in EP_SIZES
            if m.moe_layer.num_experts % e == 0
        ]
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: (c.devices, c.decode.seconds))
    min_devices = fitting[0].devices if fitting else None
    return Deployment(
        roofline.hardware.name,
        m.weight_bytes(roofline.weight_dtype),
        kv_total,
        usable,
        concurrency,
        request_len,
        min_devices,
        _listed(fitting),
    )


def _listed(fitting: list[Layout]) -> list[Layout]:
    """The fastest LAYOUTS_PER_COUNT layouts at the fewest devices and at the next COUNTS_LISTED - 1
    whole-node counts above it (what a user rents)."""
    if not fitting:
        return []
    fewest = fitting[0].devices
    nodes = sorted({c.devices for c in fitting if c.devices > fewest and c.devices % NODE_DEVICES == 0})
    counts = [fewest, *nodes]
    listed = []
    for count in counts[:COUNTS_LISTED]:
        at_count = [c for c in fitting if c.devices == count]
        listed += [c for c in at_count if c.expert_parallel == 1][:LAYOUTS_PER_COUNT]
        listed += [c for c in at_count if c.expert_parallel > 1][:1]  # MoE: the expert-parallel one too
    return listed


def _kv_share(m: ModelSpec, t: int) -> float:
    """The part of a token's KV one tensor-parallel rank holds."""
    if m.arch.mla is not None:
        return 1.0  # one latent per token, not per head: every rank holds it whole
    return kv_heads_per_rank(m.arch, t) / m.arch.num_key_value_heads


def _tp_pp(
    roofline: Roofline, usable: float, kv_total: float, t: int, p: int, concurrency: int, context_len: int
) -> Layout:
    m = roofline.model
    roles = m.weight_bytes_by_role(roofline.weight_dtype)
    layers = m.arch.num_hidden_layers
    stage_share = math.ceil(layers / p) / layers  # the largest stage's layers
    ends = roles.embedding + roles.lm_head if p == 1 else max(roles.embedding, roles.lm_head)
    weights = (roles.layers_dense + roles.routed_experts) * stage_share / t + ends / t + roles.final_norm
    share = _kv_share(m, t)
    kv = kv_total * stage_share * share
    flops = roofline.decode_flops(concurrency, context_len) / t
    nbytes = (
        m.decode_weight_bytes(roofline.weight_dtype, concurrency) / t
        + concurrency * m.decode_kv_bytes(context_len, roofline.kv_dtype) * share
    )
    return Layout(t, p, 1, weights, kv, usable, _phase(roofline, flops, nbytes))


def _ep(
    roofline: Roofline, usable: float, e: int, concurrency: int, request_len: int, context_len: int
) -> Layout:
    m = roofline.model
    assert m.moe_layer is not None
    roles = m.weight_bytes_by_role(roofline.weight_dtype)
    dense = roles.layers_dense + roles.embedding + roles.lm_head + roles.final_norm
    weights = dense + roles.routed_experts / e
    local = math.ceil(concurrency / e)  # requests on one data-parallel rank
    kv = local * m.kv_bytes_per_request(request_len, roofline.kv_dtype)
    touched_share = m.experts_read_per_layer(concurrency) / m.moe_layer.num_experts
    expert_read = roles.routed_experts * touched_share / e
    decode_dense = m.decode_weight_bytes(roofline.weight_dtype, 1) - roles.routed_experts * (
        m.experts_read_per_layer(1) / m.moe_layer.num_experts
    )
    nbytes = decode_dense + expert_read + local * m.decode_kv_bytes(context_len, roofline.kv_dtype)
    flops = roofline.decode_flops(local, context_len)
    return Layout(1, 1, e, weights, kv, usable, _phase(roofline, flops, nbytes))


def _phase(roofline: Roofline, flops: float, nbytes: float) -> PhaseTime:
    hw = roofline.hardware
    compute, memory = flops / roofline.flops_per_s, nbytes / hw.bandwidth_bytes_s
    return PhaseTime(max(compute, memory), compute, memory, hw.uncertainty)

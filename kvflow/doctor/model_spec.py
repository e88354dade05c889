"""What a model costs, from its config.json alone: parameters, weight bytes, KV bytes, FLOPs.

Counting (formulas in docs/doctor.md):
    embedding        vocab x hidden
    per layer        q: hidden x (q_heads x head_dim), k and v: hidden x (kv_heads x head_dim) each
                     (GQA/MQA: kv_heads < q_heads), o: (q_heads x head_dim) x hidden, biases when the
                     architecture has them, MLP: 3 x hidden x intermediate (gate, up, down), 2 RMSNorms
                     (+ q/k norms for Qwen3); other layer kinds (linear attention, gated queries, sinks,
                     sandwich norms) in kvflow/doctor/attention_params.py
    final norm       hidden
    LM head          vocab x hidden, unless tied to the embedding (then stored once)
    KV per token     2 (K, V) x attention layers x kv_heads x head_dim x bytes per element; latent
                     attention (DeepSeek MLA): layers x (kv_lora_rank + qk_rope_head_dim) x bytes
    KV per request   the engine's cache groups (kvflow/doctor/kv_kinds.py): full layers grow with L,
                     sliding-window and linear-attention (state) layers hold a fixed amount
Mixture-of-experts layers and latent attention are counted in kvflow/doctor/moe_spec.py: a MoE
model has total parameters (all experts, stored) and active ones (what a token multiplies).
Matmul FLOPs per token = 2 x (parameters that multiply activations) = 2 x (all but the embedding
table, which is a gather; with tied embeddings the LM head still multiplies, so it counts; of a
MoE layer only the router, shared and top_k routed experts). A decode step of B tokens reads the
experts they touch: E x (1 - (1 - k/E)^B) per MoE layer on average.
A multimodal config.json (Gemma 3) is sized by its language model (kvflow/doctor/text_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from kvflow.arch_config import ArchConfig, load_hf_config, parse_arch_config
from kvflow.doctor import kv_kinds, v4_spec
from kvflow.doctor.attention_params import mixer_params, norm_params
from kvflow.doctor.moe_spec import MoEParams, expected_experts_touched, moe_params
from kvflow.doctor.text_config import text_model_config
from kvflow.doctor.weight_format import WeightFormat, gguf_weight_format, weight_format_from_config
from kvflow.gguf.gguf_file import is_gguf_path, open_gguf
from kvflow.kv_cache.kv_cache_config import KVCacheConfig

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
# The gated delta rule per token and value head, over its state S [dk, dv]: decay S (1 multiply per
# value), S^T k (a multiply-add: 2), the rank-1 update k (beta (v - S^T k))^T (2), the output S^T q (2).
GDN_FLOPS_PER_STATE_VALUE = 7


def default_kv_dtype(weight_dtype: str, float_dtype: str) -> str:
    """The KV dtype when nothing names one: the weights' storage dtype, except that weight-only
    formats (int8 / int4 at load, a checkpoint's own format such as fp8-block or gguf) leave the
    cache in the model's float dtype."""
    return (
        weight_dtype if weight_dtype in DTYPE_BYTES and weight_dtype not in ("int8", "int4") else float_dtype
    )


def weight_bytes_per_param(dtype: str) -> float:
    if dtype == "int4":
        return DTYPE_BYTES["int4"] + GROUP_OVERHEAD_BYTES / INT4_GROUP_SIZE
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


class WeightRoles(NamedTuple):
    """A model's weight bytes by role: the layers' dense parts (attention, dense MLPs, shared experts,
    routers, layer norms), the routed experts, the embedding, the LM head (0 when tied), the final norm."""

    layers_dense: float
    routed_experts: float
    embedding: float
    lm_head: float
    final_norm: float


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: ArchConfig
    embedding_params: int
    layer_params: int  # all decoder layers together
    lm_head_params: int  # 0 when tied (the embedding's storage is reused)
    norm_params: int  # the final norm
    dtype: str  # the checkpoint's weight dtype
    # Mixture-of-experts: one MoE layer's parameters by role, and how many layers are MoE
    # (layer_params counts every expert; the rest of a MoE layer is in layer_params too).
    moe_layer: MoEParams | None = None
    num_moe_layers: int = 0
    # The checkpoint's own weight format where it is quantized (FP8 blocks, GPTQ/AWQ, MXFP4, a GGUF
    # file's types): bytes per parameter by role (kvflow/doctor/weight_format.py); None: `dtype`.
    weight_format: WeightFormat | None = None

    @classmethod
    def from_config(cls, config: dict[str, object], name: str = "model") -> ModelSpec:
        config = text_model_config(dict(config))
        arch = parse_arch_config(config)
        h = arch.hidden_size
        if arch.compressed is not None:  # DeepSeek-V4: per layer, its attention kind and hyper-connections
            mixers = sum(v4_spec.v4_attention_params(arch, i) for i in range(arch.num_hidden_layers))
            mixers += arch.num_hidden_layers * v4_spec.hyper_connection_params(arch)
            mixers += v4_spec.hyper_head_params(arch.compressed, h)
        else:
            mixers = sum(
                mixer_params(arch, kind) + norm_params(arch, kind) for kind in arch.cache_layer_kinds
            )
        mlp = 3 * h * arch.intermediate_size + (2 * arch.intermediate_size + h if arch.mlp_bias else 0)
        embedding = arch.vocab_size * h
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        moe = moe_params(arch) if arch.moe is not None else None
        num_moe = sum(arch.moe.sparse_layers) if arch.moe is not None else 0
        mlps = (arch.num_hidden_layers - num_moe) * mlp + (num_moe * moe.total if moe is not None else 0)
        return cls(
            name=name,
            arch=arch,
            embedding_params=embedding,
            layer_params=mixers + mlps,
            lm_head_params=0 if arch.tie_word_embeddings else embedding,
            norm_params=h,
            dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
            moe_layer=moe,
            num_moe_layers=num_moe,
            weight_format=weight_format_from_config(config),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        """From a checkpoint directory's config.json, or a GGUF file's metadata and tensor table."""
        path = Path(model_dir)
        spec = cls.from_config(load_hf_config(path), name=path.name)
        if is_gguf_path(path):
            table = {n: (t.type_name, t.shape, t.num_bytes) for n, t in open_gguf(path).tensors.items()}
            spec = replace(spec, weight_format=gguf_weight_format(table))
        return spec

    @property
    def weight_dtype(self) -> str:
        """The weights' storage as the checkpoint holds them: its format's name, else its dtype."""
        return self.weight_format.name if self.weight_format is not None else self.dtype

    def _uses_format(self, dtype: str | None) -> WeightFormat | None:
        fmt = self.weight_format
        return fmt if fmt is not None and (dtype is None or dtype == fmt.name) else None

    def layer_bytes_per_param(self, dtype: str) -> float:
        """Bytes per parameter of the decoder layers' linear weights stored as `dtype` (the
        checkpoint's format by its name)."""
        fmt = self._uses_format(dtype)
        return fmt.layer_bytes if fmt is not None else weight_bytes_per_param(dtype)

    @property
    def routed_expert_params(self) -> int:
        """Parameters of every routed expert of every MoE layer (0 for a dense model)."""
        m = self.moe_layer
        return 0 if m is None else self.num_moe_layers * m.num_experts * m.per_expert

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.layer_params + self.lm_head_params + self.norm_params

    @property
    def active_layer_params(self) -> int:
        """Layer parameters one token multiplies: of each MoE layer's routed experts only top_k."""
        if self.moe_layer is None:
            return self.layer_params
        return self.layer_params - self.num_moe_layers * (self.moe_layer.total - self.moe_layer.active)

    @property
    def num_active_params(self) -> int:
        """Parameters a token uses (the published "active" count: embedding and LM head included)."""
        return self.num_params - (self.layer_params - self.active_layer_params)

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: layers + LM head (tied or not); the embedding is a gather."""
        return self.active_layer_params + self.embedding_params  # the LM head has the embedding's shape

    def experts_read_per_layer(self, num_tokens: int) -> float:
        """Expected distinct routed experts a step of `num_tokens` tokens reads per MoE layer."""
        if self.moe_layer is None:
            return 0.0
        return expected_experts_touched(self.moe_layer.num_experts, self.moe_layer.top_k, num_tokens)

    def step_layer_params(self, num_tokens: int) -> float:
        """Layer parameters read by a step of `num_tokens` tokens: dense parts once, plus the experts
        its tokens touch (all of a dense model's layers)."""
        if self.moe_layer is None:
            return float(self.layer_params)
        untouched = self.moe_layer.num_experts - self.experts_read_per_layer(num_tokens)
        return self.layer_params - self.num_moe_layers * untouched * self.moe_layer.per_expert

    def weight_bytes(self, dtype: str | None = None, quantize_embeddings: bool = False) -> float:
        """Bytes of all weights; quantization applies to the linear layers (embedding and LM head stay
        in the model dtype unless `quantize_embeddings`), as kvflow and GPTQ/AWQ checkpoints do. The
        checkpoint's own format (dtype None or its name) counts each role at its bytes."""
        return sum(self.weight_bytes_by_role(dtype, quantize_embeddings))

    def weight_bytes_by_role(
        self, dtype: str | None = None, quantize_embeddings: bool = False
    ) -> WeightRoles:
        """weight_bytes, by the role each byte plays (what a parallel layout splits differently)."""
        fmt = self._uses_format(dtype)
        base = weight_bytes_per_param(self.dtype)
        experts = self.routed_expert_params
        norms = self.norm_params * base
        if fmt is not None:
            return WeightRoles(
                (self.layer_params - experts) * fmt.layer_bytes,
                experts * fmt.expert_bytes,
                self.embedding_params * fmt.embedding_bytes,
                self.lm_head_params * fmt.head_bytes,
                norms,
            )
        per_param = weight_bytes_per_param(dtype or self.dtype)
        embed = per_param if quantize_embeddings else base
        return WeightRoles(
            (self.layer_params - experts) * per_param,
            experts * per_param,
            self.embedding_params * embed,
            self.lm_head_params * embed,
            norms,
        )

    def decode_weight_bytes(self, dtype: str | None = None, batch_size: int = 1) -> float:
        """Weight bytes read per decode step of `batch_size` sequences: every layer (of MoE layers the
        experts the batch touches, step_layer_params) and the LM head; of the embedding table only
        the rows gathered (negligible), so a tied model reads its table once, as the LM head."""
        base = weight_bytes_per_param(self.dtype)
        fmt = self._uses_format(dtype)
        if fmt is not None:
            experts = self.routed_expert_params
            read = self.step_layer_params(batch_size) - (self.layer_params - experts)  # experts touched
            dense = (self.layer_params - experts) * fmt.layer_bytes + read * fmt.expert_bytes
            return dense + self.embedding_params * fmt.head_bytes + self.norm_params * base
        per_param = weight_bytes_per_param(dtype or self.dtype)
        layers = self.step_layer_params(batch_size)
        return layers * per_param + self.embedding_params * base + self.norm_params * base

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """K/V data bytes one token costs in every attention layer (sliding ones included, while the
        token is in their window; a linear-attention layer holds no per-token KV), scales left out:
        the headline figure. What a request holds: kv_bytes_per_request."""
        a, layers = self.arch, self.num_attention_layers
        if a.compressed is not None:  # what each token adds at long context: its share of the entries
            c = a.compressed
            per_layer = c.num_csa_layers * (c.head_dim + c.index_head_dim) / c.csa_rate
            per_layer += c.num_hca_layers * c.head_dim / c.hca_rate
            return per_layer * weight_bytes_per_param(kv_dtype or self.dtype)
        if a.mla is not None:  # one latent per token and layer, no per-head K/V
            return layers * a.mla.latent_dim * weight_bytes_per_param(kv_dtype or self.dtype)
        return (
            2 * layers * a.num_key_value_heads * a.head_dim * weight_bytes_per_param(kv_dtype or self.dtype)
        )

    def kv_tokens_held(self, context_len: int) -> int:
        """Tokens whose K/V a request of `context_len` tokens keeps in a layer of a uniform model:
        capped at the sliding window (per layer kind: kvflow/doctor/kv_kinds.py keys_read)."""
        window = self.arch.sliding_window
        return min(context_len, window) if window is not None else context_len

    def kv_cache_config(
        self,
        kv_dtype: str | None = None,
        block_size: int = kv_kinds.DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = True,
    ) -> KVCacheConfig:
        """The engine's cache groups for this model (kvflow/kv_cache/kv_cache_config.py)."""
        return kv_kinds.kv_cache_config(
            self.arch, kv_dtype or self.dtype, self.dtype, block_size, enable_prefix_caching
        )

    def kv_bytes_per_request(
        self, num_tokens: int, kv_dtype: str | None = None, block_size: int = kv_kinds.DEFAULT_BLOCK_SIZE
    ) -> int:
        """Pool bytes a request of `num_tokens` tokens holds: its blocks summed over the groups."""
        return self.kv_cache_config(kv_dtype, block_size).bytes_held(max(num_tokens, 1))

    def kv_bytes_per_request_by_kind(
        self, num_tokens: int, kv_dtype: str | None = None, block_size: int = kv_kinds.DEFAULT_BLOCK_SIZE
    ) -> dict[str, int]:
        return self.kv_cache_config(kv_dtype, block_size).bytes_held_by_kind(max(num_tokens, 1))

    def decode_kv_bytes(self, context_len: int, kv_dtype: str | None = None) -> float:
        """Cache bytes one sequence's decode step moves (kvflow/doctor/kv_kinds.py, by kind)."""
        by_kind = kv_kinds.decode_step_kv_bytes_by_kind(
            self.arch, kv_dtype or self.dtype, self.dtype, context_len
        )
        return sum(by_kind.values())

    def prefill_kv_bytes(self, num_tokens: int, context_len: int, kv_dtype: str | None = None) -> float:
        return kv_kinds.prefill_kv_bytes(
            self.arch, kv_dtype or self.dtype, self.dtype, num_tokens, context_len
        )

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep per-token K/V (full, sliding, MLA): all but linear attention's."""
        if self.arch.compressed is not None:
            return self.arch.num_hidden_layers
        return sum(1 for kind in self.arch.cache_layer_kinds if kind != kv_kinds.LINEAR)

    def _flops_per_query_key(self) -> float:
        """QK^T and PV of one query and one key in one layer: 4 x q_heads x head_dim (2 FLOPs per
        multiply-add, two matmuls); MLA: 2 x q_heads x (qk + v head dims), K/V expanded per head."""
        a = self.arch
        if a.compressed is not None:  # K = V: QK^T and PV over head_dim
            return 4.0 * a.num_attention_heads * a.compressed.head_dim
        if a.mla is not None:
            return 2.0 * a.num_attention_heads * (a.mla.qk_head_dim + a.mla.v_head_dim)
        return 4.0 * a.num_attention_heads * a.head_dim

    def attention_flops_per_key(self) -> float:
        """Attention FLOPs one query spends per key of its context, over the layers that read keys."""
        return self.num_attention_layers * self._flops_per_query_key()

    def attention_flops(self, num_tokens: int, context_len: int) -> float:
        """`num_tokens` queries over `context_len` keys: every key in full and MLA layers, the window's
        in sliding layers (kv_kinds.keys_read); a linear-attention layer costs
        GDN_FLOPS_PER_STATE_VALUE x Hv x dk x dv per token, whatever the context."""
        a = self.arch
        flops = 0.0
        if a.compressed is not None:
            c = a.compressed
            for kind, n in kv_kinds.layers_by_kind(a).items():
                keys = v4_spec.keys_read(c, kind, context_len) * self._flops_per_query_key()
                index = v4_spec.index_keys_scored(c, kind, context_len) * v4_spec.index_flops_per_key(c)
                flops += n * num_tokens * (keys + index)
            return flops
        for kind, n in kv_kinds.layers_by_kind(a).items():
            if kind == kv_kinds.LINEAR and a.linear is not None:
                lin = a.linear
                state = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim
                flops += n * num_tokens * GDN_FLOPS_PER_STATE_VALUE * state
            else:
                keys = kv_kinds.keys_read(a, kind, context_len)
                flops += n * num_tokens * keys * self._flops_per_query_key()
                flops += (
                    n
                    * num_tokens
                    * kv_kinds.indexer_keys_scored(a, context_len)
                    * self._index_flops_per_key()
                )
        return flops

    def _index_flops_per_key(self) -> float:
        """DeepSeek-V3.2's indexer per query and cached key: q . k in each of its heads and the
        weighted sum over them (2 x heads x head_dim + 2 x heads)."""
        m = self.arch.mla
        if m is None or m.indexer is None:
            return 0.0
        return 2.0 * m.indexer.num_heads * (m.indexer.head_dim + 1)

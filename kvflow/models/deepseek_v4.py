"""DeepSeek-V4 (DeepseekV4ForCausalLM): compressed sparse / heavily compressed attention over a
sliding window, hyper-connected residual streams, hash-routed and top-k routed experts.

Per layer (shapes: T tokens, H heads of d, one K=V head of d, r trailing rotary dims):
    streams [T, hc, D] --hyper-connection--> x = Σ_j pre_j stream_j; post [T, hc]; comb [T, hc, hc]
    q       wq_a -> RMSNorm -> wq_b -> [T, H, d], RMSNorm per head (no weight), rope
    kv      wkv -> RMSNorm -> [T, d], rope; written into the window's pages
    compressed layers: the compressor pools windows of m tokens into entries (its state carries the
            tail between steps: kvflow/attention/compressor.py); CSA's indexer pools its own keys
            and selects each query's top-k entries (kvflow/attention/compressed_attention.py)
    attend  window + entries + sink, then the conjugate rope at the query's position on the output
            (K = V carried the key's rotation into the values)
    o       grouped low-rank projection: the H d outputs in o_groups groups, each to o_lora_rank
            (wo_a, block diagonal), then wo_b to D
    streams <- post ⊗ attn_out + comb^T · streams; the same around the MoE
The MoE: sqrt(softplus) scores (+ a correction bias for the choice), weights renormalised and
scaled; the hash layers take their experts from tid2eid[token id]; SwiGLU clamped at swiglu_limit.
The last hidden state collapses the streams (hc_head) before the final norm. Rope: sliding-only
layers with rope_theta, compressed ones (and their compressors and indexer) with compress_rope_theta;
pairs interleaved on the trailing r dims. The checkpoint's MTP layers (mtp.*) are not loaded.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvflow.arch_config import ArchConfig, RopeConfig
from kvflow.attention.compressed_attention import attend, causal_entries, selected_indices
from kvflow.attention.compressed_store import EntryPool, RingState
from kvflow.attention.compressor import CompressorShape, pool_windows, ring_after, step_rows
from kvflow.attention.indexer import index_scores, selected_keys
from kvflow.attention.kv_store import KVStore
from kvflow.attention.metadata import AttentionMetadata, CompressedMetadata, CompressedRequest, StateMetadata
from kvflow.compressed_config import (
    CSA,
    CSA_ENTRIES,
    CSA_INDEX,
    CSA_STATE,
    HCA,
    HCA_ENTRIES,
    HCA_STATE,
    WINDOW,
    CompressedAttentionConfig,
    layer_cache_ids,
)
from kvflow.errors import ModelLoadError
from kvflow.kv_cache import compressed_kinds as kinds
from kvflow.layers.fused_moe import SparseMoE
from kvflow.layers.hyper_connection import hyper_head, hyper_merge, hyper_weights
from kvflow.layers.linear import Linear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import compute_inv_freq
from kvflow.models.deepseek_v4_weights import V4Quantized, scale_of, unpack_v4
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.quant.checkpoint_formats import CheckpointQuant
from kvflow.quant.prequantized import build_linear

if TYPE_CHECKING:
    from kvflow.models.loader import TensorReader

NATIVE_DECODE_UNSUPPORTED_V4 = "compressed attention, hyper-connections and experts run on the Python path"
# Query rows scored against the compressed keys at once in a prefill chunk: bounds the
# [rows, index heads, entries] float32 scores (64 x 64 x 32k entries = 512 MiB at V4-Pro's 128k).
INDEX_QUERY_PIECE = 64


class InterleavedRope:
    """cos / sin [P, r / 2] of one rope (compute_inv_freq; YaRN's attention factor is 1 here)."""

    def __init__(self, cfg: RopeConfig, max_positions: int) -> None:
        inv_freq, factor = compute_inv_freq(cfg)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos, self.sin = freqs.cos() * factor, freqs.sin() * factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, r / 2] each, rounded to `dtype` as transformers rounds them."""
        return self.cos.index_select(0, positions).to(dtype), self.sin.index_select(0, positions).to(dtype)


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 x cos.shape[-1] dims of x [n, ..., d] in interleaved pairs (x0, x1),
    (x2, x3), ...; cos / sin [n, r / 2] (pass -sin for the conjugate). float32 math, x's dtype out."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.float().view(shape), sin.float().view(shape)
    rope = x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rotated.to(x.dtype)), dim=-1)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _f32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class Compressor(nn.Module):
    """One compressor's weights (checkpoint: wkv, wgate, ape, norm); kvflow/attention/compressor.py."""

    def __init__(self, hidden: int, shape: CompressorShape, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        self.wkv = Linear(hidden, shape.series * shape.width, False, dtype)
        self.wgate = Linear(hidden, shape.series * shape.width, False, dtype)
        self.ape = _f32_param(shape.rate, shape.series * shape.width)
        self.norm = RMSNorm(shape.width, eps, dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:  # [n, D] -> [n, row_width]: raw [kv | gate]
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def entries(
        self, seq: torch.Tensor, lo: int, windows: range, rope: InterleavedRope, dtype: torch.dtype
    ) -> torch.Tensor:
        """The normed, rotated entries of `windows` [W, d] (seq: the ring's columns of this compressor)."""
        pooled = self.norm(pool_windows(self.shape, seq, lo, windows, self.ape, dtype))
        positions = torch.tensor([w * self.shape.rate for w in windows], dtype=torch.int64)
        return rotate_trailing(pooled, *rope.cos_sin(positions, dtype))


class Indexer(nn.Module):
    """CSA's lightning indexer (checkpoint: attn.indexer.{wq_b, weights_proj, compressor.*})."""

    def __init__(self, cfg: ArchConfig, c: CompressedAttentionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        self.wq_b = Linear(c.q_lora_rank, c.index_num_heads * c.index_head_dim, False, dtype)
        self.weights_proj = Linear(cfg.hidden_size, c.index_num_heads, False, dtype)
        shape = CompressorShape(c.csa_rate, c.index_head_dim, 2)
        self.compressor = Compressor(cfg.hidden_size, shape, cfg.rms_norm_eps, dtype)


@dataclasses.dataclass
class V4LayerCache:
    """One layer's cache layers in the store, and their ids for the step's metadata."""

    window: EntryPool
    window_id: int
    entries: EntryPool | None = None
    entries_id: int = -1
    index_keys: EntryPool | None = None
    index_id: int = -1
    state: RingState | None = None
    state_id: int = -1


class V4Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        assert cfg.compressed is not None
        c = self.c = cfg.compressed
        self.kind = c.layer_types[index]
        self.eps = cfg.rms_norm_eps
        h, d = cfg.num_attention_heads, c.head_dim
        self.num_heads = h
        self.wq_a = Linear(cfg.hidden_size, c.q_lora_rank, False, dtype)
        self.q_norm = RMSNorm(c.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.wq_b = Linear(c.q_lora_rank, h * d, False, dtype)
        self.wkv = Linear(cfg.hidden_size, d, False, dtype)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        # wo_a: block diagonal, o_groups blocks [o_lora_rank, H d / o_groups] stacked as the checkpoint does.
        self.wo_a = nn.Parameter(
            torch.empty(c.o_groups * c.o_lora_rank, h * d // c.o_groups, dtype=dtype), requires_grad=False
        )
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, cfg.hidden_size, False, dtype)
        self.attn_sink = _f32_param(h)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind == CSA:
            self.compressor = Compressor(
                cfg.hidden_size, CompressorShape(c.csa_rate, d, 2), cfg.rms_norm_eps, dtype
            )
            self.indexer = Indexer(cfg, c, dtype)
        elif self.kind == HCA:
            self.compressor = Compressor(
                cfg.hidden_size, CompressorShape(c.hca_rate, d, 1), cfg.rms_norm_eps, dtype
            )

    def forward(
        self,
        x: torch.Tensor,
        ropes: tuple[InterleavedRope, InterleavedRope],
        cache: V4LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, D] -> [T, D]
        c, t, dtype = self.c, x.shape[0], x.dtype
        rope = ropes[0] if self.kind not in (CSA, HCA) else ropes[1]
        cos, sin = rope.cos_sin(meta.positions, dtype)
        q_res = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_res).view(t, self.num_heads, c.head_dim), self.eps)
        q = rotate_trailing(q, cos, sin)
        kv = rotate_trailing(self.norm(self.wkv(x)), cos, sin)  # [T, d]
        window_meta = meta.attention_for_layer(cache.window_id)
        cache.window.write(window_meta.slot_mapping, kv)
        if self.compressor is not None:
            self._compress(x, ropes[1], cache, meta, meta.compressed_for_layer(cache.entries_id))
        out = torch.empty_like(q)
        step = _StepEntries(self, cache, meta, x, q_res, ropes[1])
        for row in range(window_meta.num_decode_tokens):
            assert window_meta.decode_kv_slots is not None and window_meta.decode_num_keys is not None
            slots = window_meta.decode_kv_slots[row, : int(window_meta.decode_num_keys[row])]
            out[row : row + 1] = step.attend(q, row, row + 1, cache.window.gather(slots), None)
        for piece in window_meta.prefills:
            a, b = piece.token_start, piece.token_end
            if piece.kv_slots is None:
                keys, visible = kv[a:b], torch.ones(b - a, b - a, dtype=torch.bool).tril()
            else:
                assert piece.attend is not None
                keys, visible = cache.window.gather(piece.kv_slots), piece.attend
            for p in range(a, b, INDEX_QUERY_PIECE):
                e = min(b, p + INDEX_QUERY_PIECE)
                out[p:e] = step.attend(q, p, e, keys, visible[p - a : e - a])
        out = rotate_trailing(out, cos, -sin)  # undo the values' rotation at the query's position
        grouped = out.reshape(t, c.o_groups, -1).transpose(0, 1)  # [G, T, H d / G]
        w = self.wo_a.view(c.o_groups, c.o_lora_rank, -1)  # [G, o_lora, H d / G]
        mixed = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)  # [T, G o_lora]
        return self.wo_b(mixed)

    # ------------------------------------------------------------------------------ compressors

    def _compress(
        self,
        x: torch.Tensor,
        rope: InterleavedRope,
        cache: V4LayerCache,
        meta: AttentionMetadata,
        entries_meta: CompressedMetadata,
    ) -> None:
        """Each request's windows closing in this step, pooled into its entries (and index keys);
        its ring read from the step's source and written back (and to checkpoint pages)."""
        assert self.compressor is not None and cache.state is not None and cache.entries is not None
        state_meta = meta.for_layer(cache.state_id)
        assert isinstance(state_meta, StateMetadata)
        index_meta = meta.compressed_for_layer(cache.index_id) if self.indexer is not None else None
        shape = self.compressor.shape
        width = shape.row_width
        for i, (req, st) in enumerate(zip(entries_meta.requests, state_meta.requests, strict=True)):
            xs = x[req.token_start : req.token_end]
            rows = self.compressor.rows(xs)
            if self.indexer is not None:
                rows = torch.cat((rows, self.indexer.compressor.rows(xs)), dim=-1)
            ring = cache.state.read(st.source) if st.source is not None else torch.zeros(cache.state.shape)
            seq, lo = step_rows(ring, rows, req.start, shape.ring_rows)
            windows = range(req.start // shape.rate, req.end // shape.rate)
            if len(windows):
                entries = self.compressor.entries(seq[:, :width], lo, windows, rope, x.dtype)
                cache.entries.write(entries_meta.entry_slots(req, windows.start, windows.stop), entries)
                if self.indexer is not None and index_meta is not None and cache.index_keys is not None:
                    keys = self.indexer.compressor.entries(seq[:, width:], lo, windows, rope, x.dtype)
                    index_req = index_meta.requests[i]
                    cache.index_keys.write(
                        index_meta.entry_slots(index_req, windows.start, windows.stop), keys
                    )
            n = req.token_end - req.token_start
            cache.state.write(st.state, ring_after(ring, rows, req.start, n))
            for offset, pages in st.checkpoints:
                cache.state.write(pages, ring_after(ring, rows, req.start, offset))


class _StepEntries:
    """One layer's compressed keys for one step: each request's entries (and CSA index keys)
    gathered from the pool once, on first use, then read by its queries."""

    def __init__(
        self,
        attn: V4Attention,
        cache: V4LayerCache,
        meta: AttentionMetadata,
        x: torch.Tensor,
        q_res: torch.Tensor,
        rope: InterleavedRope,
    ) -> None:
        self.attn, self.cache, self.meta, self.x, self.q_res, self.rope = attn, cache, meta, x, q_res, rope
        self.scale = attn.c.head_dim**-0.5
        self.entries_meta = meta.compressed_for_layer(cache.entries_id) if cache.entries is not None else None
        self._gathered: dict[tuple[int, str], torch.Tensor] = {}

    def _request_entries(self, req: CompressedRequest) -> torch.Tensor:
        """The request's E entries after this step [E, d], float32 (converted once here: the
        per-query gathers and products of a prefill chunk then convert nothing)."""
        key = (req.token_start, "entries")
        if key not in self._gathered:
            assert self.entries_meta is not None and self.cache.entries is not None
            num = req.end // self.entries_meta.compress_rate
            self._gathered[key] = self.cache.entries.gather(
                self.entries_meta.entry_slots(req, 0, num)
            ).float()
        return self._gathered[key]

    def _index_keys(self, req: CompressedRequest) -> torch.Tensor:
        """CSA: the indexer's keys of the request's E entries [E, d_I], float32 (every query scores all)."""
        key = (req.token_start, "index")
        if key not in self._gathered:
            assert self.entries_meta is not None and self.cache.index_keys is not None
            num = req.end // self.entries_meta.compress_rate
            index_meta = self.meta.compressed_for_layer(self.cache.index_id)
            index_req = _request_of(index_meta.requests, req.token_start)
            self._gathered[key] = self.cache.index_keys.gather(
                index_meta.entry_slots(index_req, 0, num)
            ).float()
        return self._gathered[key]

    def attend(
        self, q: torch.Tensor, a: int, b: int, window_keys: torch.Tensor, window_visible: torch.Tensor | None
    ) -> torch.Tensor:
        """Queries of flat tokens [a, b) (one request) over their window keys and compressed keys:
        HCA's causal entries beside the window's, CSA's top-k gathered per query."""
        sinks = self.attn.attn_sink
        positions = self.meta.positions[a:b]
        if self.entries_meta is None:
            return attend(q[a:b], window_keys, window_visible, sinks, self.scale)
        req = _request_of(self.entries_meta.requests, a)
        num = (int(positions.max()) + 1) // self.entries_meta.compress_rate
        if num == 0:
            return attend(q[a:b], window_keys, window_visible, sinks, self.scale)
        visible = causal_entries(positions, num, self.entries_meta.compress_rate)
        window_rows = window_visible
        if window_rows is None:  # a decode row: every key of its window
            window_rows = torch.ones(b - a, len(window_keys), dtype=torch.bool)
        if self.cache.index_keys is None:  # HCA: every causal entry, beside the window
            keys = torch.cat((window_keys, self._request_entries(req)[:num]), dim=0)
            return attend(q[a:b], keys, torch.cat((window_rows, visible), dim=1), sinks, self.scale)
        selected = self._select(a, b, positions, self._index_keys(req)[:num], visible)
        idx, valid = selected_indices(selected, self.attn.c.index_topk)
        if b - a == 1:  # a decode row reads only its selected entries from the pool
            assert self.cache.entries is not None
            slots = self.entries_meta.entry_slots(req, 0, num)[idx.reshape(-1)]
            own = self.cache.entries.gather(slots).view(*idx.shape, -1)
        else:  # a prefill chunk's queries share one float32 copy of them all
            own = self._request_entries(req)[idx]
        return attend(q[a:b], window_keys, window_rows, sinks, self.scale, own, valid)

    def _select(
        self, a: int, b: int, positions: torch.Tensor, index_keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """CSA: each query's top index_topk visible entries by the indexer's score, [n, E] bool."""
        attn = self.attn
        assert attn.indexer is not None
        c, n = attn.c, b - a
        cos, sin = self.rope.cos_sin(positions, self.x.dtype)
        q = attn.indexer.wq_b(self.q_res[a:b]).view(n, c.index_num_heads, c.index_head_dim)
        q = rotate_trailing(q, cos, sin)
        weights = attn.indexer.weights_proj(self.x[a:b]).float() * c.index_num_heads**-0.5
        scores = index_scores(q, index_keys, weights, c.index_head_dim**-0.5)  # [n, E]
        return selected_keys(scores, visible, c.index_topk)


def _request_of(requests: list[CompressedRequest], token: int) -> CompressedRequest:
    for req in requests:
        if req.token_start <= token < req.token_end:
            return req
    raise IndexError(f"flat token {token} belongs to no request of the step")


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        assert cfg.compressed is not None and cfg.moe is not None
        c = self.c = cfg.compressed
        self.eps = cfg.rms_norm_eps
        mix = (2 + c.hc_mult) * c.hc_mult
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = (
            _f32_param(mix, c.hc_mult * cfg.hidden_size),
            _f32_param(mix),
            _f32_param(3),
        )
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = (
            _f32_param(mix, c.hc_mult * cfg.hidden_size),
            _f32_param(mix),
            _f32_param(3),
        )
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = V4Attention(cfg, dtype, index)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.is_hash = c.hash_layers[index]
        # Hash layers choose experts by token id: their router only weights them (no choice bias).
        moe = dataclasses.replace(cfg.moe, score_correction_bias=not self.is_hash)
        self.ffn = SparseMoE(cfg.hidden_size, moe, dtype)
        self.tid2eid: nn.Parameter | None = (
            nn.Parameter(torch.empty(cfg.vocab_size, moe.top_k, dtype=torch.int64), requires_grad=False)
            if self.is_hash
            else None
        )

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        ropes: tuple[InterleavedRope, InterleavedRope],
        cache: V4LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hc, D] -> [T, hc, D]
        c = self.c
        post, comb, x = hyper_weights(
            streams,
            self.hc_attn_fn,
            self.hc_attn_base,
            self.hc_attn_scale,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            self.eps,
        )
        streams = hyper_merge(streams, self.attn(self.attn_norm(x), ropes, cache, meta), post, comb)
        post, comb, x = hyper_weights(
            streams,
            self.hc_ffn_fn,
            self.hc_ffn_base,
            self.hc_ffn_scale,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            self.eps,
        )
        hash_ids = None if self.tid2eid is None else self.tid2eid.index_select(0, input_ids)
        return hyper_merge(streams, self.ffn(self.ffn_norm(x), hash_ids), post, comb)


class DeepseekV4ForCausalLM(LlamaFamilyForCausalLM):
    native_decode_unsupported = NATIVE_DECODE_UNSUPPORTED_V4

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(cfg, dtype, max_positions)
        assert cfg.compressed is not None
        c = cfg.compressed
        self.hc_head_fn = _f32_param(c.hc_mult, c.hc_mult * cfg.hidden_size)
        self.hc_head_base = _f32_param(c.hc_mult)
        self.hc_head_scale = _f32_param(1)
        self.cache_ids = layer_cache_ids(c)
        self.max_positions = max_positions
        self._ropes: tuple[InterleavedRope, InterleavedRope] | None = None
        self._layer_caches: tuple[KVStore, list[V4LayerCache]] | None = None

    def make_layer(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return V4DecoderLayer(cfg, dtype, index)

    def reset_rotary(self, max_positions: int) -> None:
        super().reset_rotary(max_positions)
        self._ropes = None

    def ropes(self) -> tuple[InterleavedRope, InterleavedRope]:
        """(sliding-only layers' rope, compressed layers' rope), built on first use."""
        if self._ropes is None:
            cfg = self.config
            assert cfg.compress_rope is not None
            self._ropes = (
                InterleavedRope(cfg.rope, self.max_positions),
                InterleavedRope(cfg.compress_rope, self.max_positions),
            )
        return self._ropes

    def layer_cache(self, kv_store: KVStore, index: int) -> V4LayerCache:
        pages = kv_store.compressed_pages
        config = kv_store.kv_cache_config
        if pages is None or config is None:
            raise ValueError("DeepSeek-V4 needs a KV store built with compressed=True and its cache config")
        c = self.config.compressed
        assert c is not None
        ids = self.cache_ids[index]
        slot = config.layer_slot

        def entry_pool(kind: str, width: int) -> EntryPool:
            spec = config.groups[config.layer_group[ids[kind]]].spec
            per = getattr(spec, "entries_per_block", spec.block_size)
            return pages.entries(slot[ids[kind]], per, width)

        window_id = ids[WINDOW]
        cache = V4LayerCache(entry_pool(WINDOW, c.head_dim), window_id)
        kind = c.layer_types[index]
        if kind in (CSA, HCA):
            entries, state = (CSA_ENTRIES, CSA_STATE) if kind == CSA else (HCA_ENTRIES, HCA_STATE)
            cache.entries, cache.entries_id = entry_pool(entries, c.head_dim), ids[entries]
            cache.state_id = ids[state]
            cache.state = pages.state(
                slot[ids[state]], kinds.ring_rows(c, kind), kinds.state_row_width(c, kind)
            )
        if kind == CSA:
            cache.index_keys, cache.index_id = (
                entry_pool(CSA_INDEX, c.index_head_dim),
                ids[CSA_INDEX],
            )
        return cache

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_store: KVStore) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, D] (streams collapsed, normed)."""
        c = self.config.compressed
        assert c is not None
        hidden = self.embed(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()  # [T, hc, D]
        ropes = self.ropes()
        if self._layer_caches is None or self._layer_caches[0] is not kv_store:
            # Views of the store's pages, built once per store rather than every step and layer.
            self._layer_caches = (kv_store, [self.layer_cache(kv_store, i) for i in range(len(self.layers))])
        for layer, cache in zip(self.layers, self._layer_caches[1], strict=True):
            streams = layer(streams, input_ids, ropes, cache, meta)
        collapsed = hyper_head(
            streams,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            c.hc_eps,
            self.config.rms_norm_eps,
        )
        return self.norm(collapsed)

    def load_param(self, name: str, param: torch.Tensor, reader: TensorReader, used: set[str]) -> bool:
        """Every parameter from the checkpoint's names: transformers' save (model.*, head.weight)
        or DeepSeek's own (no model. prefix, embed.weight, hc_head_fn); experts' gate_up_proj is
        w1 then w3, down_proj w2."""
        sources = []
        for options in _checkpoint_names(name):
            found = next((n for n in options if n in reader.files), None)
            if found is None:
                raise ModelLoadError(f"checkpoint is missing tensor {options[0]!r} (needed for {name})")
            sources.append(found)
        scales = [scale_of(s, reader.files) for s in sources]
        if any(s is not None for s in scales):
            return self._load_quantized(name, param, reader, used, sources, scales)
        from kvflow.models.loader import load_param_sources  # the loader imports the registry, so late

        load_param_sources(name, param, sources, reader)
        used.update(sources)
        return True

    def begin_load(self, checkpoint_quant: CheckpointQuant | None) -> None:
        """The loader's first call: the checkpoint's quantization_config (FP8 block shape)."""
        self.__dict__["_v4_quantized"] = V4Quantized.from_quant(checkpoint_quant)

    def _load_quantized(
        self,
        name: str,
        param: torch.Tensor,
        reader: TensorReader,
        used: set[str],
        sources: list[str],
        scales: list[str | None],
    ) -> bool:
        """A parameter stored as FP8 blocks or FP4 codes (kvflow/models/deepseek_v4_weights.py): a
        Linear's weight becomes a layer on those bytes (after_load), anything else is dequantized."""
        layout: V4Quantized | None = self.__dict__.get("_v4_quantized")
        if layout is None:
            raise ModelLoadError(
                f"{sources[0]} has a scale tensor beside it but config.json has no quantization_config"
            )
        if any(s is None for s in scales):
            raise ModelLoadError(f"{name}: its checkpoint parts {sources} mix quantized and plain tensors")
        parts = [
            unpack_v4(reader.read(src), reader.read(sc), layout, src)
            for src, sc in zip(sources, scales, strict=True)
            if sc is not None
        ]
        rows, cols = sum(p.q.shape[0] for p in parts), {p.q.shape[1] for p in parts}
        if (rows, *cols) != tuple(param.shape):
            raise ModelLoadError(
                f"shape mismatch for {name}: expected {tuple(param.shape)} from config.json, got "
                f"{[tuple(p.q.shape) for p in parts]} from {sources}"
            )
        used.update(sources)
        used.update(s for s in scales if s is not None)
        path = name.removesuffix(".weight")
        if name.endswith(".weight") and isinstance(self.get_submodule(path), Linear):
            self.__dict__.setdefault("_quantized_pending", {})[path] = parts
        else:
            param.copy_(torch.cat([p.dequantize() for p in parts]).to(param.dtype))
        return True

    def after_load(self) -> None:
        """The quantized projections' layers, built on their stored bytes (prequantized.build_linear)."""
        for path, parts in self.__dict__.pop("_quantized_pending", {}).items():
            linear = self.get_submodule(path)
            assert isinstance(linear, Linear)
            bias = linear.bias.data if linear.bias is not None else None
            parent, _, attr = path.rpartition(".")
            setattr(self.get_submodule(parent), attr, build_linear(parts, bias, linear.weight.dtype))


_EXPERT = re.compile(
    r"^(layers\.\d+\.ffn\.(?:experts\.\d+|shared_expert))\.(gate_up_proj|down_proj)\.weight$"
)


def _checkpoint_names(name: str) -> list[list[str]]:
    """kvflow parameter -> the checkpoint tensors (concatenated in order) it is made of, each as
    its spellings: transformers' first, DeepSeek's own second."""
    if name == "lm_head.weight":
        return [["head.weight", "lm_head.weight"]]
    if name == "embed_tokens.weight":
        return [["model.embed_tokens.weight", "embed.weight"]]
    if name.startswith("hc_head_"):
        return [["model." + name.replace("hc_head_", "hc_head.hc_"), name]]
    parts = [name]
    match = _EXPERT.match(name)
    if match is not None:
        base = match.group(1).replace(".shared_expert", ".shared_experts")
        parts = (
            [f"{base}.w1.weight", f"{base}.w3.weight"]
            if match.group(2) == "gate_up_proj"
            else [f"{base}.w2.weight"]
        )
    elif name.endswith(".tid2eid"):
        parts = [name.replace(".tid2eid", ".ffn.gate.tid2eid")]
    elif name.endswith(".ffn.gate.e_score_correction_bias"):
        parts = [name.replace(".e_score_correction_bias", ".bias")]
    elif name.endswith(".attn.wo_a"):
        parts = [name + ".weight"]
    return [["model." + p, p] for p in parts]

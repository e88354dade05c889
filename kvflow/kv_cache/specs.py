"""Cache kinds: one small frozen spec per shape of attention a layer can have (pure Python, no torch).

A spec says what one block of one layer holds in the pool, how many blocks a request holds as it
grows, which of them it may free as it advances, and what a prefix hit of P tokens requires of it
(vLLM v1's KVCacheSpec idea). Every block of the one pool is `page_bytes` per layer slot, whatever
the kind (kvflow/kv_cache/kv_cache_config.py groups the layers and lays them over the slots).

    FullAttentionSpec     K and V of `block_size` tokens per block (MLAAttentionSpec: one latent). A
                          request of L tokens holds cdiv(L, block_size) blocks until it finishes; a
                          prefix hit of P tokens needs all of its P / block_size blocks cached.
    SlidingWindowSpec     the same blocks, but query q reads only keys (q - W, q] (HF's semantics):
                          blocks wholly before position L - W + 1 are freed as the request advances, so
                          it holds about W / block_size + 1 blocks whatever L; a hit of P tokens needs
                          only the blocks holding keys P - W + 1 .. P - 1 (the rest may be evicted).
    LinearAttentionSpec   a fixed-size recurrent state per request (Gated DeltaNet: the delta-rule
                          state and the short convolution's inputs), no per-token KV: the running
                          state takes `pages_per_state` blocks whatever L. A hit of P tokens needs a
                          checkpoint of the state taken after exactly P tokens; checkpoints are taken
                          every `checkpoint_interval` tokens (a multiple of block_size) while a request
                          computes, and parked in the pool as cached blocks, evictable like any other.
    CompressedSpec        DeepSeek-V4's compressed entries, one per compress_rate tokens, several to a
                          block; held like full attention; hits on multiples of a block's token span.
    CompressorStateSpec   the state a compressor carries between steps (its pending tail), a
                          linear-attention-like state (kvflow/kv_cache/compressed_kinds.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's share of one pool block: `page_bytes` (data, scales and zero points together)."""

    block_size: int  # tokens per block (a token-indexed kind's pages; a state kind counts tokens by it too)
    page_bytes: int

    kind: ClassVar[str] = "full_attention"

    def num_blocks_held(self, num_tokens: int) -> int:
        """Blocks a request holds once `num_tokens` tokens are computed (ready for the next token)."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_peak_prefill(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        """Blocks a prompt holds at once while its prefill is computed in chunks of up to
        `max_chunk_tokens` (what admission checks against the pool)."""
        return cdiv(num_prompt_tokens, self.block_size)

    def bytes_held(self, num_tokens: int) -> int:
        """Bytes one layer of this kind holds for a request of `num_tokens` tokens."""
        return self.num_blocks_held(num_tokens) * self.page_bytes


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token's K/V (or latent) stays resident: bytes linear in L."""

    kind: ClassVar[str] = "full_attention"


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek V2/V3): one latent per token, held like full attention."""

    kind: ClassVar[str] = "mla"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    sliding_window: int = 0

    kind: ClassVar[str] = "sliding_attention"

    def num_releasable(self, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on reads again: query q attends keys
        q - W < k <= q, so the earliest key still needed is num_computed - W + 1, and block i ends
        at position (i + 1) * block_size - 1."""
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def num_blocks_held(self, num_tokens: int) -> int:
        total = cdiv(num_tokens, self.block_size)
        return total - min(total, self.num_releasable(num_tokens))

    def num_blocks_peak_prefill(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        """A chunk of up to `max_chunk_tokens` needs the W - 1 keys before it, plus one block for
        misalignment; never more than the whole prompt."""
        resident = min(num_prompt_tokens, self.sliding_window - 1 + max_chunk_tokens)
        return min(cdiv(num_prompt_tokens, self.block_size), cdiv(resident, self.block_size) + 1)

    @property
    def num_hit_blocks_needed(self) -> int:
        """Contiguous cached blocks that end a sliding-window prefix hit: the query at P reads keys
        P - W + 1 .. P - 1 from the cache (P itself is computed), W - 1 keys."""
        return cdiv(self.sliding_window - 1, self.block_size)


@dataclass(frozen=True)
class LinearAttentionSpec(KVCacheSpec):
    """`state_bytes`: one layer's running state (recurrent + convolution), laid over
    `pages_per_state` pool blocks; `checkpoint_interval`: tokens between prefix-cache checkpoints
    of the state (a block multiple), None when prefix caching is off."""

    state_bytes: int = 0
    pages_per_state: int = 1
    checkpoint_interval: int | None = None

    kind: ClassVar[str] = "linear_attention"

    def num_blocks_held(self, num_tokens: int) -> int:
        return self.pages_per_state

    def num_blocks_peak_prefill(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        """The running state, the checkpoint a prefix hit restores from (held for one step), and the
        checkpoints one chunk writes (held until the step after)."""
        if self.checkpoint_interval is None:
            return self.pages_per_state
        per_chunk = cdiv(min(num_prompt_tokens, max_chunk_tokens), self.checkpoint_interval)
        return self.pages_per_state * (2 + per_chunk)

    def checkpoint_boundaries(self, start: int, end: int) -> list[int]:
        """Token counts b with start < b <= end at which a checkpoint is taken (multiples of the
        interval): a chunk computing tokens [start, end) writes the state after b tokens."""
        step = self.checkpoint_interval
        if step is None:
            return []
        return list(range((start // step + 1) * step, end + 1, step))


@dataclass(frozen=True)
class CompressedSpec(KVCacheSpec):
    """DeepSeek-V4's compressed entries (one per `compress_rate` tokens: a CSA / HCA layer's pooled
    K=V, or a CSA indexer's pooled key), `entries_per_block` to a block, so a block spans
    tokens_per_block = entries_per_block x compress_rate tokens. A request of L tokens holds
    cdiv(L // rate, entries_per_block) blocks until it finishes (entries are never released: a CSA
    query may select any of them, an HCA query reads them all). A prefix hit of P tokens needs P to
    be a multiple of tokens_per_block (a partly filled block is never cached) and those blocks cached."""

    compress_rate: int = 1
    entries_per_block: int = 1
    label: str = (
        "compressed"  # the cache kind (compressed_kinds.py: csa_entries, csa_index_keys, hca_entries)
    )

    @property
    def kind(self) -> str:  # type: ignore[override]  # per instance: three kinds share this spec
        return self.label

    @property
    def tokens_per_block(self) -> int:
        return self.compress_rate * self.entries_per_block

    def num_entries(self, num_tokens: int) -> int:
        return num_tokens // self.compress_rate

    def num_blocks_held(self, num_tokens: int) -> int:
        return cdiv(self.num_entries(num_tokens), self.entries_per_block)

    def num_blocks_peak_prefill(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        return self.num_blocks_held(num_prompt_tokens)


@dataclass(frozen=True)
class CompressorStateSpec(LinearAttentionSpec):
    """A compressor's state: its raw projections of the last `ring_rows` positions (the pending
    tail of a window not yet pooled and, for CSA's overlapping windows, the window before it),
    float32. At a multiple of the compress rate an HCA compressor's tail is empty, so its state
    needs no checkpoint for a prefix hit there (`empty_at_boundaries`); a CSA one still needs the
    previous window's rows, checkpointed like a linear-attention state."""

    empty_at_boundaries: bool = False
    label: str = "compressor_state"  # csa_state or hca_state

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.label

    def num_blocks_peak_prefill(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        if self.empty_at_boundaries:
            return self.pages_per_state
        return super().num_blocks_peak_prefill(num_prompt_tokens, max_chunk_tokens)

    def checkpoint_boundaries(self, start: int, end: int) -> list[int]:
        return [] if self.empty_at_boundaries else super().checkpoint_boundaries(start, end)

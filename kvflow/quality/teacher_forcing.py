"""Teacher-forced next-token distributions of a loaded model over a token sequence, and the running
totals both quality measurements keep (`kvflow quant-eval` offline, the serving probe online):
    KL          mean over positions of KL(p_ref || p_served) of the next-token distributions (nats)
    top-1       share of positions where both put the highest probability on the same token
    perplexity  exp(mean negative log-likelihood of the actual next token), for each path

The sequence is cut into windows of at most `window` tokens, each scored over a private KV store
(no cached context) along one of the engine's two paths:
    prefill  the window is one prefill chunk: every position's logits come from the forward the
             engine runs for a prompt (large matrix products, bf16 activations);
    decode   the positions are decode rows, DECODE_ROWS per step in order, each attending the keys
             the earlier steps wrote: the forward that produces generated tokens (the few-row GEMVs,
             which for int8 and int4 weights quantize activations to int8, and the decode attention kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvflow.attention.kv_layer import QUANTIZED_KV_DTYPES
from kvflow.attention.kv_store import KVStore
from kvflow.attention.metadata import AttentionMetadata, PrefillChunkMetadata
from kvflow.config import ScoringPath
from kvflow.models.llama import LlamaFamilyForCausalLM

SCORING_BLOCK_SIZE = 16
# Decode rows per step on the decode path: the most the quantized GEMVs take (NATIVE_GEMV_MAX_ROWS),
# so every row goes through them as a batch of decoding requests would.
DECODE_ROWS = 8


@torch.no_grad()
def window_log_probs(
    model: LlamaFamilyForCausalLM,
    token_ids: list[int],
    kv_cache_dtype: str = "auto",
    path: ScoringPath = "prefill",
) -> torch.Tensor:
    """log-softmax of the logits at every position of one window: [len(token_ids), vocab] float32.

    Prefill path: with a quantized `kv_cache_dtype` every query attends to keys and values read back
    from the quantized pool (explicit slots and a causal mask), as decode steps would see them;
    otherwise the chunk attends to its fresh K/V, as a prompt's prefill does."""
    store = _private_store(model, len(token_ids), kv_cache_dtype)
    if path == "decode":
        return _decode_log_probs(model, token_ids, store)
    n = len(token_ids)
    slots = SCORING_BLOCK_SIZE + torch.arange(n)  # skip the null block
    chunk = PrefillChunkMetadata(0, n, None, None, leading_keys=True)
    if kv_cache_dtype in QUANTIZED_KV_DTYPES:
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        chunk = PrefillChunkMetadata(0, n, slots, causal, leading_keys=True)
    meta = AttentionMetadata(
        positions=torch.arange(n),
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_kv_slots=None,
        decode_attend=None,
        decode_num_keys=None,
        prefills=[chunk],
    )
    hidden = model(torch.tensor(token_ids), meta, store)
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def _private_store(model: LlamaFamilyForCausalLM, n: int, kv_cache_dtype: str) -> KVStore:
    cfg = model.config
    num_blocks = n // SCORING_BLOCK_SIZE + 2  # + the null block 0 and a partial last block
    return KVStore(
        cfg.num_hidden_layers,
        num_blocks,
        SCORING_BLOCK_SIZE,
        cfg.num_key_value_heads,
        cfg.head_dim,
        model.dtype,
        kv_cache_dtype,
        latent=cfg.kv_latent,
    )


def _decode_log_probs(model: LlamaFamilyForCausalLM, token_ids: list[int], store: KVStore) -> torch.Tensor:
    """Positions as decode rows, DECODE_ROWS per step in order; row i attends keys 0..i, the earlier
    ones written by earlier steps (slot of position p: SCORING_BLOCK_SIZE + p, past the null block)."""
    n = len(token_ids)
    rows = []
    for start in range(0, n, DECODE_ROWS):
        positions = torch.arange(start, min(n, start + DECODE_ROWS))
        num_keys = positions + 1  # [B]
        key_pos = torch.arange(int(num_keys.max()))[None, :]  # [1, L]
        valid = key_pos < num_keys[:, None]  # [B, L]
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=SCORING_BLOCK_SIZE + positions,
            num_decode_tokens=len(positions),
            decode_kv_slots=torch.where(valid, SCORING_BLOCK_SIZE + key_pos, 0),
            decode_attend=valid[:, None, None, :],
            decode_num_keys=num_keys,
            prefills=[],
        )
        hidden = model(torch.tensor(token_ids[start : start + DECODE_ROWS]), meta, store)
        rows.append(torch.log_softmax(model.compute_logits(hidden).float(), dim=-1))
    return torch.cat(rows)


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Chunks of `window` + 1 tokens overlapping by one: every token after the first is predicted
    exactly once, from up to `window` tokens of context."""
    return [token_ids[i : i + window + 1] for i in range(0, len(token_ids) - 1, window)]


@dataclass
class QualityTotals:
    """Running sums over scored positions of a reference path against a served (quantized) one."""

    positions: int = 0
    kl_sum: float = 0.0
    agree: int = 0
    nll_reference: float = 0.0
    nll_served: float = 0.0

    def add(self, reference: torch.Tensor, served: torch.Tensor, targets: torch.Tensor) -> None:
        """reference, served: [N, V] log-probabilities at the same N positions; targets: [N] next tokens."""
        self.positions += len(targets)
        self.kl_sum += float((reference.exp() * (reference - served)).sum())
        self.agree += int((reference.argmax(-1) == served.argmax(-1)).sum())
        self.nll_reference -= float(reference.gather(1, targets[:, None]).sum())
        self.nll_served -= float(served.gather(1, targets[:, None]).sum())

    def snapshot(self) -> dict[str, float]:
        n = max(self.positions, 1)
        return {
            "positions": float(self.positions),
            "mean_kl": self.kl_sum / n,
            "top1_agreement": self.agree / n,
            "perplexity_reference": math.exp(self.nll_reference / n),
            "perplexity_served": math.exp(self.nll_served / n),
        }

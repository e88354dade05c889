"""Teacher-forced next-token distributions of a loaded model over a token sequence (quant-eval).

The sequence is cut into windows of at most `window` tokens; each window is one prefill chunk over
a private KV store (no cached context), so every position's logits come from the same forward the
engine runs for a prompt.
"""

from __future__ import annotations

import torch

from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.worker.attn_metadata import AttentionMetadata, PrefillChunkMetadata
from kvflow.worker.kv_layer import QUANTIZED_KV_DTYPES
from kvflow.worker.kv_store import KVStore

SCORING_BLOCK_SIZE = 16


@torch.no_grad()
def window_log_probs(
    model: LlamaFamilyForCausalLM, token_ids: list[int], kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """log-softmax of the logits at every position of one window: [len(token_ids), vocab] float32.

    With a quantized `kv_cache_dtype` every query attends to keys and values read back from the
    quantized pool (explicit slots and a causal mask), as decode steps would see them; otherwise the
    chunk attends to its fresh K/V, as a prompt's prefill does."""
    n = len(token_ids)
    cfg = model.config
    num_blocks = n // SCORING_BLOCK_SIZE + 2  # + the null block 0 and a partial last block
    store = KVStore(
        cfg.num_hidden_layers,
        num_blocks,
        SCORING_BLOCK_SIZE,
        cfg.num_key_value_heads,
        cfg.head_dim,
        model.dtype,
        kv_cache_dtype,
    )
    slots = SCORING_BLOCK_SIZE + torch.arange(n)  # skip the null block
    chunk = PrefillChunkMetadata(0, n, None, None)
    if kv_cache_dtype in QUANTIZED_KV_DTYPES:
        chunk = PrefillChunkMetadata(0, n, slots, torch.ones(n, n, dtype=torch.bool).tril())
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
    return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Chunks of `window` + 1 tokens overlapping by one: every token after the first is predicted
    exactly once, from up to `window` tokens of context."""
    return [token_ids[i : i + window + 1] for i in range(0, len(token_ids) - 1, window)]

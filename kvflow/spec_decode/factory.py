"""Build the engine's proposer from its SpeculativeConfig (the draft model is loaded here)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvflow.arch_config import load_hf_config, parse_arch_config
from kvflow.config import SpeculativeConfig
from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_file import is_gguf_path
from kvflow.models.loader import load_model
from kvflow.spec_decode.draft_proposer import DraftModelProposer
from kvflow.spec_decode.proposer import NgramProposer
from kvflow.tokenizer import Tokenizer

logger = logging.getLogger("kvflow")


def build_proposer(
    config: SpeculativeConfig,
    tokenizer: Tokenizer,
    dtype: torch.dtype,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    enforce_eager: bool = False,
    batch_invariant: bool = False,
) -> NgramProposer | DraftModelProposer | None:
    if config.speculative_method == "ngram":
        return NgramProposer(config)
    if config.speculative_method != "draft":
        return None
    assert config.draft_model is not None
    draft_dir = Path(config.draft_model).expanduser()
    if not draft_dir.is_dir() and not is_gguf_path(draft_dir):
        raise ModelLoadError(
            f"draft model {str(draft_dir)!r} is neither a checkpoint directory nor a GGUF file"
        )
    draft_tokenizer = Tokenizer.for_model(draft_dir)
    if draft_tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ModelLoadError(
            f"the draft model {draft_dir} has a different vocabulary ({draft_tokenizer.vocab_size} tokens) "
            f"from the model's ({tokenizer.vocab_size}): its guesses would be other tokens"
        )
    arch = parse_arch_config(load_hf_config(draft_dir))
    kinds = sorted(set(arch.cache_layer_kinds))
    if len(kinds) > 1:
        raise ModelLoadError(
            f"the draft model {draft_dir} mixes cache kinds ({', '.join(kinds)}): a draft model must "
            "have one kind of attention on every layer"
        )
    if arch.max_position_embeddings < max_model_len:
        raise ModelLoadError(
            f"the draft model's max_position_embeddings {arch.max_position_embeddings} is below "
            f"max_model_len {max_model_len}"
        )
    model = load_model(draft_dir, arch, dtype, max_model_len)
    logger.info(
        "speculative decoding: draft model %s, %d tokens per step", draft_dir, config.num_speculative_tokens
    )
    proposer = DraftModelProposer(
        model, config.num_speculative_tokens, num_blocks, block_size, max_model_len, batch_invariant
    )
    if not enforce_eager:  # the draft's k forwards per step are decode steps too
        proposer.native_decode = model.bind_native_decoder(proposer.kv_store)
    return proposer

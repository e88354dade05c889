"""The bitmask layout (vLLM v1's: bit b of int32 word w = token 32w + b) against llguidance's own
fill, and its application to logits rows."""

from __future__ import annotations

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from kvflow.assets import bundled_model_dir
from kvflow.sample.token_bitmask import apply_token_bitmask, unpack_bitmask


def test_unpack_matches_bit_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), generator=gen, dtype=torch.int64).to(torch.int32)
    vocab = 5 * 32 + 7  # model vocab padded past the mask: the padding is never allowed
    allowed = unpack_bitmask(words, vocab)
    for row in range(3):
        for token in range(vocab):
            expected = token < 160 and (int(words[row, token // 32]) >> (token % 32)) & 1 == 1
            assert bool(allowed[row, token]) == expected


def test_apply_masks_only_the_given_rows() -> None:
    logits = torch.randn(4, 70)
    original = logits.clone()
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 1 may only say token 5
    bitmask[1, 2] = 1 << 1  # row 3 may only say token 65
    apply_token_bitmask(logits, torch.tensor([1, 3]), bitmask)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    assert logits[1].argmax() == 5 and torch.isinf(logits[1]).sum() == 69
    assert logits[3].argmax() == 65 and torch.isinf(logits[3]).sum() == 69


def test_llguidance_mask_allows_exactly_the_grammar() -> None:
    tokenizer = llguidance.LLTokenizer((bundled_model_dir() / "tokenizer.json").read_text())
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex("(yes|no)"))
    bitmask = llg_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    allowed = unpack_bitmask(torch.from_numpy(bitmask), tokenizer.vocab_size)[0]
    texts = {tokenizer.decode_str([t]) for t in np.flatnonzero(allowed.numpy()).tolist()}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)

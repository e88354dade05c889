"""The tokenizer recipe of kvflow's own small checkpoints (the bundled models and the test fixtures).

A byte-level BPE split with Qwen2's pre-tokenization regex, BOS added by the post-processor, and
ChatML as the chat template: one set of conventions for tools/train_tiny.py and
tests/fixtures/checkpoints.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Qwen2's (and, up to digit grouping, Llama-3's) pre-tokenization regex: words with one leading
# non-letter, single digits, punctuation runs, newlines, spaces. Runs of indentation stay one piece
# ("\s+(?!\S)"), which suits Python source.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML with a tools block and a role check (so `tojson` and `raise_exception` are exercised).
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\nYou can call these tools:\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- tool | tojson }}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    # content may be absent (an assistant turn that only calls tools): render it as empty.
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | default('') + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def train_byte_level_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str],
    bos_token: str,
    length: int | None = None,
) -> Tokenizer:
    """A byte-level BPE trained on `texts`, whose post-processor puts `bos_token` in front.

    The pipeline is exactly the one transformers' Qwen2Tokenizer rebuilds (NFC, Qwen's split regex,
    byte-level): AutoTokenizer forces that class on model_type "qwen2" whatever tokenizer_config
    says, so any other pipeline would make transformers tokenize a qwen2 checkpoint differently from
    its tokenizer.json. BOS comes from the post-processor (Llama-3 style), not from a config flag.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        # All 256 bytes, so any text encodes (bytes unseen in the corpus included).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    bos_id = tokenizer.token_to_id(bos_token)
    if bos_id is None:
        raise ValueError(f"bos_token {bos_token!r} is not among the special tokens {list(special_tokens)}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A",
        pair=f"{bos_token} $A {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)],
    )
    return tokenizer


def tokenizer_config(bos_token: str, eos_token: str, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for a tokenizer built by `train_byte_level_bpe`."""
    return {
        "bos_token": bos_token,
        "eos_token": eos_token,
        "chat_template": CHAT_TEMPLATE,
        # Explicit nulls: transformers' Qwen2Tokenizer (forced on qwen2 checkpoints) would otherwise
        # add its default "<|endoftext|>" as unk/pad token, a token the embedding may lack.
        "unk_token": None,
        "pad_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }

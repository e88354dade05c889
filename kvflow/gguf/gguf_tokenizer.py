"""The tokenizer a GGUF file carries, rebuilt as a Hugging Face `tokenizers` model.

llama.cpp's converter stores the vocabulary under `tokenizer.ggml.*`:
    model          "gpt2": byte-level BPE (Llama 3, Qwen2/2.5/3/3.5, gpt-oss, ...); "llama":
                   SentencePiece BPE (Llama 2, Mistral 7B, Phi-3): pieces with scores, "▁" for a
                   space, <0xNN> byte pieces for what the vocabulary lacks; rebuilt as
                   transformers rebuilds a SentencePiece model (merges from the scores, byte fallback)
    tokens         the vocabulary in id order, byte-level encoded ("Ġthe") as in tokenizer.json
    merges         "a b" pairs in rank order
    token_type     per token: 1 normal, 2 unknown, 3 control (a special added token), 4 user-defined
                   (an added token that is not special), 5 unused, 6 byte
    pre            which pre-tokenizer split the text before BPE: llama.cpp names each known one
                   (its llama-vocab.cpp); the regexes below are those the original tokenizer.json
                   files carry
    bos/eos/eot/eom_token_id, add_bos_token, add_eos_token, chat_template[.name]
The rebuilt tokenizer encodes as the checkpoint's tokenizer.json does (tested against it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_file import GGUFFile

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The split regexes of the tokenizer.json files llama.cpp's pre-tokenizer names stand for.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_REGEX = (  # Qwen3.5's: letters take combining marks (\p{M}) along
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    regex: str | None  # None: GPT-2's own split (ByteLevel's use_regex)
    nfc: bool = False  # Qwen2 normalises to NFC first
    ignore_merges: bool = False  # Llama 3: a word already in the vocabulary is one token, merges or not


PRE_TOKENIZERS: Mapping[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec(None),
    "gpt-2": PreTokenizerSpec(None),
    "llama-bpe": PreTokenizerSpec(_LLAMA3_REGEX, ignore_merges=True),
    "llama3": PreTokenizerSpec(_LLAMA3_REGEX, ignore_merges=True),
    "smaug-bpe": PreTokenizerSpec(_LLAMA3_REGEX),
    "qwen2": PreTokenizerSpec(_QWEN2_REGEX, nfc=True),
    "qwen35": PreTokenizerSpec(
        _QWEN35_REGEX
    ),  # no NFC: a combining mark stays its own token (llama.cpp's vectors)
}
SPM_SPACE = "\u2581"  # SentencePiece's "▁": a space, and the prefix of a word


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What kvflow.tokenizer.Tokenizer is built from."""

    backend: BackendTokenizer
    special_tokens: dict[str, str]  # bos_token / eos_token / unk_token / pad_token -> text
    chat_templates: dict[str, str] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (EOS, EOT, EOM)


def gguf_tokenizer_parts(gguf: GGUFFile) -> GGUFTokenizerParts:
    kind = gguf.field("tokenizer.ggml.model", None)
    if kind is None:
        raise ModelLoadError(f"{gguf.path}: the GGUF file carries no tokenizer; pass --tokenizer DIR")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{gguf.path}: its tokenizer is of kind {kind!r}; kvflow rebuilds byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') tokenizers from GGUF metadata: pass --tokenizer DIR (the model's "
            "tokenizer.json) for this one"
        )
    tokens: list[str] = list(gguf.field("tokenizer.ggml.tokens"))
    types: list[int] = list(gguf.field("tokenizer.ggml.token_type", [1] * len(tokens)))
    if kind == "llama":
        backend = _sentencepiece_bpe(gguf, tokens, types)
        return _finish(gguf, backend, tokens, types)
    pre_name = str(gguf.field("tokenizer.ggml.pre", "default"))
    if pre_name not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{gguf.path}: tokenizer.ggml.pre {pre_name!r} is not a pre-tokenizer kvflow knows "
            f"({', '.join(PRE_TOKENIZERS)}): pass --tokenizer DIR with the model's tokenizer.json"
        )
    spec = PRE_TOKENIZERS[pre_name]
    backend = _byte_level_bpe(tokens, list(gguf.field("tokenizer.ggml.merges", [])), spec)
    return _finish(gguf, backend, tokens, types)


def _finish(
    gguf: GGUFFile, backend: BackendTokenizer, tokens: list[str], types: list[int]
) -> GGUFTokenizerParts:
    """Added tokens, BOS by the post-processor where the file asks for it, the named tokens."""
    added = [
        AddedToken(tok, special=t == TOKEN_TYPE_CONTROL, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    backend.add_tokens(added)  # ids stay theirs: each is already in the vocabulary
    special = _named_tokens(gguf, tokens)
    bos = special.get("bos_token")
    if bos is not None and bool(gguf.field("tokenizer.ggml.add_bos_token", False)):
        bos_id = tokens.index(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return GGUFTokenizerParts(backend, special, _chat_templates(gguf), _end_of_generation_ids(gguf))


def _byte_level_bpe(tokens: list[str], merges: list[str], spec: PreTokenizerSpec) -> BackendTokenizer:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)  # type: ignore[arg-type]
    backend = BackendTokenizer(bpe)
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    if spec.regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> BackendTokenizer:
    """A SentencePiece BPE vocabulary (pieces, scores) as a `tokenizers` BPE: a merge for every
    piece that splits into two pieces of the vocabulary, ranked by the merged piece's score (the
    rule transformers' SentencePieceExtractor applies, and sentencepiece's BPE encodes by); pieces it
    cannot reach fall back to their UTF-8 bytes (<0xNN>). Spaces become "▁", and a text starts with
    one unless the file says otherwise (tokenizer.ggml.add_space_prefix)."""
    scores: list[float] = list(gguf.field("tokenizer.ggml.scores", [0.0] * len(tokens)))
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, index in vocab.items():
        if types[index] != 1:  # only normal pieces are merge results
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk_id = gguf.field("tokenizer.ggml.unknown_token_id", None)
    unk = tokens[int(unk_id)] if unk_id is not None else None
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(bpe)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPM_SPACE)]
    if bool(gguf.field("tokenizer.ggml.add_space_prefix", True)):
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend


def _named_tokens(gguf: GGUFFile, tokens: list[str]) -> dict[str, str]:
    named = {}
    for key in ("bos", "eos", "unk", "pad"):
        token_id = gguf.field(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise ModelLoadError(
                f"{gguf.path}: tokenizer.ggml.{key}_token_id {token_id} is outside its {len(tokens)} tokens"
            )
        named[f"{key}_token"] = tokens[int(token_id)]
    return named


def _end_of_generation_ids(gguf: GGUFFile) -> tuple[int, ...]:
    ids = (gguf.field(f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot", "eom"))
    return tuple(sorted({int(i) for i in ids if i is not None}))


def _chat_templates(gguf: GGUFFile) -> dict[str, str]:
    """name -> jinja source: `tokenizer.chat_template` as "default", `tokenizer.chat_template.NAME`
    (e.g. tool_use) under NAME."""
    templates: dict[str, Any] = {}
    for key, value in gguf.metadata.items():
        if key == "tokenizer.chat_template":
            templates["default"] = str(value)
        elif key.startswith("tokenizer.chat_template."):
            templates[key.removeprefix("tokenizer.chat_template.")] = str(value)
    return templates

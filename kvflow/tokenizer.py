"""Text <-> token ids for kvflow: Hugging Face `tokenizers`, chat templates, streaming detokenization.

Everything here is checked against `transformers` 5 (its `AutoTokenizer`), which is the reference users
compare kvflow with; where the two could differ, the comments say which `transformers` behaviour we copy.

* `Tokenizer.from_pretrained(dir)` reads `tokenizer.json` (required), `tokenizer_config.json`,
  `chat_template.jinja` / `additional_chat_templates/*.jinja` and `generation_config.json` (all optional).
* `IncrementalDetokenizer` turns the output ids of one request into text as they arrive, never emitting
  half a UTF-8 character, and finds stop strings even when they straddle tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from kvflow.config import ConfigError
from kvflow.errors import InvalidRequestError, ModelLoadError
from kvflow.gguf.gguf_file import is_gguf_path, open_gguf
from kvflow.gguf.gguf_tokenizer import gguf_tokenizer_parts

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The named special tokens transformers exposes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# What a UTF-8 decoder writes for bytes that do not (yet) form a character.
REPLACEMENT_CHAR = "\ufffd"
# Texts at least this long are encoded without holding the GIL (Tokenizer.encode); below it the
# plain call is cheaper than the batch machinery and over in well under a millisecond.
_GIL_FREE_ENCODE_CHARS = 16_384
# apply_chat_template's own arguments: template variables of these names would collide with them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})

# Message fields a reasoning trace may arrive under; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens, chat templates and EOS ids of one checkpoint."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        generation_eos_token_ids: Iterable[int] = (),
        generation_bos_token_id: int | None = None,
        name: str = "<in-memory tokenizer>",
    ) -> None:
        self._backend = backend
        # e.g. {"bos_token": "<|begin_of_text|>", "eos_token": ...}: template variables and named specials.
        self._special_tokens = dict(special_tokens or {})
        # name -> jinja source; a single template is stored as "default" (as transformers loads it).
        self._chat_templates = dict(chat_templates or {})
        self._name = name
        self._bos_token_id = self._named_token_id("bos_token", fallback=generation_bos_token_id)
        self._eos_token_id = self._named_token_id("eos_token", fallback=None)
        eos_ids = set(generation_eos_token_ids)
        if self._eos_token_id is not None:
            eos_ids.add(self._eos_token_id)
        self._eos_token_ids = frozenset(eos_ids)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face checkpoint directory (nothing is downloaded)."""
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise ModelLoadError(
                f"no {TOKENIZER_FILE} at {tokenizer_path}: kvflow needs the fast (Rust `tokenizers`) "
                "tokenizer file in the model directory"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises plain Exception for any malformed file
            raise ModelLoadError(f"cannot parse {tokenizer_path}: {exc}") from exc
        config = _read_json_object(model_dir / TOKENIZER_CONFIG_FILE) or {}
        generation_config = _read_json_object(model_dir / GENERATION_CONFIG_FILE) or {}
        tokenizer = cls(
            backend,
            special_tokens=_special_tokens_from_config(config),
            chat_templates=_load_chat_templates(model_dir, config),
            generation_eos_token_ids=_token_ids_field(generation_config, "eos_token_id"),
            generation_bos_token_id=_single_token_id(generation_config, "bos_token_id"),
            name=str(model_dir),
        )
        tokenizer._warn_on_ignored_flags(config)
        return tokenizer

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer and chat templates a GGUF file carries in its metadata
        (kvflow/gguf/gguf_tokenizer.py)."""
        parts = gguf_tokenizer_parts(open_gguf(path))
        return cls(
            parts.backend,
            special_tokens=parts.special_tokens,
            chat_templates=parts.chat_templates,
            generation_eos_token_ids=parts.eos_token_ids,
            name=str(path),
        )

    @classmethod
    def for_model(cls, model: str | Path, tokenizer: str | Path | None = None) -> Tokenizer:
        """The model's tokenizer: `tokenizer` (a checkpoint directory or GGUF file) when given, else
        the one the model directory or GGUF file carries (vLLM's --tokenizer)."""
        source = Path(tokenizer if tokenizer is not None else model).expanduser()
        return cls.from_gguf(source) if is_gguf_path(source) else cls.from_pretrained(source)

    def _named_token_id(self, key: str, fallback: int | None) -> int | None:
        token = self._special_tokens.get(key)
        if token is None:
            return fallback
        return self._backend.token_to_id(token)

    def _warn_on_ignored_flags(self, config: Mapping[str, Any]) -> None:
        # transformers 5 drops `add_bos_token` / `add_eos_token` from tokenizer_config.json whenever a
        # tokenizer.json exists (tokenization_utils_base.from_pretrained pops them): the post-processor in
        # tokenizer.json alone decides. We do the same so `encode` matches it, but say so when they disagree.
        actual_flags = {"add_bos_token": self.adds_bos_token, "add_eos_token": self._adds_eos_token()}
        for flag, actual in actual_flags.items():
            requested = config.get(flag)
            if isinstance(requested, bool) and requested != actual:
                logger.warning(
                    "%s: tokenizer_config.json sets %s=%s but tokenizer.json's post-processor does %s; "
                    "following tokenizer.json, as transformers 5 does",
                    self._name,
                    flag,
                    requested,
                    "so" if actual else "not",
                )

    # ------------------------------------------------------------------ vocabulary

    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer` (for callers that need offsets or batch encoding)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (<= the model's vocab_size)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        """tokenizer_config's bos_token, else generation_config's bos_token_id, else None."""
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config's eos_token (what the chat template's `eos_token` is)."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: generation_config's eos_token_id(s) plus the tokenizer's EOS.

        Instruct checkpoints list several (Llama-3: <|end_of_text|>, <|eot_id|>, <|eom_id|>)."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the added tokens marked special (what `skip_special_tokens` drops) and named specials."""
        ids = {index for index, token in self._backend.get_added_tokens_decoder().items() if token.special}
        for token in self._special_tokens.values():
            token_id = self._backend.token_to_id(token)
            if token_id is not None:
                ids.add(token_id)
        return sorted(ids)

    @property
    def adds_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS (Llama-3: yes, Qwen2: no).

        A chat template that writes `bos_token` itself then needs `add_special_tokens=False`."""
        probe = self._backend.encode("", add_special_tokens=True).ids
        return self._bos_token_id is not None and probe[:1] == [self._bos_token_id]

    def _adds_eos_token(self) -> bool:
        probe = self._backend.encode("", add_special_tokens=True).ids
        return self._eos_token_id is not None and probe[-1:] == [self._eos_token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Token strings (byte-level spelling, e.g. "Ġworld"); None for an id the tokenizer lacks."""
        return [self._backend.id_to_token(token_id) for token_id in ids]

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's post-processor (e.g. BOS).

        Raises InvalidRequestError for text that is not valid Unicode (a lone surrogate, which JSON's
        "\\ud800" escape can carry): the Rust side cannot take it."""
        try:
            if len(text) < _GIL_FREE_ENCODE_CHARS:
                return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
            # `encode` holds the GIL for the whole call (seconds for megabytes, freezing every other
            # Python thread, a server's event loop included); `encode_batch` releases it.
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            check_unicode(text, "the text")
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No `clean_up_tokenization_spaces`: transformers 5 ignores it for BPE models (it would delete real
        # spaces before punctuation), and every architecture kvflow serves uses a BPE tokenizer.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template

    @property
    def chat_template(self) -> str | None:
        """The template used when no tools are passed (the "default" one), or None."""
        return self._chat_templates.get("default")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation into prompt text exactly as `transformers` does (`tokenize=False`).

        `kwargs` become template variables (e.g. `enable_thinking=False`) and override the special tokens.
        The text may already contain BOS (Llama-3 templates write it): see `adds_bos_token`."""
        template = _compile_chat_template(self._select_chat_template(tools), self._name)
        check_template_variables(kwargs)
        variables: dict[str, Any] = {"documents": None, **self._special_tokens, **kwargs}
        try:
            return template.render(
                messages=_normalize_messages(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        # raise_exception() in the template, or content of a shape the template cannot handle: the
        # template is the checkpoint's, fixed and known to render ordinary conversations, so whatever
        # fails while it renders these messages is the request's fault; the engine keeps serving.
        except Exception as exc:
            message = f"the chat template of {self._name} rejected the messages: {type(exc).__name__}: {exc}"
            raise InvalidRequestError(message) from exc

    def use_chat_template(self, source: str) -> None:
        """Replace the tokenizer's chat templates with `source` (`--chat-template`): a file path or
        the template text. ConfigError for a missing file, text that is no template, or bad Jinja."""
        path = Path(source).expanduser()
        if path.is_file():
            text = path.read_text(encoding="utf-8")
        elif "{{" in source or "{%" in source:
            text = source
        else:
            raise ConfigError(
                f"chat_template {source!r} is neither a file nor a Jinja template (no {{{{ or {{% in it)"
            )
        try:
            _compile_chat_template(text, self._name)
        except ModelLoadError as exc:
            raise ConfigError(f"chat_template: {exc}") from exc
        self._chat_templates = {"default": text}

    def _select_chat_template(self, tools: list[dict[str, Any]] | None) -> str:
        # Same choice as transformers' get_chat_template: "tool_use" when tools are given and it exists.
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            raise InvalidRequestError(
                f"{self._name} has several chat templates ({sorted(self._chat_templates)}) and none is named "
                "'default'"
            )
        raise InvalidRequestError(
            f"{self._name} has no chat template (no chat_template in {TOKENIZER_CONFIG_FILE}, no "
            f"{CHAT_TEMPLATE_FILE}): it is probably a base model; send a plain prompt instead of messages"
        )


# ---------------------------------------------------------------------- loading helpers


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, None when the (optional) file is absent."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} should hold a JSON object, found {type(value).__name__}")
    return value


def _token_content(value: object) -> str | None:
    # Special tokens are written either as "<s>" or as a serialized AddedToken {"content": "<s>", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens_from_config(config: Mapping[str, Any]) -> dict[str, str]:
    tokens = {key: _token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return {key: token for key, token in tokens.items() if token is not None}


def _token_ids_field(config: Mapping[str, Any], key: str) -> list[int]:
    # generation_config.json writes eos_token_id as an int or a list of ints (or null).
    value = config.get(key)
    if isinstance(value, bool):  # bool is an int subclass; never a token id
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def _single_token_id(config: Mapping[str, Any], key: str) -> int | None:
    ids = _token_ids_field(config, key)
    return ids[0] if ids else None


def _load_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """name -> template source. Like transformers 5, template files win over tokenizer_config entries."""
    templates: dict[str, str] = {}
    default_file = model_dir / CHAT_TEMPLATE_FILE
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    return _templates_from_config(config.get("chat_template"))


def _templates_from_config(value: object) -> dict[str, str]:
    # A single string, or (several templates) a list of {"name": ..., "template": ...}.
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            str(entry["name"]): str(entry["template"])
            for entry in value
            if isinstance(entry, Mapping) and "name" in entry and "template" in entry
        }
    return {}


# ---------------------------------------------------------------------- chat template rendering


class _GenerationTagExtension(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in transformers.

    We only render, so the body is output unchanged; a call block (as transformers builds) keeps the same
    scoping of variables set inside it."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads this class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    # Templates call raise_exception("Conversation roles must alternate ...") to reject a conversation.
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's tojson: no HTML escaping, non-ASCII kept, indent/separators allowed.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    # Llama-3.1 templates print today's date into the system prompt.
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_chat_template(source: str, model_name: str) -> jinja2.Template:
    """Compile once per template; the environment mirrors transformers' `_compile_jinja_template`."""
    # Sandboxed because templates come from the Hub (untrusted code); trim/lstrip blocks because
    # template authors rely on transformers' whitespace handling.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        # The checkpoint is broken, not the request (a server answers 500, not 400).
        raise ModelLoadError(f"the chat template of {model_name} does not compile: {exc}") from exc


def check_unicode(text: str, what: str) -> None:
    """InvalidRequestError naming the position of the first lone surrogate in `text`, if any (valid
    Unicode cannot hold one; Python strings, and so JSON bodies, can)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"U+{ord(text[exc.start]):04X}"
        raise InvalidRequestError(
            f"{what} is not valid Unicode: a lone surrogate ({bad}) at character {exc.start}"
        ) from None


def check_template_variables(variables: Mapping[str, Any]) -> None:
    """Template variables may not take the names of apply_chat_template's own arguments."""
    clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(variables))
    if clash:
        raise InvalidRequestError(
            f"chat template variables may not set {', '.join(clash)}: these come from the request itself"
        )


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # As transformers: drop None-valued keys (OpenAI clients send content=None with tool calls, and
    # templates test presence, not None) and alias the reasoning fields under their common names.
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"each chat message must be an object, got {message!r}")
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in _REASONING_FIELDS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        normalized.append(plain)
    return normalized


# ---------------------------------------------------------------------- streaming detokenization

# Prompt tokens decoded before the first output token, as in vLLM: the decoder needs a little left
# context (a leading-space marker, a character split across the prompt/output boundary), and a short
# window keeps each decode O(1) instead of O(sequence).
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Output text of one request, extended token by token (vLLM's prefix_offset / read_offset method).

    Invariant: `_ids` is a sliding window whose first `_read_offset` ids (vLLM's prefix_offset to
    read_offset) decode to `_prefix_text`, text already accounted for (prompt context or emitted output);
    the ids after them are pending. A new token is decoded together with that window; the text past
    `_prefix_text` is emitted unless it ends in U+FFFD, i.e. unless the last bytes are an incomplete UTF-8
    character, whose remaining bytes are still to come. Decoding with left context (instead of each token
    alone) also keeps the leading space of a token whose decoder strips it at the start of a text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop or () if s)  # an empty stop string would match everywhere
        self._include_stop = include_stop_str_in_output
        # Characters withheld from a stream so that the start of a stop string never reaches a client
        # (with include_stop_str_in_output the stop string is shown anyway, so nothing is withheld).
        self._holdback = 0 if not self._stop or self._include_stop else max(map(len, self._stop)) - 1

        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._output_text = ""
        self._num_streamed_chars = 0
        self._matched_stop: str | None = None

    @property
    def output_text(self) -> str:
        """All output text so far (including what the stream still holds back)."""
        return self._output_text

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, once one has."""
        return self._matched_stop

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append sampled tokens; return the stop string they complete (output_text is then cut) or None."""
        if self._matched_stop is not None:
            raise RuntimeError(f"update() after the stop string {self._matched_stop!r} ended the output")
        new_text = "".join(self._step(token_id) for token_id in new_token_ids)
        return self._append(new_text)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the client: the part not yet returned (delta) or all of it.

        Until `finished`, the last max(len(stop)) - 1 characters are held back: they may be the start of
        a stop string that the next token completes, and must then never have been shown."""
        if finished:
            self._flush()
        end = len(self._output_text)
        if not finished and self._matched_stop is None:
            end = max(end - self._holdback, 0)
        if not delta:
            return self._output_text[:end]
        start = self._num_streamed_chars
        if end <= start:
            return ""
        self._num_streamed_chars = end
        return self._output_text[start:end]

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _step(self, token_id: int) -> str:
        """Add one token; return the text it makes final ("" while a character is incomplete)."""
        self._ids.append(token_id)
        new_text = self._pending_text()
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            # A (skipped) special token adds nothing, or a character is incomplete: keep the window.
            return ""
        self._advance()
        return new_text

    def _pending_text(self) -> str:
        full_text = self._decode(self._ids)
        if full_text.startswith(self._prefix_text):
            return full_text[len(self._prefix_text) :]
        # Only when the prompt itself ends inside a character: its U+FFFD is replaced by the completed
        # character, which belongs to the output.
        common = _common_prefix_length(self._prefix_text, full_text)
        return full_text[common:]

    def _advance(self) -> None:
        # The tokens just emitted become the left context of the next ones; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def _flush(self) -> None:
        # At the end, bytes that never completed a character are emitted as U+FFFD, exactly as a
        # one-shot decode of the whole output shows them.
        if self._matched_stop is not None or self._read_offset == len(self._ids):
            return
        new_text = self._pending_text()
        self._advance()
        self._append(new_text)

    def _append(self, new_text: str) -> str | None:
        if not new_text:
            return None
        num_old_chars = len(self._output_text)
        self._output_text += new_text
        match = self._find_stop(num_old_chars)
        if match is None:
            return None
        stop_str, index = match
        self._output_text = self._output_text[: index + len(stop_str) if self._include_stop else index]
        self._matched_stop = stop_str
        return stop_str

    def _find_stop(self, num_old_chars: int) -> tuple[str, int] | None:
        """The earliest stop string that ends in the new text (it may start up to len(stop)-1 chars back)."""
        best: tuple[str, int] | None = None
        for stop_str in self._stop:
            index = self._output_text.find(stop_str, max(num_old_chars - len(stop_str) + 1, 0))
            if index != -1 and (best is None or index < best[1]):
                best = (stop_str, index)
        return best


def _common_prefix_length(a: str, b: str) -> int:
    length = 0
    for char_a, char_b in zip(a, b, strict=False):  # stops at the shorter string
        if char_a != char_b:
            break
        length += 1
    return length

"""kvflow.tokenizer against transformers 5: encode/decode, special tokens, chat templates, streaming text.

The fixture tokenizer is always tested; the real Qwen2 and Llama-3 tokenizers only where
/work/shared/assets/tokenizers exists (skipped elsewhere).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from fixtures.checkpoints import (
    ARCHS,
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    SAMPLE_TEXTS,
    TOKENIZER_VOCAB_SIZE,
    tokenizer_config,
    training_corpus,
)
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvflow.errors import InvalidRequestError, ModelLoadError
from kvflow.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

SHARED_TOKENIZERS = Path("/work/shared/assets/tokenizers")
TOKENIZER_NAMES = ("tiny", "qwen2", "llama3")

EXTRA_TEXTS = (
    "",
    " leading space and trailing spaces   ",
    "line one\nline two\r\n\ttabbed\n\n",
    f"special tokens inline: {IM_END} and {BOS_TOKEN} here",
    "mixed: naïve 東京 🚀 x² ∑ — ok",
)
ALL_TEXTS = SAMPLE_TEXTS + EXTRA_TEXTS

# Texts whose characters take several bytes, and (with the 512-token fixture vocabulary) several tokens.
MULTIBYTE_TEXTS = (
    "東京は日本の首都です。你好，世界！",
    "Emoji time: 😀🚀🎉 👍🏽 ❤️ and 🧪 done.",
    "Café naïve façade — jalapeño, Müller & smörgåsbord.",
    "混ぜる: naïve 東京 🚀 x² ∑ — ok 👨‍👩‍👧",
)

# Meta-Llama-3-8B-Instruct's chat template (the base tokenizer in the shared assets has none).
LLAMA3_INSTRUCT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama-3.1/3.2-Instruct's template: tools via tojson(indent=4), strftime_now, raise_exception, namespaces
# of `set` inside loops.
LLAMA31_TOOLS_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. " }}
    {{- "To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, ' }}
    {{- '"parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user "
                            + "message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, ' }}
    {{- '"parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville — 天气",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse. Réponds en français."},
        {"role": "user", "content": "  What is 2 + 2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 東京 🚀?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,  # OpenAI clients send this with tool calls; the key must be dropped
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "18 °C, sunny"},
    ],
)


# ---------------------------------------------------------------------- fixtures


def _shared_dir(name: str) -> Path:
    path = SHARED_TOKENIZERS / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{path} not available on this machine")
    return path


@pytest.fixture(scope="module", params=TOKENIZER_NAMES)
def tokenizer_dir(request: pytest.FixtureRequest, tiny_tokenizer_dir: Path) -> Path:
    return tiny_tokenizer_dir if request.param == "tiny" else _shared_dir(request.param)


@pytest.fixture(scope="module")
def tokenizers_pair(tokenizer_dir: Path) -> tuple[Tokenizer, Any]:
    """(kvflow's tokenizer, transformers' AutoTokenizer) loaded from the same directory."""
    return Tokenizer.from_pretrained(tokenizer_dir), transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_tokenizer_dir)


def _with_template(tmp_path: Path, source_dir: Path, config_updates: dict[str, Any]) -> Path:
    """A directory with `source_dir`'s tokenizer.json (linked) and its config updated."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").symlink_to(source_dir / "tokenizer.json")
    config = json.loads((source_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(config_updates)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


def _assert_chat_matches(directory: Path, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
    # Our add_generation_prompt defaults to True (a server renders prompts to answer), transformers' to False.
    kwargs.setdefault("add_generation_prompt", True)
    ours, reference = _load_pair(str(directory))
    text = ours.apply_chat_template(conversation, **kwargs)
    assert text == reference.apply_chat_template(conversation, tokenize=False, **kwargs)
    return text


@lru_cache(maxsize=2)
def _load_pair(directory: str) -> tuple[Tokenizer, Any]:
    # Loading Llama-3's 128k-token tokenizer takes a second; each test renders several conversations.
    return Tokenizer.from_pretrained(directory), transformers.AutoTokenizer.from_pretrained(directory)


# ---------------------------------------------------------------------- encode / decode


def test_encode_matches_transformers(tokenizers_pair: tuple[Tokenizer, Any]) -> None:
    ours, reference = tokenizers_pair
    for text in ALL_TEXTS:
        for add_special_tokens in (True, False):
            expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_decode_matches_transformers(tokenizers_pair: tuple[Tokenizer, Any]) -> None:
    ours, reference = tokenizers_pair
    for text in ALL_TEXTS:
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_tokenizers_match_transformers(
    tiny_checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    # With a config.json present, AutoTokenizer picks a class by model_type (Qwen2Tokenizer for qwen2,
    # which rebuilds the pipeline): kvflow must still agree with it on every fixture checkpoint.
    path = tiny_checkpoint_factory(arch)
    ours, reference = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(reference) == TOKENIZER_VOCAB_SIZE
    for text in ALL_TEXTS:
        ids = reference(text)["input_ids"]
        assert ours.encode(text) == ids, (arch, text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.apply_chat_template(CONVERSATIONS[1]) == reference.apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True
    )


def test_special_tokens_match_transformers(tokenizers_pair: tuple[Tokenizer, Any]) -> None:
    ours, reference = tokenizers_pair
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.vocab_size == len(reference)
    # We also count added tokens marked special that transformers 5 does not name (e.g. <|im_start|>).
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert ours.adds_bos_token == (reference("x")["input_ids"][0] == reference.bos_token_id)


def test_fixture_tokenizer_properties(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == TOKENIZER_VOCAB_SIZE
    assert tiny.bos_token == BOS_TOKEN and tiny.eos_token == EOS_TOKEN
    assert (tiny.bos_token_id, tiny.eos_token_id) == (0, 1)
    assert tiny.eos_token_ids == frozenset({1})
    assert set(tiny.all_special_ids) == {0, 1, 2, 3}
    # Llama-3 style: BOS comes from tokenizer.json's post-processor.
    assert tiny.adds_bos_token
    assert tiny.encode("hi")[0] == 0 and tiny.encode("hi", add_special_tokens=False)[0] != 0
    assert tiny.decode(tiny.encode("hi")) == "hi"
    assert tiny.decode(tiny.encode("hi"), skip_special_tokens=False) == BOS_TOKEN + "hi"


def test_generation_config_and_added_token_dicts(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    # Special tokens serialized as AddedToken dicts; extra EOS ids (Llama-3-Instruct style) in
    # generation_config.json, given as a list.
    bos = {"__type": "AddedToken", "content": BOS_TOKEN, "lstrip": False, "rstrip": False, "special": True}
    directory = _with_template(tmp_path, tiny_tokenizer_dir, {"bos_token": bos})
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [1, 3]}), encoding="utf-8"
    )
    tokenizer = Tokenizer.from_pretrained(directory)
    assert tokenizer.bos_token == BOS_TOKEN and tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({1, 3})


@pytest.mark.parametrize("with_post_processor", [True, False])
@pytest.mark.parametrize("add_bos_token", [True, False])
def test_add_bos_token_flag_follows_transformers(
    tmp_path: Path,
    tiny_tokenizer_dir: Path,
    caplog: pytest.LogCaptureFixture,
    with_post_processor: bool,
    add_bos_token: bool,
) -> None:
    # transformers 5 ignores tokenizer_config's add_bos_token once tokenizer.json exists: the
    # post-processor alone decides whether BOS is added. kvflow follows, and logs the disagreement.
    tokenizer_json = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if not with_post_processor:
        tokenizer_json["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    config = {**tokenizer_config(), "add_bos_token": add_bos_token}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours = Tokenizer.from_pretrained(tmp_path)
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path)("Hello world")["input_ids"]
    assert ours.encode("Hello world") == expected
    assert ours.adds_bos_token == with_post_processor == (expected[0] == 0)
    assert ("add_bos_token" in caplog.text) == (add_bos_token != with_post_processor)


def test_missing_tokenizer_json_raises_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)


def test_malformed_config_raises_model_load_error(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    (tmp_path / "tokenizer.json").symlink_to(tiny_tokenizer_dir / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_pretrained(tmp_path)


# ---------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_fixture_chat_template_matches_transformers(
    tiny_tokenizer_dir: Path, add_generation_prompt: bool
) -> None:
    for conversation in CONVERSATIONS:
        _assert_chat_matches(tiny_tokenizer_dir, conversation, add_generation_prompt=add_generation_prompt)
    text = _assert_chat_matches(tiny_tokenizer_dir, CONVERSATIONS[0], tools=[WEATHER_TOOL])
    assert "Météo" in text  # tojson keeps non-ASCII (ensure_ascii=False), like transformers


def test_chat_template_rejection_is_invalid_request(tiny: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="Unknown role: wizard"):
        tiny.apply_chat_template([{"role": "wizard", "content": "hi"}])


def test_missing_chat_template_is_invalid_request(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    config = tokenizer_config()
    del config["chat_template"]
    directory = _with_template(tmp_path, tiny_tokenizer_dir, {})
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_pretrained(directory).apply_chat_template(CONVERSATIONS[0])


def test_named_templates_and_template_file(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    # A list of named templates: "tool_use" is chosen when tools are passed, "default" otherwise.
    named = [
        {"name": "default", "template": "D:{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": "T:{{ tools | tojson }}|{{ messages[0]['content'] }}"},
    ]
    directory = _with_template(tmp_path / "named", tiny_tokenizer_dir, {"chat_template": named})
    assert _assert_chat_matches(directory, CONVERSATIONS[0]) == "D:Hello!"
    assert _assert_chat_matches(directory, CONVERSATIONS[0], tools=[WEATHER_TOOL]).startswith("T:[{")
    # chat_template.jinja (how transformers 5 saves templates) wins over tokenizer_config's entry.
    directory = _with_template(tmp_path / "file", tiny_tokenizer_dir, {})
    (directory / "chat_template.jinja").write_text("F:{{ messages[0]['content'] }}{{ eos_token }}", "utf-8")
    assert _assert_chat_matches(directory, CONVERSATIONS[0]) == f"F:Hello!{EOS_TOKEN}"


def test_qwen2_chat_template_matches_transformers() -> None:
    directory = _shared_dir("qwen2")
    for conversation in CONVERSATIONS[:2]:
        for add_generation_prompt in (True, False):
            _assert_chat_matches(directory, conversation, add_generation_prompt=add_generation_prompt)


def test_llama3_base_has_no_chat_template() -> None:
    directory = _shared_dir("llama3")
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_pretrained(directory).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError):
        transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
            CONVERSATIONS[0], tokenize=False
        )


@pytest.mark.parametrize(
    "template", [LLAMA3_INSTRUCT_TEMPLATE, LLAMA31_TOOLS_TEMPLATE], ids=["llama3", "llama3.1"]
)
def test_llama3_chat_templates_match_transformers(tmp_path: Path, template: str) -> None:
    directory = _with_template(tmp_path, _shared_dir("llama3"), {"chat_template": template})
    for conversation in CONVERSATIONS[:2]:
        text = _assert_chat_matches(directory, conversation)
        assert text.startswith(BOS_TOKEN)  # the template writes BOS: encode it with add_special_tokens=False
    if template is LLAMA31_TOOLS_TEMPLATE:
        _assert_chat_matches(directory, CONVERSATIONS[2], tools=[WEATHER_TOOL])
        _assert_chat_matches(directory, CONVERSATIONS[1], tools=[WEATHER_TOOL], date_string="26 Jul 2024")
        with pytest.raises(InvalidRequestError, match="no first user message"):
            only_system = [{"role": "system", "content": "Be brief."}]
            _load_pair(str(directory))[0].apply_chat_template(only_system, tools=[WEATHER_TOOL])


# ---------------------------------------------------------------------- streaming detokenization


def _stream(detokenizer: IncrementalDetokenizer, token_ids: Sequence[int]) -> tuple[list[str], str | None]:
    """Feed tokens one at a time as the engine does; return the streamed deltas and the matched stop."""
    deltas = []
    for token_id in token_ids:
        stop = detokenizer.update([token_id])
        deltas.append(detokenizer.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    deltas.append(detokenizer.get_next_output_text(finished=True, delta=True))
    return deltas, None


def test_streaming_multibyte_text_matches_decode(tokenizers_pair: tuple[Tokenizer, Any]) -> None:
    tokenizer, _ = tokenizers_pair
    prompt_ids = tokenizer.encode("Translate this, please: ")
    for text in MULTIBYTE_TEXTS:
        output_ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        deltas, _ = _stream(detokenizer, output_ids)
        assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(output_ids) == text
        assert not any("\ufffd" in delta for delta in deltas), deltas


def test_fixture_tokens_do_split_characters(tiny: Tokenizer) -> None:
    # Guards the test above: with the 512-token vocabulary, some tokens hold only part of a character.
    for text in MULTIBYTE_TEXTS[:2]:
        pieces = [tiny.decode([token_id]) for token_id in tiny.encode(text, add_special_tokens=False)]
        assert any("\ufffd" in piece for piece in pieces)


def _common_prefix_length(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_streaming_random_tokens_matches_decode(tiny: Tokenizer) -> None:
    # Random ids form invalid UTF-8 too; at the end the stream must still equal a one-shot decode
    # (incomplete bytes flushed as U+FFFD), and no U+FFFD may appear before the stream is finished
    # unless the decode of everything has one at that place.
    rng = random.Random(0)
    special = set(tiny.all_special_ids)
    vocabulary = [i for i in range(tiny.vocab_size) if i not in special]
    for _ in range(300):
        prompt_ids = [rng.choice(vocabulary) for _ in range(rng.randrange(0, 8))]
        output_ids = [rng.choice(vocabulary) for _ in range(rng.randrange(1, 12))]
        detokenizer = IncrementalDetokenizer(tiny, prompt_ids)
        deltas, _ = _stream(detokenizer, output_ids)
        # The output's text is what the decode of prompt + output shows beyond the decode of the prompt.
        # That is decode(output) unless the prompt ends inside a character that the output completes.
        prompt_text, full_text = tiny.decode(prompt_ids), tiny.decode(prompt_ids + output_ids)
        shared = _common_prefix_length(prompt_text, full_text)
        assert "".join(deltas) == full_text[shared:], (prompt_ids, output_ids)
        if not prompt_text.endswith("\ufffd"):
            assert "".join(deltas) == tiny.decode(output_ids)


def test_streaming_completes_character_split_by_prompt(tiny: Tokenizer) -> None:
    ids = tiny.encode("Rocket 🚀 launch", add_special_tokens=False)
    # Cut inside the emoji: the prompt ends with its first byte(s), the output brings the rest.
    cut = next(i for i in range(1, len(ids)) if tiny.decode(ids[:i]).endswith("\ufffd"))
    deltas, _ = _stream(IncrementalDetokenizer(tiny, ids[:cut]), ids[cut:])
    assert "".join(deltas) == "🚀 launch"


def test_streaming_special_tokens(tiny: Tokenizer) -> None:
    output_ids = [*tiny.encode("Hi there", add_special_tokens=False), 3, *tiny.encode(" more", False)]
    for skip in (True, False):
        deltas, _ = _stream(IncrementalDetokenizer(tiny, [0], skip_special_tokens=skip), output_ids)
        assert "".join(deltas) == tiny.decode(output_ids, skip_special_tokens=skip)


def _metaspace_tokenizer() -> Tokenizer:
    # SentencePiece-style: "▁" marks a space and the decoder strips it from the first token of a text.
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    ascii_corpus = [line for line in training_corpus() if line.isascii()]
    backend.train_from_iterator(
        ascii_corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    )
    return Tokenizer(backend)


def test_streaming_keeps_leading_space_from_prompt_context() -> None:
    tokenizer = _metaspace_tokenizer()
    ids = tokenizer.encode("The scheduler fills a token budget")
    # Cut before a word-initial token ("▁fills"): decoded alone, the output loses its leading space.
    cut = next(
        i for i in range(1, len(ids)) if str(tokenizer.convert_ids_to_tokens([ids[i]])[0]).startswith("▁")
    )
    prompt_ids, output_ids = ids[:cut], ids[cut:]
    expected = tokenizer.decode(ids)[len(tokenizer.decode(prompt_ids)) :]
    assert expected.startswith(" ") and not tokenizer.decode(output_ids).startswith(" ")
    deltas, _ = _stream(IncrementalDetokenizer(tokenizer, prompt_ids), output_ids)
    assert "".join(deltas) == expected


# ---------------------------------------------------------------------- stop strings


STOP_TEXT = "Hello world! The quick brown fox jumps over the lazy dog."


def _stop_case(
    tiny: Tokenizer, stop: list[str], include: bool = False
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    detokenizer = IncrementalDetokenizer(
        tiny, tiny.encode("Say: "), stop=stop, include_stop_str_in_output=include
    )
    deltas, matched = _stream(detokenizer, tiny.encode(STOP_TEXT, add_special_tokens=False))
    # Whatever was streamed is exactly the final text: nothing past a stop string ever leaked out.
    assert "".join(deltas) == detokenizer.output_text
    return detokenizer, deltas, matched


def test_stop_string_straddling_tokens(tiny: Tokenizer) -> None:
    token_texts = [tiny.decode([i]) for i in tiny.encode(STOP_TEXT, add_special_tokens=False)]
    assert not any("brown fox" in piece for piece in token_texts)  # the stop string spans tokens
    detokenizer, _, matched = _stop_case(tiny, ["brown fox"])
    assert matched == "brown fox" and detokenizer.matched_stop == "brown fox"
    assert detokenizer.output_text == "Hello world! The quick "


def test_include_stop_str_in_output(tiny: Tokenizer) -> None:
    detokenizer, _, matched = _stop_case(tiny, ["brown fox"], include=True)
    assert matched == "brown fox"
    assert detokenizer.output_text == "Hello world! The quick brown fox"


def test_earliest_stop_string_wins(tiny: Tokenizer) -> None:
    detokenizer, _, matched = _stop_case(tiny, ["lazy", "quick", "zzz"])
    assert matched == "quick" and detokenizer.output_text == "Hello world! The "


def test_holdback_never_shows_a_stop_prefix(tiny: Tokenizer) -> None:
    # "quick brown cat" never completes, but its prefix "quick brown " appears: while unfinished, the
    # stream holds back len(stop) - 1 characters, and releases them only when the request finishes.
    stop = "quick brown cat"
    detokenizer = IncrementalDetokenizer(tiny, tiny.encode("Say: "), stop=[stop])
    streamed = ""
    for token_id in tiny.encode(STOP_TEXT, add_special_tokens=False):
        assert detokenizer.update([token_id]) is None
        streamed += detokenizer.get_next_output_text(finished=False, delta=True)
        assert len(streamed) == max(len(detokenizer.output_text) - (len(stop) - 1), 0)
        assert detokenizer.get_next_output_text(finished=False, delta=False) == streamed
    streamed += detokenizer.get_next_output_text(finished=True, delta=True)
    assert streamed == detokenizer.output_text == STOP_TEXT


def test_stop_string_within_one_token(tiny: Tokenizer) -> None:
    detokenizer, deltas, matched = _stop_case(tiny, ["e"])
    assert matched == "e" and detokenizer.output_text == "H" and "".join(deltas) == "H"

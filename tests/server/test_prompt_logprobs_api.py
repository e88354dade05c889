"""Prompt logprobs on /v1/completions: `echo` with `logprobs` (OpenAI's legacy shape: the prompt's
tokens lead the lists, the first with a null logprob) and vLLM's `prompt_logprobs` field, equal to the
offline engine's values, streamed or not."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fixtures.live_server import ENGINE_KWARGS, LiveServer

from kvflow import LLM, SamplingParams

PROMPT = [5, 17, 99, 3, 42, 8, 61, 27]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def offline_prompt_logprobs(server_model_dir: Path) -> list[float | None]:
    llm = LLM(str(server_model_dir), **ENGINE_KWARGS)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    return [None] + [
        entry[token].logprob for token, entry in zip(PROMPT[1:], out.prompt_logprobs[1:], strict=True)
    ]


def test_echo_with_logprobs(server: LiveServer, offline_prompt_logprobs: list[float | None]) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "echo": True,
        "logprobs": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.client() as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(PROMPT) + MAX_TOKENS
        assert logprobs["top_logprobs"][0] is None
        prompt_part = logprobs["token_logprobs"][: len(PROMPT)]
        assert prompt_part[0] is None
        assert prompt_part[1:] == pytest.approx(offline_prompt_logprobs[1:], abs=1e-5)
        assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])
        # Streamed: the first chunk carries the prompt's entries; all chunks together equal the above.
        streamed: list[float | None] = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                        if c.get("logprobs"):
                            streamed += c["logprobs"]["token_logprobs"]
        assert streamed == logprobs["token_logprobs"]


def test_vllm_prompt_logprobs_field(server: LiveServer, offline_prompt_logprobs: list[float | None]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1}
    with server.client() as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for token, entry, expected in zip(PROMPT[1:], entries[1:], offline_prompt_logprobs[1:], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(expected, abs=1e-5)
        assert any(e["rank"] == 1 for e in entry.values())


def test_echo_text_offsets_index_the_echoed_text(server: LiveServer) -> None:
    """Each token's text_offset points at where that token's text sits in the returned text; a
    special token the tokenizer added at the front (shown in `tokens`) takes no characters there."""
    body = {"prompt": "hello world", "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    with server.client() as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
    text, offsets, tokens = choice["text"], choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert text.startswith("hello world")
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for token, start, end in zip(tokens, offsets, [*offsets[1:], len(text)], strict=True):
        assert text[start:end] in (token, ""), (token, text[start:end])


def test_chat_prompt_logprobs(server: LiveServer, server_model_dir: Path) -> None:
    """vLLM's `prompt_logprobs` on chat: the rendered chat prompt's entries once, at the top level
    (n choices share the prompt), equal to the offline engine's on the same token ids."""
    messages = [{"role": "user", "content": "What is a paged KV cache?"}]
    body = {"messages": messages, "max_tokens": 2, "n": 2, "prompt_logprobs": 1, "temperature": 0}
    with server.client() as http:
        response = http.post("/v1/chat/completions", json=body).json()
        prompt_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        refused = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    entries = response["prompt_logprobs"]
    assert len(response["choices"]) == 2 and len(entries) == len(prompt_ids) and entries[0] is None
    llm = LLM(str(server_model_dir), **ENGINE_KWARGS)
    offline = llm.generate([prompt_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert offline is not None
    for token, entry, expected in zip(prompt_ids[1:], entries[1:], offline[1:], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-5)

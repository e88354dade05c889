"""The live server through the official `openai` client: completions and chat, streamed or not,
usage, logprobs, stop strings, n, echo, timing; text equal to the offline LLM's for greedy requests."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from fixtures.live_server import ENGINE_KWARGS, LiveServer

from kvflow import LLM, SamplingParams

MAX_TOKENS = 12
PROMPT = "def main():"


@pytest.fixture(scope="module")
def offline(server_model_dir: Path) -> LLM:
    return LLM(str(server_model_dir), **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def greedy(llm: LLM, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
    return out.outputs[0].text, out.outputs[0].token_ids


def chat_prompt_ids(llm: LLM, content: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return list(tokenizer.encode(text, add_special_tokens=False))


IGNORE_EOS = {"ignore_eos": True}  # vLLM's extension, sent through extra_body


def test_completion_equals_offline_generate(client: openai.OpenAI, offline: LLM, server: LiveServer) -> None:
    text, ids = greedy(offline, PROMPT)
    response = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.choices[0].text == text
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == len(ids) == MAX_TOKENS
    assert response.usage.prompt_tokens == len(offline.get_tokenizer().encode(PROMPT))


def test_streamed_completion_with_usage(client: openai.OpenAI, offline: LLM, server: LiveServer) -> None:
    text, ids = greedy(offline, PROMPT)
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=IGNORE_EOS,
        )
    )
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == text
    assert content[-1].choices[0].finish_reason == "length"
    # continuous usage: the completion token count grows chunk by chunk up to the total.
    counts = [c.usage.completion_tokens for c in content if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == len(ids)
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None and final.usage.completion_tokens == len(ids)


def test_chat_completion_equals_offline_and_streams_role_first(
    client: openai.OpenAI, offline: LLM, server: LiveServer
) -> None:
    text, _ = greedy(offline, chat_prompt_ids(offline, "Write a function."))
    messages = [{"role": "user", "content": "Write a function."}]
    response = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.choices[0].message.content == text
    assert response.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_logprobs_in_both_endpoints(client: openai.OpenAI, offline: LLM, server: LiveServer) -> None:
    reference = offline.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    )[0].outputs[0]
    assert reference.logprobs is not None
    completion = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, extra_body=IGNORE_EOS
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    expected = [pos[t].logprob for t, pos in zip(reference.token_ids, reference.logprobs, strict=True)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert len(lp.top_logprobs) == 5 and all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.logprob - 1e-6 or (
            entry.logprob == entry.top_logprobs[0].logprob
        )


def test_stop_string_cuts_the_text(client: openai.OpenAI, offline: LLM, server: LiveServer) -> None:
    text, _ = greedy(offline, PROMPT, max_tokens=24)
    stop = text[5:8]  # a substring the greedy continuation is known to contain
    expected = text[: text.index(stop)]
    for stream in (False, True):
        response = client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=stream,
            extra_body=IGNORE_EOS,
        )  # fmt: skip
        if stream:
            chunks = list(response)  # type: ignore[arg-type]
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            got, finish = response.choices[0].text, response.choices[0].finish_reason  # type: ignore[union-attr]
        assert (got, finish) == (expected, "stop")


def test_n_choices_multiple_prompts_and_echo(client: openai.OpenAI, offline: LLM, server: LiveServer) -> None:
    response = client.completions.create(
        model=server.model, prompt=["a = 1", PROMPT], n=2, max_tokens=6, temperature=1.0, seed=7,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    # choice j of a prompt samples with seed + j: the two choices of a prompt differ, and a repeat agrees.
    again = client.completions.create(
        model=server.model, prompt=["a = 1", PROMPT], n=2, max_tokens=6, temperature=1.0, seed=7,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    assert response.choices[0].text != response.choices[1].text
    assert response.usage is not None and response.usage.completion_tokens == 4 * 6
    tokenizer = offline.get_tokenizer()
    assert response.usage.prompt_tokens == len(tokenizer.encode("a = 1")) + len(tokenizer.encode(PROMPT))
    text, _ = greedy(offline, PROMPT, max_tokens=4)
    echoed = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, extra_body=IGNORE_EOS
    )
    assert echoed.choices[0].text == PROMPT + text


def test_token_id_prompts(client: openai.OpenAI, offline: LLM, server: LiveServer) -> None:
    ids = offline.get_tokenizer().encode(PROMPT)
    text, _ = greedy(offline, ids, max_tokens=6)
    response = client.completions.create(
        model=server.model, prompt=ids, max_tokens=6, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.choices[0].text == text


def test_timing_breakdown_on_request(server: LiveServer) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with server.client() as http:
        plain = http.post("/v1/completions", json=body).json()
        assert "kvflow" not in plain
        timed = http.post("/v1/completions", json={**body, "kvflow": {"timing": True}}).json()
        by_header = http.post("/v1/completions", json=body, headers={"x-kvflow-timing": "1"}).json()
        with http.stream(
            "POST", "/v1/completions", json={**body, "stream": True, "kvflow": {"timing": True}}
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
    for timing in (timed["kvflow"]["timing"], by_header["kvflow"]["timing"]):
        assert timing["output_tokens"] == 4 and timing["prompt_tokens"] == plain["usage"]["prompt_tokens"]
        assert timing["queue_ms"] >= 0 and timing["prefill_ms"] >= 0 and timing["decode_ms"] >= 0
        assert timing["ttft_ms"] == pytest.approx(timing["queue_ms"] + timing["prefill_ms"], abs=0.01)
        assert timing["preemptions"] == 0 and timing["cached_prompt_tokens"] >= 0
    assert '"timing"' in events[-1] and all('"timing"' not in e for e in events[:-1])


def test_request_id_header_and_side_endpoints(server: LiveServer) -> None:
    with server.client() as http:
        r = http.get("/v1/models", headers={"x-request-id": "my-id-1"})
        assert r.headers["x-request-id"] == "my-id-1"
        assert r.json()["data"][0]["id"] == server.model and r.json()["data"][0]["max_model_len"] == 256
        generated = http.get("/health")
        assert generated.status_code == 200 and len(generated.headers["x-request-id"]) >= 16
        completion = http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"x-request-id": "abc"}
        )
        assert completion.json()["id"] == "cmpl-abc" and completion.headers["x-request-id"] == "abc"
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
        plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert plain["count"] == tokens["count"] - 1  # the llama fixture's tokenizer adds BOS
        # Special tokens are kept, as transformers' decode does by default.
        assert http.post("/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"] == PROMPT
        chat_tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        rendered = http.post("/detokenize", json={"tokens": chat_tokens["tokens"]}).json()["prompt"]
        # Encoded without adding special tokens, as transformers' apply_chat_template(tokenize=True) does.
        assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert http.get("/version").json()["version"]
        assert httpx.get(server.base_url + "/metrics").headers["content-type"].startswith("text/plain")


def test_cached_tokens_in_usage_the_openai_way(client: openai.OpenAI, server: LiveServer) -> None:
    """usage.prompt_tokens_details.cached_tokens: 0 for a new prompt, the prefix-cache hit (whole
    blocks, short of the last token) when the same prompt returns; streamed usage says the same."""
    prompt = "cached tokens: " + " ".join(str(i) for i in range(60))
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    stream = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage and usage[-1].prompt_tokens_details is not None
    assert usage[-1].prompt_tokens_details.cached_tokens == cached

"""Input a careless or hostile client sends: a precise 4xx with an OpenAI error body, never a 500,
and a published schema (/openapi.json) that says what the server does."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fixtures.live_server import LiveServer

from kvflow.server.middleware import PUBLIC_PATHS

JSON = {"content-type": "application/json"}


def post_raw(http: httpx.Client, path: str, raw: str) -> httpx.Response:
    return http.post(path, content=raw.encode(), headers=JSON)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        # The three requests schemathesis found accepted though they violate the schema (ST201):
        # lax pydantic coerced 0 to a boolean and "[Filtered]"-hidden strings/booleans to integers.
        ("/v1/completions", '{"prompt": "x", "echo": 0}', "echo"),
        ("/tokenize", '{"prompt": "x", "add_generation_prompt": 0}', "add_generation_prompt"),
        ("/detokenize", '{"tokens": [true]}', "tokens.0"),
        # Their relatives.
        ("/v1/completions", '{"prompt": "x", "n": "2"}', "n"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2.5}', "max_tokens"),
        ("/v1/completions", '{"prompt": "x", "stream": "true"}', "stream"),
        ("/v1/completions", '{"prompt": "x", "temperature": "0.5"}', "temperature"),
        ("/v1/completions", '{"prompt": "x", "seed": 9223372036854775808}', "seed"),
        ("/detokenize", '{"tokens": ["5"]}', "tokens.0"),
        # Work one request could put on the engine thread that serves everyone.
        ("/v1/completions", json.dumps({"prompt": "x", "stop": ["s"] * 65}), "stop"),
        ("/v1/completions", json.dumps({"prompt": "x", "stop_token_ids": [5] * 1025}), "stop_token_ids"),
    ],
)
def test_schema_violations_are_refused_naming_the_field(
    server: LiveServer, path: str, raw: str, param: str
) -> None:
    with server.client() as http:
        assert error_of(post_raw(http, path, raw), 400)["param"] == param


def test_what_json_schema_calls_an_integer_is_accepted(server: LiveServer) -> None:
    with server.client() as http:
        ok = post_raw(
            http, "/v1/completions", '{"prompt": [5, 6], "max_tokens": 2.0, "n": 2, "temperature": 1}'
        )
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        # The largest seed; choice 1 samples with seed + 1, past int64 but within torch's range.
        top = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2, "seed": 2**63 - 1, "n": 2})
        assert top.status_code == 200, top.text


def test_content_parts_are_flattened_as_text(server: LiveServer) -> None:
    as_string = {"messages": [{"role": "user", "content": "first\nsecond"}]}
    as_parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
            }
        ]
    }
    with server.client() as http:
        assert http.post("/tokenize", json=as_parts).json() == http.post("/tokenize", json=as_string).json()
        chat = http.post("/v1/chat/completions", json={**as_parts, "max_tokens": 3, "temperature": 0})
        assert chat.status_code == 200
        audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
        refused = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, audio]}]},
        )
        error = error_of(refused, 400)
        assert "'input_audio'" in error["message"] and error["param"] == "messages.0.content.1.type"


def test_chat_template_kwargs_may_not_replace_the_requests_own_arguments(server: LiveServer) -> None:
    with server.client() as http:
        for key in ("messages", "tools", "add_generation_prompt"):
            body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {key: 1}}
            error = error_of(http.post("/v1/chat/completions", json=body), 400)
            assert error["param"] == f"chat_template_kwargs.{key}"


def test_an_error_quoting_a_lone_surrogate_is_still_json(server: LiveServer) -> None:
    with server.client() as http:
        error = error_of(post_raw(http, "/v1/completions", '{"prompt": "x", "model": "\\ud800"}'), 404)
        assert error["param"] == "model" and "\ud800" in error["message"]


def test_method_not_allowed_is_a_client_error(server: LiveServer) -> None:
    with server.client() as http:
        response = http.delete("/v1/completions")
        assert error_of(response, 405)["type"] == "invalid_request_error"
        assert response.headers["allow"] == "POST"


def test_a_tokenize_failure_is_a_json_500(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(server.ctx.tokenizer, "encode", broken)
    with server.client() as http:
        error = error_of(http.post("/tokenize", json={"prompt": "x"}), 500)
        assert error["type"] == "server_error" and "injected fault" in error["message"]


def test_the_api_key_is_checked_first_and_says_how(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(api_key="sekret", max_request_body_bytes=1024)
    body = {"prompt": "x", "max_tokens": 2}
    with server.client() as http:
        missing = http.post("/v1/completions", json=body)
        assert error_of(missing, 401)["code"] == "invalid_api_key"
        assert missing.headers["www-authenticate"].startswith("Bearer")
        wrong = http.post("/v1/completions", json=body, headers={"authorization": "Bearer nope"})
        assert error_of(wrong, 401) and 'error="invalid_token"' in wrong.headers["www-authenticate"]
        # Before the body is read, let alone parsed: no 400 for bad JSON, no 413 for a large body.
        assert error_of(post_raw(http, "/v1/completions", "{not json"), 401)
        assert error_of(http.post("/v1/completions", content=b"x" * 4096, headers=JSON), 401)
        for scheme in ("Bearer", "bearer", "BEARER"):  # RFC 7235: the scheme is case-insensitive
            ok = http.post("/v1/completions", json=body, headers={"authorization": f"{scheme}  sekret"})
            assert ok.status_code == 200, (scheme, ok.text)
        for path in ("/health", "/metrics", "/version", "/openapi.json"):
            assert http.get(path).status_code == 200, path
        schema = http.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert "401" in schema["paths"]["/v1/completions"]["post"]["responses"]


def test_the_published_schema_is_the_server(server: LiveServer) -> None:
    with server.client() as http:
        schema = http.get("/openapi.json").json()
        health = http.get("/health")
        metrics = http.get("/metrics")
    paths = schema["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            answers = operation["responses"]
            assert "422" not in answers, (method, path)
            assert "503" in answers, (method, path)  # the drain answers every route
            if path not in PUBLIC_PATHS:
                assert "500" in answers, (method, path)
                if method == "post":
                    assert {"400", "413"} <= set(answers), (method, path)
                    assert answers["400"]["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorResponse"
                    }
    assert "security" not in paths["/v1/completions"]["post"]  # this server has no key
    completions = paths["/v1/completions"]["post"]["responses"]
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"404", "429"} <= set(completions)
    assert "content" not in paths["/health"]["get"]["responses"]["200"]
    assert health.content == b"" and "content-type" not in health.headers
    documented = set(paths["/metrics"]["get"]["responses"]["200"]["content"])
    assert documented == {metrics.headers["content-type"]}

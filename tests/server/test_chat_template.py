"""`--chat-template PATH_OR_TEXT` (vLLM's flag): chat renders with the given template instead of the
tokenizer's, from a file or as text; what is neither, or does not compile, stops the server at start
with a ConfigError naming it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures.live_server import LiveServer

from kvflow.config import ConfigError

TEMPLATE = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}[ASSISTANT]"


def rendered(live: LiveServer) -> str:
    with live.client() as client:
        body = {"model": live.model, "messages": [{"role": "user", "content": "hi there"}]}
        tokens = client.post("/tokenize", json=body).json()["tokens"]
        return client.post("/detokenize", json={"model": live.model, "tokens": tokens}).json()["prompt"]


@pytest.mark.parametrize("given_as", ["file", "text"])
def test_chat_renders_with_the_given_template(
    given_as: str, start_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    source = TEMPLATE
    if given_as == "file":
        source = str(tmp_path / "template.jinja")
        Path(source).write_text(TEMPLATE)
    live = start_server(chat_template=source)
    assert rendered(live).endswith("[USER] hi there\n[ASSISTANT]")
    with live.client() as client:
        body = {"model": live.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("no/such/template.jinja", "neither a file nor a Jinja template"),
        ("{% for x in %}", "does not compile"),
    ],
)
def test_a_bad_template_stops_the_server_at_start(
    source: str, message: str, start_server: Callable[..., LiveServer]
) -> None:
    with pytest.raises(ConfigError, match=message):
        start_server(chat_template=source)

"""Prefill/decode disaggregation between two kvflow servers (kvflow/kv_transfer/): the prefill
instance computes the prompt and answers with kv_transfer_params; the decode instance fetches the KV
and streams the tokens, greedy-identical to one colocated server. The same pair behind vllm-router's
--vllm-pd-disaggregation, unchanged. A decode whose KV never arrives (prefill gone) fails that one
request with a clear error and keeps serving."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fixtures.live_server import LiveServer

from kvflow.kv_transfer.exports import KVExports
from kvflow.server.spawn import free_port, spawn_vllm_router, stop_router

# vLLM's NIXL request to a prefill instance (what vllm-router and vLLM's toy proxy send).
DO_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PROMPT = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat " * 3
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def pd(start_server: Callable[..., LiveServer]) -> tuple[LiveServer, LiveServer, LiveServer]:
    """(prefill, decode, colocated) servers of the tiny model; the decode instance's pool is another
    size than the prefill's (a block's layout, not the pool's, must match)."""
    prefill = start_server(engine={"kv_role": "prefill", "kv_transfer_timeout": TIMEOUT_S})
    decode = start_server(
        engine={"kv_role": "decode", "kv_transfer_timeout": TIMEOUT_S, "num_kv_blocks": 200}
    )
    colocated = start_server()
    return prefill, decode, colocated


def completion(server: LiveServer, **body: Any) -> httpx.Response:
    with server.client() as client:
        return client.post("/v1/completions", json={"model": server.model, "temperature": 0, **body})


def exports_of(prefill: LiveServer) -> KVExports:
    transfer = prefill.ctx.engine.engine.kv_transfer
    assert transfer is not None and transfer.exports is not None
    return transfer.exports


def first_blocks_of(prefill: LiveServer, prompt: str) -> list[str]:
    """The hex block hashes of a prompt's full blocks, as a prefill instance would name them."""
    engine = prefill.ctx.engine.engine
    request = engine.make_request("probe", prompt)
    return [h.hex() for h in engine.scheduler.kv_cache_manager.hash_request_blocks(request)]


def test_prefill_then_decode_equals_one_colocated_server(
    pd: tuple[LiveServer, LiveServer, LiveServer],
) -> None:
    """(Each test sends prompts of its own: the module's servers keep what earlier tests cached.)"""
    prefill, decode, colocated = pd
    first = completion(prefill, prompt=PROMPT, max_tokens=1, kv_transfer_params=DO_REMOTE_DECODE)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0
    num_prompt = first.json()["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == num_prompt // 16

    second = completion(decode, prompt=PROMPT, max_tokens=12, kv_transfer_params=params)
    assert second.status_code == 200, second.text
    reference = completion(colocated, prompt=PROMPT, max_tokens=12)
    assert second.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    # Every full block came from the prefill instance (the last prompt token is computed here).
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 16 * min(len(params["remote_block_ids"]), (num_prompt - 1) // 16) and cached > 0
    exports = exports_of(prefill)
    assert exports.stats.fetched == 1 and len(exports) == 0

    # The same prompt again: the decode's own prefix cache holds it now, nothing is fetched.
    again = completion(decode, prompt=PROMPT, max_tokens=4, kv_transfer_params=params)
    assert again.status_code == 200 and exports.stats.fetched == 1
    # A transfer is fetched once: a new prompt naming a transfer the prefill no longer holds fails
    # clearly, and the decode serves on.
    other = PROMPT.replace("fox", "wolf")
    hashes = first_blocks_of(prefill, other)
    gone = completion(
        decode, prompt=other, max_tokens=4, kv_transfer_params={**params, "remote_block_ids": hashes}
    )
    assert gone.status_code >= 500 and "unknown here or expired" in gone.text, gone.text
    assert completion(decode, prompt="hello there", max_tokens=2).status_code == 200


def test_a_prefill_that_never_answers_fails_only_that_request(
    pd: tuple[LiveServer, LiveServer, LiveServer],
) -> None:
    prefill, decode, _ = pd
    prompt = PROMPT.replace("cat", "hamster")  # a prompt the decode instance has not cached
    first = completion(prefill, prompt=prompt, max_tokens=1, kv_transfer_params=DO_REMOTE_DECODE)
    params = {**first.json()["kv_transfer_params"], "remote_port": free_port()}  # nobody listens there
    start = time.monotonic()
    failed = completion(decode, prompt=prompt, max_tokens=4, kv_transfer_params=params)
    assert failed.status_code >= 500 and "sent no KV" in failed.text and "within 3 s" in failed.text
    assert time.monotonic() - start < TIMEOUT_S + 5
    assert completion(decode, prompt="still serving", max_tokens=2).status_code == 200
    decode.wait_until_idle()
    manager = decode.ctx.engine.engine.scheduler.kv_cache_manager
    assert manager.block_pool.usage == 0.0  # the failed request holds no block


def test_wrong_role_and_malformed_params_are_400(pd: tuple[LiveServer, LiveServer, LiveServer]) -> None:
    prefill, decode, _ = pd
    wrong = completion(decode, prompt=PROMPT, max_tokens=1, kv_transfer_params=DO_REMOTE_DECODE)
    assert wrong.status_code == 400 and "kv_role is decode" in wrong.text
    broken = completion(decode, prompt=PROMPT, max_tokens=1, kv_transfer_params={"do_remote_prefill": True})
    assert broken.status_code == 400 and "remote_host" in broken.text
    two = completion(prefill, prompt=[PROMPT, PROMPT], max_tokens=1, kv_transfer_params=DO_REMOTE_DECODE)
    assert two.status_code == 400 and "n=1" in two.text


@pytest.fixture
def pd_router(pd: tuple[LiveServer, LiveServer, LiveServer]) -> Iterator[str]:
    if shutil.which("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[test]' installs it)")
    prefill, decode, _ = pd
    args = ["--vllm-pd-disaggregation", "--prefill", prefill.base_url, "--decode", decode.base_url]
    router, base = spawn_vllm_router([*args, "--policy", "round_robin"])
    yield base
    stop_router(router)


@pytest.mark.parametrize("stream", [False, True])
def test_behind_vllm_router_in_pd_mode(
    pd: tuple[LiveServer, LiveServer, LiveServer], pd_router: str, stream: bool
) -> None:
    prefill, _, colocated = pd
    fetched = exports_of(prefill).stats.fetched
    prompt = f"stream={stream}: " + PROMPT  # a first block no earlier request cached
    body = {"model": prefill.model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": stream}
    with httpx.Client(base_url=pd_router, timeout=60) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    else:
        text = response.json()["choices"][0]["text"]
    reference = completion(colocated, prompt=prompt, max_tokens=10)
    assert text == reference.json()["choices"][0]["text"]
    assert exports_of(prefill).stats.fetched == fetched + 1  # the KV moved

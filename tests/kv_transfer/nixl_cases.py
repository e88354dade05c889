"""The KV transfer over NIXL (kvflow/kv_transfer/nixl_transport.py, `kv_transfer_backend nixl`): the
decode side READs the blocks from the prefill side's registered buffer (UCX on CPU), the buffer is
released on the READ's notification or past its deadline, and a decode instance fetching over NIXL
answers as a colocated server does. Run by test_nixl.py in a child pytest: a process that made a NIXL
agent crashes at exit (SIGSEGV in nixl-cu12 1.5.1's teardown on this CPU-only VM, an empty script
with one agent does it too), which must not take the suite's process down."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from fixtures.live_server import LiveServer
from test_pd_servers import DO_REMOTE_DECODE, PROMPT, TIMEOUT_S, completion

from kvflow.kv_transfer import server as server_module
from kvflow.kv_transfer.client import KVTransferClient, KVTransferError
from kvflow.kv_transfer.exports import KVExports
from kvflow.kv_transfer.nixl_transport import NixlExports, nixl_available
from kvflow.kv_transfer.params import RemotePrefill
from kvflow.kv_transfer.server import KVTransferServer

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12)")

HASHES = [bytes([i]) * 32 for i in range(6)]
PAYLOADS = [bytes([i + 1]) * (4096 + 512 * i) for i in range(6)]


@pytest.fixture
def server() -> Iterator[KVTransferServer]:
    srv = KVTransferServer(KVExports(ttl_s=60, capacity_bytes=1 << 30), "fp", "127.0.0.1", 0)
    yield srv
    srv.close()


def _fetch(
    server: KVTransferServer, client: KVTransferClient, transfer_id: str, first: int, n: int
) -> list[bytes]:
    server.exports.put(transfer_id, HASHES, PAYLOADS)
    remote = RemotePrefill("127.0.0.1", server.port, transfer_id, tuple(HASHES), "fp")
    return [bytes(p) for p in client.fetch_async(remote, first, n).result(timeout=20).payloads]


def test_a_nixl_read_brings_the_blocks_and_releases_the_prefill_buffer(server: KVTransferServer) -> None:
    client = KVTransferClient(timeout_s=10, backend="nixl")
    try:
        assert _fetch(server, client, "t-nixl", 2, 3) == PAYLOADS[2:5]
        assert _fetch(server, client, "t-nixl-2", 0, 6) == PAYLOADS  # the agents know each other now
    finally:
        client.close()
    assert server.nixl is not None
    deadline = time.monotonic() + 5
    while len(server.nixl) and time.monotonic() < deadline:  # the server thread reads notifications
        time.sleep(0.05)
    assert len(server.nixl) == 0


def test_a_staged_buffer_nobody_reads_is_released_past_its_deadline() -> None:
    exports = NixlExports(keep_s=0.0)
    try:
        exports.stage("never-read", PAYLOADS)
        assert len(exports) == 1
        exports.sweep()
        assert len(exports) == 0
    finally:
        exports.close()


def test_a_prefill_without_nixl_answers_with_a_clear_error(
    server: KVTransferServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "nixl_available", lambda: False)
    client = KVTransferClient(timeout_s=10, backend="nixl")
    try:
        with pytest.raises(KVTransferError, match="has no NIXL"):
            _fetch(server, client, "t-none", 0, 2)
    finally:
        client.close()


def test_a_nixl_decode_server_answers_as_a_colocated_one(start_server: Callable[..., LiveServer]) -> None:
    prefill = start_server(engine={"kv_role": "prefill", "kv_transfer_timeout": TIMEOUT_S})
    decode = start_server(
        engine={"kv_role": "decode", "kv_transfer_timeout": TIMEOUT_S, "kv_transfer_backend": "nixl"}
    )
    colocated = start_server()
    prompt = PROMPT.replace("fox", "heron")
    first = completion(prefill, prompt=prompt, max_tokens=1, kv_transfer_params=DO_REMOTE_DECODE)
    assert first.status_code == 200, first.text
    second = completion(
        decode, prompt=prompt, max_tokens=12, kv_transfer_params=first.json()["kv_transfer_params"]
    )
    assert second.status_code == 200, second.text
    reference = completion(colocated, prompt=prompt, max_tokens=12)
    assert second.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the blocks came over NIXL

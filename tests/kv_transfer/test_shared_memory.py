"""The same-machine KV transfer (kvflow/kv_transfer/shared_memory.py): a decode client on the prefill
server's machine gets the blocks through one /dev/shm segment, read once and unlinked; another
machine (or a client told not to) gets them as ZeroMQ frames; an unread segment is unlinked past its
deadline; a segment that cannot be read fails the fetch with a message naming it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvflow.kv_transfer import client as client_module
from kvflow.kv_transfer.client import KVTransferClient, KVTransferError
from kvflow.kv_transfer.exports import KVExports
from kvflow.kv_transfer.params import RemotePrefill
from kvflow.kv_transfer.server import KVTransferServer
from kvflow.kv_transfer.shared_memory import SEGMENT_PREFIX, SHM_DIR, host_identity, write_segment

pytestmark = pytest.mark.skipif(host_identity() == "", reason="no /dev/shm or boot id on this machine")

HASHES = [bytes([i]) * 32 for i in range(5)]
PAYLOADS = [bytes([i]) * (1000 + 37 * i) for i in range(5)]  # blocks of different sizes, as a tail is


@pytest.fixture
def server() -> Iterator[KVTransferServer]:
    srv = KVTransferServer(KVExports(ttl_s=60, capacity_bytes=1 << 30), "fp", "127.0.0.1", 0)
    yield srv
    srv.close()


def _segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}*")}


def _fetch(
    server: KVTransferServer, client: KVTransferClient, transfer_id: str, first: int, n: int
) -> list[bytes]:
    server.exports.put(transfer_id, HASHES, PAYLOADS)
    remote = RemotePrefill("127.0.0.1", server.port, transfer_id, tuple(HASHES), "fp")
    return client.fetch_async(remote, first, n).result(timeout=10).payloads


def test_same_machine_fetches_go_through_one_segment_read_once(
    server: KVTransferServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []
    original = client_module.read_segment

    def spy(name: str, sizes: list[int]) -> list[bytes]:
        read.append(name)
        return original(name, sizes)

    monkeypatch.setattr(client_module, "read_segment", spy)
    before = _segments()
    client = KVTransferClient(timeout_s=10)
    try:
        assert _fetch(server, client, "t-shm", 1, 3) == PAYLOADS[1:4]
    finally:
        client.close()
    assert len(read) == 1  # the blocks came in shared memory
    assert _segments() == before  # and the reader unlinked the segment


@pytest.mark.parametrize("how", ["client opts out", "another machine"])
def test_other_clients_get_frames_over_tcp(server: KVTransferServer, how: str) -> None:
    before = _segments()
    client = KVTransferClient(timeout_s=10, backend="tcp" if how == "client opts out" else "auto")
    if how == "another machine":
        client.host_id = "elsewhere/boot/1"
    try:
        assert _fetch(server, client, f"t-{how}", 0, 5) == PAYLOADS
    finally:
        client.close()
    assert _segments() == before


def test_an_unread_segment_is_unlinked_past_its_deadline(server: KVTransferServer) -> None:
    name = write_segment(PAYLOADS)
    server.segments.add(name)
    server.segments.sweep()
    assert (SHM_DIR / name).exists()  # before its deadline
    server.segments.sweep(now=float("inf"))
    assert not (SHM_DIR / name).exists()


def test_a_segment_that_cannot_be_read_fails_the_fetch_naming_it(
    server: KVTransferServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gone(name: str, sizes: list[int]) -> list[bytes]:
        (SHM_DIR / name).unlink()
        raise FileNotFoundError(2, "No such file or directory", str(SHM_DIR / name))

    monkeypatch.setattr(client_module, "read_segment", gone)
    client = KVTransferClient(timeout_s=10)
    try:
        with pytest.raises(
            KVTransferError, match=r"put the KV in shared memory kvflow-kv-\w+, which cannot be read"
        ):
            _fetch(server, client, "t-gone", 0, 2)
    finally:
        client.close()


def test_a_forged_segment_name_is_refused() -> None:
    from kvflow.kv_transfer.shared_memory import read_segment

    with pytest.raises(ValueError, match="not a KV segment name"):
        read_segment("../etc/passwd", [1])

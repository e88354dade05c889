"""`kv_transfer_params`, the request/response field vLLM's disaggregated serving passes through its
router (vllm-router copies the prefill's answer into the decode request unchanged).

vLLM's NIXL keys, kept with their meaning so the router and vLLM's toy proxy need nothing new:
    do_remote_decode   on a request to the prefill instance: compute the prompt, keep its KV for a
                       decode instance (the router also sets max_tokens=1, stream=false)
    do_remote_prefill  on the request to the decode instance: the prompt's KV is at the remote_* end
    remote_host, remote_port, remote_engine_id, remote_request_id, remote_block_ids, tp_size
kvflow's transfer fills remote_block_ids with the hex of its prefix-cache block hashes and adds
`kvflow_fingerprint` (the KV layout: model, dtypes, block size): a decode instance whose layout
differs refuses the bytes rather than reading them as its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.errors import InvalidRequestError


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV waits (parsed from its kv_transfer_params)."""

    host: str
    port: int
    transfer_id: str
    block_hashes: tuple[bytes, ...]
    fingerprint: str


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return params is not None and bool(params.get("do_remote_decode"))


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The decode side's parse; None for a request without a remote prefill (an ordinary request, or
    a prefill answer whose KV could not be kept, e.g. the prompt ended at EOS: computed locally)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        host, port = str(params["remote_host"]), int(params["remote_port"])
        transfer_id = str(params["remote_request_id"])
        hashes = tuple(bytes.fromhex(h) for h in params["remote_block_ids"])
        fingerprint = str(params["kvflow_fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"kv_transfer_params: a remote prefill needs remote_host, remote_port, remote_request_id, "
            f"remote_block_ids (hex block hashes) and kvflow_fingerprint from a kvflow prefill instance "
            f"({type(exc).__name__}: {exc})"
        ) from None
    return RemotePrefill(host, port, transfer_id, hashes, fingerprint)


def prefill_answer(
    host: str, port: int, engine_id: str, transfer_id: str, block_hashes: list[bytes], fingerprint: str
) -> dict[str, Any]:
    """The prefill's response field: what the decode instance needs to fetch the blocks."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": transfer_id,
        "remote_block_ids": [h.hex() for h in block_hashes],
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "kvflow_fingerprint": fingerprint,
    }

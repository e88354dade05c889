"""One engine's side of prefill/decode disaggregation: its role, its KV layout's fingerprint, and the
exports it serves (prefill) or the client it fetches with (decode). kvflow/engine/engine.py owns one
when `kv_role` is prefill or decode."""

from __future__ import annotations

import logging
from typing import Any

from kvflow.config import CacheConfig
from kvflow.errors import InvalidRequestError
from kvflow.kv_cache.block_pool import BlockPool
from kvflow.kv_offload.block_bytes import BlockBytes
from kvflow.kv_transfer.client import KVTransferClient
from kvflow.kv_transfer.exports import KVExports
from kvflow.kv_transfer.params import prefill_answer, remote_prefill, wants_remote_decode
from kvflow.kv_transfer.server import KVTransferServer
from kvflow.request import Request

logger = logging.getLogger(__name__)


class KVTransferEndpoint:
    def __init__(self, cache: CacheConfig, blocks: BlockBytes, fingerprint: str, engine_id: str) -> None:
        self.role = cache.kv_role
        self.blocks = blocks
        self.fingerprint = fingerprint
        self.engine_id = engine_id
        self.host = cache.kv_transfer_host
        self.exports: KVExports | None = None
        self.server: KVTransferServer | None = None
        self.client: KVTransferClient | None = None
        if self.role == "prefill":
            # Kept twice the decode's wait: a decode that fetches late still finds it, no longer.
            ttl = 2 * cache.kv_transfer_timeout
            # No more than a pool's worth: a prompt whose KV fits the pool fits here.
            capacity = blocks.block_bytes * max(1, blocks.num_blocks)
            self.exports = KVExports(ttl, capacity)
            self.server = KVTransferServer(
                self.exports, fingerprint, self.host, cache.kv_transfer_port, segment_keep_s=ttl
            )
            logger.info(
                "KV transfer (prefill role): serving prompts' KV on %s:%d", self.host, self.server.port
            )
        else:
            self.client = KVTransferClient(cache.kv_transfer_timeout, cache.kv_transfer_backend)
            logger.info("KV transfer (decode role): prompts marked do_remote_prefill fetch their KV")

    def accept(self, request: Request, params: dict[str, Any] | None) -> None:
        """Read a request's kv_transfer_params (InvalidRequestError for what this role cannot do)."""
        if params is None:
            return
        if wants_remote_decode(params):
            if self.role != "prefill":
                raise InvalidRequestError(
                    "kv_transfer_params.do_remote_decode: this instance's kv_role is decode"
                )
            request.kv_export = True
            return
        remote = remote_prefill(params)
        if remote is None:
            return
        if self.role != "decode":
            raise InvalidRequestError(
                "kv_transfer_params.do_remote_prefill: this instance's kv_role is prefill"
            )
        if remote.fingerprint != self.fingerprint:
            raise InvalidRequestError(
                "kv_transfer_params: the prefill instance's KV layout differs from this decode instance's "
                "(another checkpoint, dtype, KV cache dtype, quantization or block size)"
            )
        request.remote_prefill = remote

    def export(self, request: Request, pool: BlockPool, block_size: int) -> dict[str, Any] | None:
        """Copy a finished prompt's full blocks out of the pool (still cached: nothing has been
        allocated since it finished) and answer with where to fetch them; None if no block is left."""
        assert self.exports is not None and self.server is not None
        num_blocks = len(request.prompt_token_ids) // block_size
        hashes, payloads = [], []
        for block_hash in request.block_hashes[:num_blocks]:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            hashes.append(block_hash)
            payloads.append(self.blocks.read(block.block_id))
        if not hashes:
            return None
        self.exports.put(request.request_id, hashes, payloads)
        return prefill_answer(
            self.host, self.server.port, self.engine_id, request.request_id, hashes, self.fingerprint
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()

"""The KV transfer over NIXL (NVIDIA's inference transfer library, the transport of vLLM's
NixlConnector and Dynamo): the decode side READs the prompt's blocks out of the prefill side's
registered memory, with UCX choosing the path (shared memory or CMA on one machine, TCP or RDMA
between machines). Optional: `pip install nixl-cu12` (68 MB; its UCX backend runs on CPU-only
machines; the `nixl` meta-package would pull CUDA builds of torch), `--kv-transfer-backend nixl`.

The handshake rides on the ZeroMQ fetch (kvflow/kv_transfer/server.py), as vLLM's NIXL side channel
does: the prefill server stages the blocks back to back in one buffer it registers, and answers
with its agent's partial metadata (connection info and that buffer's registration: an agent's full
metadata, taken before the buffer existed, would not let a READ of it through) and the buffer's
serialized descriptors; the decode side loads that metadata, registers a buffer of the same size,
READs into it, and names the transfer in the READ's notification, on which the prefill side
releases its buffer (or past a deadline, if the notification never comes). The payloads handed to
the restore are views of the decode side's buffer: the restore copies each block once, into the KV
pool.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.config import ConfigError

NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels' module names, any will do
# nixl-cu12 1.5.1 crashes (SIGSEGV) any process that made an agent when the interpreter exits, on
# this CPU-only VM: `kvflow serve` ends such a process itself once it has shut down (exit_now).
_AGENTS_MADE = threading.Event()
POLL_S = 0.0005  # between READ status checks: the READ itself is a few ms for a prompt's KV


def _nixl_api() -> Any | None:
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    return None


def nixl_available() -> bool:
    return _nixl_api() is not None


def require_nixl() -> None:
    if not nixl_available():
        raise ConfigError(
            "kv_transfer_backend nixl: the NIXL library is not installed (pip install nixl-cu12: its UCX "
            "backend runs on CPU; or kvflow[nixl])"
        )


def nixl_agent_made() -> bool:
    return _AGENTS_MADE.is_set()


def exit_now(status: int) -> None:
    """End the process with `status` without the interpreter's teardown (where NIXL crashes), its
    output flushed: for a command whose work is done (kvflow serve after its shutdown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


class NixlAgent:
    """One NIXL agent (UCX backend); calls serialized by a lock (the fetch threads share the decode
    side's, the server thread owns the prefill side's)."""

    def __init__(self, role: str) -> None:
        api = _nixl_api()
        if api is None:
            raise ConfigError("NIXL is not installed (pip install nixl-cu12)")
        self.name = f"kvflow-{role}-{uuid.uuid4().hex[:12]}"
        self._agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        _AGENTS_MADE.set()
        self._lock = threading.Lock()

    def meet(self, metadata: bytes) -> str:
        """Load a remote agent's (partial) metadata: the first time its connection, then the memory
        it registered since; its name."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def metadata_of(self, registration: Any) -> bytes:
        """This agent's connection info and one registration, for a remote agent to READ it."""
        with self._lock:
            return bytes(self._agent.get_partial_agent_metadata(registration, True, ["UCX"]))

    def register(self, buffer: torch.Tensor) -> Any:
        with self._lock:
            return self._agent.register_memory(buffer)

    def deregister(self, registration: Any) -> None:
        with self._lock:
            self._agent.deregister_memory(registration)

    def descriptors(self, buffer: torch.Tensor) -> bytes:
        with self._lock:
            return bytes(self._agent.get_serialized_descs(self._agent.get_xfer_descs(buffer)))

    def read(
        self, into: torch.Tensor, remote: str, remote_descs: bytes, notify: bytes, timeout_s: float
    ) -> None:
        """READ the remote buffer into `into` (registered); TimeoutError / RuntimeError on failure."""
        with self._lock:
            local = self._agent.get_xfer_descs(into)
            handle = self._agent.initialize_xfer(
                "READ", local, self._agent.deserialize_descs(remote_descs), remote, notify
            )
            state = self._agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the NIXL READ from {remote} did not finish within {timeout_s:g} s")
                time.sleep(POLL_S)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"the NIXL READ from {remote} failed ({state})")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    def notifications(self) -> list[bytes]:
        """Messages the remote agents' READs carried since the last call."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [m for messages in notifs.values() for m in messages]


@dataclass
class Staged:
    buffer: torch.Tensor
    registration: Any
    deadline: float


class NixlExports:
    """The prefill side: exports staged in registered buffers for decode agents to READ."""

    def __init__(self, keep_s: float) -> None:
        self.agent = NixlAgent("prefill")
        self.keep_s = keep_s
        self._staged: dict[str, Staged] = {}

    def stage(self, transfer_id: str, payloads: list[bytes]) -> tuple[bytes, bytes]:
        """Put the payloads in one registered buffer; (the metadata to READ it with, its descriptors)."""
        total = sum(len(p) for p in payloads)
        buffer = torch.empty(total, dtype=torch.uint8)
        view = buffer.numpy()
        at = 0
        for p in payloads:
            view[at : at + len(p)] = memoryview(p)
            at += len(p)
        registration = self.agent.register(buffer)
        self._staged[transfer_id] = Staged(buffer, registration, time.monotonic() + self.keep_s)
        return self.agent.metadata_of(registration), self.agent.descriptors(buffer)

    def sweep(self) -> None:
        """Release the buffers whose READ has finished (their notification came) or expired."""
        for message in self.agent.notifications():
            self._release(message.decode(errors="replace"))
        now = time.monotonic()
        for key in [k for k, s in self._staged.items() if s.deadline <= now]:
            self._release(key)

    def _release(self, key: str) -> None:
        staged = self._staged.pop(key, None)
        if staged is not None:
            self.agent.deregister(staged.registration)

    def __len__(self) -> int:
        return len(self._staged)

    def close(self) -> None:
        for key in list(self._staged):
            self._release(key)


class NixlReader:
    """The decode side: READs a staged export into a buffer of its own."""

    def __init__(self) -> None:
        self.agent = NixlAgent("decode")

    def read(
        self,
        transfer_id: str,
        prefill_metadata: bytes,
        descriptors: bytes,
        sizes: list[int],
        timeout_s: float,
    ) -> list[memoryview]:
        remote = self.agent.meet(prefill_metadata)
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        registration = self.agent.register(buffer)
        try:
            self.agent.read(buffer, remote, descriptors, transfer_id.encode(), timeout_s)
        finally:
            self.agent.deregister(registration)
        whole: memoryview = buffer.numpy().data  # the buffer's bytes, kept alive by the views
        payloads, at = [], 0
        for size in sizes:
            payloads.append(whole[at : at + size])
            at += size
        return payloads

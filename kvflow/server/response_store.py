"""Stored responses for `previous_response_id` (and GET /v1/responses/{id}), bounded in memory and
in count: the least recently used goes first when either bound is passed. A server restart forgets
them (as a process-local store must); a client continuing a conversation past that gets a 404
naming the id."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Defaults: about a thousand conversations' tails on a small server, at most 64 MiB of JSON text.
MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # the conversation as chat messages, this response's output included
    response: dict[str, Any]  # the response object as it was returned
    num_bytes: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        size = len(json.dumps(messages)) + len(json.dumps(response))
        with self._lock:
            old = self._items.pop(response_id, None)
            if old is not None:
                self._bytes -= old.num_bytes
            self._items[response_id] = StoredResponse(messages, response, size)
            self._bytes += size
            while self._items and (len(self._items) > self.max_responses or self._bytes > self.max_bytes):
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self._bytes -= item.num_bytes
            return item is not None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_bytes(self) -> int:
        return self._bytes

"""The scheduler's waiting queue under `--scheduling-policy` (vLLM's flag; pure Python).

    fcfs      arrival order; a preempted request goes back to the front (it arrived before everyone
              waiting behind it)
    priority  by (priority, arrival time): the lower `priority` value first (vLLM's convention), FCFS
              within a priority; a preempted request goes back to its place by that key
The running list is kept in the same key order under `priority` (kvflow/engine/scheduler.py), so the
scheduler's victims, taken from its end, are the lowest-priority and latest requests.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from kvflow.config import SchedulingPolicy
from kvflow.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.timeline.arrival_time


class RequestQueue:
    """The waiting requests in the policy's order: `peek` / `popleft` take the next to admit."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._sorted: list[Request] = []  # priority: ascending priority_key
        self._keys: list[tuple[int, float]] = []

    def append(self, request: Request) -> None:
        """A new arrival."""
        if self.policy == "fcfs":
            self._fcfs.append(request)
        else:
            self._insert(request)

    def put_back(self, request: Request) -> None:
        """A request that was at the front (stepped over) or preempted: ahead of later arrivals."""
        if self.policy == "fcfs":
            self._fcfs.appendleft(request)
        else:
            self._insert(request)

    def _insert(self, request: Request) -> None:
        key = priority_key(request)
        at = bisect.bisect_right(self._keys, key)  # after equal keys: FCFS among identical ones
        self._keys.insert(at, key)
        self._sorted.insert(at, request)

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._sorted[0]

    def popleft(self) -> Request:
        if self.policy == "fcfs":
            return self._fcfs.popleft()
        self._keys.pop(0)
        return self._sorted.pop(0)

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.remove(request)
            return
        at = self._sorted.index(request)
        del self._sorted[at], self._keys[at]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._fcfs if self.policy == "fcfs" else self._sorted)

    def __len__(self) -> int:
        return len(self._fcfs) + len(self._sorted)

    def __bool__(self) -> bool:
        return len(self) > 0

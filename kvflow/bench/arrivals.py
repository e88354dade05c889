"""Arrival processes: closed loop (a fixed number of requests in flight) and open loop (Poisson, or
gamma with burstiness), over conversations whose turns run one after another.

Open loop follows vLLM's bench: inter-arrival gaps are gamma-distributed with shape = burstiness and
mean 1 / rate; burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = None  # closed loop: conversations in flight
    request_rate: float | None = None  # open loop: conversation arrivals per second (inf = all at once)
    burstiness: float = 1.0
    max_concurrency: int | None = None  # open loop: optional cap on conversations in flight
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) and request_rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"rate {self.request_rate}/s, burstiness {self.burstiness}"


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `num` arrivals happens (the first at 0)."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)  # gamma scale: mean gap = shape * scale = 1 / rate
    offsets, t = [], 0.0
    for i in range(num):
        if i:
            t += rng.gammavariate(burstiness, theta)
        offsets.append(t)
    return offsets


async def run_load(
    num_conversations: int, spec: LoadSpec, run_one: Callable[[int], Awaitable[None]]
) -> float:
    """Run conversations 0..n-1 under the arrival process; returns the wall time in seconds."""
    start = time.perf_counter()
    if spec.concurrency is not None:
        next_index = iter(range(num_conversations))

        async def worker() -> None:
            for index in next_index:  # the shared iterator hands each index out once
                await run_one(index)

        await asyncio.gather(*(worker() for _ in range(min(spec.concurrency, num_conversations))))
    else:
        assert spec.request_rate is not None
        cap = asyncio.Semaphore(spec.max_concurrency or num_conversations or 1)
        offsets = arrival_offsets(num_conversations, spec.request_rate, spec.burstiness, spec.seed)

        async def arrive(index: int, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with cap:
                await run_one(index)

        await asyncio.gather(*(arrive(i, off) for i, off in enumerate(offsets)))
    return time.perf_counter() - start

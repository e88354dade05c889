"""Soak and abuse `kvflow serve` as careless and hostile clients would; not part of the test suite.

    python benchmarks/soak.py [MODEL] [--requests 1000] [--concurrency 32] [--abandon 100]
                              [--half-bodies 20] [--fuzz-seconds 120] [--duration-seconds 600]
                              [--serve-flags "--num-kv-blocks 512 ..."]

Starts `kvflow serve` (the bundled model by default) as a subprocess, then runs, in order:
  mixed     N requests at concurrency C: completions and chat, streamed or not, n of 1-3, seeds,
            logprobs, stop strings, token-id prompts, content parts, /tokenize, and about 1 in 20
            requests that must be refused (bad seed, lone surrogate, fan-out past the cap, ...)
  abandon   streams dropped after 1-5 chunks, and bodies half sent before hanging up
  fuzz      schemathesis on /openapi.json for the given time (skipped when it is not installed:
            pip install schemathesis)
  soak      the mixed traffic again until --duration-seconds have passed (0: skipped)
The server's RSS is sampled every second throughout. Printed: failures (a refused request that
should have passed, a passed one that should have been refused, a stream without its final chunk
or [DONE], a transport error), the 5xx count, KV blocks still held once the server is idle, and
memory growth from after warm-up to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvflow.assets import bundled_model_dir
from kvflow.bench.server_metrics import scrape
from kvflow.server.spawn import spawn_server, stop_server

REPO = Path(__file__).resolve().parents[1]
PROMPTS = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "The with statement is used to",
    "class Stack:\n    def push(self, item):\n",
    "Café naïve façade — 東京 😀",
)
# (body, path) pairs every server must refuse with a 4xx.
MUST_REFUSE = (
    ("/v1/completions", '{"prompt": "x", "seed": 18446744073709551616}'),
    ("/v1/completions", '{"prompt": "\\ud800"}'),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", '{"prompt": ["x", "y"], "n": 128, "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": "x", "echo": 0}'),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 1}}',
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    ("/tokenize", '{"prompt": "\\udfff"}'),
)


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    requests: int = 0

    def fail(self, what: str) -> None:
        if len(self.failures) < 1000:
            self.failures.append(what)

    @property
    def num_5xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def mixed_request(rng: random.Random) -> tuple[str, dict[str, Any] | str, bool]:
    """(path, body or raw JSON, whether it must be accepted)."""
    roll = rng.random()
    if roll < 0.05:
        path, raw = rng.choice(MUST_REFUSE)
        return path, raw, False
    if roll < 0.10:
        return "/tokenize", {"prompt": rng.choice(PROMPTS)}, True
    sampling: dict[str, Any] = {"max_tokens": rng.randint(4, 48), "n": rng.choice((1, 1, 1, 2, 3))}
    if rng.random() < 0.5:
        sampling["temperature"] = 0.0
    else:
        sampling |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randint(0, 2**63 - 1)}
    if rng.random() < 0.2:
        sampling["stop"] = ["\n\n"]
    sampling["stream"] = rng.random() < 0.6
    if sampling["stream"] and rng.random() < 0.5:
        sampling["stream_options"] = {"include_usage": True}
    if roll < 0.55:
        prompt: Any = rng.choice(PROMPTS) if rng.random() < 0.8 else [rng.randint(10, 500) for _ in range(20)]
        if rng.random() < 0.2:
            sampling["logprobs"] = 2
        return "/v1/completions", {"prompt": prompt, **sampling}, True
    text = rng.choice(PROMPTS)
    content: Any = text if rng.random() < 0.5 else [{"type": "text", "text": text}]
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **sampling}, True


async def send(
    http: httpx.AsyncClient, path: str, body: dict[str, Any] | str, must_pass: bool, tally: Tally
) -> None:
    tally.requests += 1
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    streamed = isinstance(body, dict) and body.get("stream", False)
    try:
        async with http.stream(
            "POST", path, content=content, headers={"content-type": "application/json"}
        ) as r:
            tally.statuses[r.status_code] += 1
            text = (await r.aread()).decode()
    except httpx.HTTPError as exc:
        tally.fail(f"{path}: {type(exc).__name__}: {exc}")
        return
    if must_pass != (r.status_code < 400) or r.status_code >= 500:
        tally.fail(f"{path} {r.status_code}: {text[:200]} <- {content[:200]!r}")
    elif streamed and must_pass and not _stream_complete(text):
        tally.fail(f"{path}: stream without a final chunk or [DONE]: ...{text[-300:]}")


def _stream_complete(text: str) -> bool:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return False
    chunks = [json.loads(e) for e in events[:-1]]
    return not any("error" in c for c in chunks) and any(
        choice.get("finish_reason") for c in chunks for choice in c.get("choices", [])
    )


async def mixed(base: str, num_requests: int, concurrency: int, seed: int, deadline: float | None) -> Tally:
    """`num_requests` requests, or as many as fit before `deadline`, `concurrency` in flight."""
    tally = Tally()
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as http:
        counter = iter(range(num_requests) if deadline is None else iter(int, 1))

        async def worker() -> None:
            for _ in counter:
                if deadline is not None and time.monotonic() > deadline:
                    return
                await send(http, *mixed_request(rng), tally)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


async def abandon(base: str, num_streams: int, num_half_bodies: int, seed: int) -> Tally:
    """Streams dropped after 1-5 chunks (10 at a time); bodies half sent, then the connection closed."""
    tally = Tally()
    rng = random.Random(seed)
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:

        async def drop_one() -> None:
            tally.requests += 1
            async with http.stream("POST", "/v1/completions", json=body) as response:
                tally.statuses[response.status_code] += 1
                chunks = rng.randint(1, 5)
                async for line in response.aiter_lines():
                    chunks -= line.startswith("data: ")
                    if chunks == 0:
                        break

        for start in range(0, num_streams, 10):
            await asyncio.gather(*(drop_one() for _ in range(min(10, num_streams - start))))
    host, port = base.removeprefix("http://").split(":")
    for _ in range(num_half_bodies):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{"prompt": "x')
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    return tally


def fuzz(base: str, seconds: int) -> str:
    """schemathesis' summary lines, or why it did not run."""
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        return "skipped (schemathesis is not installed: pip install schemathesis)"
    with tempfile.TemporaryDirectory() as workdir:  # it writes .schemathesis/ where it runs
        result = subprocess.run(
            [exe, "run", f"{base}/openapi.json", "--checks", "all", "--max-time", str(seconds), "-w", "2",
             "--continue-on-failure", "--request-timeout", "60", "--output-sanitize", "false"],
            capture_output=True, text=True, cwd=workdir, timeout=seconds + 600,
        )  # fmt: skip
    summary = result.stdout[result.stdout.rfind("SUMMARY") :]
    lines = [line.strip() for line in summary.splitlines() if re.match(r"\s*(❌|🚫|\d+ generated)", line)]
    return "; ".join(lines) or f"exit {result.returncode}, no failures reported"


class RssSampler:
    """The server's resident memory every second, in a thread."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.samples.append((time.monotonic(), self.process.memory_info().rss))
            except psutil.Error:
                return

    def now(self) -> int:
        return int(self.process.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def late_growth(samples: list[tuple[float, int]], start: float, end: float) -> str:
    """RSS growth over the second half of the soak phase: warm-up effects (the KV pool's pages
    touched for the first time, allocator and kernel caches filling) are mostly over by then."""
    middle = (start + end) / 2
    late = [(t, r) for t, r in samples if middle <= t <= end]
    if len(late) < 2:
        return "too short to judge the second half"
    (t0, r0), (t1, r1) = late[0], late[-1]
    mib = (r1 - r0) / 2**20
    return f"second half of the soak {mib:+.0f} MiB ({mib / ((t1 - t0) / 60):+.1f} MiB/min)"


def idle_kv_blocks(base: str, timeout: float = 60.0) -> tuple[float, float]:
    """Once nothing runs or waits: (KV blocks still in use, blocks in the pool)."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = scrape(base + "/metrics") or {}
        running = sum(snapshot.get("kvflow:num_requests_running", {}).values())
        waiting = sum(snapshot.get("kvflow:num_requests_waiting", {}).values())
        if (running == 0 and waiting == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    usage = sum(snapshot.get("kvflow:kv_cache_usage_perc", {}).values())
    info = next(iter(snapshot.get("kvflow:cache_config_info", {})), ())
    total = float(dict(info).get("num_kv_blocks", 0))
    return usage * total, total


def report(phase: str, tally: Tally, took: float, base: str, rss: RssSampler) -> None:
    leaked, total = idle_kv_blocks(base)
    codes = ", ".join(f"{status}: {n}" for status, n in sorted(tally.statuses.items()))
    print(
        f"[{phase}] {tally.requests} requests in {took:.0f} s ({codes}); failures {len(tally.failures)}, "
        f"5xx {tally.num_5xx}; KV blocks held when idle {leaked:.0f}/{total:.0f}; "
        f"RSS {rss.now() / 2**20:.0f} MiB",
        flush=True,
    )
    for failure in tally.failures[:10]:
        print(f"    {failure}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", default=str(bundled_model_dir()))
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--abandon", type=int, default=100, help="streams to drop after 1-5 chunks")
    parser.add_argument("--half-bodies", type=int, default=20, help="bodies to half send, then hang up")
    parser.add_argument("--fuzz-seconds", type=int, default=120, help="schemathesis' time (0: skip)")
    parser.add_argument("--duration-seconds", type=int, default=0, help="the soak phase (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-flags", default="", help="more kvflow serve flags, as one string")
    args = parser.parse_args()
    serve_flags = shlex.split(args.serve_flags)
    log = tempfile.NamedTemporaryFile("w", prefix="kvflow-soak-", suffix=".log", delete=False)  # noqa: SIM115
    print(f"starting kvflow serve {args.model} {' '.join(serve_flags)} (log: {log.name})", flush=True)
    process, base = spawn_server(args.model, serve_flags, cwd=REPO, stderr=log)
    rss = RssSampler(process.pid)
    try:
        asyncio.run(mixed(base, 8, 4, args.seed, None))  # warm-up
        baseline = rss.now()
        started = time.monotonic()
        tally = asyncio.run(mixed(base, args.requests, args.concurrency, args.seed + 1, None))
        report("mixed", tally, time.monotonic() - started, base, rss)
        started = time.monotonic()
        tally = asyncio.run(abandon(base, args.abandon, args.half_bodies, args.seed + 2))
        report("abandon", tally, time.monotonic() - started, base, rss)
        if args.fuzz_seconds:
            print(f"[fuzz] schemathesis: {fuzz(base, args.fuzz_seconds)}", flush=True)
            report("fuzz", Tally(), args.fuzz_seconds, base, rss)
        soak_window = None
        if args.duration_seconds:
            started = time.monotonic()
            deadline = started + args.duration_seconds
            tally = asyncio.run(mixed(base, 0, args.concurrency, args.seed + 3, deadline))
            report("soak", tally, time.monotonic() - started, base, rss)
            soak_window = (started, time.monotonic())
        peak = max((r for _, r in rss.samples), default=baseline)
        end = rss.now()
        print(
            f"[memory] RSS after warm-up {baseline / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB, "
            f"end {end / 2**20:.0f} MiB: growth {(end - baseline) / 2**20:+.0f} MiB"
            + (f"; {late_growth(rss.samples, *soak_window)}" if soak_window else ""),
            flush=True,
        )
    finally:
        rss.stop()
        stop_server(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())

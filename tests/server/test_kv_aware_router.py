"""Two kvflow replicas behind vllm-router's `kv_aware` policy (installed from the registry, as users
run it): the router subscribes to each replica's KV events and sends a returning prompt to the
replica that caches its prefix, so every returning request is a prefix hit. The same load under
`round_robin` lands half the returning requests on the replica without the prefix (the control
that shows the events, not luck, did the routing). Then kvflow bench through the router reads each
replica's /metrics (--replica-metrics) and kvflow doctor reports them side by side."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.live_server import LiveServer

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.cli import main
from kvflow.server.spawn import free_port, spawn_vllm_router, stop_router

BLOCK = 16
# Long enough that a prefix hit is many blocks; the tiny model's context is 256.
PREFIX_WORDS = 25
# The events of a request reach the router within milliseconds; the pause before a returning
# request is generous so that the test checks routing, not the publisher's latency.
EVENT_SETTLE_S = 0.25


def start_router(
    policy: str, workers: list[tuple[LiveServer, str]], model: str
) -> tuple[subprocess.Popen[Any], str]:
    args = ["--policy", policy, "--worker-urls", *(w.base_url for w, _ in workers)]
    if policy == "kv_aware":
        for worker, endpoint in workers:
            args += ["--kv-event-source", f"{worker.base_url}={endpoint}"]
        args += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", model]
    return spawn_vllm_router(args)


@pytest.fixture(scope="module")
def replicas(
    start_server: Callable[..., LiveServer], server_model_dir: Path
) -> Iterator[list[tuple[LiveServer, str]]]:
    if shutil.which("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[test]' installs it)")
    out = []
    for _ in range(2):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint.replace("127.0.0.1", "*"),
        }
        # The router loads the tokenizer named by the request's model: serve under the checkpoint path.
        server = start_server(
            served_model_name=str(server_model_dir),
            engine={"block_size": BLOCK, "kv_events_config": json.dumps(events)},
        )
        out.append((server, endpoint))
    yield out


def returning_load(base: str, model: str, salt: str) -> list[int]:
    """Three conversations, then each returns twice; the cached prompt tokens of every return.
    `salt` leads every prompt, so that no run finds another run's blocks cached."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf"]
    words += ["hotel", "india", "juliet", "kilo", "lima", "mike"]
    prompts = [
        salt + " " + " ".join(words[(i + j) % len(words)] for j in range(PREFIX_WORDS)) for i in range(3)
    ]
    cached = []
    with httpx.Client(base_url=base, timeout=60.0) as client:
        for turn in range(3):
            for prompt in prompts:
                body = {"model": model, "prompt": prompt + f" turn {turn}", "max_tokens": 2, "temperature": 0}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                if turn:
                    cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
                time.sleep(EVENT_SETTLE_S)
    return cached


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_kv_aware_routes_returning_prompts_to_their_cache(
    replicas: list[tuple[LiveServer, str]], server_model_dir: Path, policy: str
) -> None:
    model = str(server_model_dir)
    router, base = start_router(policy, replicas, model)
    try:
        cached = returning_load(base, model, salt=policy)
    finally:
        stop_router(router)
    hits = sum(c >= 2 * BLOCK for c in cached)
    if policy == "kv_aware":
        assert hits == len(cached), cached
    else:  # 3 prompts over 2 replicas in turn: a return lands where its prompt was cached half the time
        assert hits < len(cached), cached


def test_bench_through_the_router_reports_each_replica_and_the_doctor_reads_them(
    replicas: list[tuple[LiveServer, str]], server_model_dir: Path, tmp_path: Path
) -> None:
    """kvflow bench through the router with --replica-metrics: one section per replica, whose request
    counts add up to the run's; kvflow doctor turns them into the replicas report."""
    model = str(server_model_dir)
    router, base = start_router("round_robin", replicas, model)
    try:
        config = BenchConfig(
            base_url=base + "/v1",
            dataset=DatasetSpec(name="multi-turn", num_requests=8, input_len=24, output_len=4, num_turns=2),
            load=LoadSpec(concurrency=2),
            model=model,
            warmup=0,
            progress=False,
            replica_metrics=tuple(server.base_url + "/metrics" for server, _ in replicas),
        )
        result = run_benchmark(config)
    finally:
        stop_router(router)
    assert result["completed"] == 8 and len(result["replicas"]) == 2
    assert sum(r["requests_finished"] for r in result["replicas"]) == 8
    assert all(r["prefix_cache_hit_rate"] is not None for r in result["replicas"])
    bench_json, out = tmp_path / "bench.json", tmp_path / "doctor.json"
    bench_json.write_text(json.dumps(result))
    assert (
        main(["doctor", model, "--hardware", "h100", "--bench", str(bench_json), "--output", str(out)]) == 0
    )
    report = json.loads(out.read_text())["replicas"]
    assert report["window"] == "the benchmark run"
    assert [r["metrics_url"] for r in report["replicas"]] == list(config.replica_metrics)
    assert report["bottleneck"] is not None  # both served requests: one of them is the slower

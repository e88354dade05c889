"""`--verify` for the disaggregation what-if (kvflow/doctor/disaggregation.py): a prefill and a decode
`kvflow serve`, each with half this machine's cores (OMP_NUM_THREADS), behind vllm-router
--vllm-pd-disaggregation, benchmarked through the router as FreshServer is directly; the baseline
is the colocated server on all the cores."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from typing import Any

from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.config import ConfigError
from kvflow.doctor.step_profile import half_the_cores
from kvflow.server.spawn import spawn_server, spawn_vllm_router, stop_router, stop_server

# The what-if's setting value: understood by --verify only (kvflow serve takes prefill or decode).
DISAGGREGATE = "prefill+decode"


class FreshPair:
    def __init__(self, model_dir: str, flags: list[str]) -> None:
        if shutil.which("vllm-router") is None:
            raise ConfigError(
                "--verify runs the disaggregated pair behind vllm-router: pip install vllm-router"
            )
        self.model_dir = model_dir
        env = {**os.environ, "OMP_NUM_THREADS": str(half_the_cores())}
        self.servers: list[subprocess.Popen[Any]] = []
        self.router: subprocess.Popen[Any] | None = None
        try:
            urls = []
            for role in ("prefill", "decode"):
                process, url = spawn_server(model_dir, [*flags, "--kv-role", role], env=env)
                self.servers.append(process)
                urls.append(url)
            args = [
                "--vllm-pd-disaggregation",
                "--prefill",
                urls[0],
                "--decode",
                urls[1],
                "--policy",
                "round_robin",
            ]
            self.router, self.base = spawn_vllm_router(args)
        except BaseException:
            self.stop()
            raise

    def bench(self, bench: BenchConfig) -> dict[str, Any]:
        # vllm-router's PD mode lists no model at /v1/models: name the one both instances serve
        # (kvflow serve's default name, the checkpoint's path) and its tokenizer.
        tokenizer = bench.tokenizer or self.model_dir
        config = replace(
            bench, base_url=self.base + "/v1", model=self.model_dir, tokenizer=tokenizer, progress=False
        )
        return run_benchmark(config)

    def stop(self) -> None:
        if self.router is not None:
            stop_router(self.router)
        for process in self.servers:
            stop_server(process)

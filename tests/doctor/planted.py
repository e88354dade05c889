"""Planted bottlenecks: a kvflow server with exactly one thing wrong (or nothing), and the workload
that makes it show. Each is large by construction, so that the diagnosis does not depend on a quiet
machine: eight clients behind one running slot, prompts near the whole context, a KV pool smaller
than one request per client, prompt chunks twenty times a decode step, a 768-token prefix repeated
with caching off (on the wide checkpoint, where it costs ~0.26 s of TTFT). Used by
tests/doctor/test_planted_scenarios.py (live servers in the test process) and
benchmarks/doctor_verify.py (`kvflow serve` subprocesses, every what-if verified)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.bench.datasets import DatasetSpec

# A checkpoint whose prefill costs far more than a decode step (4 layers of width 512, float32):
# long prompts and prompt chunks are then visible above any per-step overhead.
WIDE: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=1024,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    engine: dict[str, Any]  # the planted kvflow engine settings
    dataset: DatasetSpec
    concurrency: int
    planted: str | None  # the setting (or workload knob) the doctor's first cause must name; None: healthy
    checkpoint: dict[str, Any] = field(default_factory=dict)  # overrides of the tiny llama fixture


SCENARIOS = (
    Scenario("healthy", {}, DatasetSpec("random", 8, input_len=32, output_len=8), 1, None),
    Scenario(
        "max_num_seqs",
        {"max_num_seqs": 1},
        DatasetSpec("random", 16, input_len=32, output_len=32),
        8,
        "max_num_seqs",
    ),
    Scenario(
        "long_prompt",
        {"max_model_len": 1024},
        DatasetSpec("random", 6, input_len=960, output_len=16),
        1,
        "input_len",
        WIDE,
    ),
    Scenario(
        "kv_pool",
        {"num_kv_blocks": 12, "block_size": 16},
        DatasetSpec("random", 12, input_len=48, output_len=64),
        4,
        "num_kv_blocks",
    ),
    Scenario(
        "prefill_chunks",
        {"max_model_len": 1024},
        DatasetSpec("random", 12, input_len=384, output_len=48, range_ratio=0.5),
        4,
        "max_num_batched_tokens",
        WIDE,
    ),
    Scenario(
        "prefix_caching_off",
        {"enable_prefix_caching": False, "max_model_len": 1024},
        DatasetSpec("shared-prefix", 6, input_len=8, output_len=4, prefix_len=768),
        1,
        "enable_prefix_caching",
        # On the tiny fixture the prefix's prefill had become ~7 ms of an ~11 ms TTFT (session 8's
        # faster prefill attention): small enough for one slow step to outrank it.
        WIDE,
    ),
)

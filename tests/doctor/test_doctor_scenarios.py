"""The doctor end to end on a live kvflow server: its JSON schema, and `--verify` restarting kvflow
serve with a what-if applied (the planted scenarios are tests/doctor/test_planted_scenarios.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.live_server import LiveServer

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.cli import main
from kvflow.doctor.offload_tier import TEMPORARY_DIR


def bench(server: LiveServer, dataset: DatasetSpec, concurrency: int, tmp_path: Path) -> Path:
    config = BenchConfig(
        base_url=server.base_url + "/v1",
        dataset=dataset,
        load=LoadSpec(concurrency=concurrency),
        warmup=1,
        progress=False,
    )
    result = run_benchmark(config)
    assert result["failed"] == 0, result["errors"]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    return path


def doctor(model: Path, bench_json: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "doctor.json"
    assert main(["doctor", str(model), "--hardware", "h100", "--bench", str(bench_json), "--json",
                 "--output", str(out), *extra]) == 0  # fmt: skip
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def by_id(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in doc["findings"]}


def test_schema_has_the_documented_fields(
    server: LiveServer, server_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = doctor(server_model_dir, bench(server, DatasetSpec("random", 6, 32, 8), 1, tmp_path), tmp_path)
    for path in (
        "model.num_params",
        "model.weight_bytes",
        "model.kv_cache_bytes_per_token",
        "memory.max_concurrency",
        "roofline.prefill_ms_per_token",
        "roofline.decode_ms_per_step",
    ):
        section, key = path.split(".")
        assert isinstance(doc[section][key], (int, float)), path
    assert [f["step"] for f in doc["findings"]] == [1, 2, 3, 4, 5, 6]
    assert isinstance(doc["causes"], list) and isinstance(doc["memory"]["max_concurrency"], int)
    assert [f["id"] for f in doc["findings"]] == [
        "input_length", "ttft", "itl", "kv_memory", "quantization", "serving_features",
    ]  # fmt: skip
    for f in doc["findings"]:
        assert set(f) >= {"step", "id", "title", "severity", "evidence", "what_ifs"}
    assert doc["settings"]["server"] == "kvflow"  # read from the server's kvflow:cache_config_info
    assert main(["doctor", str(server_model_dir), "--hardware", "h100", "--context", "64"]) == 0
    assert "Is the input too long?" in capsys.readouterr().out


def test_verify_measures_the_prefix_caching_prediction(
    start_server: Callable[..., LiveServer], server_model_dir: Path, tmp_path: Path
) -> None:
    """`--verify` restarts kvflow serve with and without the change and re-runs the benchmark, and
    says how the measured gain compares with the predicted one."""
    # A long prefix, so that the gain (a few ms on this tiny model) stands above timing noise.
    server = start_server(engine={"enable_prefix_caching": False, "max_model_len": 1024})
    dataset = DatasetSpec("shared-prefix", 10, input_len=8, output_len=4, prefix_len=768)
    doc = doctor(server_model_dir, bench(server, dataset, 1, tmp_path), tmp_path, "--verify")
    [check] = [v for v in doc["verification"] if "prefix caching" in v["change"]]
    assert check["metric"] == "ttft_p50_ms"
    assert check["measured"] < check["baseline"]  # caching the prefix did cut TTFT
    assert check["agrees"] or "missed" in check["explanation"]
    # The prediction's interval from the run's noise, carried to the fresh baseline, and whether the
    # measured value fell inside it.
    lo, hi = check["interval"]
    assert lo <= check["predicted"] <= hi and check["covered"] == (lo <= check["measured"] <= hi)
    print(check["explanation"])


def test_returning_prefixes_evicted_from_a_small_pool_are_offered_the_offload_tier(
    start_server: Callable[..., LiveServer], server_model_dir: Path, tmp_path: Path
) -> None:
    """Multi-turn conversations on a pool too small for them: their histories are evicted between
    turns, so the hit rate stays under the repeat share; the TTFT check offers the disk tier with the
    prefill it saves against the restore it costs, as a setting `--verify` can apply."""
    server = start_server(engine={"num_kv_blocks": 24, "max_model_len": 1024})
    dataset = DatasetSpec("multi-turn", 12, input_len=96, output_len=8, num_turns=3)
    doc = doctor(server_model_dir, bench(server, dataset, 2, tmp_path), tmp_path)
    ttft = by_id(doc)["ttft"]
    # On the tiny model the saving can be inside the run's noise: then it is held back, not offered
    # (kvflow/doctor/noise.py), with its prediction kept in the evidence.
    held = ttft["evidence"].get("what_ifs_within_noise") or []
    offered = [w for w in ttft["what_ifs"] if w["change"].startswith("keep evicted prefix blocks")]
    [tier] = offered + [w for w in held if w["change"].startswith("keep evicted prefix blocks")]
    assert 0 < tier["predicted"]["ttft_p50_ms"] < doc["measured"]["ttft_p50_ms"]
    if offered:
        assert tier["setting"] == {"kv_offload_path": TEMPORARY_DIR}
        assert "GB/s" in tier["effect"] and "ms/token" in tier["effect"]

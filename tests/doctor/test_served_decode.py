"""The served decode probe (kvflow/doctor/served_decode.py): a real `kvflow serve` of the tiny model,
streamed to by kvflow bench at 1 and 2 clients, read back from the server's own step records; and
the per-request client gap spread the simulator draws returns from (RunEvidence.client_gap_jitter_ms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow.doctor.evidence import client_gap_jitter
from kvflow.doctor.served_decode import SERVED_KEYS, decode_step_ms, measure_served_decode


def test_a_decode_step_is_read_from_the_records_of_exactly_that_many_rows() -> None:
    steps = {
        "fields": ["dur_ms", "prefill_tokens", "decode_tokens", "attention"],
        "rows": [[5.0, 16, 0, 136], [1.0, 0, 2, 40], [1.4, 0, 2, 42], [9.0, 16, 1, 150], [0.8, 0, 1, 21]],
    }
    result: dict[str, Any] = {"server": {"steps": steps}}
    assert decode_step_ms(result, 2) == pytest.approx(1.2)  # the median of the two 2-row decodes
    assert decode_step_ms(result, 1) == 0.8  # not the 1-row step that also prefilled
    assert decode_step_ms(result, 4) is None
    assert decode_step_ms({"server": {}}, 1) is None  # another server: no records


def test_the_probe_serves_b_streaming_clients_and_reads_the_servers_steps(server_model_dir: Path) -> None:
    flags = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "2"]
    served = measure_served_decode(str(server_model_dir), flags, [1, 2])
    assert set(served) == set(SERVED_KEYS)
    for key in SERVED_KEYS:
        assert set(served[key]) == {1, 2} and all(ms > 0 for ms in served[key].values())
    for b in (1, 2):  # the clients' TPOT holds the step and what passes between steps
        assert served["served_tpot_ms"][b] >= 0.5 * served["served_decode_ms"][b]


def test_the_client_gap_spread_is_matched_by_request_id_and_centred() -> None:
    requests = [{"x_request_id": f"r{i}", "ttft_ms": ttft} for i, ttft in enumerate([10.0, 12.0, 20.0])]
    requests.append({"x_request_id": "gone", "ttft_ms": 50.0})  # not in the window: skipped
    window = {"requests": [{"x_request_id": f"r{i}", "ttft_ms": 7.0} for i in range(3)]}
    assert client_gap_jitter(requests, {"window": window}) == pytest.approx(
        (-4.0, -2.0, 6.0)
    )  # 3, 5, 13 ms about their mean
    assert client_gap_jitter(requests, {}) == ()  # no window (another server): no spread

"""The served decode probe (kvflow/doctor/served_decode.py): a real `kvflow serve` of the tiny model,
streamed to by kvflow bench at 1 and 2 clients, read back from the server's own step records; and
the per-request client gap spread the simulator draws returns from (RunEvidence.client_gap_jitter_ms)
and the HTTP handoffs it delays each request by (RunEvidence.handoff_ms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow.bench.runner import BenchConfig
from kvflow.bench.server_steps import ROW_STEP_KEYS, STEP_KEYS
from kvflow.doctor import served_decode
from kvflow.doctor.evidence import (
    client_gap_jitter,
    evidence_from_bench,
    first_alone,
    first_token_deliveries,
    handoff_delays,
)
from kvflow.doctor.served_decode import (
    ARRIVAL_KEY,
    SERVED_KEYS,
    SERVED_SWEEPS,
    SUFFIX_KEYS,
    arrival_stall_ms,
    decode_step_ms,
    measure_served_decode,
    suffix_prefixes,
    suffix_steps,
)


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
    served = measure_served_decode(str(server_model_dir), flags, [1, 2], 256)
    assert set(served) == {*SERVED_KEYS, ARRIVAL_KEY, *SUFFIX_KEYS}
    for key in SERVED_KEYS:
        assert set(served[key]) == {1, 2} and all(ms > 0 for ms in served[key].values())
    for b in (1, 2):  # the clients' TPOT holds the step and what passes between steps
        assert served["served_tpot_ms"][b] >= 0.5 * served["served_decode_ms"][b]
    # Two clients of staggered output lengths (the server allows no more): one finishes and sends its
    # next request while the other decodes, and the decode steps during which it arrived are read
    # against the other 1-row steps.
    assert served[ARRIVAL_KEY] and all(isinstance(ms, float) for ms in served[ARRIVAL_KEY])
    # The suffix probe: the server cached each prefix (the warmup request's) and took the later
    # prompts' 8-token suffixes in as query rows alone, steps the records name.
    for key in SUFFIX_KEYS:
        assert set(served[key]) == set(suffix_prefixes(256)) and all(ms > 0 for ms in served[key].values())


def test_a_step_during_which_a_request_arrived_is_read_against_the_other_steps_of_its_rows() -> None:
    """The server's window: each step's start and duration, each request's arrival. A decode step
    during which a request arrived (its client sending it, the server receiving it, on the cores the
    forward uses) is a stall; a step right after a finish during which none arrived is not (clients
    that turn around together)."""
    fields = ["t", *STEP_KEYS, *ROW_STEP_KEYS]  # the window's step rows (kvflow/bench/server_steps.py)
    steps = [
        [10.000, 1.0, 0, 2, 40, 0, 40],
        [10.001, 1.2, 0, 2, 42, 0, 42],
        [10.003, 1.0, 0, 1, 21, 0, 21],  # after a finish (2 -> 1 rows), no arrival: not a stall
        [10.004, 4.5, 0, 1, 22, 0, 22],  # the finished client's next request arrived meanwhile
        [10.009, 9.0, 16, 1, 150, 0, 22],  # its prompt: not a decode step
        [10.018, 1.1, 0, 2, 44, 0, 44],
    ]
    requests = [{"arrival": 10.0055, "handed_off": 10.0085}, {"arrival": 9.9, "handed_off": None}]
    window = {"step_fields": fields, "steps": steps, "requests": requests}
    assert arrival_stall_ms({"server": {"window": window}}) == [pytest.approx(3.5)]
    assert arrival_stall_ms({"server": {}}) == []  # another server: no window
    # A window that kept only its requests (no step times) says nothing either.
    assert arrival_stall_ms({"server": {"window": {"requests": requests}}}) == []


def test_the_client_gap_spread_is_matched_by_request_id_and_centred() -> None:
    requests = [{"x_request_id": f"r{i}", "ttft_ms": ttft} for i, ttft in enumerate([10.0, 12.0, 20.0])]
    requests.append({"x_request_id": "gone", "ttft_ms": 50.0})  # not in the window: skipped
    window = {"requests": [{"x_request_id": f"r{i}", "ttft_ms": 7.0} for i in range(3)]}
    assert client_gap_jitter(requests, {"window": window}) == pytest.approx(
        (-2.0, 0.0, 8.0)
    )  # 3, 5, 13 ms about their median (client_gap: one late client does not move the centre)
    assert client_gap_jitter(requests, {}) == ()  # no window (another server): no spread


def _closed_loop(gaps: list[float], window: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    """A closed-loop bench result of `clients` clients whose requests' client TTFT is the server's
    10 ms plus each of `gaps`, in send order, and the server's window rows `window`."""
    requests = [
        {
            "x_request_id": f"r{i}",
            "ttft_ms": 10.0 + g,
            "send_s": 0.01 * i,
            "prompt_tokens": 8,
            "output_tokens": 4,
        }
        for i, g in enumerate(gaps)
    ]
    return {
        "requests": requests,
        "server": {"window": {"requests": window}},
        "config": {"concurrency": clients},
        "ttft_ms": {"p50": 15.0, "p95": 30.0},
        "tpot_ms": {"p50": 1.0},
        "itl_ms": {"p50": 1.0, "p99": 2.0},
        "output_throughput": 100.0,
    }


def test_a_clients_first_request_opened_its_connection_and_is_kept_apart() -> None:
    """Closed loop, 2 clients: their first requests (the first 2 sent) opened the connections, and
    their client gaps (20 ms) are not what a client takes to come back (4-6 ms): the return gap and
    its jitter come from the later requests, the first gap is kept on its own."""
    gaps = [20.0, 20.0, 4.0, 6.0, 5.0, 5.0]
    result = _closed_loop(gaps, [{"x_request_id": f"r{i}", "ttft_ms": 10.0} for i in range(6)], 2)
    ev = evidence_from_bench(result)
    assert ev.client_return_gap_ms == pytest.approx(5.0) and ev.client_first_gap_ms == pytest.approx(20.0)
    assert ev.client_gap_jitter_ms == pytest.approx((-1.0, 1.0, 0.0, 0.0))
    open_loop = evidence_from_bench({**result, "config": {"request_rate": 4.0}})
    assert open_loop.client_return_gap_ms == pytest.approx(5.5) and open_loop.client_first_gap_ms is None


def test_the_gap_a_predicted_ttft_carries_is_the_median_client_not_a_late_ones_mean() -> None:
    """One returning request in five read its first token 19 ms late (the client's event loop busy);
    the others came back in 3.5-4.0 ms. Their mean, 7.6, was the offset every predicted TTFT carried,
    and put the prefix-caching what-if's 19 ms TTFT at 23.7 (session 44); the median is the typical
    client's, and the jitter about it keeps the late one for the replays."""
    gaps = [30.0, 3.7, 4.0, 4.0, 3.6, 22.9]  # the first opened the connection
    result = _closed_loop(gaps, [{"x_request_id": f"r{i}", "ttft_ms": 10.0} for i in range(6)], 1)
    ev = evidence_from_bench(result)
    assert ev.client_return_gap_ms == pytest.approx(4.0)
    assert ev.client_gap_jitter_ms == pytest.approx((-0.3, 0.0, 0.0, -0.4, 18.9))
    assert ev.client_first_gap_ms is None  # one client's first request: two are needed


def test_a_first_wave_counts_only_the_first_tokens_that_came_alone() -> None:
    """Four clients' first requests: two got their first tokens in one step (stamped 0.01 ms apart),
    the other two alone. Only the lone ones say what a first request paid where the replay adds no
    delivery of its own (Calibration.first_wave_ms); a step's shared first tokens paid for it too."""
    firsts = [1.000, 1.00001, 1.040, 1.080, 1.5, 1.6, 1.7, 1.8]
    window = [{"x_request_id": f"r{i}", "ttft_ms": 10.0, "first_token": t} for i, t in enumerate(firsts)]
    result = _closed_loop([20.0, 16.0, 8.0, 10.0, 5.0, 5.0, 5.0, 5.0], window, 4)
    assert [r["x_request_id"] for r in first_alone(result["requests"][:4], result["server"])] == ["r2", "r3"]
    ev = evidence_from_bench(result)
    assert ev.client_first_gap_ms == pytest.approx(13.0)  # the median of 20, 16, 8, 10
    assert ev.client_first_alone_gap_ms == pytest.approx(9.0)
    # All four together: none counts.
    together = [{**row, "first_token": 1.0} if i < 4 else row for i, row in enumerate(window)]
    merged = evidence_from_bench({**result, "server": {"window": {"requests": together}}})
    assert merged.client_first_alone_gap_ms is None


def test_a_returning_requests_delivery_is_what_its_first_tokens_step_delivered() -> None:
    """Each request's first token is matched to the window's last step that started at or before it
    (a step stamps its outputs before it ends); that step's output_tokens is what the client's read
    of it waited behind. The returning requests' median is what their gap already holds
    (StepCost.delivery_ms); a request outside the window, or before its steps, counts for nothing."""
    fields = ["t", "dur_ms", "output_tokens"]
    steps = [[1.000, 3.0, 4], [1.004, 2.0, 3], [1.007, 2.0, 1], [1.010, 2.0, 2]]
    firsts = [1.0029, 1.0029, 1.0029, 1.0029, 1.0058, 1.0069, 1.0088, 1.0111]
    window = [{"x_request_id": f"r{i}", "ttft_ms": 10.0, "first_token": t} for i, t in enumerate(firsts)]
    result = _closed_loop([8.0] * 8, window, 4)
    result["server"]["window"].update(step_fields=fields, steps=steps)
    later = result["requests"][4:]
    assert first_token_deliveries(later, result["server"]) == [3, 3, 1, 2]
    assert evidence_from_bench(result).client_return_delivered == pytest.approx(2.5)
    before = {**result["server"]["window"], "requests": [{"x_request_id": "r0", "first_token": 0.5}]}
    assert first_token_deliveries([{"x_request_id": "r9"}, {"x_request_id": "r0"}], {"window": before}) == []
    # Without the steps (another server, or a window that kept only its requests): not known.
    plain = _closed_loop([8.0] * 8, window, 4)
    assert first_token_deliveries(later, plain["server"]) == []
    assert evidence_from_bench(plain).client_return_delivered is None
    # A window without first tokens (an older server's): the recorded prompt steps' decode rows
    # plus their one first token, the median over them; decode-only steps say nothing.
    rows = [[9.0, 48, 2], [3.0, 0, 3], [9.0, 48, 3], [9.5, 96, 3], [2.0, 0, 4]]
    plain["server"]["steps"] = {"fields": ["dur_ms", "prefill_tokens", "decode_tokens"], "rows": rows}
    assert evidence_from_bench(plain).client_return_delivered == 4.0


def test_each_requests_handoff_is_its_handlers_time_before_the_engine_queue() -> None:
    window = {
        "requests": [
            {"arrival": 10.0, "handed_off": 10.0035, "added": 10.0041},
            {"arrival": 10.001, "handed_off": 10.0083, "added": 10.0112},  # the step in progress after
            {"arrival": 11.0, "handed_off": None, "added": None},  # still in its handler
            {"arrival": 12.0},  # a server that does not report it
        ]
    }
    assert handoff_delays({"window": window}) == pytest.approx((3.5, 7.3))
    assert handoff_delays({}) == ()  # no window (another server): scheduled at arrival


def test_each_value_is_the_median_over_sweeps_of_other_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sweep's 4-row step read 3.41 ms where the one before read 2.34 (the VM slowed for a second
    or two) and every prediction from that profile carried it: each b is probed once per sweep,
    sweeps one after another, and the median kept; each sweep sends other prompts (a prompt the
    server saw would be a prefix-cache hit)."""
    seeds: list[tuple[int, int]] = []
    arrivals: list[tuple[int, int]] = []
    # Every other sweep on a slow moment (x1.5 and more), the rest at or below speed; the first at
    # x1.1, the middle value of an odd number of sweeps.
    assert SERVED_SWEEPS % 2 == 1
    slow_sweep = {
        s: 1.1 if s == 0 else 1.5 + 0.1 * s if s % 2 else 1.0 - 0.01 * s for s in range(SERVED_SWEEPS)
    }

    def bench(config: BenchConfig) -> dict[str, Any]:
        b, sweep = config.load.concurrency or 0, config.load.seed
        if config.dataset.range_ratio:  # the arrival probe
            arrivals.append((b, sweep))
            return {}
        seeds.append((b, sweep))
        step = b * slow_sweep[sweep]
        rows = [[step, 0, b, 10.0 * b]] * 3
        steps = {"fields": ["dur_ms", "prefill_tokens", "decode_tokens", "attention"], "rows": rows}
        server = {"steps": steps, "client_minus_server_ttft_ms": 3.0}
        return {"tpot_ms": {"p50": step + 0.5}, "server": server}

    monkeypatch.setattr(served_decode, "SERVED_SWEEPS", SERVED_SWEEPS)  # tests/conftest.py sets 1
    monkeypatch.setattr(served_decode, "spawn_server", lambda model, flags: (None, "http://127.0.0.1:1"))
    monkeypatch.setattr(served_decode, "stop_server", lambda process: None)
    monkeypatch.setattr(served_decode, "run_benchmark", bench)
    served = measure_served_decode("m", [], [1, 4])
    assert sorted(seeds) == [(b, s) for b in (1, 4) for s in range(SERVED_SWEEPS)]
    assert arrivals == [(b, s) for s in range(SERVED_SWEEPS) for b in (2, 4)]  # after each sweep
    assert served["served_decode_ms"] == {1: pytest.approx(1.1), 4: pytest.approx(4.4)}  # the middle sweep
    assert served["served_tpot_ms"][4] == pytest.approx(4.9) and served["served_ttft_gap_ms"][1] == 3.0


def test_the_suffix_probe_caches_prefixes_of_a_quarter_and_three_quarters_of_the_context() -> None:
    # Room for the 8-token suffix and its 8 outputs, whole blocks.
    assert suffix_prefixes(1024) == [240, 752]
    assert suffix_prefixes(256) == [48, 176]
    assert suffix_prefixes(24) == []  # no room for a prefix of a block


def test_a_suffix_step_takes_in_query_rows_and_nothing_else() -> None:
    fields = [*STEP_KEYS, *ROW_STEP_KEYS]
    rows = [
        [60.0, 776, 0, 300_000.0, 0, 0.0],  # the prefix's prefill (the warmup request)
        [14.5, 8, 0, 6_180.0, 8, 6_180.0],  # a suffix alone: 8 query rows
        [15.1, 8, 1, 6_960.0, 8, 6_960.0],  # a suffix beside a decode: not alone
        [30.0, 24, 0, 9_000.0, 0, 0.0],  # a prefill chunk
        [7.9, 0, 1, 780.0, 0, 780.0],  # 1-row decodes
        [7.7, 0, 1, 781.0, 0, 781.0],
        [9.0, 0, 2, 1_560.0, 0, 1_560.0],  # 2 rows: not the probe's decode step
    ]
    result = {"server": {"steps": {"fields": fields, "rows": rows}}}
    assert suffix_steps(result) == [14.5]
    assert decode_step_ms(result, 1) == pytest.approx(7.8)  # the probe's 1-row decode: 7.9 and 7.7
    older = {"server": {"steps": {"fields": list(STEP_KEYS), "rows": [r[:4] for r in rows]}}}
    assert suffix_steps(older) == []  # a server that does not split the query rows out


def test_the_suffix_probe_keeps_each_prefixs_medians_over_sweeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the server's context the served probe also sends one client prompts of a cached prefix and
    an 8-token suffix, at two prefix lengths, another prefix each sweep; each length's suffix step and
    1-row decode step, the median over sweeps (StepProfile.suffix_ratio reads their ratio)."""
    probed: list[tuple[int, int, int]] = []

    def bench(config: BenchConfig) -> dict[str, Any]:
        data = config.dataset
        if data.name == "shared-prefix":
            assert (data.input_len, config.load.concurrency, config.warmup) == (8, 1, 1)
            probed.append((data.prefix_len, data.seed, config.load.seed))
            sweep = config.load.seed
            suffix = 10.0 + data.prefix_len / 100 + sweep  # slower each sweep: the median is the middle
            rows = [[suffix, 8, 0, 0.0, 8, 0.0], [7.0 + sweep, 0, 1, 0.0, 0, 0.0]]
            return {"server": {"steps": {"fields": [*STEP_KEYS, *ROW_STEP_KEYS], "rows": rows}}}
        return {}

    monkeypatch.setattr(served_decode, "SERVED_SWEEPS", 3)
    monkeypatch.setattr(served_decode, "spawn_server", lambda model, flags: (None, "http://127.0.0.1:1"))
    monkeypatch.setattr(served_decode, "stop_server", lambda process: None)
    monkeypatch.setattr(served_decode, "run_benchmark", bench)
    served = measure_served_decode("m", [], [1], 256)
    assert [(n, s) for n, _, s in probed] == [(n, s) for s in range(3) for n in (48, 176)]
    assert len({seed for _, seed, _ in probed}) == 3  # another prefix each sweep
    assert served["served_suffix_ms"] == {48: pytest.approx(11.48), 176: pytest.approx(12.76)}
    assert served["served_suffix_decode_ms"] == {48: 8.0, 176: 8.0}
    # Without the context (a caller that does not ask for it): no suffix probe, no keys.
    probed.clear()
    assert "served_suffix_ms" not in measure_served_decode("m", [], [1])
    assert probed == []

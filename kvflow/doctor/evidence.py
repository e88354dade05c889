"""The measured side of the diagnosis: numbers taken from a `kvflow bench` result (client side, the
server's /metrics view of the run, every request's lengths and times), or, in calculator mode, the
planned workload of `--context` / `--concurrency` alone."""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any

from kvflow.bench.metrics import percentile
from kvflow.server.dashboard.request_story import TIME_TOLERANCE_S

# First tokens this close (s) came from one step: a step stamps its requests' outputs within 0.01 ms
# of each other on the planted runs, and the tiny model's fastest steps take 0.6 ms.
FIRST_TOKENS_TOGETHER_S = 0.5e-3


@dataclass(frozen=True)
class RequestSample:
    """One measured request, as the simulator and the prefill estimate need it."""

    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int  # leading tokens an earlier request of the run already sent
    send_s: float  # seconds after the run's first send
    ttft_ms: float | None
    e2e_ms: float | None
    itl_ms: tuple[float, ...] = ()  # its per-token gaps
    tpot_ms: float | None = None  # (e2e - ttft) / (output tokens - 1)


@dataclass
class RunEvidence:
    """Numbers from one benchmark run (client side, plus the server's /metrics deltas)."""

    num_requests: int
    concurrency: float  # closed-loop concurrency, or requests in flight estimated by Little's law
    prompt_p50: float
    prompt_p95: float
    output_p50: float
    output_p95: float
    shared_prefix_share: float | None  # repeated leading prompt tokens / prompt tokens
    shared_prefix_p50: float | None  # repeated leading tokens per request (p50)
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    output_throughput: float
    server: dict[str, Any] = field(default_factory=dict)
    languages: dict[str, dict[str, float]] = field(default_factory=dict)
    endpoint: str = "completions"
    config: dict[str, Any] = field(default_factory=dict)
    e2e_p50_ms: float | None = None
    requests: list[RequestSample] = field(default_factory=list)
    closed_loop: bool = True
    itl_gaps_ms: list[float] = field(default_factory=list)  # every per-token gap of every request
    # kvflow bench --priority-mix: TTFT p50 / p99 (ms) per priority class, lowest value (first served) first
    ttft_by_priority: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    # Each request's client TTFT beyond the server's (a kvflow server's window names its requests),
    # less their median: how unevenly clients' requests reach the server (client_gap_jitter). In a
    # closed loop, over the requests a client sent after its first, and their median the gap a client
    # takes to come back (client_return_gap_ms; None: not known, the run's mean gap stands for it).
    client_gap_jitter_ms: tuple[float, ...] = ()
    client_return_gap_ms: float | None = None
    # The same over each client's first request (None: not a closed loop, or not known).
    client_first_gap_ms: float | None = None
    # ... over those of them whose first token no other request's shared a step with (first_alone):
    # what the first requests paid where the replay adds no delivery of its own (None: fewer than two).
    client_first_alone_gap_ms: float | None = None
    # How many tokens the step that produced a returning request's first token delivered (the median
    # over them, its output_tokens: other first tokens and decodes): what the returning gap above
    # already holds of the delivery (StepCost.delivery_ms). None: no window's steps.
    client_return_delivered: float | None = None
    # Each request's HTTP handoff on a kvflow server: from its arrival (the handler's start, where
    # the server's TTFT starts) to the engine taking it in (handoff_delays).
    handoff_ms: tuple[float, ...] = ()

    @property
    def measured(self) -> bool:
        return self.num_requests > 0

    def metric(self, name: str) -> float | None:
        """The run's value of a what-if's latency metric (decode_ms_per_step: TPOT p50), or None."""
        return {
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p95_ms": self.ttft_p95_ms,
            "itl_p99_ms": self.itl_p99_ms,
            "decode_ms_per_step": self.tpot_p50_ms,
            "e2e_p50_ms": self.e2e_p50_ms,
        }.get(name)

    @property
    def request_len_p95(self) -> float:
        return self.prompt_p95 + self.output_p95

    @property
    def decode_context(self) -> float:
        """Mean context of a decode step: the prompt plus half the output, at the median request."""
        return self.prompt_p50 + self.output_p50 / 2

    def not_exported(self, field_name: str) -> bool:
        """True when the server's /metrics lacks this field of the server view (or has no /metrics)."""
        return field_name in (self.server.get("not_exported") or ()) or not self.server

    @property
    def queue_ms(self) -> float | None:
        return (self.server.get("queue_time_ms") or {}).get("mean")

    @property
    def grammar_compile_ms(self) -> float | None:
        """Mean wait of structured-output requests for their grammar (kvflow only; None without)."""
        return (self.server.get("grammar_compile_ms") or {}).get("mean")

    @property
    def prefill_ms(self) -> float | None:
        return (self.server.get("prefill_time_ms") or {}).get("mean")

    def step_time_ms(self, kind: str) -> float | None:
        """The server's mean engine step time over the run, for one kind of step (decode_only, mixed,
        prefill_only); None when the server does not export it (only kvflow does)."""
        return ((self.server.get("step_time_ms") or {}).get(kind) or {}).get("mean")

    def step_count(self, kind: str) -> float:
        return float(((self.server.get("step_time_ms") or {}).get(kind) or {}).get("count") or 0.0)

    def gauge(self, name: str, stat: str = "max") -> float | None:
        """A gauge sampled during the run (running, waiting, kv_usage): its max or mean."""
        value = ((self.server.get("gauges") or {}).get(name) or {}).get(stat)
        return None if value is None else float(value)

    def counter(self, name: str) -> float | None:
        value = self.server.get(name)
        return None if value is None else float(value)

    @property
    def preemptions(self) -> float | None:
        return self.counter("num_preemptions")

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.counter("prefix_cache_hit_rate")

    def prefill_busy_ms_per_token(self) -> float | None:
        """Prefill cost per prompt token from the client's clock alone, for servers that export no
        step times: the time during which at least one request waited for its first token (the union
        of the [send, first token] intervals), over the prompt tokens of the run. Dividing one
        request's TTFT by its own length instead is wrong under concurrency, where a server prefills
        several prompts in one batch (llama-server: 4 slots -> about 4x too slow)."""
        spans = sorted((r.send_s, r.send_s + r.ttft_ms / 1e3) for r in self.requests if r.ttft_ms is not None)
        tokens = sum(r.prompt_tokens - r.shared_prefix_tokens for r in self.requests if r.ttft_ms is not None)
        if not spans or tokens <= 0:
            return None
        busy, end = 0.0, float("-inf")
        for start, stop in spans:
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        return 1e3 * busy / tokens


def _p(values: list[float], q: float) -> float:
    return percentile(values, q) if values else 0.0


def _request_samples(ok: list[dict[str, Any]]) -> list[RequestSample]:
    return [
        RequestSample(
            prompt_tokens=int(r["prompt_tokens"]),
            output_tokens=int(r["output_tokens"]),
            shared_prefix_tokens=int(r.get("shared_prefix_tokens") or 0),
            send_s=float(r.get("send_s") or 0.0),
            ttft_ms=r.get("ttft_ms"),
            e2e_ms=r.get("e2e_ms"),
            itl_ms=tuple(float(g) for g in r.get("itl_ms") or ()),
            tpot_ms=r.get("tpot_ms"),
        )
        for r in sorted(ok, key=lambda r: r.get("send_s") or 0.0)
    ]


def evidence_from_bench(result: dict[str, Any]) -> RunEvidence:
    ok = [r for r in result["requests"] if r.get("error") is None]
    if not ok:
        raise ValueError("the benchmark result has no successful request to diagnose")
    prompts = [float(r["prompt_tokens"]) for r in ok]
    outputs = [float(r["output_tokens"]) for r in ok]
    shared = [r.get("shared_prefix_tokens") for r in ok]
    known = [float(s) for s in shared if s is not None]
    share = sum(known) / max(sum(prompts), 1.0) if len(known) == len(ok) else None
    config = result.get("config", {})
    tpot = result["tpot_ms"]["p50"]
    concurrency = config.get("concurrency")
    closed_loop = concurrency is not None
    # A closed loop's clients each open their connection with their first request, all at once: those
    # requests' client gaps were 2-4x the later ones' on the planted runs (20 ms against 4-6 on
    # kv_pool, 11 against 2.4-4 on max_num_seqs), and drawn for a client's return they spread the
    # simulated clients apart where the real ones came back together (session 29).
    by_send = sorted(ok, key=lambda r: r.get("send_s") or 0.0)
    returning = (
        by_send[int(concurrency) :] if closed_loop and len(by_send) > int(concurrency) + 1 else by_send
    )
    firsts = by_send[: len(by_send) - len(returning)]  # each client's first request (closed loop)
    server = result.get("server") or {}
    if concurrency is None and tpot:  # open loop: Little's law, tokens/s x s/token = streams in flight
        concurrency = result["output_throughput"] * tpot / 1e3
    return RunEvidence(
        num_requests=len(ok),
        concurrency=float(concurrency or 1.0),
        prompt_p50=_p(prompts, 50),
        prompt_p95=_p(prompts, 95),
        output_p50=_p(outputs, 50),
        output_p95=_p(outputs, 95),
        shared_prefix_share=share,
        shared_prefix_p50=_p(known, 50) if share is not None else None,
        ttft_p50_ms=result["ttft_ms"]["p50"],
        ttft_p95_ms=result["ttft_ms"]["p95"],
        tpot_p50_ms=tpot,
        itl_p50_ms=result["itl_ms"]["p50"],
        itl_p99_ms=result["itl_ms"]["p99"],
        output_throughput=float(result["output_throughput"]),
        server=server,
        languages=result.get("languages") or {},
        endpoint=str(config.get("endpoint", "completions")),
        config=config,
        e2e_p50_ms=(result.get("e2e_ms") or {}).get("p50"),
        requests=_request_samples(ok),
        closed_loop=closed_loop,
        itl_gaps_ms=[float(g) for r in ok for g in r.get("itl_ms") or ()],
        ttft_by_priority={
            int(p): (row["ttft_ms"]["p50"], row["ttft_ms"]["p99"])
            for p, row in sorted((result.get("per_priority") or {}).items(), key=lambda kv: int(kv[0]))
        },
        client_gap_jitter_ms=client_gap_jitter(returning, server),
        client_return_gap_ms=client_gap(returning, server),
        client_first_gap_ms=client_gap(firsts, server),
        client_first_alone_gap_ms=client_gap(first_alone(firsts, server), server),
        client_return_delivered=returning_delivered(returning, server),
        handoff_ms=handoff_delays(server),
    )


def handoff_delays(server: dict[str, Any]) -> tuple[float, ...]:
    """Each request's HTTP handoff on a kvflow server (ms): from its arrival to its handler queueing
    it for the engine thread (the window's `handed_off` - `arrival`); empty without a window, or
    from a server that does not report it.
    Why: the handler parses and tokenizes a request before the engine can schedule it, on the
    server's one process, so more slowly while the engine's steps hold the GIL. With a slot free,
    the planted max_num_seqs 8 server's requests reached the engine 1.2-7.2 ms after they arrived
    (median 5.6) and were scheduled 0.2 ms at most after that; the simulator had them scheduled at
    arrival, and predicted a TTFT of 15 ms where 19-23 were measured (benchmarks/NOTES.md, session
    29). The rest, from handed off to taken in (`added`), is the step in progress the engine finishes
    first, which the simulator has of its own: counted in the handoff it was counted twice."""
    rows = (server.get("window") or {}).get("requests") or []
    return tuple(
        1e3 * max(float(row["handed_off"]) - float(row["arrival"]), 0.0)
        for row in rows
        if row.get("handed_off") is not None and row.get("arrival") is not None
    )


def _client_gaps(requests: list[dict[str, Any]], server: dict[str, Any]) -> list[float]:
    """Each request's client TTFT minus the server's, matched by the x-request-id kvflow bench sends
    in the server's window (kvflow/bench/server_steps.py); empty without a window."""
    rows = (server.get("window") or {}).get("requests") or []
    by_id = {row.get("x_request_id"): row.get("ttft_ms") for row in rows if row.get("x_request_id")}
    return [
        float(r["ttft_ms"]) - float(by_id[r["x_request_id"]])
        for r in requests
        if r.get("ttft_ms") is not None and by_id.get(r.get("x_request_id")) is not None
    ]


def first_alone(requests: list[dict[str, Any]], server: dict[str, Any]) -> list[dict[str, Any]]:
    """Those of `requests` whose first token no other request of the server's window got in the same
    step (first tokens FIRST_TOKENS_TOGETHER_S apart or more); none without a window.

    Why: a first wave whose first tokens came together paid for more than its connections. The
    planted kv_pool run's four first prompts are admitted in one step, the starved pool's
    preemptions follow, and its clients read those first tokens 9-23 ms after the server sent them
    (2.6-4.5 on their later requests); the 35-block change's first waves paid 4-8 (session 38). Taken
    as the first wave's own extra, that put the change's TTFT p50 10-40% high."""
    firsts = _first_tokens(server)
    stamps = sorted(float(t) for t in firsts.values() if t is not None)
    alone = []
    for r in requests:
        t = firsts.get(r.get("x_request_id"))
        if t is None:
            continue
        i = bisect_left(stamps, float(t))  # stamps[i] is its own (or one equal to it)
        neighbours = [stamps[j] for j in (i - 1, i + 1) if 0 <= j < len(stamps)]
        if all(abs(n - float(t)) >= FIRST_TOKENS_TOGETHER_S for n in neighbours):
            alone.append(r)
    return alone


def first_token_deliveries(requests: list[dict[str, Any]], server: dict[str, Any]) -> list[float]:
    """For each of `requests` the server's window names, the tokens its first token's step delivered
    (the last window step that started at or before its first token: a step stamps its outputs
    before it ends; both are rounded to the microsecond); empty without the window's steps.

    Why: a client reads a token later the more its step delivered (the API thread writes them one
    after another; kvflow/doctor/served_decode.py measures the growth), and a run's measured client
    gap holds the delivery its own steps had. The planted kv_pool run's returning requests read
    their first tokens from 3-token steps at 3.2 ms beyond the server; the replay of its 35-block
    change added the probe's whole growth to 4 tokens over 1 on top, a returning gap of 6.3 ms
    where 4.2-5.7 were measured (session 39)."""
    window = server.get("window") or {}
    fields = list(window.get("step_fields") or ())
    if "t" not in fields or "output_tokens" not in fields:
        return []
    t_at, out_at = fields.index("t"), fields.index("output_tokens")
    steps = sorted((float(s[t_at]), float(s[out_at])) for s in window.get("steps") or ())
    starts = [t for t, _ in steps]
    firsts = _first_tokens(server)
    delivered = []
    for r in requests:
        t = firsts.get(r.get("x_request_id"))
        i = -1 if t is None else bisect_right(starts, float(t) + TIME_TOLERANCE_S) - 1
        if i >= 0:
            delivered.append(steps[i][1])
    return delivered


def returning_delivered(requests: list[dict[str, Any]], server: dict[str, Any]) -> float | None:
    """The median of `requests`' first_token_deliveries; from a window without first tokens or the
    steps' outputs (a server of session 29's), the median over the server's recorded steps with
    prompt tokens of their decode rows plus the one first token; None without either.

    Why the fallback: a first token comes from a step with prompt tokens, beside the decodes running
    then. On six planted runs it reads what matching does on five (prefill_chunks 4, the one-slot
    max_num_seqs 1, ...) and 2 for kv_pool's 3 (its recomputes after preemption are prompt steps
    too); without a count, the replays had added the probe's whole growth from a lone token to every
    run's own deliveries, and a recorded 8-client run's TTFT p50 came out 50% high (session 39)."""
    delivered = first_token_deliveries(requests, server)
    if not delivered:
        delivered = [rows + 1.0 for _, prompt, rows in recorded_steps(server) if prompt]
    return statistics.median(delivered) if delivered else None


def _first_tokens(server: dict[str, Any]) -> dict[Any, Any]:
    """Each request of the server's window by its x-request-id: when its first token came (None:
    not recorded); empty without a window."""
    rows = (server.get("window") or {}).get("requests") or []
    return {row["x_request_id"]: row.get("first_token") for row in rows if row.get("x_request_id")}


def recorded_steps(server: dict[str, Any]) -> list[tuple[float, bool, int]]:
    """The server's recorded steps in the order they ran, (dur_ms, had prompt tokens, decode rows)
    (kvflow/bench/server_steps.py); none from a server section without them."""
    recorded = server.get("steps") or {}
    fields = list(recorded.get("fields") or [])
    if "dur_ms" not in fields or "prefill_tokens" not in fields or "decode_tokens" not in fields:
        return []
    dur, prompt, decode = (fields.index(k) for k in ("dur_ms", "prefill_tokens", "decode_tokens"))
    return [(row[dur], bool(row[prompt]), int(row[decode])) for row in recorded.get("rows") or []]


def client_gap(requests: list[dict[str, Any]], server: dict[str, Any]) -> float | None:
    """The median of `requests`' client gaps (_client_gaps), never below 0; None without two.

    Why the median: the gap is the offset a predicted TTFT p50 or e2e p50 carries (calibrate.py), and
    one request in twenty reads its first token 10-20 ms late beyond the server's TTFT (on a
    2-core Xeon, 3 of 60 in the planted prefix_caching_off scenario's runs, against 3-4.5 ms for the
    rest). Over one run's five returning requests the mean read 7.6 ms where four came back in
    3.6-4.0: 3.6 ms more on every predicted TTFT, on a what-if whose TTFT is 19 ms (prefix caching
    on; benchmarks/NOTES.md, session 44). The spread is the jitter's (client_gap_jitter), so the
    replays keep the late ones."""
    gaps = _client_gaps(requests, server)
    return max(statistics.median(gaps), 0.0) if len(gaps) >= 2 else None


def client_gap_jitter(requests: list[dict[str, Any]], server: dict[str, Any]) -> tuple[float, ...]:
    """Each request's client TTFT minus the server's (matched by the x-request-id kvflow bench sends,
    in the server's window, kvflow/bench/server_steps.py), less their median (client_gap: a client
    returning after the gap plus a drawn departure comes back as one of them did); empty without a
    window.
    Why: clients of a closed loop whose requests have one length finish in one step and, sent back
    after one constant gap, the simulator kept them in lockstep, every prompt in one prefill step and
    none sharing a step with another's decodes; measured, a client comes back 3-13 ms later, the
    prompts land in different steps and stall the decodes (the kv_pool what-if's ITL p99 predicted
    1.9 ms where 5.0 were measured; benchmarks/NOTES.md, session 26)."""
    gaps = _client_gaps(requests, server)
    if len(gaps) < 2:
        return ()
    center = statistics.median(gaps)
    return tuple(g - center for g in gaps)


def calculator_evidence(context: int, concurrency: int, output_len: int) -> RunEvidence:
    """No benchmark: a planned workload of `context` prompt tokens and `output_len` output tokens."""
    return RunEvidence(
        num_requests=0,
        concurrency=float(concurrency),
        prompt_p50=float(context),
        prompt_p95=float(context),
        output_p50=float(output_len),
        output_p95=float(output_len),
        shared_prefix_share=None,
        shared_prefix_p50=None,
        ttft_p50_ms=None,
        ttft_p95_ms=None,
        tpot_p50_ms=None,
        itl_p50_ms=None,
        itl_p99_ms=None,
        output_throughput=0.0,
    )

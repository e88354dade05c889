"""What one engine step costs, as a function of what it computes:

    step_ms = fixed + overhead + per_token x (decode rows + prefill tokens + ratio x attention work)
    attention work = sum over the step's prompt chunks and decode rows of tokens x the keys they see

A decode row and a prompt token each pass once through every matmul: one per-token cost for both.
`overhead` is what passes between steps (the engine loop, handing tokens to the HTTP side): not in
the server's step times, but in the cadence its clients see, so it is fitted to the client's
median gap (ITL p50: calibrate._overhead_ms).
`attention_ratio` is the model's attention FLOPs per (query token x key) over its linear FLOPs per
token, (4 x layers x q_heads x head_dim) / (2 x layer params), so a long context costs what its
QK^T and PV cost next to the matmuls. `fixed` and `per_token` are fitted to the server's measured
step times by kind (kvflow's engine_step_time_seconds{step_kind}) in kvflow/doctor/calibrate.py.

(A separate fixed cost for steps that carry a prompt chunk, and a separate cost per decode row, were
tried: fitted to three step means, one of them often from a single step, they came out unstable
and predicted chunk-size changes worse than the two coefficients above.)

With a measured step profile (kvflow/doctor/step_profile.py) the shape of the cost comes from the
profile's curves instead, and only a constant per step kind is fitted (what the server adds to the
profiled engine's step):

    query rows only      step_ms = D(rows) + extra + overhead
    with a prefill chunk step_ms = P(tokens + rows) x factor + constant + overhead
    either               + per_key x (keys a prefill chunk attended beyond the probe's: a chunk
                                       after a long context)
                         + row_per_key x (keys the query rows read beyond the decode probe's)
                         + served_growth(rows): what the server adds to a step of that many rows
                                       beyond a 1-row one (the served probe, step_profile.py)
Query rows are the decodes and the prompt chunks of at most MAX_QUERY_ROWS_PER_CHUNK tokens, which
the engine attends as single-token rows through the decode path (kvflow/query_rows.py): an 8-token
suffix after 768 cached tokens is 8 decode rows that each re-read ~770 keys, not a small prompt
chunk. A row's cost per key is measured by the profile (a decode at a long context); a prefill
chunk's per key beyond its probe is fitted to the server's step records.
A step whose prompt chunks are all query rows is priced as the decode step it runs (the server
counts it a prompt step): the decode kind's extra, and the served growth of its rows, not of the
tokens it delivers (one). Over the prefix-caching what-if's changed runs of six verify runs (30
servers, 2-core Zen 4, session 43) such 8-row steps took a median 1.18x (1.05-1.33) the profiled
step at the run's own speed, 3.3 ms more, and a served 8-row decode step (the served probe's 1-row
excess and its growth to 8 rows, 2.6 ms at the profile's speed) is 1.17x the profiled one. Priced
with the prompt kind's factor instead (fitted to 264- and 512-token chunks, 0.9-1.07) they came out
20-25% low, and the what-if's TTFT predicted again 9-21% low in five verify runs (-9% to +14% priced
as decode steps, median -6%).
On a 2-core Xeon with AMX that pricing put such steps 1.28x what they took (18.6 ms, 14.0-15.9
measured), the what-if's TTFT 22-36% high: the decode kind's served excess there is 4 ms (the API
thread streams the previous token while a decode step runs), where a suffix step of a request that
just arrived follows no delivery and was 1.5-2 ms beyond the engine's own; and the profile's rows
(of as many requests) priced one request's 8 rows after 768 cached tokens at 10.0 ms where the
engine alone took 12.6-13.8. So where the profile has the served suffix probe
(kvflow/doctor/served_decode.py), a step of prompt query rows alone (StepShape.suffix_only) is the
calibrated 1-row decode step at its context x the probe's suffix step over its 1-row decode step at
that context, measured together on one server (StepProfile.suffix_over_decode): the run's speed
and the decode steps' excess come from the run's own decode steps, and the ratio from the probe
(benchmarks/NOTES.md, session 44). A step that holds decode rows too keeps the decode-path price.
A decode step's excess on the server is per-step work (1.3 ms on the planted runs for a 0.5 ms
forward, about the same at 8 rows), while a step with prompts grows with them (its first tokens, and
the compute the benchmark's client contends for): an added constant fitted to 1-prompt steps put an
8-prompt step at half its measured time, a factor put it within 5% (benchmarks/NOTES.md, session 23).
With the server's own step records (kvflow bench keeps them from a kvflow server) the factor and the
constant of prompt steps are fitted together over those steps; where the steps are all of one shape
the profile is held as the compute and the constant fitted (calibrate.PROMPT_FITS: since the served
probe prices the rows a step delivers and the first tokens it sends, what is left of a prompt
step's excess is about the same at any size, session 28); from the per-kind means alone, the factor
only.

The fitted cost is each step's mean. A server's steps also vary around it (the engine thread
contends for the GIL and the cores with HTTP bursts, scrapes and, on one machine, the benchmark's
client), and tail latencies (ITL p99) are made of those few long steps, so with step records the
simulator adds to each step a departure drawn from the recorded ones (`residuals`, a bootstrap of
the measured run's own variation).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvflow.doctor.step_profile import StepProfile
from kvflow.query_rows import is_query_row_chunk

MIN_STEP_MS = 0.01  # a fitted constant never makes a step free
# Fewer recorded steps of a kind: fit it from the per-kind mean instead, draw no residuals for it, and
# take the profile's arrival probe for the stalls (kvflow/doctor/calibrate.py, prompt_stalls.py).
MIN_STEP_RECORDS = 8


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes, split by how the engine attends it (kvflow/query_rows.py):
    single-token query rows (the decodes, and prompt chunks of at most MAX_QUERY_ROWS_PER_CHUNK
    tokens), each re-reading its context, and prefill chunks, attended in one call each."""

    decode_rows: int = 0
    row_prefill_tokens: int = 0  # prompt tokens attended as query rows
    prefill_tokens: int = 0  # prompt tokens in prefill chunks
    row_attention: float = 0.0  # keys the query rows read
    prefill_attention: float = 0.0  # keys the prefill chunks' queries attended

    @property
    def rows(self) -> int:
        return self.decode_rows + self.row_prefill_tokens

    @property
    def decode_path(self) -> bool:
        """Whether the engine runs this step as a decode step: query rows alone, no prefill chunk
        (the server counts a short prompt chunk's step a prompt step all the same)."""
        return not self.prefill_tokens

    @property
    def suffix_only(self) -> bool:
        """Prompt query rows alone (short chunks after a cached prefix, nothing decoding): priced off
        the decode step at their context where the profile measured such steps served (module
        docstring)."""
        return self.decode_path and self.row_prefill_tokens > 0 and not self.decode_rows

    @property
    def prompt_tokens(self) -> int:
        """The tokens the server counts as prompt (its step kind): prompt chunks of either path."""
        return self.row_prefill_tokens + self.prefill_tokens

    @property
    def attention(self) -> float:
        return self.row_attention + self.prefill_attention

    def plus_chunk(self, num_tokens: int, context_end: int, decode: bool = False) -> StepShape:
        """This step with one more request's chunk of `num_tokens` ending at `context_end` (a
        decode: its one pending token)."""
        keys = attention_work(num_tokens, context_end)
        if decode:
            rows, row_keys = self.decode_rows + num_tokens, self.row_attention + keys
            return replace(self, decode_rows=rows, row_attention=row_keys)
        if is_query_row_chunk(num_tokens):
            tokens, row_keys = self.row_prefill_tokens + num_tokens, self.row_attention + keys
            return replace(self, row_prefill_tokens=tokens, row_attention=row_keys)
        tokens, prefill_keys = self.prefill_tokens + num_tokens, self.prefill_attention + keys
        return replace(self, prefill_tokens=tokens, prefill_attention=prefill_keys)

    @classmethod
    def from_record(cls, row: list[float]) -> StepShape:
        """A recorded step, [dur_ms, prefill_tokens, decode_tokens, attention, row_prefill_tokens,
        row_attention] (kvflow/bench/server_steps.py). A record from a server that did not split the
        rows out (decode rows and no row keys) puts a decode-only step's keys on its rows and a
        prompt step's on its prefill, as the single attention term did."""
        tokens, rows, attention = int(row[1]), int(row[2]), row[3]
        row_tokens, row_keys = (int(row[4]), row[5]) if len(row) >= 6 else (0, 0.0)
        if row_keys == 0 and rows + row_tokens > 0:
            row_keys = 0.0 if tokens else attention
        return cls(rows, row_tokens, tokens - row_tokens, row_keys, max(attention - row_keys, 0.0))


@dataclass(frozen=True)
class StepResiduals:
    """The recorded steps' departures from the fitted cost, by kind (calibrate.step_residuals).

    A client sending its next request and the server receiving it take the cores from the engine,
    and the step in flight makes no progress until the request has arrived
    (kvflow/doctor/arrival_stalls.py): on the planted runs the decode steps during which a request
    arrived took 3.1 ms (median) more than the others, and they were the runs' longest decode steps.
    Drawn from the other steps' departures, a replay had put those stalls on any step, and its ITL
    p99 came out 20-33% above the measured (session 30); drawn for every step after a finish
    (sessions 30-31), it put them also where the finished clients' next requests arrived after
    every other request had finished too (clients turning around together: the engine idle), and
    the kv_pool what-if's ITL p99 came out 19-67% high (session 32)."""

    decode: tuple[float, ...] = ()  # ms, centred on zero: decode-only steps
    prompt: tuple[float, ...] = ()  # fractions of the step, centred on zero: steps with prompt tokens
    # ms the engine stalls before an arrival (simulate.py: a request draws one): a decode-only step
    # during which a request arrived, over the other decode steps' centre
    arrival: tuple[float, ...] = ()
    # ms a step with prompt tokens takes longer when a request arrives during it (its drawn
    # fraction was measured without it: kvflow/doctor/prompt_stalls.py)
    prompt_arrival: float = 0.0


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float  # scheduling, the forward's per-step overhead, sampling and outputs of a step
    per_token_ms: float  # one more decode row or prompt token (and per unit of attention work)
    attention_ratio: float  # attention work per (token x key) in token units
    overhead_ms: float = 0.0  # between steps: engine loop, output delivery
    profile: StepProfile | None = None  # measured curves: the shape of the cost (module docstring)
    # With a profile (calibrate.py): (added to a decode-only step, the factor on a step with prompt
    # tokens, added to a step with prompt tokens).
    kind_extra_ms: tuple[float, float, float] = (0.0, 1.0, 0.0)
    # With a profile: ms per attended key beyond what the profile's probe of the same shape attended.
    attention_ms_per_key: float = 0.0
    # What the server's recorded steps took beyond this cost (calibrate.step_residuals). Each
    # simulated step draws one, so the simulated steps vary as the recorded ones did. Empty: every
    # step costs its mean.
    residuals: StepResiduals = StepResiduals()
    # Every step's server time x this: the same steps on a share of the cores (a what-if that splits
    # the machine, kvflow/doctor/disaggregation.py). 1: the measured server.
    scale: float = 1.0
    # The diagnosed run's clients' TTFT beyond the server's (calibrate.py: the prediction's offset)
    # and the tokens delivered with the first tokens it was measured on (evidence: returning
    # requests' client_return_delivered): delivery_ms adds the growth beyond that delivery.
    client_gap_ms: float = 0.0
    gap_delivered: float = 1.0

    def on_half_cores(self, slowdown: float) -> StepCost:
        """This cost for one instance of a machine split in two: the profile's curves measured on
        half the cores when it has them, else every step x `slowdown` (a ratio measured elsewhere)."""
        half = self.profile.on_half_cores() if self.profile is not None else None
        return replace(self, profile=half) if half is not None else replace(self, scale=slowdown)

    def work(self, tokens: int, attention: float) -> float:
        """Work in token units: the tokens and what their attention adds."""
        return tokens + self.attention_ratio * attention

    def step_ms(self, shape: StepShape) -> float:
        """The step and what passes before the next one starts."""
        return self.server_ms(shape) + self.between_ms(shape)

    def server_ms(self, shape: StepShape) -> float:
        """The step as the server records it."""
        if self.profile is not None:
            if shape.suffix_only:
                keys = shape.row_attention / shape.row_prefill_tokens
                ratio = self.profile.suffix_over_decode(shape.row_prefill_tokens, keys)
                if ratio is not None:  # the calibrated decode step at that context, x the probe's ratio
                    return self.server_ms(StepShape(decode_rows=1, row_attention=keys)) * ratio
            base, prefill_beyond = profiled_step(self.profile, shape)
            decode_add, prompt_factor, prompt_add = self.kind_extra_ms
            # The path the engine runs, whatever the server's kind (module docstring).
            server = base + decode_add if shape.decode_path else base * prompt_factor + prompt_add
            server += self.attention_ms_per_key * prefill_beyond
            server += self.profile.served_growth(shape.rows)  # serving's share, by the rows it runs
            return max(server, MIN_STEP_MS) * self.scale
        work = self.work(shape.rows + shape.prefill_tokens, shape.attention)
        return (self.fixed_ms + self.per_token_ms * work) * self.scale

    def between_ms(self, shape: StepShape) -> float:
        """After the step, before the next: the engine loop and delivering its tokens."""
        growth = self.profile.between_growth(shape.decode_rows) if self.profile is not None else 0.0
        return self.overhead_ms + growth

    def delivery_ms(self, tokens: int) -> float:
        """How much later than the diagnosed run's clients read their first tokens a client reads
        one of `tokens` a step delivered: the served probe's growth from the run's own delivery
        (gap_delivered tokens a step) to `tokens`; below 0 for fewer, never below the whole gap.

        The run's offset (client_gap_ms, added to every predicted TTFT) is its returning requests'
        gap, with as many tokens in their steps as they had. The planted kv_pool run's came from
        3-token steps (3.2 ms beyond the server): its 35-block change, 4 tokens a step, adds the
        growth from 3 to 4, where the probe's whole growth from 1 to 4 had put the change's
        returning gap at 6.3 ms (4.2-5.7 measured) and its TTFT p50 17-40% high (session 39).
        Session 28 had taken off the run's gap beyond the probe's lone client instead: on this VM
        the two gaps, measured minutes apart, differ by more than the growth itself."""
        profile = self.profile
        if profile is None:
            return 0.0
        growth = profile.delivery_growth(tokens) - profile.delivery_growth(self.gap_delivered)
        return max(growth, -self.client_gap_ms)

    def with_drawn_residual(
        self,
        step_ms: float,
        has_prompt: bool,
        rng: random.Random,
        between_ms: float | None = None,
    ) -> float:
        """`step_ms` (`between_ms` of it after the server's step; default overhead_ms) plus one
        recorded step's departure from its mean, drawn for a step of this kind: ms added to a
        decode-only step, a fraction of a step with prompt tokens; unchanged without records. (An
        arrival's stall is the simulator's: StepResiduals.arrival.)"""
        r = self.residuals
        residuals = r.prompt if has_prompt else r.decode
        if not residuals:
            return step_ms
        drawn = rng.choice(residuals)
        if not has_prompt:
            return step_ms + drawn
        between = self.overhead_ms if between_ms is None else between_ms
        return (step_ms - between) * (1.0 + drawn) + between  # the server's part

    def prefill_ms(self, work: tuple[int, float]) -> float:
        """What prompt chunks of (tokens, their attention work) add to a step."""
        if self.profile is not None:
            return self.profile.prefill.slope(work[0]) * work[0] * self.scale
        return self.per_token_ms * self.work(*work) * self.scale


def attention_work(num_tokens: int, context_end: int) -> float:
    """Keys seen by `num_tokens` queries ending at `context_end` (causal: each query sees the keys
    before it): n x (context_end - (n - 1) / 2)."""
    return num_tokens * (context_end - (num_tokens - 1) / 2)


def profiled_step(profile: StepProfile, shape: StepShape) -> tuple[float, float]:
    """(the profiled engine's step: its curve plus the rows' keys beyond the decode probe's and the
    prefill chunks' beyond their probe's, each at the profile's price; the prefill chunks' keys
    beyond, which the fit prices beyond the profile's). A profile without a row probe or a chunk probe
    (measured before it had them) leaves those keys to the fitted price alone."""
    base = profile.shape_ms(shape.rows, shape.prefill_tokens)
    row_beyond = max(shape.row_attention - profile.row_probe_attention(shape.rows), 0.0)
    prefill_beyond = max(shape.prefill_attention - profile.prefill_probe_attention(shape.prefill_tokens), 0.0)
    if profile.chunk_ms_per_key is not None:  # the chunk's context, as the profile priced it
        base += profile.chunk_ms_per_key * prefill_beyond
    if profile.row_ms_per_key is None:
        return base, prefill_beyond + row_beyond
    return base + profile.row_ms_per_key * row_beyond, prefill_beyond

"""What an arrival adds to a recorded step with prompt tokens, so that the calibration can fit such
steps without it and the simulator put it back only where the replay has an arrival.

Why: a run starved of KV blocks or of running slots admits a waiting request when another finishes,
and the finished request's client sends its next one at once: its arrival lands in the prompt step
of the admitted request. On the planted kv_pool run (2-core Zen 4, tiny Llama) 9 of 12 prompt steps
held an arrival and took 4.7-7.6 ms, the other 3 of the same shapes 2.6-3.4. Fitted as they were,
the prompt price came out at 5.5x the profile: the kv_pool what-if's 36-block server (prompts
joining while others decode, no arrival in its prompt steps) had its prompt steps priced at 4.7-6.5
ms where they took 2.7-3.7, and its TTFT p50 predicted 13.7 ms against 9.6 measured (sessions
33-35). So a flagged prompt step is fitted less the stall, and the simulator adds the stall to a
replayed prompt step that a request's arrival, or the stall before it, falls in
(kvflow/doctor/simulate.py).

How much to take off: the run's own prompt steps say it where they have both kinds (the median
excess over the profile of those that held an arrival less that of those that did not); else the
decode steps' typical stall (typical_arrival_stall). A prompt step holds less of a stall than a
decode step does: on the kv_pool and max_num_seqs runs of session 36 the prompt steps' own
difference was 2.9 and 2.7 ms where the decode steps' (the arrival probe's) was 3.4, and taking 3.4
off priced both what-ifs' TTFT 14-16% low.

Pure Python (the step records and the profile in, ms out).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvflow.doctor.step_cost import MIN_STEP_RECORDS, StepShape, profiled_step
from kvflow.doctor.step_profile import StepProfile

# The fewest steps of each kind (held an arrival, held none) from which the run's prompt steps
# state their own stall: a run has few prompt steps (the kv_pool run 12, 3 of them clear).
MIN_PROMPT_STEPS_EACH = 3


def typical_arrival_stall(
    steps: Sequence[tuple[float, StepShape]], arrivals: Sequence[bool], profile: StepProfile | None
) -> float:
    """What an arrival typically stalls a decode step in flight (ms): the median excess of the run's
    decode-only steps that held one over the median of the other decode-only steps of their rows,
    with MIN_STEP_RECORDS of them; else the median of the profile's served arrival probe (the same
    model and machine); else 0 (nothing flagged, nothing taken off)."""
    clean: dict[int, list[float]] = {}
    for (dur, shape), flagged in zip(steps, arrivals, strict=False):
        if not shape.prompt_tokens and not flagged:
            clean.setdefault(shape.decode_rows, []).append(dur)
    centre = {rows: statistics.median(durs) for rows, durs in clean.items()}
    own = [
        dur - centre[shape.decode_rows]
        for (dur, shape), flagged in zip(steps, arrivals, strict=False)
        if flagged and not shape.prompt_tokens and shape.decode_rows in centre
    ]
    if len(own) >= MIN_STEP_RECORDS:
        return max(statistics.median(own), 0.0)
    probed = profile.served_arrival_stall if profile is not None else ()
    return max(statistics.median(probed), 0.0) if len(probed) >= MIN_STEP_RECORDS else 0.0


def prompt_arrival_stall(
    steps: Sequence[tuple[float, StepShape]], arrivals: Sequence[bool], profile: StepProfile | None
) -> float:
    """What an arrival adds to a prompt step (ms): with a profile and MIN_PROMPT_STEPS_EACH prompt
    steps that held an arrival and as many that did not, the median excess over the profiled step
    (and the served growth with its decode rows) of the first less that of the second, never below
    0; else typical_arrival_stall. Without a profile the steps' shapes cannot be taken out of their
    times, and the decode steps' stall stands."""
    if profile is not None:
        excess: dict[bool, list[float]] = {True: [], False: []}
        for (dur, shape), flagged in zip(steps, arrivals, strict=False):
            if shape.prompt_tokens:
                served = profiled_step(profile, shape)[0] + profile.served_growth(shape.rows)
                excess[bool(flagged)].append(dur - served)
        if min(len(excess[True]), len(excess[False])) >= MIN_PROMPT_STEPS_EACH:
            return max(statistics.median(excess[True]) - statistics.median(excess[False]), 0.0)
    return typical_arrival_stall(steps, arrivals, profile)


def destalled_ms(dur: float, stall: float, floor: float) -> float:
    """A recorded step less the stall an arrival put on it, never below `floor` (what the step's
    own work is priced at: taking off a typical stall must not make a short stall's step free)."""
    return max(dur - stall, min(dur, floor))

"""Structured output through the engine on the bundled model (which knows nothing about JSON: the
grammar alone makes every output valid). Sampling at temperature 1 with seeds, so each check sees
varied outputs; seeded outputs are a function of (seed, logits) only, which lets preemption,
chunked prefill and prefix hits be checked for exactly the same text as an undisturbed run."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import jsonschema
import pytest

from kvflow import LLM, SamplingParams
from kvflow.assets import bundled_model_dir
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.scheduler import Scheduler
from kvflow.errors import InvalidRequestError
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import StructuredOutputsParams

ENGINE = {"dtype": "float32", "max_model_len": 512}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["red", "green", "blue"]
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
PROMPT = "Here is a record about a person:"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(str(bundled_model_dir()), **ENGINE)


def constrained(seed: int, max_tokens: int = 96, **constraint: object) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def test_every_constraint_kind_holds(llm: LLM) -> None:
    params = [constrained(s, json=PERSON) for s in range(4)]
    params += [constrained(s, regex=REGEX) for s in range(3)]
    params += [constrained(s, choice=CHOICES) for s in range(3)]
    params += [constrained(s, grammar=LARK, max_tokens=40) for s in range(2)]
    params += [constrained(0, json_object=True, max_tokens=64)]
    outputs = llm.generate([PROMPT] * len(params), params)
    texts = [o.outputs[0].text for o in outputs]
    for text in texts[:4]:
        jsonschema.validate(json.loads(text), PERSON)
    assert all(re.fullmatch(REGEX, t) for t in texts[4:7]), texts[4:7]
    assert all(t in CHOICES for t in texts[7:10]), texts[7:10]
    for out, text in zip(outputs[10:12], texts[10:12], strict=True):
        if out.outputs[0].finish_reason == "stop":  # the sum may be cut by max_tokens; what there is parses
            assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text), text
    if outputs[12].outputs[0].finish_reason == "stop":  # any object: its strings are unbounded
        assert isinstance(json.loads(texts[12]), dict)
    for out in outputs[:10]:
        assert out.outputs[0].finish_reason == "stop"
        assert out.metrics.grammar_compile_time is not None and out.metrics.grammar_compile_time >= 0


def test_constrained_rows_leave_their_neighbours_alone(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], free)[0].outputs[0].token_ids
    mixed = llm.generate(
        [PROMPT, PROMPT, "x"], [constrained(1, json=PERSON), free, constrained(2, regex=REGEX)]
    )
    assert mixed[1].outputs[0].token_ids == alone


def test_preemption_chunked_prefill_and_prefix_hits_keep_the_grammar_state(llm: LLM) -> None:
    # ~55 tokens each: a shared start (prefix-cache hits), then each its own ending.
    prompts = [PROMPT * 5 + f" number {i} of five" for i in range(5)]
    params = [constrained(s, json=PERSON) for s in range(4)] + [constrained(9, regex=REGEX)]
    reference = [o.outputs[0].text for o in llm.generate(prompts, params)]
    # 8 blocks of 16 tokens cannot hold 5 requests of ~55 prompt + ~30 output tokens: preemption and
    # recompute; 16-token steps split every prompt into chunks.
    tight = LLM(str(bundled_model_dir()), num_kv_blocks=8, max_num_batched_tokens=16, **ENGINE)
    outputs = tight.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert any(o.metrics.num_cached_prompt_tokens > 0 for o in outputs)
    assert [o.outputs[0].text for o in outputs] == reference


def test_logit_bias(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    natural = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={42: 100})
    assert llm.generate([PROMPT], forced)[0].outputs[0].token_ids == [42] * 6
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={natural[0]: -100})
    assert llm.generate([PROMPT], banned)[0].outputs[0].token_ids[0] != natural[0]


def test_bad_constraint_is_refused_before_queueing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex"):
        llm.generate([PROMPT], constrained(0, regex="(unclosed"))
    # Only the tokenizer can tell: this model has no such special token.
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.grammar: .*unknown special token"):
        llm.generate([PROMPT], constrained(0, grammar="start: <|no_such_token|>"))
    assert not llm.llm_engine.has_unfinished_requests()


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    manager = llm.llm_engine.structured
    llm.generate([PROMPT], constrained(0, json=PERSON))
    cached = len(manager._cache)
    llm.generate([PROMPT, PROMPT], [constrained(1, json=PERSON), constrained(2, json=dict(PERSON))])
    assert len(manager._cache) == cached  # the same schema compiled once


def test_scheduler_steps_over_requests_waiting_for_their_grammar() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_kv_blocks=64, max_model_len=128)
    compiling = Request("compiling", [1, 2, 3], SamplingParams())
    ready = Request("ready", [4, 5, 6], SamplingParams())
    scheduler.add_request(compiling)
    scheduler.add_request(ready)
    compiling.status = RequestStatus.WAITING_FOR_GRAMMAR
    first = scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["ready"]
    assert list(scheduler.waiting) == [compiling]
    scheduler.check_integrity()
    compiling.status = RequestStatus.WAITING  # its grammar is ready
    assert "compiling" in [s.request_id for s in scheduler.schedule().scheduled]
    assert not scheduler.waiting


def test_speculated_constrained_requests_stay_exact_and_valid(llm: LLM) -> None:
    """n-gram speculation on: constrained requests are drafted for, their drafts cut where the
    grammar says no, each verified row masked by the grammar at its position. Greedy outputs equal
    the unspeculated ones token for token; sampled ones still satisfy their constraint."""
    prompt = "ha ha ha ha ha ha ha ha"
    greedy = [
        SamplingParams(
            temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="(ha ){2,12}ho")
        ),
        SamplingParams(
            temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=PERSON)
        ),
    ]
    reference = [o.outputs[0].token_ids for o in llm.generate([prompt] * 2, greedy)]
    spec = LLM(str(bundled_model_dir()), speculative_method="ngram", speculative_auto_disable=False, **ENGINE)
    assert [o.outputs[0].token_ids for o in spec.generate([prompt] * 2, greedy)] == reference
    stats = spec.llm_engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the constrained requests were speculated
    sampled = [constrained(s, json=PERSON) for s in range(3)] + [constrained(7, regex=REGEX)]
    outputs = spec.generate([prompt] * 4, sampled)
    for out in outputs[:3]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert re.fullmatch(REGEX, outputs[3].outputs[0].text)


def test_abort_while_the_grammar_compiles(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request(
        "waits", PROMPT, constrained(0, json={"type": "object", "properties": {"q": {"type": "integer"}}})
    )
    engine.abort_request("waits")  # before any step: it is still WAITING_FOR_GRAMMAR
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("waits", "abort")]
    assert engine.structured.num_pending == 0


def test_a_compiling_grammar_stalls_nobody_else(llm: LLM) -> None:
    """While a constrained request's grammar compiles (here: held in the compile thread's queue until
    released), it waits in WAITING_FOR_GRAMMAR and the other requests decode every step."""
    engine = llm.llm_engine
    release = threading.Event()
    blocker = engine.structured._compile_pool.submit(release.wait)  # occupies the one compile thread
    new_schema = {
        "type": "object",
        "properties": {"blocked": {"enum": ["yes"]}},
        "required": ["blocked"],
        "additionalProperties": False,
    }
    try:
        engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        engine.add_request("constrained", PROMPT, constrained(0, json=new_schema))
        free_tokens = 0
        for _ in range(5):
            free_tokens += sum(len(o.delta_token_ids) for o in engine.step() if o.request_id == "free")
            assert engine.scheduler.requests["constrained"].status is RequestStatus.WAITING_FOR_GRAMMAR
        assert free_tokens == 5  # one token per step, none lost to the waiting grammar
    finally:
        release.set()
        blocker.result()
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert json.loads(finals["constrained"].outputs[0].text) == {"blocked": "yes"}
    assert finals["constrained"].metrics.grammar_compile_time > 0

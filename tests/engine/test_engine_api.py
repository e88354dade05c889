"""The engine's public API on a real (tiny) checkpoint: LLM.generate, the streaming step loop,
abort, per-request seeds, stop strings, and the clear errors bad input gets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.engine import LLMEngine
from kvflow.errors import InvalidRequestError, ModelLoadError, PromptTooLongError


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", max_model_len=256)


def test_generate_accepts_strings_and_token_ids_with_per_prompt_params(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode("def main():")
    outs = llm.generate(
        ["def main():", prompt_ids],
        [SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(temperature=0.0, max_tokens=5)],
    )
    assert [len(o.outputs[0].token_ids) <= n for o, n in zip(outs, (8, 5), strict=False)] == [True, True]
    # The string prompt is tokenized with the checkpoint's tokenizer: same ids, same greedy output.
    assert outs[0].prompt_token_ids == prompt_ids
    assert outs[0].outputs[0].token_ids[:5] == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].text == tokenizer.decode(outs[0].outputs[0].token_ids)
    t = outs[0].metrics
    assert t.arrival_time <= t.first_scheduled_time <= t.first_token_time <= t.token_times[-1]
    assert t.added_time is not None and t.arrival_time <= t.added_time <= t.first_scheduled_time
    assert len(t.token_times) == len(outs[0].outputs[0].token_ids)
    assert t.prefill_chunks and t.prefill_chunks[0].num_tokens == len(prompt_ids)


def test_streaming_deltas_reassemble_the_final_text(llama_dir: Path) -> None:
    engine = LLMEngine.from_kwargs(model=str(llama_dir), dtype="float32")
    rid = engine.add_request(
        "r1", "import os\n", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    )
    text, token_ids, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            text += out.delta_text
            token_ids += out.delta_token_ids
            final = out
    assert final is not None and final.finished
    assert text == final.outputs[0].text
    assert token_ids == final.outputs[0].token_ids
    assert len(token_ids) == 20 and final.outputs[0].finish_reason == "length"


def test_abort_mid_stream_keeps_serving_others(llama_dir: Path) -> None:
    engine = LLMEngine.from_kwargs(model=str(llama_dir), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9, 10], params)
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert finished["b"].outputs[0].finish_reason == "length"
    assert len(finished["b"].outputs[0].token_ids) == 30
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_usage == 0.0


def test_seeded_sampling_is_independent_of_batch_composition(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[1, 2, 3, 4]], seeded)[0].outputs[0].token_ids
    crowd = llm.generate([[9, 9], [1, 2, 3, 4], [7] * 40], [other, seeded, other])
    assert crowd[1].outputs[0].token_ids == alone
    again = llm.generate([[7] * 20, [1, 2, 3, 4]], [other, seeded])[1].outputs[0].token_ids
    assert again == alone


def test_stop_string_straddling_tokens_is_cut_from_the_text(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["class A:"], greedy)[0].outputs[0]
    # Pick a stop string that starts inside one token and ends inside a later one.
    assert len(full.text) >= 8
    stop = full.text[3:7]
    out = llm.generate(
        ["class A:"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.text[: full.text.find(stop)]
    assert len(completion.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate([[3, 4, 5]], greedy)[0].outputs[0].token_ids
    stop_id = full[4]
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]))
    completion = out[0].outputs[0]
    assert completion.token_ids == full[: full.index(stop_id) + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_invalid_sampling_params_are_clear_errors(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(PromptTooLongError, match="max_model_len=256"):
        llm.generate([[1] * 300], greedy)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], greedy)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[10**9]], greedy)
    with pytest.raises(InvalidRequestError, match="sampling params"):
        llm.generate(["a", "b"], [greedy])
    # A batch whose second prompt is bad leaves nothing behind; the next call is served normally.
    with pytest.raises(PromptTooLongError):
        llm.generate([[1, 2, 3], [1] * 300], greedy)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate([[1, 2, 3]], greedy)[0].outputs[0].token_ids) >= 1
    llm.llm_engine.scheduler.check_integrity()


def test_missing_directory_and_unsupported_architecture(tmp_path: Path, llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (bad / name).write_bytes((llama_dir / name).read_bytes())
    (bad / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(bad))


def test_missing_tensor_and_shape_mismatch_name_the_tensor(tmp_path: Path, llama_dir: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in llama_dir.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(llama_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(str(ckpt))
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["intermediate_size"] += 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    save_file(load_file(str(llama_dir / "model.safetensors")), str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"shape mismatch .*gate_proj.* in model\.safetensors"):
        LLM(str(ckpt))


def test_a_failed_model_step_fails_its_requests_only_and_leaves_no_stale_prefix(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine.from_kwargs(model=str(llama_dir), dtype="float32", max_model_len=256, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = list(range(10, 30))
    reference = LLM(str(llama_dir), dtype="float32", max_model_len=256).generate([prompt], params)[0]
    execute = engine.model_runner.execute_model
    calls = {"n": 0}

    def fail_first_call(*args: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected model failure")
        return execute(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.model_runner, "execute_model", fail_first_call)
    engine.add_request("doomed", prompt, params)
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outputs] == [
        ("doomed", True, "abort")
    ]
    assert outputs[0].error is not None and "injected model failure" in outputs[0].error
    assert engine.last_step_stats is not None and engine.last_step_stats.num_prefill_tokens == len(prompt)
    engine.scheduler.check_integrity()
    # The blocks allocated for the failed step were indexed for reuse but never written: a retry of the
    # same prompt must recompute them (a stale hit would change the output).
    engine.add_request("retry", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and final.error is None
    assert final.num_cached_tokens == 0
    assert final.outputs[0].token_ids == reference.outputs[0].token_ids
    engine.scheduler.check_integrity()


def test_a_failed_output_fails_that_request_only(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    processor = llm.llm_engine.output_processor
    process = processor.process

    def fail_one(update: object, logprobs: object) -> object:
        if update.request.request_id == "req-bad":  # type: ignore[attr-defined]
            raise ValueError("injected output failure")
        return process(update, logprobs)  # type: ignore[arg-type]

    monkeypatch.setattr(processor, "process", fail_one)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("req-good", "def main():", params)
    engine.add_request("req-bad", "def main():", params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["req-bad"].error == "ValueError: injected output failure"
    assert finals["req-good"].error is None and len(finals["req-good"].outputs[0].token_ids) == 5
    engine.scheduler.check_integrity()

"""tools/train_tiny.py on a tiny configuration: it learns, its checkpoint loads in transformers and in
kvflow with identical greedy outputs, and stopping then resuming reproduces an uninterrupted run exactly.

Three short trainings (~2 s each on one thread) are shared by the whole module.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from fixtures.reference import hf_greedy
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kvflow import LLM, SamplingParams
from kvflow.tokenizer import Tokenizer as KvflowTokenizer

transformers = pytest.importorskip("transformers")

TOOL_PATH = Path(__file__).resolve().parents[2] / "tools" / "train_tiny.py"
STEPS = 30
STOP_AFTER = 15  # the interrupted run stops here, then resumes to STEPS
NUM_PROMPT_TOKENS = 4
NUM_NEW_TOKENS = 8


def _load_tool() -> ModuleType:
    # tools/ is not a package: load the script by path. Registered in sys.modules before running it,
    # because dataclasses look their module up there.
    spec = importlib.util.spec_from_file_location("train_tiny", TOOL_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


train_tiny = _load_tool()


def _tiny_args(out: Path, *extra: str) -> list[str]:
    # ~300 KB of corpus (~130k tokens at vocab 512), 30 steps of 16 x 64 tokens: about 2 s on one thread.
    return [
        "--out",
        str(out),
        "--size",
        "tiny",
        "--max-corpus-bytes",
        "300000",
        "--steps",
        str(STEPS),
        "--seq-len",
        "64",
        "--batch-size",
        "16",
        "--warmup",
        "5",
        "--eval-every",
        "10",
        "--save-every",
        "10",
        "--threads",
        "1",
        *extra,
    ]


def _log(out: Path) -> dict[str, Any]:
    return json.loads((out / "train_log.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"full": an uninterrupted 30-step run, "resumed": the same run stopped at 15 and resumed}."""
    base = tmp_path_factory.mktemp("train-tiny")
    full, resumed = base / "full", base / "resumed"
    assert train_tiny.main(_tiny_args(full, "--vocab-size", "512")) == 0
    # The resumed run reuses the first run's tokenizer, so both train on identical token streams.
    interrupted = _tiny_args(resumed, "--tokenizer", str(full), "--stop-after", str(STOP_AFTER))
    assert train_tiny.main(interrupted) == 0
    assert _log(resumed)["steps"] == STOP_AFTER
    assert train_tiny.main(_tiny_args(resumed, "--tokenizer", str(full), "--resume")) == 0
    return {"full": full, "resumed": resumed}


def test_loss_decreases_and_heldout_perplexity_is_finite(runs: dict[str, Path]) -> None:
    log = _log(runs["full"])
    assert log["steps"] == STEPS
    assert log["tokens_seen"] == STEPS * 16 * 64
    # Step 1 is at chance (ln 512 = 6.24); 30 steps get the mean of the last 20 about 1 nat lower.
    assert log["final_train_loss"] < log["first_train_loss"] - 0.5
    perplexity = log["heldout_perplexity"]
    assert math.isfinite(perplexity)
    assert 1.0 < perplexity < log["vocab_size"], "held-out perplexity should beat a uniform guess"
    assert [entry["step"] for entry in log["history"]] == [10, 20, 30]


def test_resume_reproduces_the_uninterrupted_run(runs: dict[str, Path]) -> None:
    # Bit-identical, bf16 autocast included: autocast is deterministic on CPU, the batch of each step
    # depends only on (seed, step), and the optimizer state is restored exactly from train_state.pt.
    states = [torch.load(runs[name] / "train_state.pt", weights_only=True) for name in ("full", "resumed")]
    full_weights, resumed_weights = (state["model"] for state in states)
    assert full_weights.keys() == resumed_weights.keys()
    for name in full_weights:
        assert torch.equal(full_weights[name], resumed_weights[name]), name
    exported = [load_file(str(runs[name] / "model.safetensors")) for name in ("full", "resumed")]
    for name, tensor in exported[0].items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, exported[1][name]), name
    full_log, resumed_log = _log(runs["full"]), _log(runs["resumed"])
    assert full_log["final_train_loss"] == resumed_log["final_train_loss"]
    # The resumed run also evaluated where it stopped; every other entry is the same.
    evaluated_steps = {entry["step"] for entry in full_log["history"]}
    assert [e for e in resumed_log["history"] if e["step"] in evaluated_steps] == full_log["history"]


def test_checkpoint_gives_the_same_greedy_tokens_in_transformers_and_kvflow(runs: dict[str, Path]) -> None:
    path = runs["full"]
    prompt = Tokenizer.from_file(str(path / "tokenizer.json")).encode("def __init__(self").ids
    prompt = prompt[:NUM_PROMPT_TOKENS]
    assert len(prompt) == NUM_PROMPT_TOKENS
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    expected, _ = hf_greedy(model, prompt, NUM_NEW_TOKENS)
    # min_tokens bans EOS exactly as transformers' min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    output = LLM(str(path), dtype="float32").generate([prompt], params)[0]
    assert output.outputs[0].token_ids == expected


def test_tokenizer_agrees_with_transformers_and_kvflow(runs: dict[str, Path]) -> None:
    path = runs["full"]
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(path)
    ours = KvflowTokenizer.from_pretrained(path)
    text = "def add(a, b):\n    return a + b  # Café\n"
    ids = backend.encode(text).ids
    assert ids[0] == backend.token_to_id("<|endoftext|>"), "documents and prompts start with <|endoftext|>"
    assert reference(text)["input_ids"] == ids
    assert ours.encode(text) == ids
    messages = [{"role": "user", "content": "hi"}]
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chatml
    assert ours.apply_chat_template(messages) == chatml
    im_end = backend.token_to_id("<|im_end|>")
    assert ours.eos_token_ids == {backend.token_to_id("<|endoftext|>"), im_end}


def test_presets_have_the_intended_parameter_counts() -> None:
    vocab_size = train_tiny.DEFAULT_VOCAB_SIZE
    target, draft = train_tiny.SIZES["target"], train_tiny.SIZES["draft"]
    assert 15e6 <= train_tiny.count_parameters(target, vocab_size) <= 30e6
    assert 2e6 <= train_tiny.count_parameters(draft, vocab_size) <= 5e6
    assert target.num_attention_heads > target.num_key_value_heads  # GQA
    assert target.hidden_size == target.num_attention_heads * train_tiny.HEAD_DIM


def test_corpus_split_is_deterministic_disjoint_and_about_five_percent() -> None:
    names = [name for name, _ in train_tiny._stdlib_sources()]
    assert not any("site-packages" in name for name in names)
    heldout_fraction = sum(map(train_tiny.is_heldout, names)) / len(names)
    assert 0.03 < heldout_fraction < 0.07
    first, second = (train_tiny.collect_corpus(max_bytes=100_000) for _ in range(2))
    assert [d.name for d in first.train] == [d.name for d in second.train]
    train_names, heldout_names = {d.name for d in first.train}, {d.name for d in first.heldout}
    assert train_names and heldout_names and not train_names & heldout_names
    assert all(train_tiny.is_heldout(name) for name in heldout_names)


def test_lr_schedule_warms_up_then_decays_to_a_tenth() -> None:
    lr, warmup, steps = 1e-3, 10, 100
    schedule = [train_tiny.lr_at(step, lr, warmup, steps) for step in range(steps)]
    assert schedule[0] == pytest.approx(lr / warmup)
    assert schedule[warmup - 1] == pytest.approx(lr)
    assert all(a >= b for a, b in zip(schedule[warmup:], schedule[warmup + 1 :], strict=False))
    assert schedule[-1] == pytest.approx(lr * train_tiny.MIN_LR_FRACTION, rel=1e-2)


def test_draft_requires_the_targets_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        train_tiny.parse_args(["--out", str(tmp_path), "--size", "draft"])


def test_distillation_from_a_teacher_pulls_the_student_towards_it(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """--teacher: the loss is KL(teacher || student), so a student started from the teacher's own
    weights (--init) begins at exactly 0 and agrees with it; one started from random weights moves
    towards it (its KL falls) and the log records the greedy agreement with the teacher."""
    teacher = runs["full"]
    twin = tmp_path / "twin"
    assert (
        train_tiny.main(
            _tiny_args(twin, "--tokenizer", str(teacher), "--teacher", str(teacher), "--init", str(teacher))
        )
        == 0
    )
    twin_log = _log(twin)
    assert twin_log["first_train_loss"] == pytest.approx(0.0, abs=1e-6)
    student = tmp_path / "student"
    args = _tiny_args(
        student, "--tokenizer", str(teacher), "--teacher", str(teacher), "--repeat-fraction", "0.5"
    )
    assert train_tiny.main(args) == 0
    log = _log(student)
    assert log["final_train_loss"] < log["first_train_loss"] - 0.5
    assert all("agreement" in entry for entry in log["history"])
    # 30 steps of weight decay and Adam noise move the twin off its teacher a little (measured 88%
    # agreement); the student from random weights gets most of a 30-step teacher's (nearly unigram)
    # argmaxes but not all (measured 76%). Both runs are deterministic (seeded, one thread).
    assert 0.0 <= log["teacher_agreement"] < twin_log["teacher_agreement"]


def test_with_repeats_restates_an_earlier_span_and_leaves_the_rest() -> None:
    windows = torch.arange(8 * 65).view(8, 65) * 7 % 1000  # distinct tokens within a row
    out = train_tiny.with_repeats(windows, 0.5, torch.Generator().manual_seed(0))
    changed = [i for i in range(len(windows)) if not torch.equal(out[i], windows[i])]
    assert 0 < len(changed) < len(windows)
    for i in changed:
        split = int((out[i] != windows[i]).nonzero()[0])  # the first changed token
        assert torch.equal(out[i, :split], windows[i, :split])
        source = int((windows[i] == out[i, split]).nonzero()[0])  # where the restated span starts
        span = split - source
        assert span >= train_tiny.MIN_REPEAT_SPAN
        tail = out[i, split:]
        expected = windows[i, source:split].repeat(len(tail) // span + 1)[: len(tail)]
        assert torch.equal(tail, expected)

"""`kvflow generate` end to end in a subprocess, as a user runs it; every command's flags parsed
in-process (generated from the config dataclasses by kvflow/arg_utils.py)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from kvflow.arg_utils import FlagParser, add_dataclass_args, dataclass_kwargs
from kvflow.bench import cli as bench_cli
from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig
from kvflow.cli import build_parser, engine_kwargs
from kvflow.config import EngineConfig, QuantConfig


def _kvflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_generate_streams_text_and_prints_timing(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    path = tiny_checkpoint_factory("qwen2")
    result = _kvflow(
        "generate",
        str(path),
        "--prompt",
        "hello",
        "--chat",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "4",
    )
    assert result.returncode == 0, result.stderr
    assert "KV cache pool:" in result.stderr
    assert "TTFT" in result.stderr and "ITL" in result.stderr and "tokens/s" in result.stderr
    assert "finish length" in result.stderr


def test_generate_reports_a_missing_model_clearly(tmp_path: Path) -> None:
    result = _kvflow("generate", str(tmp_path / "missing"), "--prompt", "x")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_doctor_without_model_diagnoses_the_bundled_model(capsys: pytest.CaptureFixture[str]) -> None:
    """As the README says of every command: MODEL omitted means the bundled model."""
    from kvflow.cli import main

    assert main(["doctor", "--hardware", "h100", "--context", "64"]) == 0
    assert "kvflow doctor: tiny-target" in capsys.readouterr().out


def test_demo_generates_with_timing(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    path = tiny_checkpoint_factory("llama")
    result = _kvflow("demo", "--model", str(path), "--max-tokens", "4", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- completion ---") == 4
    assert "TTFT" in result.stderr and "continuous batching" in result.stderr


# --- flags generated from the config dataclasses (kvflow/arg_utils.py), parsed in-process ---

BOOL_FLAGS = {
    "--enable-prefix-caching": "enable_prefix_caching",
    "--quantize-lm-head": "quantize_lm_head",
    "--speculative-auto-disable": "speculative_auto_disable",
}


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", ["generate", "demo", "serve"])
@pytest.mark.parametrize(("flag", "dest"), BOOL_FLAGS.items())
def test_boolean_engine_flags_come_in_pairs(
    command: str, flag: str, dest: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--prompt", "x"] if command == "generate" else []
    no_flag = "--no-" + flag.removeprefix("--")
    assert getattr(_parse(command, *extra, flag), dest) is True
    assert getattr(_parse(command, *extra, no_flag), dest) is False
    assert getattr(_parse(command, *extra, flag, no_flag), dest) is False  # the last one wins
    assert capsys.readouterr().err == ""  # no deprecation warning for the new spelling


@pytest.mark.parametrize(
    ("typed", "expected", "replacement"),
    [
        (["--enable-prefix-caching", "false"], False, "--no-enable-prefix-caching"),
        (["--enable-prefix-caching", "TRUE"], True, "--enable-prefix-caching"),
        (["--enable-prefix-caching=off"], False, "--no-enable-prefix-caching"),
        (["--enable-prefix-caching", "1"], True, "--enable-prefix-caching"),
    ],
)
def test_the_deprecated_value_spelling_still_works_with_a_warning(
    typed: list[str], expected: bool, replacement: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse("serve", "MODEL", *typed)
    assert args.enable_prefix_caching is expected and args.model == "MODEL"
    err = capsys.readouterr().err
    assert f"kvflow: warning: '{' '.join(typed)}' is deprecated; use {replacement}" in err


def test_deprecated_spelling_of_every_boolean_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("generate", "--prompt", "x", *[part for f in BOOL_FLAGS for part in (f, "no")])
    assert all(getattr(args, dest) is False for dest in BOOL_FLAGS.values())
    assert capsys.readouterr().err.count("is deprecated") == len(BOOL_FLAGS)


def test_a_positional_after_a_bare_boolean_flag_stays_positional() -> None:
    args = _parse("serve", "--enable-prefix-caching", "MODEL")
    assert args.model == "MODEL" and args.enable_prefix_caching is True


def test_doctor_names_a_bench_file_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing, non-JSON or non-result --bench file: exit 2 and a message naming it, no traceback."""
    from kvflow.cli import main

    (tmp_path / "notjson.json").write_text("kvflow bench printed this, not --output")
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = [("missing.json", "cannot read it"), ("notjson.json", "not JSON"), ("list.json", "not a kvflow")]
    for name, why in cases:
        path = str(tmp_path / name)
        assert main(["doctor", "--hardware", "cpu", "--bench", path]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvflow: error: --bench {path}: {why}") and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "choices"),
    [
        (["serve", "--kv-cache-dtype", "fp16"], "'auto', 'bfloat16', 'float16', 'fp8_e4m3', 'int8', 'int4'"),
        (["serve", "--quantization", "int2"], "'none', 'int8', 'int4'"),
        (["generate", "--prompt", "x", "--speculative-method", "eagle"], "'none', 'ngram', 'draft'"),
        (["demo", "--dtype", "fp64"], "'auto', 'float32', 'bfloat16', 'float16'"),
        (["quant-eval", "--quantization", "fp8"], "'none', 'int8', 'int4'"),
        (["quant-eval", "--kv-cache-dtype", "bfloat16"], "'auto', 'fp8_e4m3', 'int8', 'int4'"),
        (["bench", "--endpoint", "responses"], "'chat', 'completions'"),
        (["doctor", "MODEL", "--hardware", "tpu"], "'auto', 'cpu', 'a100-80g', 'h100'"),
    ],
)
def test_an_invalid_choice_is_rejected_with_the_valid_ones(
    argv: list[str], choices: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}: invalid choice: '{argv[-1]}'" in err and choices in err


def test_engine_flag_defaults_are_the_config_defaults() -> None:
    """One source: with no flags, the CLI builds exactly the configs `LLM(model)` builds."""
    from_cli = EngineConfig.from_kwargs(model="m", **engine_kwargs(_parse("serve")))
    assert from_cli == EngineConfig.from_kwargs(model="m")


def test_bench_flag_defaults_are_the_config_defaults() -> None:
    args = _parse("bench")
    for cls in (BenchConfig, DatasetSpec, LoadSpec):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and hasattr(args, f.name):
                assert getattr(args, f.name) == f.default, f"{cls.__name__}.{f.name}"
    assert vars(args).keys() >= {"ignore_eos", "continuous_usage_stats", "include_usage", "burstiness"}
    config = bench_cli._config(args, LoadSpec(concurrency=1))
    expected = BenchConfig(
        base_url="http://127.0.0.1:8000/v1",
        dataset=DatasetSpec(name="random", num_requests=32),
        load=LoadSpec(concurrency=1),
    )
    assert config == expected


def test_bench_flags_keep_their_spelling() -> None:
    args = _parse(
        "bench", "sweep", "--no-ignore-eos", "--no-continuous-usage", "--no-usage", "--quiet",
        "--find-capacity", "--concurrency", "1,2,4", "--dataset", "shared-prefix", "--prefix-len", "64",
    )  # fmt: skip
    config = bench_cli._config(args, LoadSpec(concurrency=1))
    assert not config.ignore_eos and not config.continuous_usage_stats and not config.include_usage
    assert not config.progress and args.find_capacity and bench_cli._loads(args.concurrency) == [1, 2, 4]
    assert config.dataset.name == "shared-prefix" and config.dataset.prefix_len == 64
    assert _parse("bench", "--ignore-eos").ignore_eos is True


def test_quant_eval_flags_from_the_quant_config() -> None:
    args = _parse("quant-eval")
    assert args.quantization_group_size == QuantConfig().quantization_group_size
    assert args.quantize_lm_head is QuantConfig().quantize_lm_head is False
    assert _parse("quant-eval", "--quantize-lm-head").quantize_lm_head is True


@pytest.mark.parametrize("command", ["serve", "bench", "doctor", "generate", "quant-eval", "demo"])
def test_help_shows_defaults_and_choices(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(command, "--help")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvflow {command}") and "(default: " in out
    assert "(default: None)" not in out  # unset flags say what unset means instead
    if command in ("serve", "generate", "demo"):
        assert "--enable-prefix-caching, --no-enable-prefix-caching" in out
        assert "{auto,bfloat16,float16,fp8_e4m3,int8,int4}" in out and "(default: 16)" in out


# --- the generator itself, on a dataclass of its own ---

Color = Literal["red", "green"]


@dataclass(frozen=True)
class _Example:
    name: str = field(metadata={"help": "required in Python"})
    count: int | None = field(default=None, metadata={"help": "optional int"})
    color: Color = field(default="red", metadata={"help": "a Literal"})
    fast: bool = field(default=True, metadata={"help": "a bool"})
    wait_s: float = field(default=1.5, metadata={"flag": "--wait-seconds", "help": "100% renamed"})


def _example_parser(**kwargs: Any) -> FlagParser:
    parser = FlagParser(prog="example")
    add_dataclass_args(parser, _Example, **kwargs)
    return parser


def test_a_field_becomes_a_flag_by_its_type() -> None:
    parser = _example_parser(overrides={"name": {"default": "n"}})
    args = parser.parse_args([])
    assert dataclass_kwargs(args, _Example) == {
        "name": "n", "count": None, "color": "red", "fast": True, "wait_s": 1.5
    }  # fmt: skip
    args = parser.parse_args(["--count", "3", "--color", "green", "--no-fast", "--wait-seconds", "2"])
    assert _Example(**dataclass_kwargs(args, _Example)) == _Example("n", 3, "green", False, 2.0)
    help_text = parser.format_help()
    assert "--wait-seconds WAIT_SECONDS" in help_text and "100% renamed (default: 1.5)" in help_text


def test_a_field_without_default_and_override_is_a_required_flag() -> None:
    with pytest.raises(SystemExit):
        _example_parser().parse_args([])
    assert _example_parser().parse_args(["--name", "x"]).name == "x"


def test_a_default_the_field_has_cannot_be_given_twice() -> None:
    with pytest.raises(ValueError, match=r"_Example\.count has a default"):
        _example_parser(overrides={"count": {"default": 3}})


def test_unknown_fields_and_unsupported_types_are_errors() -> None:
    with pytest.raises(ValueError, match="no field colour"):
        _example_parser(exclude=("colour",))

    @dataclass
    class Nested:
        inner: _Example

    with pytest.raises(TypeError, match=r"Nested\.inner: no flag for type"):
        add_dataclass_args(FlagParser(), Nested)

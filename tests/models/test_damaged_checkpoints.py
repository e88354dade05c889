"""A damaged checkpoint is one line naming the file (and the field), and exit status 2: a truncated or
corrupt safetensors file, a config.json field of the wrong type."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvflow.cli import main


def copy_checkpoint(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def generate(model: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["generate", str(model), "--prompt", "x", "--max-tokens", "1", "--dtype", "float32"])
    return status, capsys.readouterr().err


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    assert status == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("kvflow: error: ")
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_weights_file_is_named(
    tiny_checkpoint_factory: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    model = copy_checkpoint(tiny_checkpoint_factory("llama"), tmp_path)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 64)
    status, err = generate(model, capsys)
    assert_one_line_error(status, err, str(weights), "not a readable safetensors file")


def test_a_truncated_shard_is_named_with_its_tensor(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sharded: the index lists the shard, whose header is read only when a tensor is."""
    model = copy_checkpoint(tiny_checkpoint_factory("llama", max_shard_size="200KB"), tmp_path)
    shard = sorted(model.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    status, err = generate(model, capsys)
    assert_one_line_error(status, err, str(shard), "not a readable safetensors file")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("hidden_size", "abc", "field 'hidden_size' must be an integer, got 'abc'"),
        ("num_hidden_layers", 2.5, "field 'num_hidden_layers' must be an integer, got 2.5"),
        ("vocab_size", None, "field 'vocab_size' must be an integer, got None"),
        ("rms_norm_eps", "small", "field 'rms_norm_eps' must be a number, got 'small'"),
        ("rope_parameters", [1], "rope_scaling / rope_parameters must be an object"),
        ("num_attention_heads", True, "field 'num_attention_heads' must be an integer, got True"),
    ],
)
def test_a_config_field_of_the_wrong_type_is_named(
    tiny_checkpoint_factory: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    field: str,
    value: Any,
    expected: str,
) -> None:
    model = copy_checkpoint(tiny_checkpoint_factory("llama"), tmp_path)
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config[field] = value
    config_path.write_text(json.dumps(config))
    status, err = generate(model, capsys)
    assert_one_line_error(status, err, f"{config_path}: {expected}")


def test_a_config_that_is_not_an_object_is_named(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = copy_checkpoint(tiny_checkpoint_factory("llama"), tmp_path)
    (model / "config.json").write_text("[1, 2]")
    status, err = generate(model, capsys)
    assert_one_line_error(status, err, str(model / "config.json"), "must hold a JSON object")

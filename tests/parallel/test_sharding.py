"""Which slices a rank holds and reads (no processes: kvflow/parallel/sharding.py, sharded_reader.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvflow.arch_config import load_arch_config
from kvflow.config import ConfigError, QuantConfig
from kvflow.models.loader import resolve_weight_files
from kvflow.parallel.model_loader import check_supported
from kvflow.parallel.sharded_reader import ShardedTensorReader
from kvflow.parallel.sharding import ShardLayout


def _whole(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_read_disjoint_slices_that_rebuild_every_tensor(
    world_size: int, tiny_checkpoint_factory: Callable[..., Path]
) -> None:
    """llama fixture: 4 query heads, 2 KV heads (replicated at N = 4), a sharded checkpoint."""
    model_dir = tiny_checkpoint_factory("llama", max_shard_size="100KB")
    arch = load_arch_config(model_dir)
    files = resolve_weight_files(model_dir)
    whole = _whole(model_dir)
    readers = [ShardedTensorReader(files, ShardLayout.plan(arch, r, world_size)) for r in range(world_size)]
    for name, tensor in whole.items():
        parts = [reader.read(name) for reader in readers]
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: input columns
            torch.testing.assert_close(torch.cat(parts, dim=1), tensor, rtol=0, atol=0)
        elif name.endswith(("k_proj.weight", "v_proj.weight")) and world_size > arch.num_key_value_heads:
            d = arch.head_dim
            for r, part in enumerate(parts):  # replicated: rank r holds the head its queries read
                head = r * arch.num_key_value_heads // world_size
                torch.testing.assert_close(part, tensor[head * d : (head + 1) * d], rtol=0, atol=0)
        elif "proj" in name or name in ("model.embed_tokens.weight", "lm_head.weight"):  # output rows
            torch.testing.assert_close(torch.cat(parts)[: tensor.shape[0]], tensor, rtol=0, atol=0)
        else:  # norms: replicated
            for part in parts:
                torch.testing.assert_close(part, tensor, rtol=0, atol=0)
    # What each rank reads: a 1/N share of everything but the norms (and the replicated KV heads).
    total = sum(t.numel() * t.element_size() for t in whole.values())
    assert max(r.bytes_read for r in readers) < 0.6 * total if world_size == 2 else 0.4 * total


def test_vocabulary_not_divisible_is_padded_with_zero_rows(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_checkpoint_factory("qwen2", vocab_size=511)  # 2 parts of 256, the last one short
    arch = load_arch_config(model_dir)
    files = resolve_weight_files(model_dir)
    last = ShardedTensorReader(files, ShardLayout.plan(arch, 1, 2)).read("model.embed_tokens.weight")
    assert last.shape[0] == 256
    assert torch.count_nonzero(last[-1]) == 0
    torch.testing.assert_close(
        last[:-1], _whole(model_dir)["model.embed_tokens.weight"][256:], rtol=0, atol=0
    )


def test_row_parallel_bias_is_held_by_rank_zero_only(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    model_dir = tiny_checkpoint_factory("llama", attention_bias=True, mlp_bias=True)
    arch = load_arch_config(model_dir)
    files = resolve_weight_files(model_dir)
    name = "model.layers.0.mlp.down_proj.bias"
    rank0, rank1 = (ShardedTensorReader(files, ShardLayout.plan(arch, r, 2)).read(name) for r in (0, 1))
    torch.testing.assert_close(rank0, _whole(model_dir)[name], rtol=0, atol=0)
    assert torch.count_nonzero(rank1) == 0


@pytest.mark.parametrize(
    ("overrides", "world_size", "quant", "message"),
    [
        ({}, 3, None, "must divide the 4 attention heads"),
        ({"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6}, 4, None, "6 KV heads"),
        ({"intermediate_size": 130}, 4, None, "intermediate_size 130"),
        # 4 heads x 16 / 2 ranks = 32 o_proj columns per rank: not whole groups of 64.
        ({}, 2, QuantConfig("int4", 64), "int4 group size 64 would be split across ranks"),
    ],
)
def test_sizes_that_cannot_split_are_refused(
    overrides: dict[str, int],
    world_size: int,
    quant: QuantConfig | None,
    message: str,
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    arch = load_arch_config(tiny_checkpoint_factory("llama", **overrides))
    with pytest.raises(ConfigError, match=message):
        ShardLayout.plan(arch, 0, world_size, quant)


def test_other_architectures_are_refused(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    model_dir = tiny_checkpoint_factory("llama")
    arch = load_arch_config(model_dir)
    moe = type(arch)(**{**arch.__dict__, "architecture": "MixtralForCausalLM"})
    with pytest.raises(ConfigError, match="not supported for MixtralForCausalLM"):
        check_supported(moe)

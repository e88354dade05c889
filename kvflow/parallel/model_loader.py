"""Checkpoint -> this rank's shard of the llama-family model (kvflow/models/loader.py does the
reading, through the WeightShard hooks implemented here).

Quantization at load stays per rank: int4 groups are never cut (sharding.py refuses sizes that
would), column-parallel int8 rows keep their own scales, and row-parallel int8 rows, whose inputs
are split, take the scale of the whole row (max |w| all-reduced over ranks), so that every rank
holds exactly its part of the weights TP=1 would quantize.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from kvflow.arch_config import ArchConfig, load_hf_config
from kvflow.config import ConfigError, QuantConfig
from kvflow.layers.linear import Linear
from kvflow.models.llama import MLP, Attention, DecoderLayer, LlamaFamilyForCausalLM
from kvflow.models.loader import load_model
from kvflow.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from kvflow.parallel.sharded_reader import ShardedTensorReader
from kvflow.parallel.sharding import ShardLayout
from kvflow.parallel.state import ParallelContext
from kvflow.quant.checkpoint_formats import parse_quantization_config
from kvflow.quant.linear import Int8Linear
from kvflow.quant.weights import INT8_MAX, Int8Weight

logger = logging.getLogger("kvflow")

# The architectures whose sharding sharding.py knows (dense llama-family attention and MLP); MoE and
# MLA models have other projections and are refused rather than split wrongly.
TENSOR_PARALLEL_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class TensorParallelShard:
    """kvflow/models/loader.py's WeightShard for one rank."""

    def __init__(self, layout: ShardLayout, ctx: ParallelContext, quant: QuantConfig | None) -> None:
        self.layout = layout
        self.ctx = ctx
        self.quant = quant
        self.arch = layout.arch
        self.sharded_reader: ShardedTensorReader | None = None

    def reader(self, files: dict[str, Path]) -> ShardedTensorReader:
        self.sharded_reader = ShardedTensorReader(files, self.layout)
        return self.sharded_reader

    def on_loaded(self, model: nn.Module) -> None:
        assert isinstance(model, LlamaFamilyForCausalLM)
        comm = self.ctx.comm
        for layer in model.layers:
            # TP>1 refuses MoE and latent attention before loading: the llama family's modules only.
            assert isinstance(layer, DecoderLayer)
            assert isinstance(layer.self_attn, Attention) and isinstance(layer.mlp, MLP)
            layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, comm)  # type: ignore[assignment]
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, comm)  # type: ignore[assignment]
        model.embed_tokens = VocabParallelEmbedding(
            model.embed_tokens.weight.data, self.layout.vocab_start, comm
        )  # type: ignore[assignment]
        model.lm_head = ParallelLMHead(model.lm_head, self.layout.full.vocab_size, comm)  # type: ignore[assignment]
        if self.quant is not None and self.quant.quantization == "int8":
            for module in model.modules():
                if isinstance(module, RowParallelLinear) and isinstance(module.linear, Linear):
                    module.linear = self._int8_whole_row_scales(module.linear)

    def _int8_whole_row_scales(self, linear: Linear) -> Int8Linear:
        """quantize_int8 with each row's scale taken over the whole row, all ranks' columns."""
        w = linear.weight.data.float()  # [out, in / N]
        amax = self.ctx.comm.all_reduce(w.abs().amax(dim=1).contiguous(), op="max")
        scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
        q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.data
        return Int8Linear(Int8Weight(q, scales), bias, linear.weight.dtype)


def check_supported(arch: ArchConfig) -> None:
    if arch.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ConfigError(
            f"tensor_parallel_size > 1 is not supported for {arch.architecture} (only "
            f"{', '.join(TENSOR_PARALLEL_ARCHITECTURES)}): run it with tensor_parallel_size 1"
        )


def load_shard(
    model_dir: Path,
    arch: ArchConfig,
    dtype: torch.dtype,
    max_positions: int,
    quant: QuantConfig | None,
    ctx: ParallelContext,
) -> LlamaFamilyForCausalLM:
    """This rank's part of the model, read from the files slice by slice."""
    check_supported(arch)
    checkpoint_quant = parse_quantization_config(load_hf_config(model_dir))
    layout = ShardLayout.plan(arch, ctx.rank, ctx.world_size, quant, checkpoint_quant)
    shard = TensorParallelShard(layout, ctx, quant)
    model = load_model(model_dir, arch, dtype, max_positions, quant, shard=shard)
    read = 0 if shard.sharded_reader is None else shard.sharded_reader.bytes_read
    logger.info("tensor parallel %s; read %.1f MiB of the checkpoint", layout.describe(), read / 2**20)
    return model

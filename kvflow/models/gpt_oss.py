"""gpt-oss (GptOssForCausalLM): the llama family's attention with sinks, sliding and full layers
alternating, and a mixture of experts on every layer.

By config switches (ArchConfig, kvflow/arch_kinds.py): q/k/v/o biases; one learned sink logit per
query head (kvflow/attention/paged_attention.py folds it into the softmax); `layer_types` puts every
other layer in the sliding-window cache group (window 128), the rest in the full one, so a 32k
request holds full-attention blocks for 32k tokens and sliding blocks for about 128
(kvflow/kv_cache/); YaRN rope. The MoE: the router's logits carry a bias, the top k are softmaxed
among themselves, and each expert is a biased SwiGLU clamped at `swiglu_limit`.

Checkpoint layout: the experts of a layer come fused, `mlp.experts.gate_up_proj` [E, hidden, 2I]
(x @ W, gate and up interleaved column by column) with `gate_up_proj_bias` [E, 2I], and
`mlp.experts.down_proj` [E, I, hidden] with `down_proj_bias` [E, hidden]; the router is
`mlp.router.{weight,bias}`. The loader slices them into kvflow's per-expert Linears [out, in]
(gate rows then up rows), so int8/int4 weight quantization applies to the experts as to any MoE.
The released checkpoints store the experts in MXFP4 (quantization_config quant_method mxfp4):
`gate_up_proj_blocks` [E, 2I, hidden / 32, 16] and `gate_up_proj_scales` [E, 2I, hidden / 32] (rows
interleaved gate / up as above), `down_proj_blocks` / `_scales` likewise; the rest stays bf16. In
bf16 with the native kernels each expert becomes a GGUFLinear over its MXFP4 codes (4.25 bits per
weight, gemv_ggml.cpp; swapped in by after_load, once the expert's bias is in); otherwise (float32,
no kernels) the codes are dequantized into the expert's float weight. A GGUF file holds the experts
split (llama.cpp's converter: `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` [E, out, in], biases
alike): `checkpoint_sources` names an expert's parts and the loader reads them like any projection.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvflow.arch_config import ArchConfig
from kvflow.errors import ModelLoadError
from kvflow.kernels import ggml_weight_kernels
from kvflow.layers.fused_moe import SparseMoE
from kvflow.layers.linear import Linear
from kvflow.models.llama import DecoderLayer, LlamaFamilyForCausalLM
from kvflow.models.moe import NATIVE_DECODE_UNSUPPORTED_MOE
from kvflow.quant.gguf_linear import GGUFLinear, select_rows, unpack_mxfp4_blocks

if TYPE_CHECKING:
    from kvflow.models.loader import TensorReader

_EXPERT_PARAM = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.(weight|bias)$")
_ROUTER_PARAM = re.compile(r"^(layers\.\d+\.mlp)\.gate\.(weight|bias)$")


class GptOssForCausalLM(LlamaFamilyForCausalLM):
    native_decode_unsupported = NATIVE_DECODE_UNSUPPORTED_MOE

    def make_layer(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module:
        assert cfg.moe is not None
        return DecoderLayer(cfg, dtype, mlp=SparseMoE(cfg.hidden_size, cfg.moe, dtype))

    def checkpoint_sources(self, param_name: str) -> list[str] | None:
        router = _ROUTER_PARAM.match(param_name)
        if router is not None:
            return [f"model.{router.group(1)}.router.{router.group(2)}"]
        expert = _EXPERT_PARAM.match(param_name)
        if expert is not None:  # a reader with one tensor per projection (a GGUF file's, split by
            # llama.cpp's converter into gate, up and down): gate rows, then up rows
            layer, index, proj, kind = expert.groups()
            base = f"model.layers.{layer}.mlp.experts.{index}"
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            return [f"{base}.{part}.{kind}" for part in parts]
        return None

    def load_param(self, name: str, param: torch.Tensor, reader: TensorReader, used: set[str]) -> bool:
        """Expert parameters from the fused tensors (module docstring); False for everything else."""
        match = _EXPERT_PARAM.match(name)
        if match is None:
            return False
        layer, expert, proj, kind = match.groups()
        source = f"model.layers.{layer}.mlp.experts.{proj}" + ("_bias" if kind == "bias" else "")
        if kind == "weight" and source not in reader.files and f"{source}_blocks" in reader.files:
            return self._load_mxfp4(name, param, reader, used, source, int(expert))
        split = self.checkpoint_sources(name) or []
        if source not in reader.files and split and all(s in reader.files for s in split):
            return False  # the loader reads the split tensors (checkpoint_sources), packed or not
        if source not in reader.files:
            raise ModelLoadError(f"checkpoint is missing tensor {source!r} (needed for {name})")
        fused = self._fused(reader, source)[int(expert)]  # weight [in, out] (x @ W), bias [out]
        if proj == "gate_up_proj":  # interleaved columns: gate 0, 2, 4, ...; up 1, 3, 5, ...
            fused = torch.cat((fused[..., 0::2], fused[..., 1::2]), dim=-1)
        value = fused.transpose(0, 1) if kind == "weight" else fused
        if tuple(value.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"shape mismatch for {name}: expected {tuple(param.shape)} from config.json, got "
                f"{tuple(value.shape)} from {source} {tuple(self._fused(reader, source).shape)}"
            )
        param.copy_(value.to(param.dtype))
        used.add(source)
        return True

    def _fused(self, reader: TensorReader, source: str) -> torch.Tensor:
        """Each fused tensor read once for all of its experts: the loader walks a layer's parameters
        expert by expert, so the four fused tensors of the current layer are kept, no more."""
        layer = source.split(".mlp.")[0]
        cache: dict[str, torch.Tensor] = self.__dict__.setdefault("_fused_cache", {})
        if source not in cache:
            for stale in [k for k in cache if not k.startswith(layer + ".")]:
                del cache[stale]
            cache[source] = reader.read(source)
        return cache[source]

    def _load_mxfp4(
        self, name: str, param: torch.Tensor, reader: TensorReader, used: set[str], source: str, expert: int
    ) -> bool:
        """One expert's weight from the layer's MXFP4 blocks and scales (module docstring)."""
        blocks = self._fused(reader, f"{source}_blocks")[expert]
        scales = self._fused(reader, f"{source}_scales")[expert]
        weight = unpack_mxfp4_blocks(blocks, scales)
        if source.endswith("gate_up_proj"):  # interleaved rows: gate 0, 2, 4, ...; up 1, 3, 5, ...
            n = weight.q.shape[0]
            weight = select_rows(weight, torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2))))
        if tuple(weight.q.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"shape mismatch for {name}: expected {tuple(param.shape)} from config.json, got "
                f"{tuple(weight.q.shape)} from {source}_blocks"
            )
        used.update((f"{source}_blocks", f"{source}_scales"))
        kernels = ggml_weight_kernels() if param.dtype == torch.bfloat16 else None
        if kernels is None:
            param.copy_(weight.dequantize().to(param.dtype))
            return True
        pending: dict[str, object] = self.__dict__.setdefault("_mxfp4_pending", {})
        pending[name.removesuffix(".weight")] = (weight, kernels)
        return True

    def after_load(self) -> None:
        self.__dict__.pop("_fused_cache", None)
        # The MXFP4 experts' layers, now that their biases are loaded.
        for path, (weight, kernels) in self.__dict__.pop("_mxfp4_pending", {}).items():
            linear = self.get_submodule(path)
            assert isinstance(linear, Linear)
            parent, _, attr = path.rpartition(".")
            bias = linear.bias.data if linear.bias is not None else None
            setattr(self.get_submodule(parent), attr, GGUFLinear(weight, bias, kernels))

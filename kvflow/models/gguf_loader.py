"""Read a GGUF file's tensors under the Hugging Face names kvflow's models are built from.

Names (llama.cpp's converter writes the right column for the left; kvflow asks by the left):
    model.embed_tokens / lm_head / model.norm              token_embd / output / output_norm
    layers.i.input_layernorm / post_attention_layernorm    blk.i.attn_norm / ffn_norm
    layers.i.self_attn.{q,k,v,o}_proj, {q,k}_norm          blk.i.attn_{q,k,v,output}, attn_{q,k}_norm
    layers.i.mlp.{gate,up,down}_proj, mlp.gate (router)     blk.i.ffn_{gate,up,down}, ffn_gate_inp
    layers.i.mlp.experts.e.{gate,up,down}_proj             blk.i.ffn_{gate,up,down}_exps, expert e's
                                                           slice of the [experts, out, in] tensor
Llama-architecture files hold attn_q / attn_k with their rows permuted into ggml's interleaved
rope order (the converter's `permute`); rows are whole quantization blocks, so the inverse
permutation is applied to the stored bytes, whatever the type.

Each tensor is read two ways: `read` gives it dequantized (float32 for block-quantized types, their
own dtype for F32 / F16 / BF16), as norms, embeddings and float32 models take it; `stored` gives
the type and raw bytes [rows, bytes per row], from which kvflow/quant/gguf_linear.py builds a layer
that computes on those bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvflow.arch_config import ArchConfig
from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_config import PERMUTED_QK_ARCHITECTURES
from kvflow.gguf.gguf_file import GGUFFile, GGUFTensor
from kvflow.quant.gguf_linear import KERNEL_TYPES, unpack_ggml

_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# (Hugging Face name, GGUF name) patterns; an expert's index is the group named "expert".
_NAME_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(hf), gguf)
    for hf, gguf in (
        (r"model\.embed_tokens\.weight", "token_embd.weight"),
        (r"lm_head\.weight", "output.weight"),
        (r"model\.norm\.weight", "output_norm.weight"),
        (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
        (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
        (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
        (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"blk.\1.attn_\2_norm.weight"),
        (r"model\.layers\.(\d+)\.self_attn\.sinks", r"blk.\1.attn_sinks.weight"),
        (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2.weight"),
        (r"model\.layers\.(\d+)\.mlp\.(?:gate|router)\.(weight|bias)", r"blk.\1.ffn_gate_inp.\2"),
        (
            r"model\.layers\.(\d+)\.mlp\.experts\.(?P<expert>\d+)\.(gate|up|down)_proj\.(weight|bias)",
            r"blk.\1.ffn_\3_exps.\4",
        ),
    )
)
# Architectures whose converter names a tensor otherwise (gpt-oss: the norm after attention).
_ARCH_RULES: dict[str, tuple[tuple[re.Pattern[str], str], ...]] = {
    "gpt-oss": (
        (
            re.compile(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight"),
            r"blk.\1.post_attention_norm.weight",
        ),
    ),
}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's rows as stored: `data` [rows, bytes per row] uint8 (copied out of the mapped file),
    `shape` [rows, K] in weights."""

    name: str  # the GGUF name (with the expert index where sliced)
    type_name: str
    shape: tuple[int, int]
    data: torch.Tensor


def gguf_name(hf_name: str, architecture: str = "") -> tuple[str, int | None] | None:
    """The GGUF tensor (and expert index) holding `hf_name` in a file of `architecture`, or None for a
    name GGUF has no rule for."""
    for pattern, replacement in (*_ARCH_RULES.get(architecture, ()), *_NAME_RULES):
        match = pattern.fullmatch(hf_name)
        if match is not None:
            expert = match.groupdict().get("expert")
            return match.expand(replacement), None if expert is None else int(expert)
    return None


class GGUFTensorReader:
    """kvflow's loader's TensorReader over one GGUF file (`files`: every Hugging Face name it serves)."""

    def __init__(self, gguf: GGUFFile, cfg: ArchConfig) -> None:
        self.gguf = gguf
        self.cfg = cfg
        self._permuted = gguf.architecture in PERMUTED_QK_ARCHITECTURES
        # GGUF name -> (type, bytes in the file, values) of each block-quantized tensor read as floats.
        self.dequantized: dict[str, tuple[str, int, int]] = {}
        # Hugging Face name -> (GGUF name, expert index), resolved once for every name in the file.
        self._names: dict[str, tuple[str, int | None]] = {}
        for name in _hf_names(cfg):
            found = gguf_name(name, gguf.architecture)
            if found is not None and found[0] in gguf.tensors:
                self._names[name] = found
        self.files: dict[str, Path] = dict.fromkeys(self._names, gguf.path)

    def _locate(self, hf_name: str) -> tuple[GGUFTensor, int | None]:
        found = self._names.get(hf_name)
        if found is None:
            raise ModelLoadError(f"{self.gguf.path}: no GGUF tensor holds {hf_name!r}")
        return self.gguf.tensors[found[0]], found[1]

    def missing_detail(self, hf_name: str) -> str:
        """Which GGUF tensor the file lacks for `hf_name` (the loader's missing-tensor error)."""
        found = gguf_name(hf_name, self.gguf.architecture)
        if found is None:
            return f"no GGUF tensor name is known for it ({self.gguf.path})"
        return f"the GGUF file {self.gguf.path} has no tensor {found[0]!r}"

    def stored_type(self, hf_name: str) -> str:
        return self._locate(hf_name)[0].type_name

    def stored(self, hf_name: str) -> StoredTensor:
        """The tensor's rows as stored (module docstring), q/k rows in Hugging Face order."""
        tensor, expert = self._locate(hf_name)
        data = tensor.data
        shape = tensor.shape
        if expert is not None:
            if len(shape) != 3 or not 0 <= expert < shape[0]:
                raise ModelLoadError(
                    f"{self.gguf.path}: tensor {tensor.name!r} {list(shape)} has no expert {expert}"
                )
            data, shape = data[expert], shape[1:]
        if len(shape) != 2:
            raise ModelLoadError(
                f"{self.gguf.path}: tensor {tensor.name!r} has dims {list(shape)}, expected 2"
            )
        # A copy: the file stays mapped read-only; the layers repack these bytes anyway.
        rows = torch.from_numpy(np.array(data, copy=True).view(np.uint8).reshape(shape[0], -1))
        rows = self._unpermute(hf_name, rows)
        name = tensor.name if expert is None else f"{tensor.name}[{expert}]"
        return StoredTensor(name, tensor.type_name, (shape[0], shape[1]), rows)

    def read(self, hf_name: str) -> torch.Tensor:
        """The tensor's values: F32 / F16 / BF16 as stored, block-quantized types dequantized to float32
        (_dequantized)."""
        tensor, expert = self._locate(hf_name)
        if tensor.type_name in _FLOAT_TYPES:
            values = _float_values(tensor)
        else:
            values = _dequantized(self.gguf.path, tensor)
            self.dequantized[tensor.name] = (tensor.type_name, tensor.num_bytes, values.numel())
        if expert is not None:
            values = values[expert]
        return self._unpermute(hf_name, values)

    def _unpermute(self, hf_name: str, rows: torch.Tensor) -> torch.Tensor:
        """Undo the converter's q/k row permutation for rope (Llama-architecture files only)."""
        if not self._permuted or not re.search(r"self_attn\.[qk]_proj\.", hf_name):
            return rows
        heads = self.cfg.num_attention_heads if ".q_proj." in hf_name else self.cfg.num_key_value_heads
        return rows[hf_rows_of_interleaved(rows.shape[0], heads)]


def hf_rows_of_interleaved(num_rows: int, num_heads: int) -> torch.Tensor:
    """Index [num_rows]: row r of the Hugging Face (rotate-half) layout is row index[r] of ggml's
    interleaved one. The converter maps HF row (h, j, i) (head h, half j, pair i) to ggml row
    (h, i, j); the inverse reads ggml's rows in HF order."""
    half = num_rows // num_heads // 2
    ggml = torch.arange(num_rows).reshape(num_heads, half, 2)  # ggml row of (h, i, j)
    return ggml.transpose(1, 2).reshape(num_rows)  # ordered (h, j, i)


def _float_values(tensor: GGUFTensor) -> torch.Tensor:
    if tensor.type_name == "BF16":  # the reader maps BF16 as raw bytes [..., 2K]
        bits = np.array(tensor.data, copy=True).view(np.int16).reshape(tensor.shape)
        return torch.from_numpy(bits).view(torch.bfloat16)
    return torch.from_numpy(np.array(tensor.data, copy=True).reshape(tensor.shape))


def _dequantized(path: Path, tensor: GGUFTensor) -> torch.Tensor:
    """float32 values of a block-quantized tensor: the kernels' unpacking for their types (torch,
    ~3x the gguf package's numpy on an embedding table), the gguf package's reference for the rest."""
    if tensor.type_name in KERNEL_TYPES:
        rows = torch.from_numpy(np.array(tensor.data, copy=True)).reshape(-1, tensor.data.shape[-1])
        flat = (math.prod(tensor.shape[:-1]), tensor.shape[-1])
        return (
            unpack_ggml(tensor.type_name, rows, flat, f"{path}: {tensor.name}")
            .dequantize()
            .reshape(tensor.shape)
        )
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, GGMLQuantizationType(tensor.ggml_type))
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} is {tensor.type_name}, which kvflow cannot read yet"
        ) from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(tensor.shape))


def _hf_names(cfg: ArchConfig) -> list[str]:
    """Every Hugging Face tensor name a model of `cfg` may ask for."""
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{x}_proj.{w}" for x in "qkvo" for w in ("weight", "bias")]
        names += [f"{p}.self_attn.{x}_norm.weight" for x in "qk"] + [f"{p}.self_attn.sinks"]
        names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"{p}.mlp.{r}.{w}" for r in ("gate", "router") for w in ("weight", "bias")]
        if cfg.moe is not None:
            names += [
                f"{p}.mlp.experts.{e}.{x}_proj.{w}"
                for e in range(cfg.moe.num_experts)
                for x in ("gate", "up", "down")
                for w in ("weight", "bias")
            ]
    return names

"""Load a Hugging Face checkpoint directory (single or sharded safetensors) into kvflow's model.

Every parameter of the model names the checkpoint tensors it is made of (merged projections
concatenate theirs along the output dimension); each source is checked for presence and shape,
and an error names the tensor and the file. The model is built on the meta device and
materialised uninitialised: every parameter is then overwritten from the checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from kvflow.arch_config import ArchConfig, load_hf_config
from kvflow.config import QuantConfig
from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_file import is_gguf_path, open_gguf
from kvflow.layers.linear import Linear
from kvflow.models.gguf_builder import GGUFLinearBuilder
from kvflow.models.gguf_loader import GGUFTensorReader
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.models.registry import MODEL_REGISTRY
from kvflow.quant.apply import quantize_model
from kvflow.quant.checkpoint_formats import (
    TENSOR_SUFFIXES,
    UNPACKERS,
    CheckpointQuant,
    parse_quantization_config,
)
from kvflow.quant.prequantized import build_linear, is_prequantized, unpack_source

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes (RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Merged parameters: kvflow name fragment -> the checkpoint fragments concatenated (dim 0) in order.
_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def resolve_weight_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise ModelLoadError(f"{index}: lists {path.name}, which is missing")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    files = {}
    for path in shards:
        with open_safetensors(path) as f:
            files.update({name: path for name in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return files


def open_safetensors(path: Path) -> Any:
    """safe_open(path), or a ModelLoadError naming the file (a truncated download, a corrupt header)."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ValueError
        raise ModelLoadError(_unreadable(path, exc)) from exc


def _unreadable(path: Path, exc: Exception) -> str:
    return (
        f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc}); the download may be "
        "truncated or corrupt: fetch it again"
    )


def _sources(param_name: str, cfg: ArchConfig, available: set[str]) -> list[str]:
    """The checkpoint tensors one kvflow parameter is built from."""
    if param_name == "lm_head.weight":
        if cfg.tie_word_embeddings or "lm_head.weight" not in available:
            return ["model.embed_tokens.weight"]
        return ["lm_head.weight"]
    for merged, parts in _MERGED.items():
        if merged in param_name:
            return ["model." + param_name.replace(merged, part) for part in parts]
    return ["model." + param_name]


class TensorReader(Protocol):
    files: dict[str, Path]

    def read(self, name: str) -> torch.Tensor: ...


class WeightShard(Protocol):
    """Tensor parallelism's hooks (kvflow/parallel/model_loader.py): the per-rank shapes the model
    is built with, a reader of this rank's slices only, and the module swaps made (before any
    quantization) once the weights are in."""

    arch: ArchConfig

    def reader(self, files: dict[str, Path]) -> TensorReader: ...

    def on_loaded(self, model: nn.Module) -> None: ...


class _ShardReader:
    """Opens each safetensors file once and reads tensors by name."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._handles: dict[Path, object] = {}

    def read(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = open_safetensors(path)
        try:
            return self._handles[path].get_tensor(name)  # type: ignore[attr-defined]
        except Exception as exc:  # the header lists bytes the file does not hold (truncated)
            raise ModelLoadError(f"{_unreadable(path, exc)} (reading tensor {name!r})") from exc


# Storage dtypes of quantized checkpoint tensors (FP8 e4m3 / e5m2; FP4 or int packed into bytes).
QUANTIZED_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)


def load_param_sources(name: str, param: torch.Tensor, sources: list[str], reader: TensorReader) -> None:
    """Copy the checkpoint tensors `sources` (concatenated along dim 0) into `param`, or a
    ModelLoadError naming the tensor: missing, of the wrong shape, or quantized storage for a
    floating-point parameter (a format the checkpoint's quantization_config names that no
    kvflow layer reads for this projection: the bytes would be taken as numbers)."""
    for src in sources:
        if src not in reader.files:
            # A reader whose files name tensors otherwise (GGUF) says which of its own is missing.
            detail = getattr(reader, "missing_detail", None)
            where = f": {detail(src)}" if detail is not None else ""
            raise ModelLoadError(f"checkpoint is missing tensor {src!r} (needed for {name}){where}")
    tensors = [reader.read(src) for src in sources]
    for src, tensor in zip(sources, tensors, strict=True):
        if tensor.dtype in QUANTIZED_STORAGE and param.is_floating_point():
            raise ModelLoadError(
                f"{src} is stored as {tensor.dtype} (the checkpoint's quantization_config): kvflow does not "
                f"read that format for {name} yet; use a bf16 or float32 checkpoint"
            )
    merged = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    if tuple(merged.shape) != tuple(param.shape):
        detail = ", ".join(
            f"{s} {tuple(t.shape)} in {reader.files[s].name}" for s, t in zip(sources, tensors, strict=False)
        )
        raise ModelLoadError(
            f"shape mismatch for {name}: expected {tuple(param.shape)} from config.json, got {detail}"
        )
    param.copy_(merged.to(param.dtype))


def load_model(
    model_dir: Path,
    cfg: ArchConfig,
    dtype: torch.dtype,
    max_positions: int,
    quant: QuantConfig | None = None,
    shard: WeightShard | None = None,
) -> LlamaFamilyForCausalLM:
    """`model_dir`: a Hugging Face checkpoint directory or a GGUF file; `shard`: load one
    tensor-parallel rank's part (kvflow/parallel/) instead of the whole model."""
    source = open_weights(model_dir, cfg, dtype, shard)
    with torch.device("meta"):
        model = MODEL_REGISTRY[cfg.architecture](cfg if shard is None else shard.arch, dtype, max_positions)
    model.to_empty(device="cpu")
    model.reset_rotary(max_positions)  # buffers were meta: recompute
    with torch.no_grad():
        used, packed = _load_params(model, cfg, source)
        for path, module in packed.items():
            parent_path, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent_path), attr, module)
    source.log_loaded(len(packed))
    unused = [
        n
        for n in source.reader.files
        if n not in used and not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight"
    ]
    if unused:
        logger.warning("ignoring %d checkpoint tensors kvflow does not use, e.g. %s", len(unused), unused[:3])
    model.eval()
    after_load = getattr(model, "after_load", None)
    if after_load is not None:  # e.g. RMSNorm weights stored as w, applied as (1 + w)
        after_load()
    if shard is not None:
        shard.on_loaded(model)
    if quant is not None:
        quantize_model(model, quant)
    model.prepare_for_inference()
    return model


@dataclass
class WeightSource:
    """Where a model's tensors come from: a reader by Hugging Face name, and what builds a packed
    layer from a projection's sources (a pre-quantized checkpoint's, a GGUF file's blocks)."""

    reader: TensorReader
    checkpoint_quant: CheckpointQuant | None = None
    gguf: GGUFLinearBuilder | None = None
    # The reader's tensor names as a set, built once: asked per parameter (18k in a 128-expert MoE).
    available: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.available = set(self.reader.files)

    def is_packed(self, sources: list[str]) -> bool:
        """Whether the projection made of `sources` is built from its stored blocks (not as floats)."""
        if self.gguf is not None:
            return self.gguf.is_packed(sources)
        quant = self.checkpoint_quant
        if quant is None or quant.method not in UNPACKERS:  # mxfp4: the family reads its own tensors
            return False
        return all(is_prequantized(s.removesuffix(".weight"), self.available, quant) for s in sources)

    def build_packed(self, sources: list[str], linear: Linear, used: set[str]) -> nn.Module:
        """The layer replacing `linear` (bias already loaded), built from its sources' blocks."""
        bias = linear.bias.data if linear.bias is not None else None
        if self.gguf is not None:
            used.update(sources)
            return self.gguf.build(sources, bias)
        quant = self.checkpoint_quant
        assert quant is not None
        bases = [s.removesuffix(".weight") for s in sources]
        parts = [unpack_source(b, quant, self.reader.read, self.available) for b in bases]
        used.update(f"{b}.{suffix}" for b in bases for suffix in TENSOR_SUFFIXES[quant.method])
        return build_linear(parts, bias, linear.weight.dtype)

    def log_loaded(self, num_packed: int) -> None:
        quant = self.checkpoint_quant
        if num_packed and quant is not None:
            logger.info(
                "%s checkpoint (%d-bit, group %d%s): %d projections loaded packed",
                quant.method,
                quant.bits,
                quant.group_size,
                ", act-order" if quant.desc_act else "",
                num_packed,
            )
        if self.gguf is not None:
            self.gguf.log_summary()


def open_weights(
    model_path: Path, cfg: ArchConfig, dtype: torch.dtype, shard: WeightShard | None = None
) -> WeightSource:
    """The tensors of a checkpoint directory (safetensors, maybe pre-quantized) or a GGUF file."""
    if is_gguf_path(model_path):
        if shard is not None:
            raise ModelLoadError(f"{model_path}: tensor parallel over a GGUF file is not supported yet")
        reader = GGUFTensorReader(open_gguf(model_path), cfg)
        return WeightSource(reader, gguf=GGUFLinearBuilder(reader, dtype))
    files = resolve_weight_files(model_path)
    tensors: TensorReader = _ShardReader(files) if shard is None else shard.reader(files)
    return WeightSource(tensors, parse_quantization_config(load_hf_config(model_path)))


def _load_params(
    model: LlamaFamilyForCausalLM, cfg: ArchConfig, source: WeightSource
) -> tuple[set[str], dict[str, nn.Module]]:
    """Copy every parameter in from `source`; returns the checkpoint names used and the packed
    layers (module path -> module) that replace float ones."""
    reader = source.reader
    used: set[str] = set()
    packed_sources: dict[str, list[str]] = {}  # module path -> its weight's sources, stored packed
    available = source.available
    # Families with their own checkpoint names (experts, routers) map those themselves.
    family_sources = getattr(model, "checkpoint_sources", None)
    # Families whose checkpoint tensors need more than a concatenation (gpt-oss's fused experts),
    # told the checkpoint's quantization first (DeepSeek-V4's FP8 / FP4 tensors).
    family_load = getattr(model, "load_param", None)
    begin_load = getattr(model, "begin_load", None)
    if begin_load is not None:
        begin_load(source.checkpoint_quant)
    for name, param in model.named_parameters():
        if family_load is not None and family_load(name, param, reader, used):
            continue
        sources = (family_sources and family_sources(name)) or _sources(name, cfg, available)
        path = name.removesuffix(".weight")
        if (
            name.endswith(".weight")
            and isinstance(model.get_submodule(path), Linear)
            and source.is_packed(sources)
        ):
            packed_sources[path] = sources
            continue
        load_param_sources(name, param, sources, reader)
        used.update(sources)
    # Built once every float parameter is in: a projection's bias is registered after its weight.
    packed = {}
    for path, sources in packed_sources.items():
        linear = model.get_submodule(path)
        assert isinstance(linear, Linear)
        packed[path] = source.build_packed(sources, linear, used)
    return used, packed

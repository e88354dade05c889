"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style, as vLLM).

With N ranks, rank r of an H-query-head, Hkv-KV-head, I-wide-MLP, V-token model holds:
    q_proj                 rows of query heads [r H/N, (r+1) H/N)                column-parallel
    k_proj, v_proj         rows of its KV heads: Hkv/N of them, or, when N > Hkv, the one head its
                           query heads read (replicated on N/Hkv ranks, as vLLM does)
    o_proj                 the matching input columns of the query heads           row-parallel
    gate_proj, up_proj     rows [r I/N, (r+1) I/N)                                 column-parallel
    down_proj              the matching input columns                              row-parallel
    embed_tokens, lm_head  rows of its vocabulary part [r Vp, (r+1) Vp), Vp = ceil(V / N); rows past
                           V are zeros (padding: never looked up, their logits are cut)
    norms                  whole (replicated)
Row-parallel outputs are partial sums, all-reduced once per layer each; their bias is added once:
rank 0 holds it, the others zeros (vLLM's rule). Column-parallel biases are sliced like the rows.

int4 weights quantized at load keep their groups of g inputs whole: a row-parallel layer's input
part per rank (H/N x head_dim, I/N) must be a multiple of g, or the size is refused; column-parallel
layers split output rows only, which never cuts a group.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from kvflow.arch_config import ArchConfig
from kvflow.config import ConfigError, QuantConfig
from kvflow.parallel.prequantized_slices import PackedSlice, check_alignment, packed_slice
from kvflow.quant.checkpoint_formats import CheckpointQuant

# A checkpoint tensor's projection and kind: model.layers.<i>.<module>.<proj>.<weight|bias>.
_PROJECTION = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TensorSlice:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a checkpoint tensor; `pad_to` pads
    dim 0 with zero rows (the vocabulary's last part); `zeros`: a zero tensor of the full shape
    instead (a row-parallel bias on ranks other than 0)."""

    dim: int
    start: int
    length: int
    pad_to: int | None = None
    zeros: bool = False


_PACKED_PROJECTION = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\."
    r"(qweight|qzeros|scales|g_idx|weight_packed|weight_scale|weight_scale_inv|weight_zero_point|weight_shape)$"
)


@dataclass(frozen=True)
class ShardLayout:
    full: ArchConfig
    rank: int
    world_size: int
    checkpoint_quant: CheckpointQuant | None = None  # a pre-quantized checkpoint's format

    @staticmethod
    def plan(
        arch: ArchConfig,
        rank: int,
        world_size: int,
        quant: QuantConfig | None = None,
        checkpoint_quant: CheckpointQuant | None = None,
    ) -> ShardLayout:
        """The layout of `rank`, or a ConfigError saying why the model cannot be split N ways."""
        n = world_size
        h, hkv, inter = arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size
        if h % n:
            raise ConfigError(f"tensor_parallel_size {n} must divide the {h} attention heads")
        if hkv % n and n % hkv:
            raise ConfigError(
                f"tensor_parallel_size {n} must divide the {hkv} KV heads or be a multiple of them "
                "(then each KV head is replicated on N / num_kv_heads ranks)"
            )
        if inter % n:
            raise ConfigError(f"tensor_parallel_size {n} must divide intermediate_size {inter}")
        if quant is not None and quant.quantization == "int4":
            g = quant.quantization_group_size
            for what, width in (("o_proj", h // n * arch.head_dim), ("down_proj", inter // n)):
                if width % g:
                    raise ConfigError(
                        f"int4 group size {g} would be split across ranks: with tensor_parallel_size {n} "
                        f"each rank's {what} holds {width} input columns, not a multiple of {g}; choose "
                        "a tensor_parallel_size or quantization_group_size that divides it"
                    )
        if checkpoint_quant is not None and checkpoint_quant.method == "mxfp4":
            raise ConfigError(
                "tensor parallelism over mxfp4 checkpoints (gpt-oss's experts) is not supported yet: run "
                "them with tensor_parallel_size 1"
            )
        if checkpoint_quant is not None:
            q_width, inter_width = h // n * arch.head_dim, inter // n
            kv_width = max(1, hkv // n) * arch.head_dim
            check_alignment(
                checkpoint_quant,
                {"q_proj": q_width, "k_proj/v_proj": kv_width, "gate_proj/up_proj": inter_width},
                {"o_proj": q_width, "down_proj": inter_width},
            )
        return ShardLayout(arch, rank, n, checkpoint_quant)

    @property
    def num_heads(self) -> int:
        return self.full.num_attention_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.full.num_key_value_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head of this rank (with replication, the head its query heads read)."""
        hkv = self.full.num_key_value_heads
        if hkv >= self.world_size:
            return self.rank * self.num_kv_heads
        return self.rank * hkv // self.world_size

    @property
    def replicated_kv(self) -> bool:
        return self.full.num_key_value_heads < self.world_size

    @property
    def intermediate_size(self) -> int:
        return self.full.intermediate_size // self.world_size

    @property
    def vocab_part(self) -> int:
        """Vocabulary rows per rank (the last part padded up to it)."""
        return -(-self.full.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_part

    @property
    def arch(self) -> ArchConfig:
        """The per-rank shapes the model is built with (vocab_size: this rank's part)."""
        return dataclasses.replace(
            self.full,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_part,
        )

    def slice_of(self, name: str) -> TensorSlice | None:
        """This rank's part of checkpoint tensor `name`; None: the whole tensor (replicated)."""
        d = self.full.head_dim
        if name in _VOCAB_TENSORS:
            start = self.vocab_start
            length = max(0, min(self.full.vocab_size, start + self.vocab_part) - start)
            return TensorSlice(0, start, length, pad_to=self.vocab_part)
        match = _PROJECTION.search(name)
        if match is None:
            return None  # norms: replicated
        proj, kind = match.groups()
        if proj == "q_proj":
            return TensorSlice(0, self.rank * self.num_heads * d, self.num_heads * d)
        if proj in ("k_proj", "v_proj"):
            return TensorSlice(0, self.kv_head_start * d, self.num_kv_heads * d)
        if proj in ("gate_proj", "up_proj"):
            return TensorSlice(0, self.rank * self.intermediate_size, self.intermediate_size)
        # o_proj, down_proj: row-parallel
        if kind == "bias":
            return None if self.rank == 0 else TensorSlice(0, 0, 0, zeros=True)
        width = self.num_heads * d if proj == "o_proj" else self.intermediate_size
        return TensorSlice(1, self.rank * width, width)

    def packed_slice_of(self, name: str) -> PackedSlice | None:
        """This rank's part of a pre-quantized projection's tensor (prequantized_slices.py); None
        when `name` is not one."""
        match = _PACKED_PROJECTION.search(name)
        if match is None or self.checkpoint_quant is None:
            return None
        proj, suffix = match.groups()
        d, hidden = self.full.head_dim, self.full.hidden_size
        q_width, inter = self.num_heads * d, self.intermediate_size
        ranges = {  # projection -> (column-parallel, start, end, outputs, inputs) of the whole layer
            "q_proj": (True, self.rank * q_width, (self.rank + 1) * q_width, 0, hidden),
            "k_proj": (True, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d, 0, hidden),
            "gate_proj": (True, self.rank * inter, (self.rank + 1) * inter, 0, hidden),
            "o_proj": (False, self.rank * q_width, (self.rank + 1) * q_width, hidden, 0),
            "down_proj": (False, self.rank * inter, (self.rank + 1) * inter, hidden, 0),
        }
        ranges["v_proj"], ranges["up_proj"] = ranges["k_proj"], ranges["gate_proj"]
        column, start, end, full_out, full_in = ranges[proj]
        return packed_slice(self.checkpoint_quant, suffix, column, start, end, full_out, full_in)

    def describe(self) -> str:
        """The startup log's line on what this rank holds."""
        f = self.full
        kv = (
            f"KV head {self.kv_head_start} of {f.num_key_value_heads} (replicated on "
            f"{self.world_size // f.num_key_value_heads} ranks)"
            if self.replicated_kv
            else f"KV heads [{self.kv_head_start}, {self.kv_head_start + self.num_kv_heads}) of "
            f"{f.num_key_value_heads}"
        )
        return (
            f"rank {self.rank}/{self.world_size}: query heads [{self.rank * self.num_heads}, "
            f"{(self.rank + 1) * self.num_heads}) of {f.num_attention_heads}, {kv}, MLP columns "
            f"{self.intermediate_size} of {f.intermediate_size}, vocabulary rows [{self.vocab_start}, "
            f"{min(f.vocab_size, self.vocab_start + self.vocab_part)}) of {f.vocab_size}"
        )

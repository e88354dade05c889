"""Optional native CPU kernels, compiled on first use with ninja (ninja_build.py).

- `skinny_linear_bf16()`: the bf16 GEMV (vdpbf16ps) for few-row (decode) linears on 16-row tiles of the
  weights, and the tiling (gemv_bf16.cpp);
- `paged_decode_attention_bf16()` / `paged_decode_attention_quantized()`: decode attention read in
  place from the paged KV pool, bf16 or int8 / fp8_e4m3 / int4 (paged_decode_attention.cpp);
- `prefill_attention_bf16()`: causal attention of a prefill chunk over a bf16 pool, flash style
  (prefill_attention.cpp); the attention kernels take optional per-head sink logits (gpt-oss;
  attention_sinks.h);
- `int8_weight_kernels()` / `int4_weight_kernels()`: weight-only GEMVs on 16-row tiles with VNNI
  for decode and row-block dequantization for prefill (gemv_int8.cpp, gemv_int4.cpp);
  `fp8_weight_kernel()`: the FP8 (e4m3, block-scaled) decode GEMV over the checkpoint's bytes
  (gemv_fp8.cpp); `ggml_weight_kernels()`: a GGUF file's block types (Q8_0 on the int8 tiles,
  Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K in gemv_ggml.cpp);
- `argmax_rows()`: greedy sampling's argmax over the vocabulary (argmax.cpp);
- `on_huge_pages()` / `zeros_on_huge_pages()`: tensors on 2 MiB transparent huge pages, for the
  weights and KV pools decode streams (huge_pages.cpp);
- `elementwise_kernels()`: bf16 RMSNorm and SiLU-and-mul in one pass each (elementwise.cpp);
- `native_decoder_classes()`: the decoder layers of a decode step in one native call, over the
  kernels above (decode_forward.cpp; built by kvflow/models/native_decoder.py).
The kernels are written in AVX-512 intrinsics and built for the best of two targets the CPU runs
(`simd_target`): AVX512-BF16 + VNNI (Zen 4, Sapphire Rapids), or AVX2 + FMA + F16C (Zen 2/3, Intel
client cores), where simd.h supplies the same intrinsics over pairs of 256-bit registers
(avx512_on_avx2.h). Each returns None when the CPU has neither, no compiler is available, or the
build fails; callers then keep the generic torch path. The build (~21 s on 2 cores, once per
sources, torch, compiler and target; `kvflow build-kernels` does it ahead of time) is cached under
~/.cache/kvflow/kernels (KVFLOW_KERNEL_CACHE), one process at a time under a lock that dies with its
process (build_cache.py); KVFLOW_DISABLE_KERNELS=1 skips it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import torch

from kvflow.kernels.build_cache import (
    build_dir_for,
    build_progress,
    cache_root,
    locked_build,
    sources_key,
    toolchain_key,
)
from kvflow.kernels.ninja_build import (
    compile_flags,
    import_extension,
    link_flags,
    run_ninja,
    write_build_file,
)

logger = logging.getLogger(__name__)

# (x [M <= 8, K] bf16, weight tiles [N_pad / 16, K / 2, 16, 2] bf16, N, bias) -> [M, N] bf16
SkinnyLinear = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]
# W [N, K] bf16 -> its 16-row tiles (layout in gemv_bf16.cpp)
TileBf16Weight = Callable[[torch.Tensor], torch.Tensor]


# The attention kernels' `sinks`: [Hq] float32 sink logits, one per query head (gpt-oss: the
# softmax's denominator gets exp(sinks[h] - max), with no value), or None for the plain softmax
# (bit for bit the result without the argument). Keyword names as bound in bindings.cpp.
class PagedDecodeAttention(Protocol):
    """(q [B, Hq, D] bf16, key_cache [S, Hkv, D] bf16, value_cache, slots [B, L] int64, seq_lens [B]
    int64, scale, sinks) -> [B, Hq, D] bf16: row b attends the keys at slots[b, :seq_lens[b]]."""

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PrefillAttention(Protocol):
    """(q [n, Hq, D] bf16, key_cache [S, Hkv, D] bf16, value_cache, slots [L] int64, scale, sinks)
    -> [n, Hq, D] bf16; query i is position L - n + i and attends the first L - n + i + 1 keys of
    `slots`."""

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PagedDecodeAttentionQuantized(Protocol):
    """PagedDecodeAttention over a quantized pool (kvflow/attention/kv_layer.py QuantizedPools):
    kind "int8" | "fp8_e4m3" | "int4"; k_zero / v_zero are read for int4 only."""

    def __call__(
        self,
        q: torch.Tensor,
        k_data: torch.Tensor,
        k_scale: torch.Tensor,
        k_zero: torch.Tensor,
        v_data: torch.Tensor,
        v_scale: torch.Tensor,
        v_zero: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        kind: str,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


# (x [M, K] bf16, tiles [N_pad / 16, K_pad / 4, 16, 4] uint8, scales [N] fp32, bias) -> [M, N] bf16
# (layout in gemv_int8.cpp)
SkinnyLinearInt8 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (tiles, scales [N] fp32, K, n_begin (a multiple of 16), n_end) -> [n_end - n_begin, K] bf16
DequantizeInt8Rows = Callable[[torch.Tensor, torch.Tensor, int, int, int], torch.Tensor]
# (x [M, K] bf16, packed 16-row tiles [N_pad / 16, 8K] uint8, scales [N_pad / 16, K / g, 16] bf16,
#  mins, g, N, bias) -> [M, N] bf16 (layout in gemv_int4.cpp)
SkinnyLinearInt4 = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, torch.Tensor | None], torch.Tensor
]
# (packed, scales, mins, g, N, n_begin, n_end) -> [n_end - n_begin, K] bf16; n_begin % 16 == 0
DequantizeInt4Rows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int], torch.Tensor]
# Longest first (their compile times on 2 cores, benchmarks/NOTES.md session 23): ninja starts units
# in this order, so the long ones do not start last and stretch the build.
_SOURCES = (
    "bindings.cpp",  # 10.7 s (pybind11), needs no precompiled header: starts at once
    "gemv_ggml.cpp",  # 10.3 s
    "decode_forward.cpp",  # 9.4 s
    "paged_decode_attention.cpp",
    "gemv_int8.cpp",
    "gemv_fp8.cpp",
    "gemv_int4.cpp",
    "gemv_bf16.cpp",
    "prefill_attention.cpp",
    "argmax.cpp",
    "elementwise.cpp",
    "huge_pages.cpp",
)


class SimdTarget(NamedTuple):
    """An instruction set the kernels build for: the CPU flags it needs and the compiler's."""

    name: str
    required_cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]


# The kernels are written in AVX-512 intrinsics (simd.h). On an AVX2 CPU they build against
# avx512_on_avx2.h, which supplies those intrinsics over pairs of 256-bit registers.
AVX512_BF16 = SimdTarget(
    "avx512-bf16",
    ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c", "bmi2"),
    ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c", "-mbmi2", "-fopenmp"),
)
AVX2 = SimdTarget(
    "avx2", ("avx2", "fma", "f16c", "bmi2"), ("-O3", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-fopenmp")
)
_TARGETS = (AVX512_BF16, AVX2)  # preference order


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def simd_target(cpu_flags: set[str] | None = None) -> SimdTarget | None:
    """The best target this CPU runs (`cpu_flags` as /proc/cpuinfo spells them), or None."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    return next((t for t in _TARGETS if all(f in flags for f in t.required_cpu_flags)), None)


_LDFLAGS = ("-fopenmp",)
_MODULE_NAME = "kvflow_cpu_kernels"
_HERE = Path(__file__).parent


class NativeBuild(NamedTuple):
    """The native module, or None and why not."""

    module: ModuleType | None
    reason: str
    build_dir: Path | None = None


def native_build_dir(target: SimdTarget) -> Path:
    """Where this kvflow's kernels are built for `target` and this torch, Python and compiler."""
    # ninja_build.py is the recipe (flags per unit, the precompiled header): a new recipe, a new build.
    inputs = [*(_HERE / s for s in _SOURCES), *sorted(_HERE.glob("*.h")), _HERE / "ninja_build.py"]
    return build_dir_for(cache_root(), toolchain_key(target.cflags, _LDFLAGS), sources_key(inputs))


@functools.cache
def native_build() -> NativeBuild:
    """Load the native kernels, building them first if this key has no build (once per process)."""
    if os.environ.get("KVFLOW_DISABLE_KERNELS") == "1":
        return NativeBuild(None, "disabled by KVFLOW_DISABLE_KERNELS=1")
    target = simd_target()
    if target is None:
        wanted = " or ".join(" + ".join(t.required_cpu_flags) for t in _TARGETS)
        logger.info("native kernels disabled: this CPU has neither %s", wanted)
        return NativeBuild(None, f"this CPU has neither {wanted}")
    sources = [_HERE / s for s in _SOURCES]
    build_dir: Path | None = None
    try:
        build_dir = native_build_dir(target)

        def load(directory: Path) -> ModuleType:
            return import_extension(directory / f"{_MODULE_NAME}.so", _MODULE_NAME)

        def build(directory: Path) -> ModuleType:
            # Not skipped when a .so is there: a new key's directory starts as a copy of an older
            # build (build_cache.py), which ninja brings up to date unit by unit.
            write_build_file(
                directory,
                sources,
                _MODULE_NAME,
                compile_flags(_MODULE_NAME, target.cflags),
                link_flags(_LDFLAGS),
                pch_source=_HERE / "aten_lite.h",
            )
            for warning in run_ninja(directory, progress=build_progress):
                logger.warning("native kernels' build: %s", warning)
            return load(directory)

        module = locked_build(
            build_dir,
            build,
            "kvflow's native CPU kernels",
            is_built=lambda d: (d / f"{_MODULE_NAME}.so").exists(),
            load=load,  # a finished build (linked last, under the lock) loads without ninja
        )
        return NativeBuild(module, f"built for {target.name}", build_dir)
    except Exception as e:  # a missing compiler or ninja, or a stuck build, must not stop the engine
        logger.warning("native bf16 kernels unavailable (build failed: %s); using torch paths", e)
        return NativeBuild(None, f"the build failed: {e}", build_dir)


def _native_module() -> ModuleType | None:
    return native_build().module


def skinny_linear_bf16() -> tuple[SkinnyLinear, TileBf16Weight] | None:
    module = _native_module()
    return None if module is None else (module.skinny_linear_bf16, module.tile_bf16_weight)


# Tensors smaller than this stay where they are: a huge-page buffer rounds up to 2 MiB, and a tensor
# that spans a few 4 KiB pages costs a few TLB misses per step at most.
HUGE_PAGE_MIN_BYTES = 2 << 20


def _huge_page_buffer(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised tensor on transparent huge pages (huge_pages.cpp), or None when it would be
    small or the native module is missing."""
    module = _native_module()
    nbytes = math.prod(shape) * dtype.itemsize
    if module is None or nbytes < HUGE_PAGE_MIN_BYTES:
        return None
    return module.empty_huge_pages(nbytes).view(dtype).view(shape)


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous, CPU) copied onto transparent huge pages (fewer TLB misses for data read
    in full every decode step), or itself when it is small, not a contiguous CPU tensor, or the
    native module is missing. Same dtype, shape and values."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return tensor
    buffer = _huge_page_buffer(tensor.shape, tensor.dtype)
    return tensor if buffer is None else buffer.copy_(tensor)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype), on transparent huge pages when large and the native module
    is built (the KV pools: decode attention reads a block per page otherwise)."""
    buffer = _huge_page_buffer(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if buffer is None else buffer.zero_()


def argmax_rows() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """logits [R, V] fp32 or bf16 -> [R] int64: torch.argmax(logits, -1), vectorised (argmax.cpp)."""
    module = _native_module()
    return None if module is None else module.argmax_rows


class ElementwiseKernels(NamedTuple):
    """elementwise.cpp: a decoder layer's bf16 element-wise steps, one pass each."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x [R, H], w [H], eps) -> [R, H]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # [R, 2I] ([gate | up]) -> [R, I]


def elementwise_kernels() -> ElementwiseKernels | None:
    module = _native_module()
    return None if module is None else ElementwiseKernels(module.rms_norm_bf16, module.silu_and_mul_bf16)


def paged_decode_attention_bf16() -> PagedDecodeAttention | None:
    module = _native_module()
    return None if module is None else module.paged_decode_attention_bf16


def prefill_attention_bf16() -> PrefillAttention | None:
    """Causal attention of a prefill chunk over its keys in a bf16 pool, flash style
    (prefill_attention.cpp)."""
    module = _native_module()
    return None if module is None else module.prefill_attention_bf16


def paged_decode_attention_quantized() -> PagedDecodeAttentionQuantized | None:
    module = _native_module()
    return None if module is None else module.paged_decode_attention_quantized


def int8_weight_kernels() -> tuple[SkinnyLinearInt8, DequantizeInt8Rows] | None:
    module = _native_module()
    return None if module is None else (module.skinny_linear_int8, module.dequantize_int8_rows)


# (x [M <= 8, K] bf16, q [N, K] uint8 e4m3 bytes, scale [N, ceil(K / block)] fp32, block, bias) -> [M, N] bf16
SkinnyLinearFp8 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


def fp8_weight_kernel() -> SkinnyLinearFp8 | None:
    """The FP8 decode GEMV (gemv_fp8.cpp), or None without the native kernels."""
    module = _native_module()
    return None if module is None else module.skinny_linear_fp8


class GgmlKernels(NamedTuple):
    """GGUF block types on kvflow's 16-row tiles (gemv_int8.cpp for Q8_0, gemv_ggml.cpp for the rest;
    layouts in kvflow/quant/gguf_linear.py)."""

    # (x [M, K] bf16, tiles, block_scales fp16, N, bias) -> [M, N] bf16
    q8_0: Callable[..., torch.Tensor]
    # (tiles, block_scales, K, N, n_begin, n_end) -> [n_end - n_begin, K] bf16
    dequantize_q8_0: Callable[..., torch.Tensor]
    # (x, ggml_type, values, scales, mins, supers, N, bias) -> [M, N] bf16
    gemv: Callable[..., torch.Tensor]
    # (ggml_type, values, scales, mins, supers, N, n_begin, n_end) -> [n_end - n_begin, K] bf16
    dequantize: Callable[..., torch.Tensor]


def ggml_weight_kernels() -> GgmlKernels | None:
    module = _native_module()
    if module is None:
        return None
    return GgmlKernels(
        module.skinny_linear_q8_0,
        module.dequantize_q8_0_rows,
        module.skinny_linear_ggml,
        module.dequantize_ggml_rows,
    )


def int4_weight_kernels() -> tuple[SkinnyLinearInt4, DequantizeInt4Rows] | None:
    module = _native_module()
    return None if module is None else (module.skinny_linear_int4, module.dequantize_int4_rows)


class NativeDecoderClasses(NamedTuple):
    """The pybind classes of decode_forward.cpp (their fields in decode_forward.h)."""

    linear: Any  # NativeLinear.bf16(...) / .int8(...) / .int4(...)
    decoder: Any  # NativeDecoder(num_heads, num_kv_heads, head_dim, eps, final_norm)


def native_decoder_classes() -> NativeDecoderClasses | None:
    module = _native_module()
    return None if module is None else NativeDecoderClasses(module.NativeLinear, module.NativeDecoder)

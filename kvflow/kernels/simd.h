// The SIMD intrinsics of kvflow's CPU kernels: include this instead of <immintrin.h>, after every
// system and torch header of the source.
//
// The kernels are written in AVX-512 intrinsics (16 fp32 lanes, __mmask16 lane masks, vdpbf16ps,
// vpdpbusd). Built with -mavx512* (kvflow/kernels/__init__.py picks the flags from the CPU), they
// compile to those instructions unchanged. Built for an AVX2 CPU (Zen 2/3, Intel client cores:
// no AVX-512), avx512_on_avx2.h supplies the same intrinsics over pairs of 256-bit registers, so
// the one source serves both and the kernel tests check both against torch.
#pragma once

#include <immintrin.h>

#if !defined(__AVX512F__)
#include "avx512_on_avx2.h"
#endif

// The slice of libtorch the kernels use: tensors, parallel_for, TORCH_CHECK, and tensor allocation.
// Not <torch/extension.h> (all of the C++ API and pybind11; ~19 s to parse on this VM) and not the
// public op headers (<ATen/ops/empty.h> pulls ATen/Context.h and DeviceGuard.h: 3.0 s per unit
// against 1.5 s for these). Allocation goes through the operators' entry points (<ATen/ops/*_ops.h>)
// behind the three wrappers below, which do what at::empty / at::empty_like / at::zeros do with
// TensorOptions (benchmarks/NOTES.md, session 23). A unit that needs other operators includes their
// public headers itself (decode_forward.cpp, huge_pages.cpp).
//
// A classic include guard, not #pragma once: the build may precompile this header, and a guard
// macro is what a precompiled header carries into the unit reliably.
#ifndef KVFLOW_KERNELS_ATEN_LITE_H
#define KVFLOW_KERNELS_ATEN_LITE_H

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like_ops.h>
#include <ATen/ops/empty_ops.h>
#include <ATen/ops/zeros_ops.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#include <optional>

namespace kvflow {

// at::empty(size, options): uninitialised, contiguous.
inline at::Tensor empty(at::IntArrayRef size, at::TensorOptions options = {}) {
  return at::_ops::empty_memory_format::call(
      c10::fromIntArrayRefSlow(size), c10::optTypeMetaToScalarType(options.dtype_opt()), options.layout_opt(),
      options.device_opt(), options.pinned_memory_opt(),
      c10::impl::check_tensor_options_and_extract_memory_format(options, std::nullopt));
}

// at::empty_like(self): uninitialised, self's dtype, device and strides.
inline at::Tensor empty_like(const at::Tensor& self) {
  return at::_ops::empty_like::call(self, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
}

// at::zeros(size, options).
inline at::Tensor zeros(at::IntArrayRef size, at::TensorOptions options = {}) {
  return at::_ops::zeros::call(c10::fromIntArrayRefSlow(size), c10::optTypeMetaToScalarType(options.dtype_opt()),
                               options.layout_opt(), options.device_opt(), options.pinned_memory_opt());
}

}  // namespace kvflow

#endif  // KVFLOW_KERNELS_ATEN_LITE_H

// The slice of libtorch the kernels use: tensors, the few operators they call, parallel_for and
// TORCH_CHECK. Not <torch/extension.h> (all of the C++ API and pybind11), which bindings.cpp alone
// includes: parsing it takes ~11.5 s per translation unit against ~1 s for these, and the first
// build compiled it twelve times (benchmarks/NOTES.md, session 22).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <optional>

// The torch side of a kernel file: what its host code needs to turn tensors into a launcher
// call and register the op's CUDA implementation (TORCH_LIBRARY_IMPL(graphopt, CUDA, m); the
// schema is defined from Python, cuda_ext/ops/<op>.py). A .cu includes it after its kernels,
// inside `#ifndef __CUDA_ARCH__`, so only the host pass parses torch's headers.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels.h"

namespace graphopt {

inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DT_F32;
    case at::kHalf: return DT_F16;
    case at::kBFloat16: return DT_BF16;
    default: TORCH_CHECK(false, "graphopt: dtype ", t, " is not supported (float32, float16, bfloat16)");
  }
  return -1;
}

inline void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "graphopt::", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

inline cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.get_device()).stream(); }

}  // namespace graphopt

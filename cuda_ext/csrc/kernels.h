// Shared by every kernel file: dtype codes and the launch-configuration variants. Plain C++
// (no torch headers), so the kernels' device passes compile quickly; a file's torch side
// includes host.h.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace graphopt {

enum DType : int { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

// Launch-configuration variants, for benchmarking alternatives in one process (0 = the default;
// bench_kernels.py --variants sets them through the C symbol graphopt_set_variant, variants.cpp).
// Every variant computes the same result; only block shape / grid sizing differ.
enum VariantKernel : int { VAR_NORM = 0, VAR_SOFTMAX = 1, VAR_ROTARY = 2, VAR_COUNT = 3 };
int variant(int kernel);

}  // namespace graphopt

extern "C" int graphopt_set_variant(int kernel, int variant);

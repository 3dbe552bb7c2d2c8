// Host-side launchers of the graphopt CUDA kernels. Plain C++ types only (no torch headers),
// so the .cu files compile quickly; registration.cpp converts tensors into these calls.
// Every launcher returns the cudaError_t of its launch (cudaGetLastError()).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace graphopt {

enum DType : int { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum Act : int {
  ACT_NONE = 0, ACT_RELU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3,
  ACT_SILU = 4, ACT_SIGMOID = 5, ACT_TANH = 6, ACT_HARDSWISH = 7
};

// y = act(x + bias[(i / inner) % channels]) + residual[i]; all contiguous, same dtype.
// bias / residual may be null.
cudaError_t launch_bias_act(int dtype, int act, const void* x, const void* bias, const void* residual,
                            void* y, int64_t numel, int64_t channels, int64_t inner, cudaStream_t stream);

// h = x + residual (or x); out = norm(h) * weight (+ bias); rows x hidden, contiguous.
// weight/bias dtype given separately (wdtype), may be null (layer norm only).
cudaError_t launch_add_rms_norm(int dtype, int wdtype, const void* x, const void* residual, const void* weight,
                                void* out, void* h, int64_t rows, int64_t hidden, float eps, cudaStream_t stream);
cudaError_t launch_add_layer_norm(int dtype, int wdtype, const void* x, const void* residual, const void* weight,
                                  const void* bias, void* out, void* h, int64_t rows, int64_t hidden, float eps,
                                  cudaStream_t stream);

// out[r, j] = silu(in[r, j]) * in[r, H + j]; in is rows x 2H contiguous, out rows x H.
cudaError_t launch_swiglu(int dtype, const void* in, void* out, int64_t rows, int64_t H, cudaStream_t stream);

// Rotary embedding on one 4-D tensor x[B, H, S, D] (any strides, in elements) into a contiguous out.
// cos/sin are [Bc, S, R] with strides (cs_b may be 0 to broadcast), same dtype as x.
struct RotaryArgs {
  const void* x; void* out;
  int64_t B, H, S, D, R;
  int64_t sb, sh, ss, sd;        // x strides
  int64_t osb, osh, oss;         // out strides (last dim contiguous): [B, H, S, D] or a transposed [B, S, H, D]
  const void* cos; const void* sin;
  int64_t cb, cs, cr;            // cos/sin strides (shared layout)
  bool interleaved;
};
cudaError_t launch_rotary(int dtype, const RotaryArgs& q, const RotaryArgs& k, cudaStream_t stream);

// Max pooling (square kernel, stride, padding; dilation 1, floor) over NHWC-dense in/out:
// in [N, H, W, C], out [N, Ho, Wo, C] in memory; padding left out of the window.
struct PoolArgs {
  int64_t N, H, W, C, Ho, Wo;
  int kernel, stride, pad;
};
cudaError_t launch_max_pool_nhwc(int dtype, const void* in, void* out, const PoolArgs& a, cudaStream_t stream);

// softmax(scores * scale + mask) over the last dim (n), rows = prod(leading dims) .
// scores contiguous. mask: up to 4 leading dims described by (mdims, mstrides) for the row index
// decomposition, and last-dim stride mlast; mask_kind: 0 none, 1 bool (keep), 2 additive.
struct SoftmaxMask {
  const void* ptr = nullptr;
  int kind = 0;           // 0 none, 1 bool, 2 additive
  int dtype = DT_F32;     // for additive masks
  int ndims = 0;          // leading dims of the scores (<= 4)
  int64_t dims[4] = {1, 1, 1, 1};
  int64_t strides[4] = {0, 0, 0, 0};
  int64_t last_stride = 0;
};
cudaError_t launch_softmax_mask(int dtype, const void* scores, void* out, int64_t rows, int64_t n, float scale,
                                const SoftmaxMask& mask, cudaStream_t stream);

// Launch-configuration variants, for benchmarking alternatives in one process (0 = the default;
// bench_kernels.py --variants sets them through the C symbol graphopt_set_variant). Every variant
// computes the same result; only block shape / grid sizing differ.
enum VariantKernel : int { VAR_NORM = 0, VAR_SOFTMAX = 1, VAR_ROTARY = 2, VAR_COUNT = 3 };
int variant(int kernel);

}  // namespace graphopt

extern "C" int graphopt_set_variant(int kernel, int variant);

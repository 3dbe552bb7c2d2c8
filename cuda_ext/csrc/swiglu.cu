// SwiGLU from a merged gate/up projection: out[r, j] = silu(in[r, j]) * in[r, H + j].
// Grid: x over rows, y over column chunks, so no index division; 16-byte vectors when H and
// the pointers allow, scalar otherwise.
#include <type_traits>
#include "common.cuh"

namespace graphopt {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float silu_mul(float g, float u) {
  return g * sigmoid_f<!std::is_same<T, float>::value>(g) * u;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t H) {
  const int64_t row = blockIdx.x;
  const T* g = in + row * 2 * H;
  const T* u = g + H;
  T* o = out + row * H;
  const int64_t step = int64_t(gridDim.y) * kThreads * VEC;
  for (int64_t e = (int64_t(blockIdx.y) * kThreads + threadIdx.x) * VEC; e < H; e += step) {
    if constexpr (VEC > 1) {
      float gv[VEC], uv[VEC], ov[VEC];
      load_vec_stream(g + e, gv);
      load_vec_stream(u + e, uv);
#pragma unroll
      for (int j = 0; j < VEC; ++j) ov[j] = silu_mul<T>(gv[j], uv[j]);
      store_vec_stream(o + e, ov);
    } else {
      o[e] = from_f<T>(silu_mul<T>(to_f(g[e]), to_f(u[e])));
    }
  }
}

template <typename T>
cudaError_t run(const T* in, T* out, int64_t rows, int64_t H, cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const bool vec = H % N == 0 && aligned16(in) && aligned16(out);
  const int vw = vec ? N : 1;
  int64_t chunks = (H + int64_t(kThreads) * vw - 1) / (int64_t(kThreads) * vw);
  if (chunks > 65535) chunks = 65535;
  for (int64_t r0 = 0; r0 < rows; r0 += 0x7fffffff) {
    const int64_t nr = rows - r0 < 0x7fffffff ? rows - r0 : 0x7fffffff;
    const dim3 grid(static_cast<unsigned>(nr), static_cast<unsigned>(chunks));
    if (vec) swiglu_kernel<T, N><<<grid, kThreads, 0, stream>>>(in + r0 * 2 * H, out + r0 * H, H);
    else swiglu_kernel<T, 1><<<grid, kThreads, 0, stream>>>(in + r0 * 2 * H, out + r0 * H, H);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_swiglu(int dtype, const void* in, void* out, int64_t rows, int64_t H, cudaStream_t stream) {
  if (rows == 0 || H == 0) return cudaSuccess;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, { return run<T>(static_cast<const T*>(in), static_cast<T*>(out), rows, H, stream); });
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

// ---- graphopt::swiglu (host side; torch headers stay out of the device passes)
#ifndef __CUDA_ARCH__
#include "host.h"

namespace graphopt {
namespace {

at::Tensor swiglu_cuda(const at::Tensor& gate_up) {
  c10::cuda::CUDAGuard guard(gate_up.device());
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "graphopt::swiglu: last dim must be even (gate and up halves), got ", gate_up.sizes());
  const int dt = dtype_code(gate_up.scalar_type());
  at::Tensor in = gate_up.contiguous();
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  const int64_t H = shape.back() / 2;
  shape.back() = H;
  at::Tensor out = at::empty(shape, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = H == 0 ? 0 : out.numel() / H;
  check(launch_swiglu(dt, in.data_ptr(), out.data_ptr(), rows, H, stream_of(gate_up)), "swiglu");
  return out;
}

}  // namespace
}  // namespace graphopt

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) {
  m.impl("swiglu", &graphopt::swiglu_cuda);
}
#endif  // __CUDA_ARCH__

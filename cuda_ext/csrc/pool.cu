// Max pooling over a channels_last (NHWC) tensor, inference (no indices):
//   out[n, oh, ow, c] = max over dh, dw < k of in[n, oh*s - p + dh, ow*s - p + dw, c],
// positions outside the image left out (as aten's max_pool2d pads with -inf); a NaN in the window
// gives NaN. One thread per output pixel and 16-byte vector of channels (scalar when C or the
// pointers do not allow it); neighbouring windows overlap, so inputs are read through the cache.
#include "common.cuh"

namespace graphopt {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float max_nan(float m, float v) { return (v > m || isnan(v)) ? v : m; }

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) max_pool_nhwc_kernel(const T* __restrict__ in, T* __restrict__ out,
                                                                 PoolArgs a) {
  const int64_t cv = a.C / VEC;
  const int64_t total = a.N * a.Ho * a.Wo * cv;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    const int64_t c = (i % cv) * VEC;
    int64_t t = i / cv;
    const int64_t ow = t % a.Wo;
    t /= a.Wo;
    const int64_t oh = t % a.Ho;
    const int64_t n = t / a.Ho;
    float m[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) m[j] = -INFINITY;
    const int64_t h0 = oh * a.stride - a.pad, w0 = ow * a.stride - a.pad;
    for (int dh = 0; dh < a.kernel; ++dh) {
      const int64_t h = h0 + dh;
      if (h < 0 || h >= a.H) continue;
      for (int dw = 0; dw < a.kernel; ++dw) {
        const int64_t w = w0 + dw;
        if (w < 0 || w >= a.W) continue;
        const T* src = in + ((n * a.H + h) * a.W + w) * a.C + c;
        if constexpr (VEC > 1) {
          float v[VEC];
          load_vec(src, v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) m[j] = max_nan(m[j], v[j]);
        } else {
          m[0] = max_nan(m[0], to_f(src[0]));
        }
      }
    }
    T* dst = out + ((n * a.Ho + oh) * a.Wo + ow) * a.C + c;
    if constexpr (VEC > 1) {
      store_vec(dst, m);
    } else {
      dst[0] = from_f<T>(m[0]);
    }
  }
}

template <typename T>
cudaError_t run(const T* in, T* out, const PoolArgs& a, cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const bool vec = a.C % N == 0 && aligned16(in) && aligned16(out);
  const int64_t total = a.N * a.Ho * a.Wo * (vec ? a.C / N : a.C);
  int64_t blocks = (total + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(num_sms()) * 32;  // a grid-stride loop beyond a few waves
  if (blocks > cap) blocks = cap;
  if (vec) max_pool_nhwc_kernel<T, N><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, out, a);
  else max_pool_nhwc_kernel<T, 1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, out, a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_max_pool_nhwc(int dtype, const void* in, void* out, const PoolArgs& a, cudaStream_t stream) {
  if (a.N == 0 || a.C == 0 || a.Ho == 0 || a.Wo == 0) return cudaSuccess;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, { return run<T>(static_cast<const T*>(in), static_cast<T*>(out), a, stream); });
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

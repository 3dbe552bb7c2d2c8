// Max and average pooling over a channels_last (NHWC) tensor, inference (no indices):
//   max: out[n, oh, ow, c] = max over dh, dw < k of in[n, oh*s - p + dh, ow*s - p + dw, c],
//        positions outside the image left out (as aten's max_pool2d pads with -inf); a NaN in the
//        window gives NaN;
//   avg: the sum over the window's positions inside the image, in fp32, divided by k*k
//        (count_include_pad) or by the number of positions inside the image; one rounding at the store.
// One thread per output pixel and 16-byte vector of channels (scalar when C or the pointers do
// not allow it); neighbouring windows overlap, so inputs are read through the cache.
#include "common.cuh"

namespace graphopt {

// Pooling (square kernel, stride, padding; dilation 1, floor) over NHWC-dense in/out:
// in [N, H, W, C], out [N, Ho, Wo, C] in memory; padding left out of the window (max, and the
// sum of avg; avg divides by kernel*kernel where count_include_pad, else by the positions inside).
struct PoolArgs {
  int64_t N, H, W, C, Ho, Wo;
  int kernel, stride, pad;
  int count_include_pad = 1;
};

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float max_nan(float m, float v) { return (v > m || isnan(v)) ? v : m; }

template <typename T, int VEC, bool AVG>
__global__ void __launch_bounds__(kThreads) pool_nhwc_kernel(const T* __restrict__ in, T* __restrict__ out,
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
    for (int j = 0; j < VEC; ++j) m[j] = AVG ? 0.f : -INFINITY;
    const int64_t h0 = oh * a.stride - a.pad, w0 = ow * a.stride - a.pad;
    int inside = 0;
    for (int dh = 0; dh < a.kernel; ++dh) {
      const int64_t h = h0 + dh;
      if (h < 0 || h >= a.H) continue;
      for (int dw = 0; dw < a.kernel; ++dw) {
        const int64_t w = w0 + dw;
        if (w < 0 || w >= a.W) continue;
        const T* src = in + ((n * a.H + h) * a.W + w) * a.C + c;
        ++inside;
        if constexpr (VEC > 1) {
          float v[VEC];
          load_vec(src, v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) m[j] = AVG ? m[j] + v[j] : max_nan(m[j], v[j]);
        } else {
          m[0] = AVG ? m[0] + to_f(src[0]) : max_nan(m[0], to_f(src[0]));
        }
      }
    }
    if constexpr (AVG) {
      const float inv = 1.f / float(a.count_include_pad ? a.kernel * a.kernel : inside);
#pragma unroll
      for (int j = 0; j < VEC; ++j) m[j] *= inv;
    }
    T* dst = out + ((n * a.Ho + oh) * a.Wo + ow) * a.C + c;
    if constexpr (VEC > 1) {
      store_vec(dst, m);
    } else {
      dst[0] = from_f<T>(m[0]);
    }
  }
}

template <typename T, bool AVG>
cudaError_t run(const T* in, T* out, const PoolArgs& a, cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const bool vec = a.C % N == 0 && aligned16(in) && aligned16(out);
  const int64_t total = a.N * a.Ho * a.Wo * (vec ? a.C / N : a.C);
  int64_t blocks = (total + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(num_sms()) * 32;  // a grid-stride loop beyond a few waves
  if (blocks > cap) blocks = cap;
  if (vec) pool_nhwc_kernel<T, N, AVG><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, out, a);
  else pool_nhwc_kernel<T, 1, AVG><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, out, a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_max_pool_nhwc(int dtype, const void* in, void* out, const PoolArgs& a, cudaStream_t stream) {
  if (a.N == 0 || a.C == 0 || a.Ho == 0 || a.Wo == 0) return cudaSuccess;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, {
    return run<T, false>(static_cast<const T*>(in), static_cast<T*>(out), a, stream);
  });
  return cudaErrorInvalidValue;
}

cudaError_t launch_avg_pool_nhwc(int dtype, const void* in, void* out, const PoolArgs& a, cudaStream_t stream) {
  if (a.N == 0 || a.C == 0 || a.Ho == 0 || a.Wo == 0) return cudaSuccess;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, {
    return run<T, true>(static_cast<const T*>(in), static_cast<T*>(out), a, stream);
  });
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

// ---- graphopt::max_pool2d_nhwc (host side; torch headers stay out of the device passes)
#ifndef __CUDA_ARCH__
#include "host.h"

namespace graphopt {
namespace {

at::Tensor pool2d_nhwc_cuda(const char* name, bool avg, const at::Tensor& x, int64_t kernel, int64_t stride,
                            int64_t padding, bool count_include_pad) {
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() == 4, "graphopt::", name, ": x must be [N, C, H, W], got ", x.sizes());
  TORCH_CHECK(kernel >= 1 && stride >= 1 && padding >= 0 && 2 * padding <= kernel,
              "graphopt::", name, ": needs kernel >= 1, stride >= 1 and 0 <= padding <= kernel / 2, got ",
              kernel, ", ", stride, ", ", padding);
  const int dt = dtype_code(x.scalar_type());
  at::Tensor in = x.contiguous(at::MemoryFormat::ChannelsLast);
  graphopt::PoolArgs a;
  a.N = x.size(0); a.C = x.size(1); a.H = x.size(2); a.W = x.size(3);
  a.Ho = (a.H + 2 * padding - kernel) / stride + 1;
  a.Wo = (a.W + 2 * padding - kernel) / stride + 1;
  TORCH_CHECK(a.Ho >= 1 && a.Wo >= 1, "graphopt::", name, ": output would be empty for input ", x.sizes());
  a.kernel = static_cast<int>(kernel); a.stride = static_cast<int>(stride); a.pad = static_cast<int>(padding);
  a.count_include_pad = count_include_pad ? 1 : 0;
  at::Tensor out = at::empty({a.N, a.C, a.Ho, a.Wo}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  check((avg ? launch_avg_pool_nhwc : launch_max_pool_nhwc)(dt, in.data_ptr(), out.data_ptr(), a, stream_of(x)), name);
  return out;
}

at::Tensor max_pool2d_nhwc_cuda(const at::Tensor& x, int64_t kernel, int64_t stride, int64_t padding) {
  return pool2d_nhwc_cuda("max_pool2d_nhwc", false, x, kernel, stride, padding, true);
}

at::Tensor avg_pool2d_nhwc_cuda(const at::Tensor& x, int64_t kernel, int64_t stride, int64_t padding,
                                bool count_include_pad) {
  return pool2d_nhwc_cuda("avg_pool2d_nhwc", true, x, kernel, stride, padding, count_include_pad);
}

}  // namespace
}  // namespace graphopt

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) {
  m.impl("max_pool2d_nhwc", &graphopt::max_pool2d_nhwc_cuda);
  m.impl("avg_pool2d_nhwc", &graphopt::avg_pool2d_nhwc_cuda);
}
#endif  // __CUDA_ARCH__

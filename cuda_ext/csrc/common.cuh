// Shared device helpers for the graphopt kernels. Free of torch headers so the device passes
// compile in seconds (each kernel file's torch side includes host.h in its host pass only).
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels.h"

namespace graphopt {

// ---- scalar conversions: all arithmetic is fp32 ----------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Round a float through T and back (used to reproduce Hugging Face's intermediate roundings).
template <typename T> __device__ __forceinline__ float round_through(float v) { return to_f(from_f<T>(v)); }

// ---- 16-byte vectors ------------------------------------------------------------------
// Vec<T>::N elements of T in one 16-byte aligned chunk (8 for bf16/fp16, 4 for fp32).
template <typename T> struct Vec {
  static constexpr int N = 16 / sizeof(T);
  union { uint4 raw; T v[N]; };
};

template <typename T> __device__ __forceinline__ void load_vec(const T* p, float (&out)[16 / sizeof(T)]) {
  Vec<T> t;
  t.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) out[i] = to_f(t.v[i]);
}
// Streaming load: data read exactly once, keep it out of L1.
template <typename T> __device__ __forceinline__ void load_vec_stream(const T* p, float (&out)[16 / sizeof(T)]) {
  Vec<T> t;
  t.raw = __ldcs(reinterpret_cast<const uint4*>(p));
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) out[i] = to_f(t.v[i]);
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float (&in)[16 / sizeof(T)]) {
  Vec<T> t;
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) t.v[i] = from_f<T>(in[i]);
  *reinterpret_cast<uint4*>(p) = t.raw;
}
template <typename T> __device__ __forceinline__ void store_vec_stream(T* p, const float (&in)[16 / sizeof(T)]) {
  Vec<T> t;
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) t.v[i] = from_f<T>(in[i]);
  __stcs(reinterpret_cast<uint4*>(p), t.raw);
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// ---- activations (fp32 in, fp32 out) --------------------------------------------------
// FAST selects hardware approximations that are exact enough for 16-bit outputs.
template <bool FAST> __device__ __forceinline__ float tanh_f(float x) {
  if (FAST) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    return tanhf(x);
  }
}
template <bool FAST> __device__ __forceinline__ float sigmoid_f(float x) {
  return FAST ? __fdividef(1.0f, 1.0f + __expf(-x)) : 1.0f / (1.0f + expf(-x));
}

// ---- reductions -----------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide sum; every thread gets the result. `smem` holds >= 33 floats. blockDim.x % 32 == 0.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (nwarps == 1) return v;
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? smem[lane] : 0.f;
  return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  if (nwarps == 1) return v;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? smem[lane] : -INFINITY;
  return warp_max(t);
}

inline int num_sms() {
  static int n = 0;
  if (n == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (n <= 0) n = 1;
  }
  return n;
}

}  // namespace graphopt

// dtype dispatch over the three floating types (dtype codes from kernels.h)
#define GRAPHOPT_DISPATCH_FLOAT(DT, T, ...)                                   \
  switch (DT) {                                                               \
    case ::graphopt::DT_F32: { using T = float; __VA_ARGS__; break; }         \
    case ::graphopt::DT_F16: { using T = __half; __VA_ARGS__; break; }        \
    case ::graphopt::DT_BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;                                    \
  }

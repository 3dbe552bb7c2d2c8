// residual add + RMSNorm / LayerNorm, one pass over memory.
// One row per block; the row stays in registers (NV vectors of VEC elements per thread) for
// hidden sizes up to 32768 (16-bit, aligned) / 16384 (otherwise); larger rows take a loop
// kernel that re-reads the row it just wrote (L2-resident) instead.
// Numerics follow Hugging Face's LlamaRMSNorm: h = T(x + residual) is rounded to the input
// dtype first, statistics in fp32 over that rounded h, out = T(weight * T(h * rstd)).
// LayerNorm follows torch.nn.functional.layer_norm: fp32 statistics (two-pass), one rounding.
#include <type_traits>
#include "common.cuh"

namespace graphopt {
namespace {

template <typename W, int K>
__device__ __forceinline__ void load_elems(const W* p, float (&out)[K]) {
  constexpr int N = Vec<W>::N;
  if constexpr (K % N == 0) {
#pragma unroll
    for (int c = 0; c < K / N; ++c) {
      float t[N];
      load_vec(p + c * N, t);
#pragma unroll
      for (int j = 0; j < N; ++j) out[c * N + j] = t[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) out[j] = to_f(p[j]);
  }
}
template <typename T, int K>
__device__ __forceinline__ void store_elems(T* p, const float (&in)[K]) {
  constexpr int N = Vec<T>::N;
  if constexpr (K == N) {
    store_vec(p, in);
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) p[j] = from_f<T>(in[j]);
  }
}
template <typename T, int K>
__device__ __forceinline__ void load_row_elems(const T* p, float (&out)[K]) {
  constexpr int N = Vec<T>::N;
  if constexpr (K == N) {
    load_vec_stream(p, out);
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) out[j] = to_f(p[j]);
  }
}


// Chan et al.'s pairwise merge of (count, mean, M2) partial statistics: one block reduction gives
// LayerNorm's mean and variance, each thread's part computed two-pass from its registers.
__device__ __forceinline__ void chan_merge(float& n, float& mean, float& m2, float nb, float meanb, float m2b) {
  const float nn = n + nb;
  if (nn == 0.f) return;
  const float d = meanb - mean, wb = nb / nn;
  mean += d * wb;
  m2 += m2b + d * d * n * wb;
  n = nn;
}
__device__ __forceinline__ void block_mean_var(float& n, float& mean, float& m2, float* smem /* >= 96 */) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, o), mb = __shfl_xor_sync(0xffffffffu, mean, o),
                m2b = __shfl_xor_sync(0xffffffffu, m2, o);
    chan_merge(n, mean, m2, nb, mb, m2b);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (nwarps == 1) return;
  __syncthreads();
  if (lane == 0) { smem[warp] = n; smem[32 + warp] = mean; smem[64 + warp] = m2; }
  __syncthreads();
  n = lane < nwarps ? smem[lane] : 0.f;
  mean = lane < nwarps ? smem[32 + lane] : 0.f;
  m2 = lane < nwarps ? smem[64 + lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, o), mb = __shfl_xor_sync(0xffffffffu, mean, o),
                m2b = __shfl_xor_sync(0xffffffffu, m2, o);
    chan_merge(n, mean, m2, nb, mb, m2b);
  }
}

// VEC: elements per access (Vec<T>::N, or 1 for the unaligned path); NV: accesses per thread.
template <typename T, typename W, int VEC, int NV, bool LN, int MAXT>
__global__ void __launch_bounds__(MAXT) norm_reg_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                        const W* __restrict__ w, const W* __restrict__ b,
                                                        T* __restrict__ out, T* __restrict__ hout, int64_t H,
                                                        float eps) {
  __shared__ float smem[96];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * H;
  const T* rr = res ? res + row * H : nullptr;
  T* hr = hout + row * H;
  T* orow = out + row * H;
  float h[NV][VEC];
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t e = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
    if (e < H) {
      load_row_elems<T, VEC>(xr + e, h[k]);
      if (rr) {
        float r[VEC];
        load_row_elems<T, VEC>(rr + e, r);
#pragma unroll
        for (int j = 0; j < VEC; ++j) h[k][j] = round_through<T>(h[k][j] + r[j]);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc += LN ? h[k][j] : h[k][j] * h[k][j];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) h[k][j] = 0.f;
    }
  }
  float mean = 0.f, rstd;
  if (LN) {
    // this thread's elements: count, mean, M2 (two-pass over registers), then one block merge
    float cnt = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if ((int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC < H) cnt += VEC;
    float m = cnt > 0.f ? acc / cnt : 0.f, m2 = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t e = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
      if (e < H) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = h[k][j] - m;
          m2 += d * d;
        }
      }
    }
    block_mean_var(cnt, m, m2, smem);
    mean = m;
    rstd = rsqrtf(fmaxf(m2, 0.f) / float(H) + eps);
  } else {
    acc = block_sum(acc, smem);
    rstd = rsqrtf(acc / float(H) + eps);
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t e = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
    if (e < H) {
      store_elems<T, VEC>(hr + e, h[k]);
      float wv[VEC], o[VEC];
      if (w) load_elems<W, VEC>(w + e, wv);
      if (LN) {
        float bv[VEC];
        if (b) load_elems<W, VEC>(b + e, bv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float v = (h[k][j] - mean) * rstd;
          if (w) v *= wv[j];
          if (b) v += bv[j];
          o[j] = v;
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = wv[j] * round_through<T>(h[k][j] * rstd);
      }
      store_elems<T, VEC>(orow + e, o);
    }
  }
}

// Any hidden size: three sweeps over the row (the 2nd and 3rd read h back from L2).
template <typename T, typename W, bool LN>
__global__ void __launch_bounds__(1024) norm_loop_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                         const W* __restrict__ w, const W* __restrict__ b,
                                                         T* __restrict__ out, T* __restrict__ hout, int64_t H,
                                                         float eps) {
  __shared__ float smem[33];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * H;
  const T* rr = res ? res + row * H : nullptr;
  T* hr = hout + row * H;
  T* orow = out + row * H;
  float acc = 0.f;
  for (int64_t e = threadIdx.x; e < H; e += blockDim.x) {
    float v = to_f(xr[e]);
    if (rr) v = round_through<T>(v + to_f(rr[e]));
    hr[e] = from_f<T>(v);
    acc += LN ? v : v * v;
  }
  acc = block_sum(acc, smem);
  float mean = 0.f, rstd;
  if (LN) {
    mean = acc / float(H);
    float var = 0.f;
    for (int64_t e = threadIdx.x; e < H; e += blockDim.x) {
      const float d = to_f(hr[e]) - mean;
      var += d * d;
    }
    var = block_sum(var, smem);
    rstd = rsqrtf(var / float(H) + eps);
  } else {
    rstd = rsqrtf(acc / float(H) + eps);
  }
  for (int64_t e = threadIdx.x; e < H; e += blockDim.x) {
    const float v = to_f(hr[e]);
    float o;
    if (LN) {
      o = (v - mean) * rstd;
      if (w) o *= to_f(w[e]);
      if (b) o += to_f(b[e]);
    } else {
      o = to_f(w[e]) * round_through<T>(v * rstd);
    }
    orow[e] = from_f<T>(o);
  }
}

inline int round_up32(int64_t v) { return int((v + 31) / 32 * 32); }

template <typename T, typename W, bool LN>
cudaError_t run_norm(const T* x, const T* res, const W* w, const W* b, T* out, T* h, int64_t rows, int64_t H,
                     float eps, cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const bool vec_ok = H % N == 0 && aligned16(x) && aligned16(out) && aligned16(h) && (!res || aligned16(res)) &&
                      (!w || aligned16(w)) && (!b || aligned16(b));
  const dim3 grid(static_cast<unsigned>(rows));
#define GO_REG(VEC, NV, MAXT)                                                                          \
  norm_reg_kernel<T, W, VEC, NV, LN, MAXT>                                                                \
      <<<grid, round_up32((H / VEC + NV - 1) / NV), 0, stream>>>(x, res, w, b, out, h, H, eps);          \
  return cudaGetLastError();
  // Rows up to 2048 vectors (16384 16-bit / 8192 fp32 elements) stay in registers as vectors;
  // up to 16384 elements as scalars (coalesced, 1024 threads x 16); longer rows loop.
  if (vec_ok && H / N <= 2048) {
    const int64_t nvec = H / N;
    if (nvec <= 256) { GO_REG(N, 1, 256); }
    if (nvec <= 512) { GO_REG(N, 2, 256); }
    GO_REG(N, 4, 512);
  } else if (H <= 16384) {
    if (H <= 256) { GO_REG(1, 1, 256); }
    if (H <= 1024) { GO_REG(1, 4, 256); }
    GO_REG(1, 16, 1024);
  }
#undef GO_REG
  norm_loop_kernel<T, W, LN><<<grid, 1024, 0, stream>>>(x, res, w, b, out, h, H, eps);
  return cudaGetLastError();
}

template <bool LN>
cudaError_t dispatch(int dtype, int wdtype, const void* x, const void* res, const void* w, const void* b, void* out,
                     void* h, int64_t rows, int64_t H, float eps, cudaStream_t stream) {
  if (rows == 0 || H == 0) return cudaSuccess;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, {
    if (wdtype == DT_F32 || std::is_same<T, float>::value) {
      if (wdtype != DT_F32 && !std::is_same<T, float>::value) return cudaErrorInvalidValue;
      if (std::is_same<T, float>::value && wdtype != DT_F32) return cudaErrorInvalidValue;
      return run_norm<T, float, LN>(static_cast<const T*>(x), static_cast<const T*>(res),
                                    static_cast<const float*>(w), static_cast<const float*>(b), static_cast<T*>(out),
                                    static_cast<T*>(h), rows, H, eps, stream);
    } else {
      if (wdtype != dtype) return cudaErrorInvalidValue;
      return run_norm<T, T, LN>(static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w),
                                static_cast<const T*>(b), static_cast<T*>(out), static_cast<T*>(h), rows, H, eps,
                                stream);
    }
  });
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_add_rms_norm(int dtype, int wdtype, const void* x, const void* residual, const void* weight,
                                void* out, void* h, int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  return dispatch<false>(dtype, wdtype, x, residual, weight, nullptr, out, h, rows, hidden, eps, stream);
}

cudaError_t launch_add_layer_norm(int dtype, int wdtype, const void* x, const void* residual, const void* weight,
                                  const void* bias, void* out, void* h, int64_t rows, int64_t hidden, float eps,
                                  cudaStream_t stream) {
  return dispatch<true>(dtype, wdtype, x, residual, weight, bias, out, h, rows, hidden, eps, stream);
}

}  // namespace graphopt

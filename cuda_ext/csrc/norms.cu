// residual add + RMSNorm / LayerNorm, one pass over memory.
//
// Main path (16-byte aligned rows, hidden/8 (16-bit) or hidden/4 (fp32) <= 2048 vectors):
// norm_vec_kernel. Each CTA owns whole rows (blockDim threads x NV 16-byte vectors = one row in
// registers, read exactly once) and is *persistent*: the grid is sized to the resident CTAs
// (SMs x occupancy) and each CTA walks rows blockIdx.x, +gridDim.x, ... While it reduces and
// stores row r it already has row r + gridDim.x's loads in flight (software pipelining), so the
// barrier-separated phases of one row no longer leave the memory pipe idle; weight and bias are
// loaded once per CTA and kept in registers. LayerNorm is two register passes (mean, then the
// centered variance): the same cost as RMSNorm plus one block reduction.
// Other rows: norm_reg_kernel (scalar accesses, row in registers, up to 16384 elements) or
// norm_loop_kernel (any size, re-reads the row it just wrote from L2).
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


// VEC: elements per access (Vec<T>::N, or 1 for the unaligned path); NV: accesses per thread.
template <typename T, typename W, int VEC, int NV, bool LN, int MAXT>
__global__ void __launch_bounds__(MAXT) norm_reg_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                        const W* __restrict__ w, const W* __restrict__ b,
                                                        T* __restrict__ out, T* __restrict__ hout, int64_t H,
                                                        float eps) {
  __shared__ float smem[33];
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
  acc = block_sum(acc, smem);
  if (LN) {
    // two passes over the registers: mean, then the centered variance
    mean = acc / float(H);
    float m2 = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t e = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
      if (e < H) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = h[k][j] - mean;
          m2 += d * d;
        }
      }
    }
    m2 = block_sum(m2, smem);
    rstd = rsqrtf(m2 / float(H) + eps);
  } else {
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

// K elements of W kept as raw 16-byte chunks (K * sizeof(W) is 16 or 32 bytes): half the
// registers of floats for 16-bit weights; converted at each use (a shift for bf16).
template <typename W, int K>
struct RawW {
  static constexpr int NR = K * int(sizeof(W)) / 16;
  union { uint4 r[NR]; W v[K]; };
  __device__ __forceinline__ void load(const W* p) {
#pragma unroll
    for (int i = 0; i < NR; ++i) r[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
  }
};

// Persistent, software-pipelined row kernel (see the top of this file). blockDim.x * NV vectors
// of N = 16 / sizeof(T) elements cover the row; vectors past H / N are idle lanes. h (already
// rounded to T) is kept packed in T between the passes: half the registers of floats for
// 16-bit types, so more CTAs stay resident.
template <typename T, typename W, int NV, bool LN, int MAXT, int MINB>
__global__ void __launch_bounds__(MAXT, MINB) norm_vec_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                        const W* __restrict__ w, const W* __restrict__ b,
                                                        T* __restrict__ out, T* __restrict__ hout, int64_t rows,
                                                        int64_t H, float eps) {
  constexpr int N = Vec<T>::N;
  __shared__ float smem[33];
  const int nvec = int(H / N);  // <= 2048 (the launcher checks)
  // weight / bias: loaded once per CTA, reused for every row it normalizes
  RawW<W, N> wv[NV], bv[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int v = int(threadIdx.x) + k * int(blockDim.x);
    if (v < nvec) {
      if (w) wv[k].load(w + v * N);
      if (LN && b) bv[k].load(b + v * N);
    }
  }
  Vec<T> cx[NV], cr[NV];
  auto issue = [&](int64_t r) {  // start the loads of row r (read once: streaming)
    const uint4* xp = reinterpret_cast<const uint4*>(x + r * H);
    const uint4* rp = reinterpret_cast<const uint4*>(res ? res + r * H : x);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = int(threadIdx.x) + k * int(blockDim.x);
      if (v < nvec) {
        cx[k].raw = __ldcs(xp + v);
        if (res) cr[k].raw = __ldcs(rp + v);
      }
    }
  };
  int64_t row = blockIdx.x;
  if (row < rows) issue(row);
  for (; row < rows; row += gridDim.x) {
    Vec<T> h[NV];
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = int(threadIdx.x) + k * int(blockDim.x);
      h[k].raw = cx[k].raw;
      if (res) {
#pragma unroll
        for (int j = 0; j < N; ++j) h[k].v[j] = from_f<T>(to_f(cx[k].v[j]) + to_f(cr[k].v[j]));
      }
      if (v < nvec) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float f = to_f(h[k].v[j]);
          acc += LN ? f : f * f;
        }
      }
    }
    // the next row's loads go out now and overlap this row's reductions and stores
    if (row + gridDim.x < rows) issue(row + gridDim.x);
    uint4* hp = reinterpret_cast<uint4*>(hout + row * H);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = int(threadIdx.x) + k * int(blockDim.x);
      if (v < nvec) __stcs(hp + v, h[k].raw);
    }
    acc = block_sum(acc, smem);
    float mean = 0.f, rstd;
    if (LN) {
      mean = acc / float(H);
      float m2 = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int v = int(threadIdx.x) + k * int(blockDim.x);
        if (v < nvec) {
#pragma unroll
          for (int j = 0; j < N; ++j) {
            const float d = to_f(h[k].v[j]) - mean;
            m2 += d * d;
          }
        }
      }
      m2 = block_sum(m2, smem);
      rstd = rsqrtf(m2 / float(H) + eps);
    } else {
      rstd = rsqrtf(acc / float(H) + eps);
    }
    T* op = out + row * H;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int v = int(threadIdx.x) + k * int(blockDim.x);
      if (v >= nvec) continue;
      float o[N];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float f = to_f(h[k].v[j]);
        if (LN) {
          float y = (f - mean) * rstd;
          if (w) y *= to_f(wv[k].v[j]);
          if (b) y += to_f(bv[k].v[j]);
          o[j] = y;
        } else {
          o[j] = to_f(wv[k].v[j]) * round_through<T>(f * rstd);
        }
      }
      store_vec_stream(op + v * N, o);
    }
  }
}

inline int round_up32(int64_t v) { return int((v + 31) / 32 * 32); }

// Resident CTAs per SM for this kernel at this block size; `cache` is the caller's (one per
// kernel instantiation), indexed by warps per block.
template <typename K>
int resident_ctas(K kernel, int threads, int (&cache)[33]) {
  const int slot = threads / 32;
  if (slot <= 32 && cache[slot] > 0) return cache[slot];
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    n = 1;
  }
  if (slot <= 32) cache[slot] = n;
  return n;
}

template <typename T, typename W, int NV, bool LN, int MAXT, int MINB>
cudaError_t go_vec(const T* x, const T* res, const W* w, const W* b, T* out, T* h, int64_t rows, int64_t H,
                   float eps, bool persistent, cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const int threads = round_up32((H / N + NV - 1) / NV);
  auto kern = norm_vec_kernel<T, W, NV, LN, MAXT, MINB>;
  int64_t grid = rows;
  if (persistent) {
    static int occupancy[33] = {0};
    const int64_t cap = int64_t(num_sms()) * resident_ctas(kern, threads, occupancy);
    if (grid > cap) grid = cap;
  }
  kern<<<static_cast<unsigned>(grid), threads, 0, stream>>>(x, res, w, b, out, h, rows, H, eps);
  return cudaGetLastError();
}

template <typename T, typename W, bool LN>
cudaError_t run_norm(const T* x, const T* res, const W* w, const W* b, T* out, T* h, int64_t rows, int64_t H,
                     float eps, cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const bool vec_ok = H % N == 0 && aligned16(x) && aligned16(out) && aligned16(h) && (!res || aligned16(res)) &&
                      (!w || aligned16(w)) && (!b || aligned16(b));
  const dim3 grid(static_cast<unsigned>(rows));
  if (vec_ok && H / N <= 2048) {
    // Default (variant 0), the fastest measured on the H200 (kernels_2026-11-30_h200_variants.md):
    // one CTA per row (grid = rows); RMSNorm with one vector per thread up to 512 vectors (the
    // 4096-wide bf16 row is 512 threads x 8 elements: 70.5 us, 90% of the copy rate), LayerNorm
    // with two per thread above 256 vectors (its extra registers: 73.8 us, 86%). Variant bit 0
    // flips the vectors per thread; bit 1 makes the grid persistent (SMs x resident CTAs, next
    // row in flight), which measured 5-8% slower at 8192 rows.
    const int var = variant(VAR_NORM);
    const bool wide = ((var & 1) == 0) != LN, persistent = (var & 2) != 0;
    const int64_t nvec = H / N;
    // register budgets (launch bounds) chosen so that 2048 (RMSNorm, NV 1: 32 registers),
    // 1536 (LayerNorm, NV 1: 40 registers; 32 would spill) or 1024 (NV 2) threads stay resident
    // per SM without spills: with the next row in flight that is 48-64 KB of loads per SM
    if (nvec <= 256 || (wide && nvec <= 512))
      return go_vec<T, W, 1, LN, 512, LN ? 3 : 4>(x, res, w, b, out, h, rows, H, eps, persistent, stream);
    if (nvec <= 1024) return go_vec<T, W, 2, LN, 512, 2>(x, res, w, b, out, h, rows, H, eps, persistent, stream);
    return go_vec<T, W, 4, LN, 512, 1>(x, res, w, b, out, h, rows, H, eps, persistent, stream);
  }
#define GO_REG(VEC, NV, MAXT)                                                                          \
  norm_reg_kernel<T, W, VEC, NV, LN, MAXT>                                                                \
      <<<grid, round_up32((H / VEC + NV - 1) / NV), 0, stream>>>(x, res, w, b, out, h, H, eps);          \
  return cudaGetLastError();
  // Unaligned or odd rows up to 16384 elements stay in registers as scalars (coalesced,
  // 1024 threads x 16); longer rows loop.
  if (H <= 16384) {
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

// ---- graphopt::add_rms_norm and graphopt::add_layer_norm (host side; torch headers stay out of the device passes)
#ifndef __CUDA_ARCH__
#include "host.h"

namespace graphopt {
namespace {

// weight/bias dtype: fp32 stays fp32, otherwise the activation dtype
at::Tensor norm_param(const std::optional<at::Tensor>& p, const at::Tensor& x, at::ScalarType wt, int64_t hidden,
                      const char* what) {
  if (!p.has_value() || !p->defined()) return at::Tensor();
  TORCH_CHECK(p->numel() == hidden, "graphopt: ", what, " must have ", hidden, " elements, got ", p->sizes());
  return p->to(x.device(), wt).contiguous().view({hidden});
}

at::ScalarType param_dtype(const at::Tensor& x, const std::optional<at::Tensor>& w,
                           const std::optional<at::Tensor>& b) {
  if (x.scalar_type() == at::kFloat) return at::kFloat;
  const bool wf = w.has_value() && w->defined() && w->scalar_type() == at::kFloat;
  const bool bf = b.has_value() && b->defined() && b->scalar_type() == at::kFloat;
  return (wf || bf) ? at::kFloat : x.scalar_type();
}

std::tuple<at::Tensor, at::Tensor> add_norm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                 const std::optional<at::Tensor>& weight,
                                                 const std::optional<at::Tensor>& bias, double eps, bool ln) {
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() >= 1, "graphopt: norm input needs at least one dim");
  const int dt = dtype_code(x.scalar_type());
  const int64_t hidden = x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  at::Tensor xc = x.contiguous();
  at::Tensor r;
  if (residual.has_value() && residual->defined()) {
    r = residual->to(x.scalar_type());
    if (r.sizes() != x.sizes()) r = r.expand(x.sizes());
    r = r.contiguous();
  }
  const at::ScalarType wt = param_dtype(x, weight, bias);
  at::Tensor w = norm_param(weight, x, wt, hidden, "weight");
  at::Tensor b = norm_param(bias, x, wt, hidden, "bias");
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor h = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const void* rp = r.defined() ? r.data_ptr() : nullptr;
  const void* wp = w.defined() ? w.data_ptr() : nullptr;
  if (ln) {
    check(launch_add_layer_norm(dt, dtype_code(wt), xc.data_ptr(), rp, wp, b.defined() ? b.data_ptr() : nullptr,
                                out.data_ptr(), h.data_ptr(), rows, hidden, static_cast<float>(eps), stream_of(x)),
          "add_layer_norm");
  } else {
    check(launch_add_rms_norm(dt, dtype_code(wt), xc.data_ptr(), rp, wp, out.data_ptr(), h.data_ptr(), rows, hidden,
                              static_cast<float>(eps), stream_of(x)),
          "add_rms_norm");
  }
  return {out, h};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                     const at::Tensor& weight, double eps) {
  return add_norm_cuda(x, residual, weight, std::nullopt, eps, false);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_cuda(const at::Tensor& x,
                                                       const std::optional<at::Tensor>& residual,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias, double eps) {
  return add_norm_cuda(x, residual, weight, bias, eps, true);
}

}  // namespace
}  // namespace graphopt

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) {
  m.impl("add_rms_norm", &graphopt::add_rms_norm_cuda);
  m.impl("add_layer_norm", &graphopt::add_layer_norm_cuda);
}
#endif  // __CUDA_ARCH__

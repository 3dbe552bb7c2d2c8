// softmax(scores * scale + mask) over the last dim, fp32 math, one pass over memory.
// One row per block, the row held in registers (as norms.cu). Mask: bool (True = keep) or
// additive, broadcast through strides. A row with every position masked (max == -inf) is
// written as zeros instead of NaN.
#include <type_traits>
#include "common.cuh"

namespace graphopt {

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

namespace {

template <typename MT>
__device__ __forceinline__ float apply_mask(float s, const MT* m, int64_t off) {
  if constexpr (std::is_same<MT, uint8_t>::value) {
    return m[off] ? s : -INFINITY;
  } else {
    return s + to_f(m[off]);
  }
}

// The mask offset of a row: its index decomposed over the scores' leading dims. rows < 2^31 (the
// launcher checks), so every dim and index fits 32 bits: 32-bit divisions (~4x cheaper).
__device__ __forceinline__ int64_t mask_row_offset(const SoftmaxMask& mk, int64_t row) {
  uint32_t r = uint32_t(row);
  int64_t off = 0;
#pragma unroll
  for (int d = 3; d >= 0; --d) {
    if (d < mk.ndims) {
      const uint32_t dim = uint32_t(mk.dims[d]);
      const uint32_t q = r / dim;
      off += int64_t(r - q * dim) * mk.strides[d];
      r = q;
    }
  }
  return off;
}

template <typename T, typename MT, int VEC, int NV, int MAXT>
__global__ void __launch_bounds__(MAXT) softmax_reg_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n,
                                                           float scale, SoftmaxMask mk) {
  __shared__ float smem[33];
  constexpr bool FAST = !std::is_same<T, float>::value;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  T* orow = out + row * n;
  const MT* m = static_cast<const MT*>(mk.ptr);
  const int64_t moff = m ? mask_row_offset(mk, row) : 0;
  float v[NV][VEC];
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t e = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
    if (e < n) {
      if constexpr (VEC > 1) load_vec_stream(xr + e, v[k]);
      else v[k][0] = to_f(xr[e]);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        v[k][j] *= scale;
        if (m) v[k][j] = apply_mask(v[k][j], m, moff + (e + j) * mk.last_stride);
        mx = fmaxf(mx, v[k][j]);
      }
    }
  }
  mx = block_max(mx, smem);
  const bool dead = mx == -INFINITY;  // every position masked
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t e = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
    if (e < n) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        v[k][j] = dead ? 0.f : (FAST ? __expf(v[k][j] - mx) : expf(v[k][j] - mx));
        sum += v[k][j];
      }
    }
  }
  sum = block_sum(sum, smem);
  const float inv = dead ? 0.f : 1.0f / sum;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t e = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
    if (e < n) {
      float o[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = v[k][j] * inv;
      if constexpr (VEC > 1) store_vec_stream(orow + e, o);
      else orow[e] = from_f<T>(o[0]);
    }
  }
}


// VEC mask values for positions e..e+VEC-1 of a row whose mask starts at m + moff. `vec` says the
// mask's last dim is contiguous and this chunk is aligned for one vector load.
template <typename MT, int VEC>
__device__ __forceinline__ void mask_chunk(const MT* m, int64_t moff, int64_t e, int64_t last_stride, bool vec,
                                           float (&s)[VEC]) {
  if constexpr (sizeof(MT) * VEC == 8 || sizeof(MT) * VEC == 16 || sizeof(MT) * VEC == 4) {
    if (vec) {
      MT mv[VEC];
      if constexpr (sizeof(MT) * VEC == 16) *reinterpret_cast<uint4*>(mv) = *reinterpret_cast<const uint4*>(m + moff + e);
      else if constexpr (sizeof(MT) * VEC == 8) *reinterpret_cast<uint2*>(mv) = *reinterpret_cast<const uint2*>(m + moff + e);
      else *reinterpret_cast<uint32_t*>(mv) = *reinterpret_cast<const uint32_t*>(m + moff + e);
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[j] = apply_mask(s[j], mv, j);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) s[j] = apply_mask(s[j], m, moff + (e + j) * last_stride);
}

__device__ __forceinline__ float exp2_fast(float x) {  // ex2.approx: 2 ulp, -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One warp per row, the row in registers (NV 16-byte vectors per lane), no shared memory and no
// block barriers. Persistent: warp g handles rows g, g + total_warps, ... and issues the next
// row's loads as soon as the current row is in floats, so they overlap this row's reductions,
// exponentials and stores. Scores are scaled by scale * log2(e) (an additive mask by log2(e))
// and exponentiated with exp2: one FFMA + one MUFU per element.
template <typename T, typename MT, int NV, int MINB>
__global__ void __launch_bounds__(128, MINB) softmax_warp_kernel(const T* __restrict__ x, T* __restrict__ out,
                                                                 int64_t rows, int64_t n, float scale_log2,
                                                                 SoftmaxMask mk) {
  constexpr int N = Vec<T>::N;
  constexpr bool FAST = !std::is_same<T, float>::value;
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = threadIdx.x & 31;
  const int64_t wpb = blockDim.x >> 5;
  const int64_t warps = int64_t(gridDim.x) * wpb;
  const MT* m = static_cast<const MT*>(mk.ptr);
  Vec<T> cx[NV];
  auto issue = [&](int64_t r) {
    const uint4* xp = reinterpret_cast<const uint4*>(x + r * n);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t e = (int64_t(lane) + k * 32) * N;
      if (e < n) cx[k].raw = __ldcs(xp + lane + k * 32);
    }
  };
  int64_t row = int64_t(blockIdx.x) * wpb + (threadIdx.x >> 5);
  if (row < rows) issue(row);
  for (; row < rows; row += warps) {
    const int64_t moff = m ? mask_row_offset(mk, row) : 0;
    const bool mvec = m && mk.last_stride == 1 && ((reinterpret_cast<uintptr_t>(m + moff)) % (sizeof(MT) * N)) == 0;
    float v[NV][N];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t e = (int64_t(lane) + k * 32) * N;
      if (e < n) {
#pragma unroll
        for (int j = 0; j < N; ++j) v[k][j] = to_f(cx[k].v[j]) * scale_log2;
        if (m) {
          if constexpr (std::is_same<MT, uint8_t>::value) {
            mask_chunk<MT, N>(m, moff, e, mk.last_stride, mvec, v[k]);
          } else {  // additive: + mask * log2(e)
            float mv[N];
#pragma unroll
            for (int j = 0; j < N; ++j) mv[j] = 0.f;
            mask_chunk<MT, N>(m, moff, e, mk.last_stride, mvec, mv);
#pragma unroll
            for (int j = 0; j < N; ++j) v[k][j] = fmaf(mv[j], kLog2e, v[k][j]);
          }
        }
#pragma unroll
        for (int j = 0; j < N; ++j) mx = fmaxf(mx, v[k][j]);
      }
    }
    if (row + warps < rows) issue(row + warps);
    mx = warp_max(mx);
    const bool dead = mx == -INFINITY;  // every position masked
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t e = (int64_t(lane) + k * 32) * N;
      if (e < n) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          v[k][j] = dead ? 0.f : (FAST ? exp2_fast(v[k][j] - mx) : exp2f(v[k][j] - mx));
          sum += v[k][j];
        }
      }
    }
    sum = warp_sum(sum);
    const float inv = dead ? 0.f : 1.0f / sum;
    T* op = out + row * n;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t e = (int64_t(lane) + k * 32) * N;
      if (e < n) {
        float o[N];
#pragma unroll
        for (int j = 0; j < N; ++j) o[j] = v[k][j] * inv;
        store_vec_stream(op + e, o);
      }
    }
  }
}

// Any row length: three sweeps (the 2nd and 3rd re-read the row from L2).
template <typename T, typename MT>
__global__ void __launch_bounds__(1024) softmax_loop_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n,
                                                            float scale, SoftmaxMask mk) {
  __shared__ float smem[33];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  T* orow = out + row * n;
  const MT* m = static_cast<const MT*>(mk.ptr);
  const int64_t moff = m ? mask_row_offset(mk, row) : 0;
  auto val = [&](int64_t e) {
    float s = to_f(xr[e]) * scale;
    return m ? apply_mask(s, m, moff + e * mk.last_stride) : s;
  };
  float mx = -INFINITY;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) mx = fmaxf(mx, val(e));
  mx = block_max(mx, smem);
  const bool dead = mx == -INFINITY;
  float sum = 0.f;
  if (!dead)
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) sum += expf(val(e) - mx);
  sum = block_sum(sum, smem);
  const float inv = dead ? 0.f : 1.0f / sum;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) orow[e] = from_f<T>(dead ? 0.f : expf(val(e) - mx) * inv);
}

inline int round_up32(int64_t v) { return int((v + 31) / 32 * 32); }

template <typename T, typename MT>
cudaError_t run(const T* x, T* out, int64_t rows, int64_t n, float scale, const SoftmaxMask& mk,
                cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const bool vec_ok = n % N == 0 && aligned16(x) && aligned16(out);
  const dim3 grid(static_cast<unsigned>(rows));
#define GO_REG(VEC, NV, MAXT)                                                                                  \
  softmax_reg_kernel<T, MT, VEC, NV, MAXT><<<grid, round_up32((n / VEC + NV - 1) / NV), 0, stream>>>(x, out, n, \
                                                                                                    scale, mk); \
  return cudaGetLastError();
  // Rows of up to 32 * 8 vectors: one warp per row, four warps per block, grid = rows / 4
  // (variant 0: 74.3 us, 85% of the copy rate on the H200) or a persistent grid (variant 1: 77.6).
  if (vec_ok && n <= 32 * 8 * N) {
    constexpr float kLog2e = 1.4426950408889634f;
    const bool persistent = variant(VAR_SOFTMAX) != 0;
#define GO_WARP(NV, MINB)                                                                                 \
  {                                                                                                        \
    auto kern = softmax_warp_kernel<T, MT, NV, MINB>;                                                      \
    int64_t blocks = (rows + 3) / 4;                                                                       \
    if (persistent) {                                                                                      \
      static int occ = 0;                                                                                  \
      if (occ == 0 && (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 128, 0) != cudaSuccess || \
                       occ <= 0)) {                                                                        \
        (void)cudaGetLastError();                                                                          \
        occ = 1;                                                                                           \
      }                                                                                                    \
      const int64_t cap = int64_t(num_sms()) * occ;                                                        \
      if (blocks > cap) blocks = cap;                                                                      \
    }                                                                                                      \
    kern<<<static_cast<unsigned>(blocks), 128, 0, stream>>>(x, out, rows, n, scale * kLog2e, mk);          \
    return cudaGetLastError();                                                                             \
  }
    if (n <= 32 * 2 * N) GO_WARP(2, 8)
    if (n <= 32 * 4 * N) GO_WARP(4, 6)
    GO_WARP(8, 4)
#undef GO_WARP
  }
  if (vec_ok && n / N <= 2048) {
    const int64_t nvec = n / N;
    if (nvec <= 256) { GO_REG(N, 1, 256); }
    if (nvec <= 512) { GO_REG(N, 2, 256); }
    GO_REG(N, 4, 512);
  } else if (n <= 16384) {
    if (n <= 256) { GO_REG(1, 1, 256); }
    if (n <= 1024) { GO_REG(1, 4, 256); }
    GO_REG(1, 16, 1024);
  }
#undef GO_REG
  softmax_loop_kernel<T, MT><<<grid, 1024, 0, stream>>>(x, out, n, scale, mk);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_softmax_mask(int dtype, const void* scores, void* out, int64_t rows, int64_t n, float scale,
                                const SoftmaxMask& mask, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, {
    const T* x = static_cast<const T*>(scores);
    T* o = static_cast<T*>(out);
    if (mask.kind == 1) return run<T, uint8_t>(x, o, rows, n, scale, mask, stream);
    if (mask.kind == 2 && mask.dtype == DT_F32) return run<T, float>(x, o, rows, n, scale, mask, stream);
    if (mask.kind == 2 && mask.dtype == dtype) return run<T, T>(x, o, rows, n, scale, mask, stream);
    if (mask.kind != 0) return cudaErrorInvalidValue;
    SoftmaxMask none = mask;
    none.ptr = nullptr;
    return run<T, float>(x, o, rows, n, scale, none, stream);
  });
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

// ---- graphopt::softmax_mask (host side; torch headers stay out of the device passes)
#ifndef __CUDA_ARCH__
#include "host.h"

namespace graphopt {
namespace {

at::Tensor softmax_mask_cuda(const at::Tensor& scores, double scale, const std::optional<at::Tensor>& mask) {
  c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(scores.dim() >= 1, "graphopt::softmax_mask: scores need at least one dim");
  const int dt = dtype_code(scores.scalar_type());
  at::Tensor x = scores.contiguous();
  at::Tensor out = at::empty(scores.sizes(), scores.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = scores.size(-1);
  const int64_t rows = n == 0 ? 0 : scores.numel() / n;
  SoftmaxMask mk;
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    if (m.device() != scores.device()) m = m.to(scores.device());
    if (m.scalar_type() == at::kBool) {
      mk.kind = 1;
    } else {
      mk.kind = 2;
      if (m.scalar_type() != at::kFloat && m.scalar_type() != scores.scalar_type()) m = m.to(at::kFloat);
      mk.dtype = dtype_code(m.scalar_type());
    }
    m = m.expand(scores.sizes());  // zero strides where broadcast
    const int64_t lead = scores.dim() - 1;
    if (lead > 4) {
      m = m.contiguous().view({rows, n});
      mk.ndims = 1; mk.dims[0] = rows; mk.strides[0] = n; mk.last_stride = 1;
    } else {
      mk.ndims = static_cast<int>(lead);
      for (int64_t i = 0; i < lead; ++i) { mk.dims[i] = scores.size(i); mk.strides[i] = m.stride(i); }
      mk.last_stride = m.stride(-1);
    }
    mk.ptr = m.data_ptr();
  }
  check(launch_softmax_mask(dt, x.data_ptr(), out.data_ptr(), rows, n, static_cast<float>(scale), mk,
                            stream_of(scores)),
        "softmax_mask");
  return out;
}

}  // namespace
}  // namespace graphopt

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) {
  m.impl("softmax_mask", &graphopt::softmax_mask_cuda);
}
#endif  // __CUDA_ARCH__

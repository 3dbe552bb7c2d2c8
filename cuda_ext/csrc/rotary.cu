// Rotary position embedding on q and k in one launch. x[B, H, S, D] may have any strides
// (e.g. a transposed [B, S, H, D] projection); the outputs are contiguous [B, H, S, D].
// The first R dims of each head rotate, R..D pass through (GLM's partial rotary):
//   interleaved = false (Llama, rotate_half): pairs (i, i + R/2)
//   interleaved = true  (GLM, stack((-x1, x0), -1)): pairs (2i, 2i + 1)
//   out_a = x_a * cos_a - x_b * sin_a,  out_b = x_b * cos_b + x_a * sin_b
#include "common.cuh"

namespace graphopt {
namespace {

// blockDim = (32, 8): threadIdx.x walks the pairs of one row, threadIdx.y picks the row.
template <typename T>
__global__ void __launch_bounds__(256) rotary_kernel(RotaryArgs q, RotaryArgs k, int64_t q_rows, int64_t total_rows) {
  const int64_t grow = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (grow >= total_rows) return;
  const bool is_q = grow < q_rows;
  const RotaryArgs& a = is_q ? q : k;
  const int64_t row = is_q ? grow : grow - q_rows;
  // row = (b * H + h) * S + s
  const int64_t s = row % a.S;
  const int64_t bh = row / a.S;
  const int64_t h = bh % a.H;
  const int64_t b = bh / a.H;
  const T* x = static_cast<const T*>(a.x) + b * a.sb + h * a.sh + s * a.ss;
  T* o = static_cast<T*>(a.out) + row * a.D;
  const int64_t cbase = b * a.cb + s * a.cs;
  const T* c = static_cast<const T*>(a.cos) + cbase;
  const T* sn = static_cast<const T*>(a.sin) + cbase;
  const int64_t half = a.R / 2;
  for (int64_t p = threadIdx.x; p < half; p += blockDim.x) {
    const int64_t ia = a.interleaved ? 2 * p : p;
    const int64_t ib = a.interleaved ? 2 * p + 1 : p + half;
    const float xa = to_f(x[ia * a.sd]), xb = to_f(x[ib * a.sd]);
    const float ca = to_f(c[ia * a.cr]), sa = to_f(sn[ia * a.cr]);
    const float cb = to_f(c[ib * a.cr]), sb = to_f(sn[ib * a.cr]);
    o[ia] = from_f<T>(xa * ca - xb * sa);
    o[ib] = from_f<T>(xb * cb + xa * sb);
  }
  for (int64_t e = a.R + threadIdx.x; e < a.D; e += blockDim.x) o[e] = x[e * a.sd];
}


// Vectorized path: the last dim contiguous and every row start 16-byte aligned. One item is one
// 16-byte chunk of a row (N elements): a rotary chunk (interleaved: pairs inside the chunk), a
// pair of chunks e and e + R/2 (rotate_half), or a pass-through chunk; U items per thread.
// Item and row counters are 32-bit (the launcher checks the item count); offsets are 64-bit.
template <typename T, bool INTERLEAVED, int U>
__global__ void __launch_bounds__(256) rotary_vec_kernel(RotaryArgs q, RotaryArgs k, uint32_t q_items,
                                                         uint32_t total_items) {
  constexpr int N = Vec<T>::N;
  const uint32_t base = blockIdx.x * (blockDim.x * U) + threadIdx.x;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t g = base + u * blockDim.x;
    if (g >= total_items) return;
    const bool is_q = g < q_items;
    const RotaryArgs& a = is_q ? q : k;
    const uint32_t li = is_q ? g : g - q_items;
    const uint32_t rot_items = INTERLEAVED ? uint32_t(a.R / N) : uint32_t(a.R / (2 * N));
    const uint32_t ipr = rot_items + uint32_t((a.D - a.R) / N);
    const uint32_t row = li / ipr, c = li - row * ipr;
    const uint32_t S = uint32_t(a.S), H = uint32_t(a.H);
    const uint32_t s = row % S, bh = row / S;
    const uint32_t h = bh % H, b = bh / H;
    const T* x = static_cast<const T*>(a.x) + b * a.sb + h * a.sh + s * a.ss;
    T* o = static_cast<T*>(a.out) + int64_t(row) * a.D;
    if (c >= rot_items) {  // pass-through chunk
      const int64_t e = a.R + int64_t(c - rot_items) * N;
      __stcs(reinterpret_cast<uint4*>(o + e), __ldcs(reinterpret_cast<const uint4*>(x + e)));
      continue;
    }
    const int64_t cbase = b * a.cb + s * a.cs;
    const T* cp = static_cast<const T*>(a.cos) + cbase;
    const T* sp = static_cast<const T*>(a.sin) + cbase;
    if constexpr (INTERLEAVED) {
      const int64_t e = int64_t(c) * N;
      float xv[N], cv[N], sv[N], ov[N];
      load_vec_stream(x + e, xv);
      load_vec(cp + e, cv);
      load_vec(sp + e, sv);
#pragma unroll
      for (int j = 0; j < N; j += 2) {
        ov[j] = xv[j] * cv[j] - xv[j + 1] * sv[j];
        ov[j + 1] = xv[j + 1] * cv[j + 1] + xv[j] * sv[j + 1];
      }
      store_vec_stream(o + e, ov);
    } else {
      const int64_t half = a.R / 2;
      const int64_t ea = int64_t(c) * N, eb = ea + half;
      float xa[N], xb[N], ca[N], sa[N], cb[N], sb[N], oa[N], ob[N];
      load_vec_stream(x + ea, xa);
      load_vec_stream(x + eb, xb);
      load_vec(cp + ea, ca);
      load_vec(sp + ea, sa);
      load_vec(cp + eb, cb);
      load_vec(sp + eb, sb);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        oa[j] = xa[j] * ca[j] - xb[j] * sa[j];
        ob[j] = xb[j] * cb[j] + xa[j] * sb[j];
      }
      store_vec_stream(o + ea, oa);
      store_vec_stream(o + eb, ob);
    }
  }
}

template <typename T>
bool vec_ok(const RotaryArgs& a) {
  constexpr int N = Vec<T>::N;
  const int64_t rq = a.interleaved ? N : 2 * N;
  return a.sd == 1 && a.cr == 1 && a.D % N == 0 && a.R % rq == 0 && aligned16(a.x) && aligned16(a.out) &&
         aligned16(a.cos) && aligned16(a.sin) && a.sb % N == 0 && a.sh % N == 0 && a.ss % N == 0 &&
         a.cb % N == 0 && a.cs % N == 0;
}

template <typename T>
int64_t vec_items(const RotaryArgs& a) {
  constexpr int N = Vec<T>::N;
  const int64_t ipr = (a.interleaved ? a.R / N : a.R / (2 * N)) + (a.D - a.R) / N;
  return a.B * a.H * a.S * ipr;
}

}  // namespace

cudaError_t launch_rotary(int dtype, const RotaryArgs& q, const RotaryArgs& k, cudaStream_t stream) {
  const int64_t q_rows = q.B * q.H * q.S, k_rows = k.B * k.H * k.S;
  const int64_t total = q_rows + k_rows;
  if (total == 0) return cudaSuccess;
  const dim3 block(32, 8);
  const int64_t blocks = (total + 7) / 8;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, {
    if (q.interleaved == k.interleaved && q.R == k.R && vec_ok<T>(q) && vec_ok<T>(k)) {
      const int64_t qi = vec_items<T>(q), ti = qi + vec_items<T>(k);
      // 32-bit index math: also b * sb etc. stay in 64 bits, only item/row counters are 32-bit
      if (ti < (int64_t(1) << 31) && q.S < (int64_t(1) << 31) && q.H < (int64_t(1) << 31) &&
          k.H < (int64_t(1) << 31)) {
        constexpr int U = 2;
        const int64_t vblocks = (ti + 256 * U - 1) / (256 * U);
        if (q.interleaved)
          rotary_vec_kernel<T, true, U><<<static_cast<unsigned>(vblocks), 256, 0, stream>>>(q, k, uint32_t(qi), uint32_t(ti));
        else
          rotary_vec_kernel<T, false, U><<<static_cast<unsigned>(vblocks), 256, 0, stream>>>(q, k, uint32_t(qi), uint32_t(ti));
        return cudaGetLastError();
      }
    }
    rotary_kernel<T><<<static_cast<unsigned>(blocks), block, 0, stream>>>(q, k, q_rows, total);
    return cudaGetLastError();
  });
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

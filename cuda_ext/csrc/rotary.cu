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

}  // namespace

cudaError_t launch_rotary(int dtype, const RotaryArgs& q, const RotaryArgs& k, cudaStream_t stream) {
  const int64_t q_rows = q.B * q.H * q.S, k_rows = k.B * k.H * k.S;
  const int64_t total = q_rows + k_rows;
  if (total == 0) return cudaSuccess;
  const dim3 block(32, 8);
  const int64_t blocks = (total + 7) / 8;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, {
    rotary_kernel<T><<<static_cast<unsigned>(blocks), block, 0, stream>>>(q, k, q_rows, total);
    return cudaGetLastError();
  });
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

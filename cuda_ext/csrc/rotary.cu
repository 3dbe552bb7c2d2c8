// Rotary position embedding on q and k in one launch. x[B, H, S, D] may have any strides
// (e.g. a transposed [B, S, H, D] projection); the outputs have a contiguous last dim and the
// strides the host side gives (rotary_out below: the input's [B, S, H, D] order when the input is
// a transposed projection, so attention's output comes back in that order too, else [B, H, S, D]).
// The first R dims of each head rotate, R..D pass through (GLM's partial rotary):
//   interleaved = false (Llama, rotate_half): pairs (i, i + R/2)
//   interleaved = true  (GLM, stack((-x1, x0), -1)): pairs (2i, 2i + 1)
//   out_a = x_a * cos_a - x_b * sin_a,  out_b = x_b * cos_b + x_a * sin_b
#include "common.cuh"

namespace graphopt {

// Rotary embedding on one 4-D tensor x[B, H, S, D] (any strides, in elements) into a contiguous out.
// cos/sin are [Bc, S, R] with strides (cs_b may be 0 to broadcast), of x's dtype or float32 (TC below).
struct RotaryArgs {
  const void* x; void* out;
  int64_t B, H, S, D, R;
  int64_t sb, sh, ss, sd;        // x strides
  int64_t osb, osh, oss;         // out strides (last dim contiguous): [B, H, S, D] or a transposed [B, S, H, D]
  const void* cos; const void* sin;
  int64_t cb, cs, cr;            // cos/sin strides (shared layout)
  bool interleaved;
};

namespace {

// blockDim = (32, 8): threadIdx.x walks the pairs of one row, threadIdx.y picks the row.
template <typename T, typename TC>
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
  T* o = static_cast<T*>(a.out) + b * a.osb + h * a.osh + s * a.oss;
  const int64_t cbase = b * a.cb + s * a.cs;
  const TC* c = static_cast<const TC*>(a.cos) + cbase;
  const TC* sn = static_cast<const TC*>(a.sin) + cbase;
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


// Vectorized path: the last dim contiguous and every row start 16-byte aligned. A thread owns one
// (token, chunk) item, token = (b, s), chunk = one 16-byte piece of a head row (N elements): a
// rotary chunk (interleaved: the pairs lie inside it), a pair of chunks c and c + R/2
// (rotate_half), or a pass-through chunk. It loads its cos/sin chunk(s) once and then loops over
// every head of q and then of k, U heads at a time (U independent 16-byte loads in flight
// before the first use): cos/sin are read once per (token, pair) instead of once per head, and
// the index math (two 32-bit divisions) is paid once per item, not per access. A warp covers
// whole head rows of consecutive tokens: reads are 16-byte vectors over contiguous 256-byte
// head rows (the input may be a transposed [B, S, H, D] projection), writes contiguous runs
// of the output. Interleaved (GLM): pass-through chunks take the same loads and
// stores as rotary ones (a select, not a branch), so a warp mixing both kinds issues one
// instruction stream. When there are too few tokens to fill the GPU, blockIdx.y splits the
// heads (each y takes a contiguous range of q's and of k's heads).
template <typename T, bool INTERLEAVED, int U>
__device__ __forceinline__ void rotary_heads(const RotaryArgs& a, uint32_t b, uint32_t s, bool rot,
                                             int64_t ea, int64_t eb, const float (&ca)[Vec<T>::N],
                                             const float (&sa)[Vec<T>::N], const float (&cb)[Vec<T>::N],
                                             const float (&sb)[Vec<T>::N]) {
  constexpr int N = Vec<T>::N;
  const T* xbase = static_cast<const T*>(a.x) + int64_t(b) * a.sb + int64_t(s) * a.ss;
  T* obase = static_cast<T*>(a.out) + int64_t(b) * a.osb + int64_t(s) * a.oss;
  const int64_t ostride = a.osh;  // one head further in the output
  const bool pair = !INTERLEAVED && rot;
  // blockIdx.y splits the heads when there are too few tokens to fill the GPU
  const int64_t per = (a.H + gridDim.y - 1) / gridDim.y;
  const int64_t hbeg = int64_t(blockIdx.y) * per;
  const int64_t hend = hbeg + per < a.H ? hbeg + per : a.H;
  for (int64_t h0 = hbeg; h0 < hend; h0 += U) {
    Vec<T> xa[U], xb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (h0 + u < hend) {
        const T* xp = xbase + (h0 + u) * a.sh;
        xa[u].raw = __ldcs(reinterpret_cast<const uint4*>(xp + ea));
        if (pair) xb[u].raw = __ldcs(reinterpret_cast<const uint4*>(xp + eb));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (h0 + u >= hend) break;
      T* op = obase + (h0 + u) * ostride;
      float xv[N], ov[N];
#pragma unroll
      for (int j = 0; j < N; ++j) xv[j] = to_f(xa[u].v[j]);
      if constexpr (INTERLEAVED) {
#pragma unroll
        for (int j = 0; j < N; j += 2) {
          ov[j] = rot ? xv[j] * ca[j] - xv[j + 1] * sa[j] : xv[j];
          ov[j + 1] = rot ? xv[j + 1] * ca[j + 1] + xv[j] * sa[j + 1] : xv[j + 1];
        }
        store_vec_stream(op + ea, ov);
      } else {
        if (pair) {
          float yv[N], pv[N];
#pragma unroll
          for (int j = 0; j < N; ++j) yv[j] = to_f(xb[u].v[j]);
#pragma unroll
          for (int j = 0; j < N; ++j) {
            ov[j] = xv[j] * ca[j] - yv[j] * sa[j];
            pv[j] = yv[j] * cb[j] + xv[j] * sb[j];
          }
          store_vec_stream(op + ea, ov);
          store_vec_stream(op + eb, pv);
        } else {
          __stcs(reinterpret_cast<uint4*>(op + ea), xa[u].raw);
        }
      }
    }
  }
}

// One chunk of cos/sin (Vec<T>::N values) as floats: one 16-byte load of x's dtype, or N/4 of float32.
template <typename T, typename TC>
__device__ __forceinline__ void load_table(const TC* p, float (&out)[Vec<T>::N]) {
  if constexpr (sizeof(TC) == sizeof(T)) {
    load_vec(p, out);
  } else {
#pragma unroll
    for (int i = 0; i < Vec<T>::N; i += 4) {
      float part[4];
      load_vec(p + i, part);
#pragma unroll
      for (int j = 0; j < 4; ++j) out[i + j] = part[j];
    }
  }
}

template <typename T, typename TC, bool INTERLEAVED, int U>
__global__ void __launch_bounds__(256) rotary_vec_kernel(RotaryArgs q, RotaryArgs k, uint32_t items) {
  constexpr int N = Vec<T>::N;
  const uint32_t g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= items) return;
  // q and k share B, S, D, R (the launcher checks)
  const uint32_t rot_items = INTERLEAVED ? uint32_t(q.R / N) : uint32_t(q.R / (2 * N));
  const uint32_t ipr = rot_items + uint32_t((q.D - q.R) / N);
  const uint32_t token = g / ipr, c = g - token * ipr;
  const uint32_t S = uint32_t(q.S);
  const uint32_t b = token / S, s = token - b * S;
  const bool rot = c < rot_items;
  int64_t ea, eb = 0;
  if (rot) {
    ea = int64_t(c) * N;
    if (!INTERLEAVED) eb = ea + q.R / 2;
  } else {
    ea = q.R + int64_t(c - rot_items) * N;
  }
  float ca[N], sa[N], cb[N], sb[N];
#pragma unroll
  for (int j = 0; j < N; ++j) ca[j] = sa[j] = cb[j] = sb[j] = 0.f;
  if (rot) {  // this token's cos/sin chunk(s): read once, used for every head of q and k
    const int64_t cbase = int64_t(b) * q.cb + int64_t(s) * q.cs;
    const TC* cp = static_cast<const TC*>(q.cos) + cbase;
    const TC* sp = static_cast<const TC*>(q.sin) + cbase;
    load_table<T>(cp + ea, ca);
    load_table<T>(sp + ea, sa);
    if (!INTERLEAVED) {
      load_table<T>(cp + eb, cb);
      load_table<T>(sp + eb, sb);
    }
  }
  rotary_heads<T, INTERLEAVED, U>(q, b, s, rot, ea, eb, ca, sa, cb, sb);
  rotary_heads<T, INTERLEAVED, U>(k, b, s, rot, ea, eb, ca, sa, cb, sb);
}

template <typename T>
bool vec_ok(const RotaryArgs& a) {
  constexpr int N = Vec<T>::N;
  const int64_t rq = a.interleaved ? N : 2 * N;
  return a.sd == 1 && a.cr == 1 && a.D % N == 0 && a.R % rq == 0 && aligned16(a.x) && aligned16(a.out) &&
         aligned16(a.cos) && aligned16(a.sin) && a.sb % N == 0 && a.sh % N == 0 && a.ss % N == 0 &&
         a.cb % N == 0 && a.cs % N == 0 && a.osb % N == 0 && a.osh % N == 0 && a.oss % N == 0;
}

template <typename T>
int64_t vec_items_per_token(const RotaryArgs& a) {
  constexpr int N = Vec<T>::N;
  return (a.interleaved ? a.R / N : a.R / (2 * N)) + (a.D - a.R) / N;
}

}  // namespace

template <typename T, typename TC>
cudaError_t launch_rotary_typed(const RotaryArgs& q, const RotaryArgs& k, cudaStream_t stream) {
  const int64_t q_rows = q.B * q.H * q.S, k_rows = k.B * k.H * k.S;
  const int64_t total = q_rows + k_rows;
  if (total == 0) return cudaSuccess;
  const dim3 block(32, 8);
  const int64_t blocks = (total + 7) / 8;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  if (q.interleaved == k.interleaved && q.R == k.R && q.B == k.B && q.S == k.S && q.D == k.D &&
      q.cb == k.cb && q.cs == k.cs && vec_ok<T>(q) && vec_ok<T>(k)) {
    const int64_t items = q.B * q.S * vec_items_per_token<T>(q);
    // 32-bit item/token counters; all element offsets are 64-bit
    if (items < (int64_t(1) << 31) && q.S < (int64_t(1) << 31)) {
      const unsigned vblocks = static_cast<unsigned>((items + 255) / 256);
      // few tokens: split the heads over blockIdx.y until ~8 CTAs per SM exist
      const int64_t hmax = q.H > k.H ? q.H : k.H;
      int64_t split = (int64_t(num_sms()) * 8 + vblocks - 1) / vblocks;
      if (split > hmax) split = hmax;
      if (split > 65535) split = 65535;
      if (split < 1) split = 1;
      const dim3 grid(vblocks, static_cast<unsigned>(split));
      // variant 0: 4 heads in flight per thread; variant 1: 8
      const bool deep = variant(VAR_ROTARY) == 1;
      if (q.interleaved) {
        if (deep) rotary_vec_kernel<T, TC, true, 8><<<grid, 256, 0, stream>>>(q, k, uint32_t(items));
        else rotary_vec_kernel<T, TC, true, 4><<<grid, 256, 0, stream>>>(q, k, uint32_t(items));
      } else {
        if (deep) rotary_vec_kernel<T, TC, false, 8><<<grid, 256, 0, stream>>>(q, k, uint32_t(items));
        else rotary_vec_kernel<T, TC, false, 4><<<grid, 256, 0, stream>>>(q, k, uint32_t(items));
      }
      return cudaGetLastError();
    }
  }
  rotary_kernel<T, TC><<<static_cast<unsigned>(blocks), block, 0, stream>>>(q, k, q_rows, total);
  return cudaGetLastError();
}

// table_f32: cos/sin are float32 while q/k are half or bfloat16 (a model that rotates in float32
// between casts of its activations: the casts are absorbed, the tables keep their precision)
cudaError_t launch_rotary(int dtype, bool table_f32, const RotaryArgs& q, const RotaryArgs& k, cudaStream_t stream) {
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, {
    if (table_f32 && sizeof(T) != sizeof(float)) return launch_rotary_typed<T, float>(q, k, stream);
    return launch_rotary_typed<T, T>(q, k, stream);
  });
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

// ---- graphopt::rotary (host side; torch headers stay out of the device passes)
#ifndef __CUDA_ARCH__
#include "host.h"

namespace graphopt {
namespace {

RotaryArgs rotary_args(const at::Tensor& x, const at::Tensor& out, const at::Tensor& c, const at::Tensor& s,
                       int64_t R, bool interleaved, const char* name) {
  TORCH_CHECK(x.dim() == 4, "graphopt::rotary: ", name, " must be [B, H, S, D], got ", x.sizes());
  RotaryArgs a;
  a.x = x.data_ptr();
  a.out = out.data_ptr();
  a.B = x.size(0); a.H = x.size(1); a.S = x.size(2); a.D = x.size(3); a.R = R;
  a.sb = x.stride(0); a.sh = x.stride(1); a.ss = x.stride(2); a.sd = x.stride(3);
  a.osb = out.stride(0); a.osh = out.stride(1); a.oss = out.stride(2);
  TORCH_CHECK(out.size(3) <= 1 || out.stride(3) == 1, "graphopt::rotary: output's last dim must be contiguous");
  TORCH_CHECK(c.size(0) == 1 || c.size(0) == a.B, "graphopt::rotary: cos/sin batch ", c.size(0),
              " must be 1 or ", a.B);
  TORCH_CHECK(c.size(1) == a.S, "graphopt::rotary: cos/sin have ", c.size(1), " positions, ", name, " has ", a.S);
  TORCH_CHECK(R <= a.D && R % 2 == 0, "graphopt::rotary: rotary dim ", R, " must be even and <= head dim ", a.D);
  a.cos = c.data_ptr();
  a.sin = s.data_ptr();
  a.cb = c.size(0) == 1 ? 0 : c.stride(0);
  a.cs = c.stride(1);
  a.cr = c.stride(2);
  a.interleaved = interleaved;
  return a;
}

// The output layout: a q/k whose heads are closer in memory than its positions (a [B, S, H, D]
// projection viewed as heads and transposed, the usual spelling, also a slice of a merged QKV
// projection) gets a dense output in that [B, S, H, D] order, so attention reading it writes its own
// output in [B, S, H, D] order and the heads merge back without a copy; anything else gets a
// contiguous [B, H, S, D]. reference.rotary_layout is the same rule for the CPU and fake paths.
at::Tensor rotary_out(const at::Tensor& x) {
  if (x.dim() == 4 && x.stride(3) == 1 && x.stride(1) < x.stride(2))
    return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor rotary_table(const at::Tensor& t, const at::Tensor& q) {
  at::Tensor c = t;
  if (c.dim() == 4) {
    TORCH_CHECK(c.size(1) == 1, "graphopt::rotary: 4-D cos/sin must be [B, 1, S, R], got ", c.sizes());
    c = c.squeeze(1);
  }
  if (c.dim() == 2) c = c.unsqueeze(0);
  TORCH_CHECK(c.dim() == 3, "graphopt::rotary: cos/sin must be [B or 1, S, R], got ", t.sizes());
  // float32 tables beside half/bfloat16 q stay float32 (the kernel reads them as such)
  const bool keep_f32 = c.scalar_type() == at::kFloat && q.scalar_type() != at::kFloat &&
                        q.scalar_type() != at::kDouble;
  return c.to(q.device(), keep_f32 ? at::kFloat : q.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> rotary_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                               const at::Tensor& sin, bool interleaved) {
  c10::cuda::CUDAGuard guard(q.device());
  const int dt = dtype_code(q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "graphopt::rotary: q and k dtypes differ");
  at::Tensor c = rotary_table(cos, q), s = rotary_table(sin, q);
  TORCH_CHECK(c.sizes() == s.sizes(), "graphopt::rotary: cos and sin shapes differ");
  const int64_t R = c.size(2);
  at::Tensor qo = rotary_out(q), ko = rotary_out(k);
  RotaryArgs qa = rotary_args(q, qo, c, s, R, interleaved, "q");
  RotaryArgs ka = rotary_args(k, ko, c, s, R, interleaved, "k");
  TORCH_CHECK(qa.B == ka.B && qa.S == ka.S && qa.D == ka.D, "graphopt::rotary: q ", q.sizes(), " and k ", k.sizes(),
              " must agree in B, S and D");
  TORCH_CHECK(c.scalar_type() == s.scalar_type(), "graphopt::rotary: cos and sin dtypes differ");
  const bool table_f32 = c.scalar_type() == at::kFloat && q.scalar_type() != at::kFloat;
  check(launch_rotary(dt, table_f32, qa, ka, stream_of(q)), "rotary");
  return {qo, ko};
}

}  // namespace
}  // namespace graphopt

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) {
  m.impl("rotary", &graphopt::rotary_cuda);
}
#endif  // __CUDA_ARCH__

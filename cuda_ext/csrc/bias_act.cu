// bias + activation (+ residual) epilogue: y = act(x + bias) + residual.
// One pass over memory; 16-byte vector loads/stores when the pointers allow it, a scalar
// kernel for the unaligned case and for the tail that does not fill a vector.
#include "common.cuh"

#define GRAPHOPT_DISPATCH_ACT(ACT, A, ...)                               \
  switch (ACT) {                                                         \
    case ::graphopt::ACT_NONE: { constexpr int A = ::graphopt::ACT_NONE; __VA_ARGS__; break; } \
    case ::graphopt::ACT_RELU: { constexpr int A = ::graphopt::ACT_RELU; __VA_ARGS__; break; } \
    case ::graphopt::ACT_GELU: { constexpr int A = ::graphopt::ACT_GELU; __VA_ARGS__; break; } \
    case ::graphopt::ACT_GELU_TANH: { constexpr int A = ::graphopt::ACT_GELU_TANH; __VA_ARGS__; break; } \
    case ::graphopt::ACT_SILU: { constexpr int A = ::graphopt::ACT_SILU; __VA_ARGS__; break; } \
    case ::graphopt::ACT_SIGMOID: { constexpr int A = ::graphopt::ACT_SIGMOID; __VA_ARGS__; break; } \
    case ::graphopt::ACT_TANH: { constexpr int A = ::graphopt::ACT_TANH; __VA_ARGS__; break; } \
    case ::graphopt::ACT_HARDSWISH: { constexpr int A = ::graphopt::ACT_HARDSWISH; __VA_ARGS__; break; } \
    case ::graphopt::ACT_LEAKY_RELU: { constexpr int A = ::graphopt::ACT_LEAKY_RELU; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;                               \
  }

namespace graphopt {

enum Act : int {
  ACT_NONE = 0, ACT_RELU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3,
  ACT_SILU = 4, ACT_SIGMOID = 5, ACT_TANH = 6, ACT_HARDSWISH = 7, ACT_LEAKY_RELU = 8
};

// fp32 in, fp32 out; FAST: the hardware approximations (exact enough for 16-bit outputs);
// alpha: leaky_relu's negative slope (unused by the others)
template <int ACT, bool FAST> __device__ __forceinline__ float apply_act(float x, float alpha) {
  if constexpr (ACT == ACT_NONE) {
    return x;
  } else if constexpr (ACT == ACT_RELU) {
    return x > 0.f ? x : (x != x ? x : 0.f);  // keep NaN like torch.relu
  } else if constexpr (ACT == ACT_GELU) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
  } else if constexpr (ACT == ACT_GELU_TANH) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    return 0.5f * x * (1.0f + tanh_f<FAST>(k0 * (x + k1 * x * x * x)));
  } else if constexpr (ACT == ACT_SILU) {
    return x * sigmoid_f<FAST>(x);
  } else if constexpr (ACT == ACT_SIGMOID) {
    return sigmoid_f<FAST>(x);
  } else if constexpr (ACT == ACT_TANH) {
    return tanh_f<FAST>(x);
  } else if constexpr (ACT == ACT_LEAKY_RELU) {
    return x > 0.f ? x : x * alpha;  // as torch's kernel (NaN stays NaN)
  } else {  // ACT_HARDSWISH
    return x * fminf(fmaxf(x + 3.0f, 0.0f), 6.0f) * (1.0f / 6.0f);
  }
}

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 2;

// BMODE: 0 no bias, 1 bias along the last dim with channels % N == 0 (vector load),
//        2 every vector lies inside one channel (inner % N == 0), 3 general per element.
template <typename T, int ACT, int BMODE, bool RES>
__global__ void __launch_bounds__(kThreads) bias_act_vec_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                                const T* __restrict__ res, T* __restrict__ y,
                                                                int64_t nvec, int64_t C, int64_t inner,
                                                                float alpha) {
  constexpr int N = Vec<T>::N;
  constexpr bool FAST = !std::is_same<T, float>::value;
  const int64_t base = int64_t(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
  float xv[kUnroll][N];
  float rv[kUnroll][N];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + int64_t(u) * kThreads;
    if (v < nvec) {
      load_vec_stream(x + v * N, xv[u]);
      if (RES) load_vec_stream(res + v * N, rv[u]);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + int64_t(u) * kThreads;
    if (v >= nvec) continue;
    const int64_t i0 = v * N;
    float b[N];
    if constexpr (BMODE == 0) {
#pragma unroll
      for (int j = 0; j < N; ++j) b[j] = 0.f;
    } else if constexpr (BMODE == 1) {
      load_vec(bias + (i0 % C), b);
    } else if constexpr (BMODE == 2) {
      const float bb = to_f(bias[(i0 / inner) % C]);
#pragma unroll
      for (int j = 0; j < N; ++j) b[j] = bb;
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) b[j] = to_f(bias[((i0 + j) / inner) % C]);
    }
    float o[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      o[j] = apply_act<ACT, FAST>(xv[u][j] + b[j], alpha);
      if (RES) o[j] += rv[u][j];
    }
    store_vec_stream(y + i0, o);
  }
}

template <typename T, int ACT>
__global__ void bias_act_scalar_kernel(const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ res,
                                       T* __restrict__ y, int64_t start, int64_t numel, int64_t C, int64_t inner,
                                       float alpha) {
  constexpr bool FAST = !std::is_same<T, float>::value;
  for (int64_t i = start + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    float v = to_f(x[i]);
    if (bias) v += to_f(bias[(i / inner) % C]);
    v = apply_act<ACT, FAST>(v, alpha);
    if (res) v += to_f(res[i]);
    y[i] = from_f<T>(v);
  }
}

template <typename T, int ACT>
cudaError_t run(const T* x, const T* bias, const T* res, T* y, int64_t numel, int64_t C, int64_t inner,
                float alpha, cudaStream_t stream) {
  constexpr int N = Vec<T>::N;
  const bool vec_ok = aligned16(x) && aligned16(y) && (res == nullptr || aligned16(res));
  int64_t nvec = vec_ok ? numel / N : 0;
  if (nvec > 0) {
    int bmode = 0;
    if (bias != nullptr) {
      if (inner == 1 && C % N == 0 && aligned16(bias)) bmode = 1;
      else if (inner % N == 0) bmode = 2;
      else bmode = 3;
    }
    const int64_t blocks = (nvec + kThreads * kUnroll - 1) / (kThreads * kUnroll);
    const dim3 grid(static_cast<unsigned>(blocks));
#define GO_LAUNCH(BM)                                                                                   \
  if (res) bias_act_vec_kernel<T, ACT, BM, true><<<grid, kThreads, 0, stream>>>(x, bias, res, y, nvec, C, inner, alpha); \
  else bias_act_vec_kernel<T, ACT, BM, false><<<grid, kThreads, 0, stream>>>(x, bias, res, y, nvec, C, inner, alpha);
    switch (bmode) {
      case 0: GO_LAUNCH(0); break;
      case 1: GO_LAUNCH(1); break;
      case 2: GO_LAUNCH(2); break;
      default: GO_LAUNCH(3); break;
    }
#undef GO_LAUNCH
  }
  const int64_t start = nvec * N;
  if (start < numel) {
    const int64_t rest = numel - start;
    int64_t blocks = (rest + kThreads - 1) / kThreads;
    const int64_t cap = int64_t(num_sms()) * 8;
    if (blocks > cap) blocks = cap;
    bias_act_scalar_kernel<T, ACT><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, bias, res, y, start,
                                                                                          numel, C, inner, alpha);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_bias_act(int dtype, int act, float alpha, const void* x, const void* bias, const void* residual,
                            void* y, int64_t numel, int64_t channels, int64_t inner, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  if (channels <= 0) channels = 1;
  if (inner <= 0) inner = 1;
  GRAPHOPT_DISPATCH_FLOAT(dtype, T, GRAPHOPT_DISPATCH_ACT(act, A, {
    return run<T, A>(static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<const T*>(residual),
                     static_cast<T*>(y), numel, channels, inner, alpha, stream);
  }));
  return cudaErrorInvalidValue;
}

}  // namespace graphopt

// ---- graphopt::bias_act (host side; torch headers stay out of the device passes)
#ifndef __CUDA_ARCH__
#include "host.h"

namespace graphopt {
namespace {

// "leaky_relu:<slope>" (the slope as Python's repr writes it) sets alpha
int act_code(const std::string& a, float& alpha) {
  alpha = 0.f;
  if (a.rfind("leaky_relu:", 0) == 0) {
    size_t used = 0;
    double slope = 0.0;
    try {
      slope = std::stod(a.substr(11), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used > 0 && used == a.size() - 11, "graphopt::bias_act: bad leaky_relu slope in '", a, "'");
    alpha = static_cast<float>(slope);
    return ACT_LEAKY_RELU;
  }
  if (a == "none") return ACT_NONE;
  if (a == "relu") return ACT_RELU;
  if (a == "gelu") return ACT_GELU;
  if (a == "gelu_tanh") return ACT_GELU_TANH;
  if (a == "silu") return ACT_SILU;
  if (a == "sigmoid") return ACT_SIGMOID;
  if (a == "tanh") return ACT_TANH;
  if (a == "hardswish") return ACT_HARDSWISH;
  TORCH_CHECK(false, "graphopt::bias_act: unknown activation '", a,
              "' (none, relu, gelu, gelu_tanh, silu, sigmoid, tanh, hardswish, leaky_relu:<slope>)");
  return -1;
}

// channels_last (3d) where x is dense in it and not also contiguous, and the bias, if any, runs
// along dim 1; else contiguous (the op's fake and reference follow the same rule)
at::MemoryFormat out_format(const at::Tensor& x, bool has_bias, int64_t bias_dim) {
  if (x.is_contiguous()) return at::MemoryFormat::Contiguous;
  if (has_bias && c10::maybe_wrap_dim(bias_dim, x.dim()) != 1) return at::MemoryFormat::Contiguous;
  if (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::MemoryFormat::ChannelsLast;
  if (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

at::Tensor bias_act_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias, c10::string_view act,
                         const std::optional<at::Tensor>& residual, int64_t bias_dim) {
  c10::cuda::CUDAGuard guard(x.device());
  const int dt = dtype_code(x.scalar_type());
  float alpha = 0.f;
  const int a = act_code(std::string(act), alpha);
  const bool has_bias = bias.has_value() && bias->defined();
  // a channels_last x (bias along dim 1, or none) is read and written in its own layout: the
  // channels are then the innermost memory dim, the bias one value per channel along it
  const at::MemoryFormat fmt = out_format(x, has_bias, bias_dim);
  const bool cl = fmt != at::MemoryFormat::Contiguous;
  at::Tensor xc = x.contiguous(fmt);
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(fmt));
  int64_t channels = 1, inner = 1;
  at::Tensor b;
  if (has_bias) {
    TORCH_CHECK(x.dim() > 0, "graphopt::bias_act: bias needs x with at least one dim");
    const int64_t d = c10::maybe_wrap_dim(bias_dim, x.dim());
    channels = x.size(d);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == channels, "graphopt::bias_act: bias must be 1-D of length ",
                channels, " (x.size(", bias_dim, ")), got ", bias->sizes());
    if (!cl) {
      for (int64_t i = d + 1; i < x.dim(); ++i) inner *= x.size(i);
    }
    b = bias->to(x.scalar_type()).contiguous();
  }
  at::Tensor r;
  if (residual.has_value() && residual->defined()) {
    r = residual->to(x.scalar_type());
    if (r.sizes() != x.sizes()) r = r.expand(x.sizes());
    r = r.contiguous(fmt);
  }
  check(launch_bias_act(dt, a, alpha, xc.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
                        r.defined() ? r.data_ptr() : nullptr, y.data_ptr(), x.numel(), channels, inner,
                        stream_of(x)),
        "bias_act");
  return y;
}

}  // namespace
}  // namespace graphopt

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) {
  m.impl("bias_act", &graphopt::bias_act_cuda);
}
#endif  // __CUDA_ARCH__

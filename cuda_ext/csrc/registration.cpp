// graphopt custom ops: the one place their schemas are written.
//
// TORCH_LIBRARY(graphopt) below is the single definition of every op's schema. When the CUDA
// extension is built and loaded (backend "cuda"), this block defines the ops and the CUDA
// kernels are registered for DispatchKey::CUDA. Without a GPU or a CUDA toolkit the extension
// is never compiled: graphopt/cuda_ext/_schemas.py parses the m.def("...") strings out of this
// file and defines the same ops from Python. In both cases the CPU implementation (the fp64-able
// torch reference), the Meta/fake implementation and fused_pointwise's CUDA implementation (Triton
// code generated from the program) are registered from Python (graphopt/cuda_ext/_register.py).
// Keep each m.def on one line: the parser reads them with a regular expression.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <vector>

#include "kernels.h"

namespace graphopt {
namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DT_F32;
    case at::kHalf: return DT_F16;
    case at::kBFloat16: return DT_BF16;
    default: TORCH_CHECK(false, "graphopt: dtype ", t, " is not supported (float32, float16, bfloat16)");
  }
  return -1;
}

int act_code(const std::string& a) {
  if (a == "none") return ACT_NONE;
  if (a == "relu") return ACT_RELU;
  if (a == "gelu") return ACT_GELU;
  if (a == "gelu_tanh") return ACT_GELU_TANH;
  if (a == "silu") return ACT_SILU;
  if (a == "sigmoid") return ACT_SIGMOID;
  if (a == "tanh") return ACT_TANH;
  if (a == "hardswish") return ACT_HARDSWISH;
  TORCH_CHECK(false, "graphopt::bias_act: unknown activation '", a,
              "' (none, relu, gelu, gelu_tanh, silu, sigmoid, tanh, hardswish)");
  return -1;
}

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "graphopt::", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.get_device()).stream(); }

at::Tensor bias_act_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias, c10::string_view act,
                         const std::optional<at::Tensor>& residual, int64_t bias_dim) {
  c10::cuda::CUDAGuard guard(x.device());
  const int dt = dtype_code(x.scalar_type());
  const int a = act_code(std::string(act));
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  int64_t channels = 1, inner = 1;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(x.dim() > 0, "graphopt::bias_act: bias needs x with at least one dim");
    const int64_t d = c10::maybe_wrap_dim(bias_dim, x.dim());
    channels = x.size(d);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == channels, "graphopt::bias_act: bias must be 1-D of length ",
                channels, " (x.size(", bias_dim, ")), got ", bias->sizes());
    for (int64_t i = d + 1; i < x.dim(); ++i) inner *= x.size(i);
    b = bias->to(x.scalar_type()).contiguous();
  }
  at::Tensor r;
  if (residual.has_value() && residual->defined()) {
    r = residual->to(x.scalar_type());
    if (r.sizes() != x.sizes()) r = r.expand(x.sizes());
    r = r.contiguous();
  }
  check(launch_bias_act(dt, a, xc.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
                        r.defined() ? r.data_ptr() : nullptr, y.data_ptr(), x.numel(), channels, inner,
                        stream_of(x)),
        "bias_act");
  return y;
}

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

at::Tensor swiglu_cuda(const at::Tensor& gate_up) {
  c10::cuda::CUDAGuard guard(gate_up.device());
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "graphopt::swiglu: last dim must be even (gate and up halves), got ", gate_up.sizes());
  const int dt = dtype_code(gate_up.scalar_type());
  at::Tensor in = gate_up.contiguous();
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  const int64_t H = shape.back() / 2;
  shape.back() = H;
  at::Tensor out = at::empty(shape, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = H == 0 ? 0 : out.numel() / H;
  check(launch_swiglu(dt, in.data_ptr(), out.data_ptr(), rows, H, stream_of(gate_up)), "swiglu");
  return out;
}

at::Tensor max_pool2d_nhwc_cuda(const at::Tensor& x, int64_t kernel, int64_t stride, int64_t padding) {
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() == 4, "graphopt::max_pool2d_nhwc: x must be [N, C, H, W], got ", x.sizes());
  TORCH_CHECK(kernel >= 1 && stride >= 1 && padding >= 0 && 2 * padding <= kernel,
              "graphopt::max_pool2d_nhwc: needs kernel >= 1, stride >= 1 and 0 <= padding <= kernel / 2, got ",
              kernel, ", ", stride, ", ", padding);
  const int dt = dtype_code(x.scalar_type());
  at::Tensor in = x.contiguous(at::MemoryFormat::ChannelsLast);
  graphopt::PoolArgs a;
  a.N = x.size(0); a.C = x.size(1); a.H = x.size(2); a.W = x.size(3);
  a.Ho = (a.H + 2 * padding - kernel) / stride + 1;
  a.Wo = (a.W + 2 * padding - kernel) / stride + 1;
  TORCH_CHECK(a.Ho >= 1 && a.Wo >= 1, "graphopt::max_pool2d_nhwc: output would be empty for input ", x.sizes());
  a.kernel = static_cast<int>(kernel); a.stride = static_cast<int>(stride); a.pad = static_cast<int>(padding);
  at::Tensor out = at::empty({a.N, a.C, a.Ho, a.Wo}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  check(launch_max_pool_nhwc(dt, in.data_ptr(), out.data_ptr(), a, stream_of(x)), "max_pool2d_nhwc");
  return out;
}

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
  return c.to(q.device(), q.scalar_type()).contiguous();
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
  check(launch_rotary(dt, qa, ka, stream_of(q)), "rotary");
  return {qo, ko};
}

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


// relu(conv2d(x, w) + bias + z) as one cuDNN call (cuDNN's fused convolution + bias + add +
// activation; aten exposes it as cudnn_convolution_relu / cudnn_convolution_add_relu). The output
// takes the layout cuDNN suggests for x and w (channels_last when either is).
at::Tensor conv_bias_relu_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& z, at::IntArrayRef stride, at::IntArrayRef padding,
                               at::IntArrayRef dilation, int64_t groups) {
  TORCH_CHECK(x.dim() == 4 && w.dim() == 4, "graphopt::conv_bias_relu: 2-D convolutions only (4-D x and w), got ",
              x.dim(), "-D x and ", w.dim(), "-D w");
  c10::cuda::CUDAGuard guard(x.device());
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->to(x.scalar_type());
  if (z.has_value() && z->defined())
    return at::cudnn_convolution_add_relu(x, w, z->to(x.scalar_type()), at::Scalar(1.0), b, stride, padding,
                                          dilation, groups);
  return at::cudnn_convolution_relu(x, w, b, stride, padding, dilation, groups);
}

}  // namespace

// launch-configuration variants (kernels.h): process-wide, default 0
static int g_variants[VAR_COUNT] = {0, 0, 0};
int variant(int kernel) { return (kernel >= 0 && kernel < VAR_COUNT) ? g_variants[kernel] : 0; }

}  // namespace graphopt

// Set a kernel family's launch variant (for bench_kernels.py --variants, through ctypes);
// returns the previous value, or -1 for an unknown family / negative variant.
extern "C" int graphopt_set_variant(int kernel, int v) {
  if (kernel < 0 || kernel >= graphopt::VAR_COUNT || v < 0) return -1;
  const int old = graphopt::g_variants[kernel];
  graphopt::g_variants[kernel] = v;
  return old;
}

TORCH_LIBRARY(graphopt, m) {
  m.def("bias_act(Tensor x, Tensor? bias, str act, Tensor? residual, int bias_dim=-1) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("linear_add_layer_norm(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, Tensor? ln_weight, Tensor? ln_bias, float eps, int splits) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("rms_norm_add_rms_norm(Tensor y, Tensor residual, Tensor weight_y, Tensor weight, float eps_y, float eps) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("swiglu(Tensor gate_up) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("gemm_swiglu(Tensor x, Tensor weight, int n, int block) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("softmax_mask(Tensor scores, float scale, Tensor? mask) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("fused_pointwise(str program, Tensor[] inputs) -> Tensor[]", {at::Tag::pt2_compliant_tag});
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("max_pool2d_nhwc(Tensor x, int kernel, int stride, int padding) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("short_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? kv_len, float scale) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("conv_bias_relu(Tensor x, Tensor w, Tensor? bias, Tensor? z, int[2] stride, int[2] padding, int[2] dilation, int groups) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) {
  m.impl("bias_act", &graphopt::bias_act_cuda);
  m.impl("add_rms_norm", &graphopt::add_rms_norm_cuda);
  m.impl("add_layer_norm", &graphopt::add_layer_norm_cuda);
  m.impl("swiglu", &graphopt::swiglu_cuda);
  m.impl("rotary", &graphopt::rotary_cuda);
  m.impl("softmax_mask", &graphopt::softmax_mask_cuda);
  m.impl("conv_bias_relu", &graphopt::conv_bias_relu_cuda);
  m.impl("max_pool2d_nhwc", &graphopt::max_pool2d_nhwc_cuda);
}

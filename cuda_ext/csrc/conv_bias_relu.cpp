// graphopt::conv_bias_relu on CUDA: relu(conv2d(x, w) + bias + z) as one cuDNN call (cuDNN's fused
// convolution + bias + add + activation; aten exposes it as cudnn_convolution_relu /
// cudnn_convolution_add_relu). The output takes the layout cuDNN suggests for x and w
// (channels_last when either is). The schema: cuda_ext/ops/conv_bias_relu.py.
#include <ATen/ops/cudnn_convolution_add_relu.h>
#include <ATen/ops/cudnn_convolution_relu.h>

#include "host.h"

namespace graphopt {
namespace {

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
}  // namespace graphopt

TORCH_LIBRARY_IMPL(graphopt, CUDA, m) { m.impl("conv_bias_relu", &graphopt::conv_bias_relu_cuda); }

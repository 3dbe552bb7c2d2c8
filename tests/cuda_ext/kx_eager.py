"""The eager PyTorch composites each op replaces, in the op's own dtype (what a model runs
today). Used for the accuracy rule's rmse comparison and by the benchmark."""
import torch
import torch.nn.functional as F

from graphopt.cuda_ext.ops.bias_act import activation


def bias_act(x, bias, act, residual, bias_dim=-1):
    y = x
    if bias is not None:
        shape = [1] * x.dim()
        shape[bias_dim % x.dim()] = -1
        y = y + bias.view(shape)
    y = activation(y, act)
    return y + residual if residual is not None else y


def add_rms_norm(x, residual, weight, eps):
    h = x + residual if residual is not None else x
    hf = h.to(torch.float32)
    var = hf.pow(2).mean(-1, keepdim=True)
    return weight * (hf * torch.rsqrt(var + eps)).to(x.dtype), h


def add_layer_norm(x, residual, weight, bias, eps):
    h = x + residual if residual is not None else x
    return F.layer_norm(h, (x.shape[-1],), weight, bias, eps), h


def swiglu(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


def rotary(q, k, cos, sin, interleaved):
    R = cos.shape[-1]
    c, s = cos.to(q.dtype).unsqueeze(1), sin.to(q.dtype).unsqueeze(1)

    def rot(x):
        if interleaved:
            return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        a, b = x.chunk(2, -1)
        return torch.cat((-b, a), -1)

    def one(x):
        xr, xp = x[..., :R], x[..., R:]
        return torch.cat((xr * c + rot(xr) * s, xp), -1)

    return one(q), one(k)


def softmax_mask(scores, scale, mask):
    s = scores * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s.float(), -1).to(scores.dtype)

"""Autograd of the fused norms (graphopt::add_layer_norm, layer_norm, add_rms_norm; cuda_ext/norm_grad.py):
gradcheck in fp64, and in bf16/fp32 every input's gradient against the fp64 gradient of the model's
own spelling by the accuracy rule (training tolerance), eager's gradient in the op's dtype the
yardstick; a gradient that reaches h (the residual stream) as well as the output."""
import pytest
import torch
import torch.nn.functional as F

import graphopt.cuda_ext  # noqa: F401  (defines torch.ops.graphopt.*)

from kx_accuracy import check

F64 = torch.float64
ops = torch.ops.graphopt


def hf_rms(h, w, eps):
    """LlamaRMSNorm's spelling (fp32 statistics, the normalized value rounded before the weight)."""
    hf = h.to(torch.float32) if h.dtype != F64 else h
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return w * normed.to(h.dtype)


def eager_add_rms(x, r, w, eps):
    h = x + r if r is not None else x
    return hf_rms(h, w, eps), h


def eager_add_ln(x, r, w, b, eps):
    h = x + r if r is not None else x
    return F.layer_norm(h, (h.shape[-1],), w, b, eps), h


def fused_add_rms(x, r, w, eps):
    return tuple(ops.add_rms_norm(x, r, w, eps))


def fused_add_ln(x, r, w, b, eps):
    return tuple(ops.add_layer_norm(x, r, w, b, eps))


def fused_ln(x, w, b, eps):
    return (ops.layer_norm(x, w, b, eps),)


def eager_ln(x, w, b, eps):
    return (F.layer_norm(x, (x.shape[-1],), w, b, eps),)


def leaves(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        if s is None:
            out.append(None)
            continue
        t = torch.randn(*s, generator=g, dtype=F64)
        if len(s) == 1 and i >= 2:  # weights around 1, biases small
            t = 1 + 0.2 * t if i == 2 else 0.1 * t
        out.append(t)
    return out


CASES = {
    # name: (fused, eager, shapes of the tensor inputs, eps)
    "add_rms_norm": (fused_add_rms, eager_add_rms, ((3, 7, 48), (3, 7, 48), (48,)), 1e-6),
    "add_rms_norm no residual": (fused_add_rms, eager_add_rms, ((5, 33), None, (33,)), 1e-5),
    "add_layer_norm": (fused_add_ln, eager_add_ln, ((3, 7, 48), (3, 7, 48), (48,), (48,)), 1e-5),
    "add_layer_norm no residual, no bias": (fused_add_ln, eager_add_ln, ((4, 65), None, (65,), None), 1e-12),
    "layer_norm": (fused_ln, eager_ln, ((3, 7, 48), (48,), (48,)), 1e-5),
}


def _run(fn, tensors, eps, grads):
    ins = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*ins, eps)
    torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None], [g for g in grads if g is not None])
    return [o.detach() for o in outs], [None if t is None else t.grad for t in ins]


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_fp64(name):
    fused, _, shapes, eps = CASES[name]
    # the [3, 7, N] inputs as [2, 3, N]: gradcheck runs the op twice per input element, and rows are
    # independent (test_gradients_against_fp64 keeps the 21 rows)
    shapes = tuple(s if s is None or len(s) != 3 else (2, 3, s[-1]) for s in shapes)
    tensors = [None if t is None else t.requires_grad_() for t in leaves(shapes, F64, 0)]
    assert torch.autograd.gradcheck(lambda *a: fused(*a, eps), tuple(tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("grad_h", [False, True])
def test_gradients_against_fp64(name, dtype, grad_h):
    fused, eager, shapes, eps = CASES[name]
    if grad_h and fused is fused_ln:
        pytest.skip("layer_norm has no h output")
    for seed in (1, 2):  # fresh inputs each check
        t64 = leaves(shapes, F64, seed)
        tlow = [None if t is None else t.to(dtype) for t in t64]
        g = torch.Generator().manual_seed(100 + seed)
        out_shape = shapes[0]
        grads64 = [torch.randn(*out_shape, generator=g, dtype=F64)]
        if grad_h:
            grads64.append(torch.randn(*out_shape, generator=g, dtype=F64))
        elif fused is not fused_ln:
            grads64.append(None)
        glow = [None if t is None else t.to(dtype) for t in grads64]
        out, grads = _run(fused, tlow, eps, glow)
        ref_out, ref_grads = _run(eager, t64, eps, grads64)
        e_out, e_grads = _run(eager, tlow, eps, glow)
        for i, (o, r, e) in enumerate(zip(out, ref_out, e_out)):
            check(o, r, e, dtype=dtype, training=True, what=f"{name} output {i}")
        for i, (a, r, e) in enumerate(zip(grads, ref_grads, e_grads)):
            if r is None:
                assert a is None
                continue
            assert a is not None and a.dtype == dtype and a.shape == r.shape, f"{name} input {i}"
            check(a, r, e, dtype=dtype, training=True, what=f"{name} gradient of input {i}")


def test_rms_backward_saves_h_and_weight_only():
    """Autograd keeps h (the op's own output) and the weight: the statistics are recomputed."""
    x, r, w = (t.requires_grad_() for t in leaves(((4, 16), (4, 16), (16,)), F64, 3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, h = fused_add_rms(x, r, w, 1e-6)
    assert len(saved) == 2 and any(s is w for s in saved)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_on_the_gpu_against_fp64(name):
    """The CUDA backward (aten's layer-norm / fused RMS-norm backward kernels on bf16 tensors)
    against the model's own spelling in fp64 on the CPU, eager bf16 on the GPU the yardstick."""
    fused, eager, shapes, eps = CASES[name]
    t64 = leaves(shapes, F64, 5)
    tgpu = [None if t is None else t.to("cuda", torch.bfloat16) for t in t64]
    g64 = torch.randn(*shapes[0], generator=torch.Generator().manual_seed(7), dtype=F64)
    grads64 = [g64] + ([g64.flip(0)] if fused is not fused_ln else [])
    ggpu = [t.to("cuda", torch.bfloat16) for t in grads64]
    out, grads = _run(fused, tgpu, eps, ggpu)
    ref_out, ref_grads = _run(eager, t64, eps, grads64)
    e_out, e_grads = _run(eager, tgpu, eps, ggpu)
    for i, (o, r, e) in enumerate(zip(out, ref_out, e_out)):
        check(o.cpu(), r, e.cpu(), dtype=torch.bfloat16, training=True, what=f"{name} output {i}")
    for i, (a, r, e) in enumerate(zip(grads, ref_grads, e_grads)):
        if r is None:
            assert a is None
            continue
        check(a.cpu(), r, e.cpu(), dtype=torch.bfloat16, training=True, what=f"{name} gradient of input {i} (cuda)")

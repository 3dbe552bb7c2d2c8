import operator

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.cost.profiles import get_profile
from graphopt.examples import zoo

aten = torch.ops.aten


def _dtypes(gm, target):
    return [n.meta["val"].dtype for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


class Cancel(nn.Module):
    """(y + 4096) - 4096 loses every bit of y in bf16: those two ops must stay fp32."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        y = self.fc(x)
        z = (y + 4096.0) - 4096.0
        return self.out(torch.relu(z))


def test_bf16_compute_fp32_sensitive_ops_and_outputs():
    model, inputs = zoo.get("glm4-tiny")
    # only cleanup + precision: the explicit softmax and RMSNorm statistics must be there to check
    opt = graphopt.optimize(model, inputs, precision="bf16",
                            passes=["eliminate_dead_code", "fold_constants", "assign_precision"])
    gm = opt.graph_module
    res = opt.report.pass_result("assign_precision")
    assert res.status == "applied"
    assert set(_dtypes(gm, aten.linear.default)) == {torch.bfloat16}
    # the attention softmax is read only by the bf16 PV matmul: it reads and writes bf16 (aten
    # computes it in fp32 inside, the same numbers as fp32 then a cast: see the test below)
    sms = [n for n in gm.graph.nodes if n.target is aten.softmax.int]
    assert sms and all(n.args[0].meta["val"].dtype == torch.bfloat16 and "dtype" not in n.kwargs for n in sms)
    assert set(_dtypes(gm, aten.mean.dim)) == {torch.float32}  # RMSNorm statistics
    # parameters converted once at optimization time: no cast reads a parameter
    for n in gm.graph.nodes:
        if n.target is aten._to_copy.default:
            assert n.args[0].op != "get_attr", n
    out = opt(*inputs)
    assert out.logits.dtype == torch.float32  # the caller's dtype
    assert opt.report.accuracy["passed"]
    assert res.details["flops_share"]["bfloat16"] > 0.9
    assert "hand_converted_passes" in res.details
    # integer inputs are never cast
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert all(u.target is not aten._to_copy.default for u in ids.users)


def test_guarded_search_keeps_offending_nodes_in_fp32():
    torch.manual_seed(0)
    m = Cancel().eval()
    x = torch.randn(16, 32)
    opt = graphopt.optimize(m, (x,), precision="bf16")
    res = opt.report.pass_result("assign_precision")
    kept = {k["node"] for k in res.details["kept_fp32"]}
    assert kept & {"add", "sub"}, kept
    assert opt.report.accuracy["passed"]
    assert set(_dtypes(opt.graph_module, aten.linear.default)) == {torch.bfloat16}


def test_already_bf16_model_is_left_alone():
    model, inputs = zoo.get("mlp", dtype=torch.bfloat16)
    opt = graphopt.optimize(model, inputs, precision="auto", target="h200")
    res = opt.report.pass_result("assign_precision")
    assert res.status == "unchanged"
    assert any("already computes in bfloat16" in n for n in res.notes)


def test_fp32_request_and_bad_request():
    model, inputs = zoo.get("mlp")
    opt = graphopt.optimize(model, inputs, precision="fp32")
    assert opt.report.pass_result("assign_precision").status == "unchanged"
    assert set(_dtypes(opt.graph_module, aten.linear.default)) == {torch.float32}
    with pytest.raises(graphopt.GraphoptError, match="precision must be one of"):
        graphopt.optimize(model, inputs, precision="int4")


def test_auto_refuses_when_bf16_is_slower():
    prof, _ = get_profile("cpu")
    slow = type(prof)(**{**prof.to_dict(), "peak_flops": {**prof.peak_flops, "bfloat16": prof.peak_flops["float32"] / 4}})
    model, inputs = zoo.get("mlp")
    opt = graphopt.optimize(model, inputs, precision="auto", target=slow)
    res = opt.report.pass_result("assign_precision")
    assert res.status == "unchanged"
    assert "slower than fp32" in res.rejected[0].reason


def test_auto_on_a_gpu_profile_lowers_big_gemms_but_not_launch_bound_graphs():
    big = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).eval()
    opt = graphopt.optimize(big, (torch.randn(512, 1024),), precision="auto", target="h200")
    res = opt.report.pass_result("assign_precision")
    assert res.status == "applied" and res.details["dtype"] == "bfloat16"
    assert res.predicted_s_after < res.predicted_s_before
    # a tiny model is launch-bound on the H200: the casts would cost more than bf16 saves
    model, inputs = zoo.get("bert-tiny")
    res = graphopt.optimize(model, inputs, precision="auto", target="h200").report.pass_result("assign_precision")
    assert res.status == "unchanged" and "predicted no gain" in res.rejected[0].reason


def test_training_keeps_fp32_master_weights_and_gradients_flow():
    model, inputs = zoo.get("mlp")
    model.train()
    ref = [p.detach().clone() for p in model.parameters()]
    opt = graphopt.optimize(model, inputs, precision="bf16", training=True)
    assert opt.report.pass_result("assign_precision").status == "applied"
    params = dict(opt.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert {id(p) for p in model.parameters()} <= {id(p) for p in opt.parameters()}
    loss = opt(*inputs).float().pow(2).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)
    # compare with fp32 training gradients
    m32, _ = zoo.get("mlp")
    for p, r in zip(m32.parameters(), ref):
        p.data.copy_(r)
    m32.train()
    m32(*inputs).pow(2).mean().backward()
    for g, g32 in zip(grads, [p.grad for p in m32.parameters()]):
        rel = (g - g32).norm() / g32.norm()
        assert rel < 5e-2, rel


def test_auto_keeps_fp32_on_the_cpu_even_with_fast_bf16_matmuls():
    prof, _ = get_profile("cpu")
    fast = type(prof)(**{**prof.to_dict(), "peak_flops": {**prof.peak_flops, "bfloat16": prof.peak_flops["float32"] * 4}})
    model, inputs = zoo.get("mlp")
    res = graphopt.optimize(model, inputs, precision="auto", target=fast).report.pass_result("assign_precision")
    assert res.status == "unchanged" and "auto keeps fp32" in res.rejected[0].reason


class FillMin(nn.Module):
    """Hugging Face's attention-mask spelling: masked_fill with finfo(float32).min, which bf16
    cannot represent; the fill must stay fp32 (a bf16 fill raises "cannot be converted ... without
    overflow")."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, keep):
        s = self.fc(x)
        s = s.masked_fill(~keep, torch.finfo(torch.float32).min)
        return torch.softmax(s, -1) @ self.fc.weight


def test_out_of_range_literal_stays_fp32():
    torch.manual_seed(0)
    x, keep = torch.randn(4, 16), torch.rand(4, 16) > 0.2
    opt = graphopt.optimize(FillMin().eval(), (x, keep), precision="bf16")
    res = opt.report.pass_result("assign_precision")
    assert res.status == "applied", res.notes
    fills = [n for n in opt.graph_module.graph.nodes if n.op == "call_function" and "masked_fill" in str(n.target)]
    assert fills and all(n.meta["val"].dtype == torch.float32 for n in fills)
    assert set(_dtypes(opt.graph_module, aten.linear.default)) == {torch.bfloat16}
    assert opt.report.accuracy["passed"]
    # the hand-converted model itself cannot run in bf16: reported, not raised
    assert "without overflow" in res.details["hand_converted_error"]


class HFNorm(nn.Module):
    """Hugging Face's RMSNorm spelling then a softmax with an fp32 dtype: captured from an fp32
    model, both .to(float32) and .to(input_dtype) read .to(float32)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.w = nn.Parameter(torch.rand(64) + 0.5)

    def forward(self, x):
        h = self.fc(x)
        dt = h.dtype
        hf = h.to(torch.float32)
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        n = self.w * hf.to(dt)
        p = torch.softmax(n @ n.transpose(-1, -2), dim=-1, dtype=torch.float32).to(dt)
        return p @ n


def _bf16_only(m, x):
    """The model through dead-code elimination and assign_precision alone, in bf16."""
    return graphopt.optimize(m.eval(), (x,), precision="bf16", passes=["eliminate_dead_code", "assign_precision"],
                             cuda_graphs=False)


def test_identity_casts_follow_their_input_and_softmax_reads_low():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)
    opt = _bf16_only(HFNorm(), x)
    gm = opt.graph_module
    assert opt.report.pass_result("assign_precision").status == "applied"
    # the fp32 -> fp32 casts of the capture became no-ops in bf16 (they follow their input)
    for n in gm.graph.nodes:
        if n.target is aten.to.dtype:
            assert n.args[1] == n.args[0].meta["val"].dtype == n.meta["val"].dtype, n
    big = [n for n in gm.graph.nodes if n.target is aten._to_copy.default
           and n.meta["val"].numel() == x.numel() and n.meta["val"].dtype == torch.float32
           and all(u.op != "output" for u in n.users)]
    assert len(big) == 1  # one full-size upcast, for pow's fp32 statistics (besides the output's)
    # the statistics between sensitive ops stay fp32; softmax reads bf16 and, since its only
    # reader is a bf16 matmul, writes bf16 (no fp32 probabilities and cast)
    (add_eps,) = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert add_eps.meta["val"].dtype == torch.float32
    (sm,) = [n for n in gm.graph.nodes if n.target is aten.softmax.int]
    assert sm.args[0].meta["val"].dtype == torch.bfloat16 and sm.meta["val"].dtype == torch.bfloat16
    assert all(u.target is not aten._to_copy.default for u in sm.users)
    assert opt.report.accuracy["passed"]


class ProbsOut(nn.Module):
    """The probabilities are also returned: the fp32 softmax stays (its output is read in fp32)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc(x)
        p = torch.softmax(h @ h.transpose(-1, -2), dim=-1)
        return p @ h, p


def test_softmax_returned_keeps_fp32_output():
    torch.manual_seed(0)
    opt = _bf16_only(ProbsOut(), torch.randn(4, 16, 64))
    (sm,) = [n for n in opt.graph_module.graph.nodes if n.target is aten.softmax.int]
    assert sm.meta["val"].dtype == torch.float32 and sm.kwargs.get("dtype") == torch.float32
    assert opt.report.accuracy["passed"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_low_precision_softmax_equals_fp32_softmax_rounded(device):
    """Why the rewrite above is exact: aten's softmax on bf16/fp16 accumulates in fp32 and rounds
    once, so its output equals the fp32-output softmax cast down, bit for bit."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        for shape in ((8, 12, 128, 128), (3, 7, 1000), (5, 33)):
            x = (torch.randn(*shape, device=device) * 8).to(dt)
            assert torch.equal(torch.softmax(x, -1, dtype=torch.float32).to(dt), torch.softmax(x, -1))


class AutocastOffTable(nn.Module):
    """A table computed in fp32 under autocast(enabled=False) (HF's rotary under transformers 5.17):
    export wraps it in a higher-order op."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)
        self.register_buffer("freq", torch.rand(32))

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            t = (self.freq.float()[None, :] * torch.arange(x.shape[0], dtype=torch.float32)[:, None]).cos()
        h = self.fc(x) * t.to(x.dtype).repeat_interleave(2, dim=-1)
        return self.fc2(h) @ h.t()


def test_higher_order_op_regions_are_left_as_written():
    """The region's inputs are not cast (its fp32 frequencies stay fp32) and its outputs keep their
    dtype; the GEMMs after it still run in bf16 (under transformers 5.17 the region's outputs were
    taken for bf16, and GLM's attention scores stayed fp32 on the GPU)."""
    torch.manual_seed(0)
    m = AutocastOffTable().eval()
    x = torch.randn(16, 64)
    opt = graphopt.optimize(m, (x,), precision="bf16", passes=["eliminate_dead_code", "assign_precision"],
                            cuda_graphs=False)
    gm = opt.graph_module
    hop = next(n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator))
    assert all(a.meta["val"].dtype == torch.float32 for a in hop.all_input_nodes if "val" in a.meta)
    assert set(_dtypes(gm, aten.linear.default)) | set(_dtypes(gm, aten.matmul.default)) == {torch.bfloat16}
    assert opt.report.accuracy["passed"]


class ExpandedWeight(nn.Module):
    """A weight applied from the left to every sample (W @ x, as left_matmul_linears writes a token MLP):
    the bmm reads it expanded over the batch, transposed in the second product."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 40) / 7)

    def forward(self, x):
        y = torch.bmm(self.w.expand(x.shape[0], -1, -1), x)
        return torch.bmm(self.w.t().expand(x.shape[0], -1, -1), torch.relu(y))


def test_a_viewed_weight_is_converted_once_and_viewed_again():
    """A cast of views of a constant is the views of the constant converted once: no cast copies the
    weight at its expanded size on every call."""
    torch.manual_seed(0)
    m = ExpandedWeight().eval()
    x = torch.randn(16, 40, 24)
    opt = graphopt.optimize(m, (x,), precision="bf16", passes=["eliminate_dead_code", "assign_precision"])
    gm = opt.graph_module
    assert opt.report.pass_result("assign_precision").status == "applied"
    for n in gm.graph.nodes:
        if n.target is aten.bmm.default:
            assert n.meta["val"].dtype == torch.bfloat16
            a = n.args[0]
            while a.op == "call_function" and a.target is not aten._to_copy.default:
                a = a.args[0]
            assert a.op == "get_attr", a  # views of the converted constant, no cast in between
    assert opt.report.accuracy["passed"]


class Glu(nn.Module):
    """A gated MLP: the gate's pointwise ops fuse into one kernel that a bf16 projection reads."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, -1)
        return self.fc2(torch.nn.functional.silu(a) * (b + 1.0))


def _fused_kernels_store_bf16(module):
    """``module`` (fp32) optimized to bf16 with fuse_elementwise before the precision pass: its fused
    kernels store bf16 and no cast reads their outputs, directly or through a transpose; accuracy kept."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32)
    opt = graphopt.optimize(module.eval(), (x,), precision="bf16", passes=["fuse_elementwise", "assign_precision"],
                            target="h200")
    gm = opt.graph_module
    fused = [n for n in gm.graph.nodes if str(n.target) == "graphopt.fused_pointwise.default"]
    assert fused and all(n.args[0].rstrip().splitlines()[-1].endswith("bf16") for n in fused), [n.args[0] for n in fused]
    for n in gm.graph.nodes:
        if n.target is aten._to_copy.default:
            src = n.args[0]
            while src.op == "call_function" and src.target in (operator.getitem, aten.transpose.int):
                src = src.args[0]
            assert src not in fused, n
    assert opt.report.accuracy["passed"]


def test_a_fused_kernel_read_only_in_bf16_stores_bf16():
    """fuse_elementwise's kernel, made before the precision pass in the model's fp32, is read only by a
    bf16 projection: it stores bf16 (one rounding at its store) instead of fp32 and a cast after it."""
    _fused_kernels_store_bf16(Glu())


class GluT(Glu):
    """The gated values read transposed by the projection (a view between the fused kernel and its cast)."""

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, -1)
        g = torch.nn.functional.silu(a) * (b + 1.0)
        return self.fc2(g.transpose(0, 1)).transpose(0, 1)


def test_a_fused_kernel_read_in_bf16_through_a_view_stores_bf16():
    _fused_kernels_store_bf16(GluT())

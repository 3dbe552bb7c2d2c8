"""The ops exist with the schemas their modules declare (one module per op in cuda_ext/ops), the op
list and the C++ registrations follow from those modules, the ops have working fake (Meta)
kernels, pass torch.library.opcheck, export with torch.export, and TorchScript modules calling
them reload in a fresh process. Plus the build's compile-only check and error reporting."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import graphopt.cuda_ext as ce
from graphopt.cuda_ext import build
from graphopt.errors import KernelBuildError
from kx_conformance import check_fake, check_opcheck

REPO = Path(__file__).resolve().parents[2]

EXPECTED = {
    "bias_act": "bias_act(Tensor x, Tensor? bias, str act, Tensor? residual, int bias_dim=-1) -> Tensor",
    "add_rms_norm": "add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "add_layer_norm": "add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor)",
    "rms_norm_add_rms_norm": "rms_norm_add_rms_norm(Tensor y, Tensor residual, Tensor weight_y, Tensor weight, "
                             "float eps_y, float eps) -> (Tensor, Tensor)",
    "linear_add_layer_norm": "linear_add_layer_norm(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, "
                             "Tensor? ln_weight, Tensor? ln_bias, float eps, int splits) -> (Tensor, Tensor)",
    "swiglu": "swiglu(Tensor gate_up) -> Tensor",
    "gemm_swiglu": "gemm_swiglu(Tensor x, Tensor weight, int n, int block) -> Tensor",
    "rotary": "rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)",
    "softmax_mask": "softmax_mask(Tensor scores, float scale, Tensor? mask) -> Tensor",
    "fused_pointwise": "fused_pointwise(str program, Tensor[] inputs) -> Tensor[]",
    "layer_norm": "layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor",
    "max_pool2d_nhwc": "max_pool2d_nhwc(Tensor x, int kernel, int stride, int padding) -> Tensor",
    "short_attention": "short_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal) -> Tensor",
    "conv_bias_relu": "conv_bias_relu(Tensor x, Tensor w, Tensor? bias, Tensor? z, int[2] stride, int[2] padding, "
                      "int[2] dilation, int groups) -> Tensor",
    "decode_attention": "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? kv_len, float scale) "
                        "-> Tensor",
}


def sample_args(device="cpu"):
    """One valid call of every op."""
    x = torch.randn(4, 24, device=device)
    pw = ce.Program()
    a, b = pw.input(), pw.input()
    pw.output(pw.silu(a * b + 1.0), torch.float32)
    return {
        "bias_act": (x, torch.randn(24, device=device), "gelu_tanh", torch.randn(4, 24, device=device), -1),
        "add_rms_norm": (x, torch.randn(4, 24, device=device), torch.randn(24, device=device), 1e-6),
        "add_layer_norm": (x, torch.randn(4, 24, device=device), torch.randn(24, device=device),
                           torch.randn(24, device=device), 1e-5),
        "rms_norm_add_rms_norm": (x, torch.randn(4, 24, device=device), torch.randn(24, device=device),
                                  torch.randn(24, device=device), 1e-6, 1e-5),
        "linear_add_layer_norm": (torch.randn(2, 3, 48, device=device), torch.randn(24, 48, device=device),
                                  torch.randn(24, device=device), torch.randn(2, 3, 24, device=device),
                                  torch.randn(24, device=device), torch.randn(24, device=device), 1e-5, 3),
        "swiglu": (torch.randn(3, 2, 16, device=device),),
        "gemm_swiglu": (torch.randn(2, 3, 32, device=device), torch.randn(64, 32, device=device), 24, 16),
        "rotary": (torch.randn(2, 4, 5, 16, device=device), torch.randn(2, 2, 5, 16, device=device),
                   torch.randn(1, 5, 8, device=device), torch.randn(1, 5, 8, device=device), True),
        "softmax_mask": (torch.randn(2, 2, 5, 9, device=device), 0.3, torch.rand(2, 1, 1, 9, device=device) > 0.2),
        "fused_pointwise": (pw.source, [torch.randn(3, 5, device=device), torch.randn(5, device=device)]),
        "layer_norm": (torch.randn(3, 5, 24, device=device), torch.randn(24, device=device), None, 1e-5),
        "conv_bias_relu": (torch.randn(2, 3, 7, 7, device=device), torch.randn(4, 3, 3, 3, device=device),
                           torch.randn(4, device=device), torch.randn(2, 4, 4, 4, device=device), [2, 2], [1, 1],
                           [1, 1], 1),
        "max_pool2d_nhwc": (torch.randn(2, 16, 7, 9, device=device).contiguous(memory_format=torch.channels_last),
                            3, 2, 1),
        "short_attention": (torch.randn(2, 4, 5, 16, device=device), torch.randn(2, 2, 7, 16, device=device),
                            torch.randn(2, 2, 7, 16, device=device), torch.rand(2, 1, 1, 7, device=device) > 0.2,
                            0.25, False),
        "decode_attention": (torch.randn(2, 4, 1, 16, device=device), torch.randn(2, 2, 9, 16, device=device),
                             torch.randn(2, 2, 9, 16, device=device), torch.rand(2, 1, 1, 9, device=device) > 0.2,
                             torch.tensor([5, 9], device=device), 0.25),
    }


def test_schemas_are_the_registered_ones():
    assert {n: s for n, s in ce.schemas().items() if n in EXPECTED} == EXPECTED
    for name, schema in ce.schemas().items():
        op = getattr(torch.ops.graphopt, name).default
        assert str(op._schema) == f"graphopt::{schema}"
        assert torch.Tag.pt2_compliant_tag in op.tags


def test_the_op_list_comes_from_the_op_modules():
    ops = ce.registry.all_ops()
    assert set(EXPECTED) <= set(ops)
    for name, op in ops.items():
        assert op.module == f"graphopt.cuda_ext.ops.{name}" and op.schema == EXPECTED.get(name, op.schema)
        assert name in ce.__all__ and getattr(ce, name) is op.wrapper  # graphopt.cuda_ext.<op>
        assert getattr(ce.reference, name) is op.reference
        assert sys.modules[op.module].__doc__.startswith(f"graphopt::{name}")
        assert (Path(ce.__file__).parent / op.kernel).is_file()


def test_csrc_registers_the_cuda_kernel_of_exactly_the_compiled_ops():
    """Each csrc/ source registers its own ops' CUDA kernels (TORCH_LIBRARY_IMPL): the ops whose
    module names that source as its kernel, and no others; no source defines a schema."""
    ops = ce.registry.all_ops()
    assert ce.registry.csrc_registrations() == {n: op.kernel for n, op in ops.items() if op.compiled}
    assert all(op.cuda is not None for op in ops.values() if not op.compiled)
    for src in (Path(ce.__file__).parent / "csrc").iterdir():
        assert "TORCH_LIBRARY(" not in src.read_text(), f"{src.name} defines schemas (they are in ops/)"
    assert {p.name for p in build.source_files()} == {Path(op.kernel).name for op in ops.values() if op.compiled} | {
        "variants.cpp"}


def test_backend_reported():
    info = ce.backend_info()
    assert ce.backend() in ("cuda", "reference")
    assert info["backend"] == ce.backend() and info["reason"]
    if not torch.cuda.is_available():
        assert ce.backend() == "reference" and info["library"] is None


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fake_tensor_shapes(name):
    check_fake(name, sample_args()[name])


def test_meta_device():
    x = torch.empty(8, 2 * 7, device="meta", dtype=torch.bfloat16)
    assert torch.ops.graphopt.swiglu(x).shape == (8, 7)
    out, h = torch.ops.graphopt.add_rms_norm(x, x, torch.empty(14, device="meta"), 1e-6)
    assert out.shape == h.shape == x.shape and out.device.type == "meta"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_opcheck(name):
    check_opcheck(name, sample_args()[name])


def test_every_op_has_the_conformance_checks():
    """An op added after these: its own test runs kx_conformance.check_op on a call of it."""
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    for name in set(ce.registry.all_ops()) - set(sample_args()):
        assert f'check_op("{name}"' in tests, f"no test calls kx_conformance.check_op(\"{name}\", ...)"


def test_torch_export_keeps_ops():
    class M(torch.nn.Module):
        def forward(self, x, r, w, gu):
            y, h = torch.ops.graphopt.add_rms_norm(x, r, w, 1e-6)
            z = torch.ops.graphopt.bias_act(y, None, "silu", h, -1)
            return z, torch.ops.graphopt.swiglu(gu)

    args = (torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(3, 16))
    ep = torch.export.export(M(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"graphopt.add_rms_norm.default", "graphopt.bias_act.default", "graphopt.swiglu.default"} <= targets
    for a, b in zip(ep.module()(*args), M()(*args)):
        torch.testing.assert_close(a, b)


SCRIPT_MODULE = '''
import torch
import graphopt.cuda_ext

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))
        self.b = torch.nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        y, h = torch.ops.graphopt.add_rms_norm(x, r, self.w, 1e-6)
        z = torch.ops.graphopt.bias_act(torch.cat([y, h], -1), self.b, "gelu_tanh", None, -1)
        outs = torch.ops.graphopt.fused_pointwise("%0 = input 0; %1 = tanh %0; out %1 f32", [z])
        return torch.ops.graphopt.swiglu(outs[0])
'''


def test_torchscript_save_and_reload_in_fresh_process(tmp_path):
    """Saved here (scripted and traced, from a module file of their own), loaded in a fresh process
    that imports only graphopt.cuda_ext."""
    import importlib.util

    (tmp_path / "blockmod.py").write_text(SCRIPT_MODULE)
    spec = importlib.util.spec_from_file_location("blockmod", tmp_path / "blockmod.py")
    blockmod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blockmod)
    torch.manual_seed(0)
    m = blockmod.Block().eval()
    x, r = torch.randn(5, 16), torch.randn(5, 16)
    torch.jit.script(m).save(str(tmp_path / "scripted.pt"))
    torch.jit.trace(m, (x, r)).save(str(tmp_path / "traced.pt"))
    torch.save({"x": x, "r": r, "y": m(x, r)}, str(tmp_path / "io.pt"))
    load = textwrap.dedent(f"""
        import torch
        import graphopt.cuda_ext
        io = torch.load({str(tmp_path / 'io.pt')!r})
        for f in ('scripted.pt', 'traced.pt'):
            m = torch.jit.load({str(tmp_path)!r} + '/' + f)
            torch.testing.assert_close(m(io['x'], io['r']), io['y'])
        print('reloaded-ok')
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "reloaded-ok" in p.stdout


def test_reference_backend_forced_in_subprocess():
    code = "import graphopt.cuda_ext as c; import torch; print(c.backend()); print(torch.ops.graphopt.swiglu(torch.ones(2, 4)).shape)"
    env = dict(os.environ, GRAPHOPT_KERNELS="reference")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["reference", "torch.Size([2,", "2])"]


def test_build_errors_are_kernel_build_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelBuildError):
        build._arch_list("")
    if not torch.cuda.is_available():
        with pytest.raises(KernelBuildError, match="no CUDA GPU"):
            build.build_kernels()
    assert build.normalize_arch("9.0") == build.normalize_arch("90") == "sm_90"
    assert build.build_dir(["sm_90"]).parent == tmp_path / "ext"
    assert "sm_90" in build.build_dir(["sm_90"]).name and torch.__version__.split("+")[0] in build.build_dir(["sm_90"]).name


def test_check_compile_without_a_toolkit_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    monkeypatch.setattr(build, "find_pip_cuda_home", lambda: None)
    lines = []
    assert build.check_compile("sm_90", echo=lines.append, missing_ok=True) == 0
    assert len(lines) == 1 and lines[0].startswith("check-compile: nvcc not found: CUDA kernels not compile-checked")
    assert build.check_compile("sm_90", echo=lines.append) == 1  # asked for explicitly: a failure


def test_pip_toolkit_is_found_under_the_torch_cuda_major(tmp_path, monkeypatch):
    import importlib.machinery
    import importlib.util

    root = tmp_path / "nvidia"
    for major in ("12", "13"):
        (root / f"cu{major}" / "bin").mkdir(parents=True)
        (root / f"cu{major}" / "include").mkdir()
        (root / f"cu{major}" / "bin" / "nvcc").write_text("")
        (root / f"cu{major}" / "include" / "cuda_runtime.h").write_text("")
    spec = importlib.machinery.ModuleSpec("nvidia", None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "nvidia" else None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert build.find_pip_cuda_home() == root / "cu13"
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch: no toolkit to match
    assert build.find_pip_cuda_home() is None


@pytest.mark.skipif(build.find_cuda_home() is None and build.find_pip_cuda_home() is None, reason="needs nvcc")
def test_check_compile_reports_first_error(tmp_path, monkeypatch):
    # a broken copy of the sources must fail with the compiler's first error line and a log path
    bad = tmp_path / "csrc"
    bad.mkdir()
    (bad / "broken.cu").write_text("__global__ void k() { this_is_not_defined(); }\n")
    monkeypatch.setattr(build, "CSRC", bad)
    monkeypatch.setattr(build, "source_files", lambda: [bad / "broken.cu"])
    lines = []
    rc = build.check_compile("sm_90", log_dir=tmp_path / "logs", echo=lines.append)
    assert rc == 1
    text = "\n".join(lines)
    assert "this_is_not_defined" in text and "error" in text and "full log:" in text
    assert (tmp_path / "logs" / "broken.cu.log").exists()


LOAD_AS_ON_A_GPU = '''
import warnings, torch
torch.cuda.is_available = lambda: True  # ensure_loaded's cuda branch, with or without a GPU here
torch.cuda.get_device_capability = lambda *a: (9, 0)
warnings.simplefilter("error")  # no kernel registered twice
import graphopt.cuda_ext as ce
from graphopt.cuda_ext import registry
assert ce.backend() == "cuda", ce.backend_info()
for name, op in registry.all_ops().items():
    where = [l for l in torch._C._dispatch_dump("graphopt::" + name).splitlines() if l.startswith("CUDA:")]
    assert len(where) == 1 and (op.kernel if op.compiled else "registry.py") in where[0], (name, where)
print("ok")
'''
LOAD_BY_HAND_FIRST = '''
import sys, torch
torch.ops.load_library(sys.argv[1])  # before graphopt defines the schemas
import graphopt.cuda_ext as ce
assert "already registered" in ce.backend_info()["reason"], ce.backend_info()
assert "csrc/rotary.cu" in torch._C._dispatch_dump("graphopt::rotary")
print("ok")
'''


@pytest.mark.slow
@pytest.mark.skipif(build.find_cuda_home() is None, reason="needs nvcc")
def test_the_library_registers_each_kernel_on_the_python_schema():
    """The compiled library (built for sm_90, no GPU needed) loaded as ensure_loaded loads it:
    after the schemas are defined from the op modules, each csrc op gets the CUDA kernel of its
    own source and the Triton ops keep their Python dispatch; loaded by hand before graphopt,
    its kernels attach once the schemas exist."""
    so = build.build_kernels(arch_list=["sm_90"])
    env = dict(os.environ, GRAPHOPT_KERNELS="cuda", GRAPHOPT_CACHE_DIR=str(build.cache_root()),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for code in (LOAD_AS_ON_A_GPU, LOAD_BY_HAND_FIRST):
        p = subprocess.run([sys.executable, "-c", code, str(so)], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0 and p.stdout.split() == ["ok"], p.stderr[-3000:]

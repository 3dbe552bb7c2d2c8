"""The bundled zoo: every entry builds offline, runs, is deterministic per seed, has real inputs."""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest
import torch

from graphopt.examples import zoo

EXPECTED = ["resnet50", "mobilenet_v3_large", "convnext_tiny", "vit_b_16", "vit-tiny", "bert-base",
            "bert-tiny", "glm4-9b-4l", "glm4-tiny", "shape-branch", "mlp"]
FAMILIES = {"cnn", "vit", "encoder", "decoder", "toy"}
# small enough to build twice in the default run; the other cpu_friendly ones are marked slow
FAST = ["vit-tiny", "bert-tiny", "glm4-tiny", "shape-branch", "mlp", "mobilenet_v3_large"]
CPU_FRIENDLY = [n for n in zoo.names() if zoo.entry(n).cpu_friendly]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _tensors(out):
    """Tensors of a model output: a tensor, a tuple, or a transformers ModelOutput (cache skipped)."""
    if torch.is_tensor(out):
        return [out]
    if hasattr(out, "keys"):
        return [v for v in out.values() if torch.is_tensor(v)]
    return [t for t in out if torch.is_tensor(t)]


def _forward(model, inputs):
    with torch.no_grad():
        return _tensors(model(*inputs))


def test_names_and_entries():
    assert set(EXPECTED) <= set(zoo.names())
    assert zoo.DEFAULT in zoo.names()
    for n in zoo.names():
        e = zoo.entry(n)
        assert e.name == n and e.family in FAMILIES and e.default_batch >= 1 and e.description
        assert "\n" not in e.description
    assert not zoo.entry("glm4-9b-4l").cpu_friendly
    assert zoo.entry("bert-base").default_seq_len == 128
    assert zoo.entry("glm4-9b-4l").default_seq_len == 1024


def test_unknown_name_lists_choices():
    with pytest.raises(KeyError) as ei:
        zoo.entry("nope")
    msg = str(ei.value)
    assert "nope" in msg and all(n in msg for n in EXPECTED)
    with pytest.raises(KeyError):
        zoo.get("nope")


def test_bad_batch():
    with pytest.raises(ValueError):
        zoo.get("mlp", batch=0)


def _check_model(name):
    m1, in1 = zoo.get(name, seed=0)
    assert not m1.training
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in m1.parameters())
    for t in in1:
        assert t.shape[0] == zoo.entry(name).default_batch
        assert t.abs().sum() > 0 and t.unique().numel() > 1  # random, never all zeros
    out1 = _forward(m1, in1)
    assert out1 and all(torch.isfinite(o).all() and o.abs().sum() > 0 for o in out1)
    m2, in2 = zoo.get(name, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(in1, in2))
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(out1, _forward(m2, in2)))
    m3, in3 = zoo.get(name, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m3.state_dict().values()))


@pytest.mark.parametrize("name", FAST)
def test_fast_models_build_run_deterministic(name):
    _check_model(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CPU_FRIENDLY if n not in FAST])
def test_cpu_friendly_models_build_run_deterministic(name):
    _check_model(name)


def test_default_builds_and_runs():
    model, inputs = zoo.get(zoo.DEFAULT)
    (out,) = _forward(model, inputs)
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


def test_no_constant_parameters():
    # zero-initialised heads/biases would make rewrites that drop them invisible
    for name in ["vit-tiny", "bert-tiny", "glm4-tiny"]:
        model, _ = zoo.get(name)
        for k, p in model.named_parameters():
            assert p.numel() == 1 or not (p == p.reshape(-1)[0]).all(), f"{name}.{k} is constant"


def test_global_rng_untouched():
    torch.manual_seed(123)
    a = torch.rand(3)
    torch.manual_seed(123)
    zoo.get("mlp")
    assert torch.equal(torch.rand(3), a)


def test_batch_seq_dtype_args():
    model, (ids, mask) = zoo.get("bert-tiny", batch=3, seq_len=20)
    assert ids.shape == mask.shape == (3, 20) and ids.dtype == mask.dtype == torch.long
    assert (mask == 0).any(), "bert inputs should carry some padding"
    assert (ids[mask == 0] == 0).all() and (mask[:, 0] == 1).all()
    model, (ids,) = zoo.get("glm4-tiny", batch=1, seq_len=7, dtype=torch.bfloat16)
    assert ids.shape == (1, 7) and ids.dtype == torch.long
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    out = model(ids)
    assert out.logits.shape == (1, 7, 256)
    model, (x,) = zoo.get("shape-branch", batch=5, dtype=torch.float64)
    assert x.shape == (5, 3, 64, 64) and x.dtype == torch.float64
    assert model(x).shape == (5, 10)


def test_hf_models_use_eager_attention():
    for name in ["bert-tiny", "glm4-tiny"]:
        model, _ = zoo.get(name)
        assert model.config._attn_implementation == "eager"


def test_shape_branch_takes_both_branches():
    model, _ = zoo.get("shape-branch")
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 10)
        assert model(torch.randn(1, 3, 16, 16)).shape == (1, 10)


def test_glm4_9b_config_values():
    cfg = zoo.glm4_9b_config(num_layers=4)
    assert cfg.num_hidden_layers == 4
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4096, 32, 2, 128)
    assert cfg.intermediate_size == 13696 and cfg.vocab_size == 151552
    assert cfg.hidden_act == "silu" and cfg.attention_bias is True
    assert cfg.rms_norm_eps == pytest.approx(1.5625e-07)
    assert zoo.glm4_partial_rotary_factor(cfg) == 0.5
    for tok in [cfg.pad_token_id, cfg.bos_token_id, *cfg.eos_token_id]:
        assert 0 <= tok < cfg.vocab_size
    assert cfg._attn_implementation == "eager"
    tiny = zoo.glm4_tiny_config()
    assert zoo.glm4_partial_rotary_factor(tiny) == 0.5
    assert tiny.num_attention_heads // tiny.num_key_value_heads == 2


def test_full_size_entries_on_meta():
    # shapes only, no memory: the GLM-4-9B-shaped decoder is ~2.06e9 parameters (8 GB in fp32)
    model, (ids,) = zoo.get("glm4-9b-4l", device="meta")
    assert ids.shape == (1, 1024) and ids.device.type == "meta"
    n = sum(p.numel() for p in model.parameters())
    assert 2.0e9 < n < 2.1e9
    assert model.model.rotary_emb.inv_freq.shape == (32,)  # head_dim 128 * 0.5 / 2
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.bias is not None and layer.self_attn.k_proj.weight.shape == (256, 4096)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 13696, 4096)
    for name in ["bert-base", "vit_b_16", "resnet50"]:
        model, inputs = zoo.get(name, device="meta", batch=2)
        assert all(p.device.type == "meta" for p in model.parameters())
        assert inputs[0].shape[0] == 2


def test_example_scripts_compile():
    for f in ["zoo.py", "data_dependent.py", "optimize_resnet.py", "train_mlp.py"]:
        py_compile.compile(str(EXAMPLES / f), doraise=True)


def test_train_mlp_fp16_with_loss_scaling():
    """examples/train_mlp.py --precision fp16: fp16 compute through graphopt, a GradScaler on the
    loss, the loss falling as in fp32 training."""
    from graphopt.examples import train_mlp

    src = (EXAMPLES / "train_mlp.py").read_text()
    assert "torch.amp.GradScaler" in src and "scaler.scale(loss).backward()" in src
    fp16 = train_mlp.main(steps=20, precision="fp16")
    fp32 = train_mlp.main(steps=20)
    assert all(torch.isfinite(torch.tensor(fp16)))
    assert fp16[-1] < 0.5 * fp16[0] and abs(fp16[-1] - fp32[-1]) < 0.05 * fp32[0]


def test_data_dependent_model_runs():
    from graphopt.examples import data_dependent

    model, (x,) = data_dependent.build()
    assert model(x).shape == x.shape
    src = (EXAMPLES / "data_dependent.py").read_text().splitlines()
    assert "h.sum() > 0" in src[data_dependent.BRANCH_LINE - 1]

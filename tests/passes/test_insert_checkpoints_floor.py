"""insert_checkpoints' achievable minimum on decoders whose floor is the embedding's gradient.

A Llama-shaped base decoder (LlamaModel; vocab 31x the tokens of a step, as Llama-3-8B at batch 2,
seq 2048) planned for the H200 on meta: the backward's last node, the embedding, makes a fresh
vocab x hidden weight gradient that no plan recomputes away (0.29 of the step's activation memory),
so a budget of 0.3 is out of reach for any checkpointing, the model's own per-layer one included.
With ``checkpoint_backend="auto"`` a budget no AOT plan meets was retried with the selective
checkpoint, and its BudgetError (one-level plans, priced as upper bounds: 0.56 of the baseline on
the H200 Llama against the AOT planner's 0.32) was the one raised. The error now states the lower
minimum, the backend that reaches it and the fixed part with the node and parameter behind it; a
budget at that minimum is met. A tiny decoder on the CPU trains at the memory per-layer
checkpointing takes, with gradients passing the accuracy rule against fp64."""

import importlib

import pytest
import torch

import graphopt
from graphopt import ir
from graphopt.capture import capture
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.errors import BudgetError
from graphopt.pipeline import PassContext
from tests.helpers import step_check
from tests.passes.test_insert_checkpoints_memory import traced_peak

ic = importlib.import_module("graphopt.checkpoint")
aot = importlib.import_module("graphopt.checkpoint.aot")

pytestmark = pytest.mark.skipif(aot.available() is not None, reason=f"AOT backend unavailable: {aot.available()}")


def llama(layers=2, hidden=512, tokens=512, batch=2, device="meta", dtype=torch.bfloat16, vocab=None):
    """A Llama-3-shaped LlamaModel (GQA 4:1, head_dim 128 where hidden allows, SwiGLU 3.5x, vocab
    31.3x the step's tokens unless given) and its input ids."""
    from transformers import LlamaConfig, LlamaModel

    heads = max(hidden // 128, 4)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 3.5), num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                      vocab_size=vocab or int(31.3 * tokens), max_position_embeddings=2 * tokens // batch)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype).train()
    ids = torch.randint(3, cfg.vocab_size, (batch, tokens // batch), generator=torch.Generator().manual_seed(0))
    return model, (ids.to(device),)


@pytest.fixture(scope="module")
def planned():
    """The meta Llama's graph and a pass context planning for the H200."""
    model, args = llama()
    gm = capture(model, args)
    prof, _ = get_profile("h200")
    ctx = PassContext(profile=prof, cost=CostModel(prof), training=True, hints=ir.shape_hints(gm))
    return gm, ctx


@pytest.mark.slow  # make test-all: five plans of a two-layer decoder (about 3 s)
def test_auto_states_the_aot_minimum_and_meets_it(planned):
    gm, ctx = planned
    with pytest.raises(BudgetError, match="by the AOT backend") as e:
        ic.plan_checkpoints(gm, ctx, 0.05, "auto")
    err = e.value
    base = ic.ActivationModel.build(gm, ctx.cost, ctx.hints, device_kind=ctx.cost.device_kind).step_activation_bytes()
    # the fixed part is named: the embedding's weight gradient, most of the backward's largest working set
    assert "fixed" in str(err) and "embed_tokens.weight" in str(err)
    # what the selective checkpoint alone can reach is well above it
    with pytest.raises(BudgetError) as e_sac:
        ic.plan_checkpoints(gm, ctx, 0.05, "sac")
    assert e_sac.value.minimum > 1.2 * err.minimum
    # the stated minimum is met by an AOT plan; just under it nothing is
    cp = ic.plan_checkpoints(gm, ctx, err.minimum, "auto")
    assert cp.backend == "aot" and cp.plan is not None
    assert cp.details["predicted_activation_bytes"] <= err.minimum
    with pytest.raises(BudgetError):
        ic.plan_checkpoints(gm, ctx, int(0.99 * err.minimum), "auto")
    # the floor here is the embedding's gradient: 0.3 of the baseline is out of reach, as at Llama-3-8B's size
    assert err.minimum > 0.3 * base


@pytest.fixture
def one_cpu_thread():
    """The CPU profile prices ops by the threads torch runs on: one thread, so the plan is the same
    on every machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow  # make test-all: a traced eager, per-layer checkpointed and planned step, and three fp64 steps
def test_at_the_memory_of_per_layer_checkpointing_a_tiny_decoder_trains(one_cpu_thread):
    """The budget (bytes) is what the model's own per-layer checkpointing takes in a traced step on
    the CPU: the plan is accepted, the traced step stays within it (up to the prediction's error)
    and the gradients pass the accuracy rule against fp64."""
    model, args = llama(layers=4, hidden=64, tokens=256, device="cpu", dtype=torch.float32)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    per_layer = traced_peak(model, model, args)
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert per_layer < 0.6 * traced_peak(model, model, args)
    opt = graphopt.optimize(model, args, training=True, memory_budget=int(per_layer), passes=["insert_checkpoints"],
                            check_accuracy=False, target="cpu")
    model.train()
    d = opt.report.pass_result("insert_checkpoints").details
    assert d["backend"] == "aot" and d["regions"] >= 2
    assert d["predicted_activation_bytes"] <= d["budget_bytes"] == per_layer
    assert traced_peak(opt, model, args) <= 1.05 * per_layer
    step_check(model, opt, args)

"""optimize()'s options: one typed declaration (graphopt.options.OptimizeOptions), checked before
anything is captured, handed to the passes typed and, on re-optimization, as they were."""

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.cost.activations import parse_memory_budget
from graphopt.examples import zoo
from graphopt.options import OptimizeOptions


class NeverRun(nn.Module):
    """A model whose forward fails the test: bad options must be refused before capture runs it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        raise AssertionError("the model ran: options were not checked first")


@pytest.mark.parametrize("options,match", [
    ({"precision": "int4"}, "precision must be one of"),
    ({"checkpoint_backend": "jit"}, "checkpoint_backend must be"),
    ({"on_new_shape": "sometimes"}, "on_new_shape must be"),
    ({"memory_budget": 0.5}, "memory_budget applies to training"),
    ({"training": True, "memory_budget": "lots"}, "memory_budget 'lots'"),
    ({"devices": ["cpu", "cpu"], "schedule": "zigzag"}, "schedule must be one of"),
    ({"devices": ["cpu", "cpu"], "microbatches": 0}, "microbatches must be a positive integer"),
    ({"devices": ["cpu", "tpu:0"]}, "device"),
    ({"passes": ["fuse_everything"]}, "unknown pass fuse_everything"),
    ({"disable": "fold_conv_bn, nope"}, "unknown pass nope;"),  # a string is names by commas, not letters
    ({"disable": 3}, "disable must be pass ids"),
    ({"cuda_graphs": "maybe"}, "cuda_graphs must be 'auto', True or False"),
    ({"calibration_data": 5}, "calibration_data must be a list of example inputs"),
    ({"fast": True}, "optimize\\(\\) has no option 'fast'"),
])
def test_a_bad_option_is_refused_before_the_model_runs(options, match):
    with pytest.raises(graphopt.GraphoptError, match=match):
        graphopt.optimize(NeverRun(), (torch.randn(2, 4),), **options)


def test_options_are_held_checked_and_normalized():
    opts = OptimizeOptions(training=True, memory_budget="512MB", passes=["fold_constants"], dump_dir="out")
    assert opts.memory_budget == parse_memory_budget("512MB") and isinstance(opts.memory_budget, int)
    assert opts.passes == ("fold_constants",) and opts.disable == () and str(opts.dump_dir) == "out"
    assert OptimizeOptions(passes="fold_constants, fuse_attention", disable="fold_conv_bn").passes == (
        "fold_constants", "fuse_attention")
    assert OptimizeOptions(disable="fold_conv_bn,").disable == ("fold_conv_bn",)
    planned = OptimizeOptions(devices=["cpu", "cpu"], microbatches=2)
    assert [d.name for d in planned.partition_devices] == ["cpu", "cpu"]
    with pytest.raises(AttributeError):
        opts.precision = "bf16"  # frozen: what the caller asked for stays what it asked for


def test_reoptimizing_keeps_the_options_but_the_calibration_batches():
    model, (x,) = zoo.get("mlp")
    opt = graphopt.optimize(model, (x,), precision="fp32", on_new_shape="reoptimize", cuda_graphs=False,
                            calibration_data=[(torch.randn_like(x),)], model_name="mlp-spec", check_accuracy=False,
                            passes=["fuse_bias_act"])
    _, kept, _ = opt._reoptimize
    assert kept.calibration_data is None
    assert (kept.precision, kept.cuda_graphs, kept.model_name, kept.on_new_shape, kept.passes) == (
        "fp32", False, "mlp-spec", "reoptimize", ("fuse_bias_act",))
    with pytest.warns(RuntimeWarning, match="re-optimizing"):
        out = opt(torch.randn(3, x.shape[1]))
    (spec,) = opt._specializations.values()
    assert spec.report.model == "mlp-spec" and spec._reoptimize[1] == kept and out.shape[0] == 3

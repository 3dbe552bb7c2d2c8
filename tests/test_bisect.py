import torch

import graphopt
from graphopt.tools.bisect import bisect
from graphopt.examples import zoo
from graphopt.pipeline import Candidate, Pass, assemble

aten = torch.ops.aten


class ScaleThirdRelu(Pass):
    """Planted fault: rewrites every relu into relu * 1.0 (harmless) except the third, * 1.5."""

    name = "scale_third_relu_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        relus = [n for n in gm.graph.nodes if n.target is aten.relu.default]
        cands = []
        for i, n in enumerate(relus):
            factor = 1.5 if i == 2 else 1.0

            def apply(n=n, factor=factor):
                with gm.graph.inserting_after(n):
                    new = gm.graph.call_function(aten.mul.Tensor, (n, factor))
                n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
                return new

            # decreasing gains: the pass applies them in graph order
            cands.append(Candidate("planted scale", [n], 1e-3 - i * 1e-6, apply, label=f"relu #{i + 1} {n.name}"))
        res.apply_ranked(ctx, cands)
        return res


def test_bisect_names_the_planted_pass_and_rewrite():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    x = torch.randn(8, 64)
    pipeline = assemble(["eliminate_dead_code", "fold_constants"]) + [ScaleThirdRelu()]
    result = bisect(model, (x,), pipeline=pipeline, precision="fp32")
    assert result.pass_name == "scale_third_relu_planted"
    assert result.rewrite_index == 3
    assert result.rewrite.matched == ["relu_2"]
    assert "first failure" in result.summary() and "#3" in result.summary()
    assert result.checked[-1] == ("scale_third_relu_planted", "fails")
    assert all(status in ("ok", "unchanged") for _, status in result.checked[:-1])


def test_bisect_clean_pipeline_reports_no_failure():
    model, inputs = zoo.get("shape-branch")
    result = bisect(model, inputs, precision="fp32")
    assert result.pass_name is None
    assert "no pass breaks" in result.summary()
    assert any(name == "fold_conv_bn" and status == "ok" for name, status in result.checked)


def test_cli_bisect(capsys):
    from graphopt.tools.cli import main

    assert main(["explain", "shape-branch", "--bisect", "--precision", "fp32"]) == 0
    assert "no pass breaks the accuracy rule" in capsys.readouterr().out

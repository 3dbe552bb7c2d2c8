"""Encoder-decoder (seq2seq) transformers on the CPU, none of them in the sweep (which has T5's encoder
alone): T5, mT5, BART, Marian, Pegasus, Whisper (tiny configs, random weights, fp32, one forward to the
logits with decoder_input_ids and no cache). Answered: do capture, the passes a GPU plan applies, the
defaults and training (with a memory budget) hold the accuracy rule on models with cross-attention.

Per model: ``plan``: ``sweep.strict_plan`` priced for the H200 (a pass that breaks the graph raises) and
the accuracy rule; ``optimize``: defaults and the rule; ``train``: ``optimize(training=True)``, then with
``memory_budget=0.6``, one step's loss and every parameter gradient against float64 by the rule
(``tests.helpers.step_check``).

    PYTHONPATH=$PWD python benchmarks/diag/diag_outside_seq2seq.py [--only t5,bart] --out DIR
"""
from __future__ import annotations

import argparse
import copy
import datetime
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
from graphopt import accuracy  # noqa: E402
from graphopt.tools import sweep  # noqa: E402
from tests.helpers import step_check  # noqa: E402

VOCAB = 128
LAYERS = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
              encoder_ffn_dim=128, decoder_ffn_dim=128, d_model=64)
T5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
          decoder_start_token_id=0, pad_token_id=0)
# name -> (config class, model class, config kwargs, input kind)
MODELS = {
    "t5": ("T5Config", "T5ForConditionalGeneration", T5, "text"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", T5, "text"),
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(LAYERS, vocab_size=VOCAB, max_position_embeddings=64),
             "text"),
    "marian": ("MarianConfig", "MarianMTModel", dict(LAYERS, vocab_size=VOCAB, max_position_embeddings=64,
                                                     pad_token_id=0, decoder_start_token_id=0), "text"),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration",
                dict(LAYERS, vocab_size=VOCAB, max_position_embeddings=64), "text"),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",
                dict(LAYERS, vocab_size=VOCAB, num_mel_bins=16, max_source_positions=32, max_target_positions=32,
                     pad_token_id=0, decoder_start_token_id=0, bos_token_id=1, eos_token_id=2), "audio"),
}


class Logits(torch.nn.Module):
    """The logits of one teacher-forced forward, without a cache."""

    def __init__(self, model, kind):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, src, mask, decoder_input_ids):
        if self.kind == "audio":
            return self.model(input_features=src, decoder_input_ids=decoder_input_ids, use_cache=False).logits
        return self.model(input_ids=src, attention_mask=mask, decoder_input_ids=decoder_input_ids,
                          use_cache=False).logits


def build(name):
    import transformers

    cfg_cls, model_cls, kwargs, kind = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).eval()
    dec = torch.randint(3, VOCAB, (2, 7))
    if kind == "audio":  # [B, mel bins, 2 * max_source_positions frames]; no attention mask
        args = (torch.randn(2, 16, 64), torch.ones(2, 64, dtype=torch.long), dec)
    else:
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 9:] = 0  # a padded row
        args = (torch.randint(3, VOCAB, (2, 12)), mask, dec)
    return Logits(model, kind).eval(), args


def _rule(model, fn, args) -> str:
    with torch.no_grad():
        out, eager = fn(*args), model(*args)
    res = accuracy.check(out, accuracy.fp64_reference(model, args, {}), eager)
    return "pass" if res.passed else f"FAIL: {res.reason}"


def _failed(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def cells(model, args) -> dict:
    """One table row's cells for an eval-mode ``model`` and its positional ``args`` (the other outside
    diags use it too): plan, optimize, train, train + budget, and the passes the plan applied."""
    row = {}
    try:
        gm, applied = sweep.strict_plan(model, args, "h200")
        row["plan"] = _rule(model, gm, args)
        row["applied"] = ", ".join(a for a in applied if a not in ("eliminate_dead_code",
                                                                     "eliminate_common_subexpressions"))
    except Exception as e:  # noqa: BLE001 - the table says what broke
        row["plan"] = _failed(e)
    try:
        row["optimize"] = _rule(model, graphopt.optimize(model, args), args)
    except Exception as e:  # noqa: BLE001
        row["optimize"] = _failed(e)
    for cell, opts in (("train", {}), ("train + budget", {"memory_budget": 0.6})):
        row[cell] = _train(model, args, opts)
        if cell == "train + budget" and row[cell].startswith("BudgetError") and _MINIMUM[0]:
            # 0.6 is below what this model can reach: train at its minimum (2% above), which the
            # error names, so the budgeted path runs anyway
            low = _MINIMUM[0]
            again = _train(model, args, {"memory_budget": int(low * 1.02)})
            row[cell] = f"{again} at its minimum {low / 1e3:.1f} kB (0.6 is below it)"
    return row


_MINIMUM = [None]  # the last BudgetError's minimum (bytes)


def _train(model, args, opts) -> str:
    trained = copy.deepcopy(model).train()
    for m in trained.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    _MINIMUM[0] = None
    try:
        step_check(trained, graphopt.optimize(trained, args, training=True, **opts), args)
        return "pass"
    except graphopt.BudgetError as e:
        _MINIMUM[0] = e.minimum
        return _failed(e)
    except Exception as e:  # noqa: BLE001
        return _failed(e)


def table(argv, title: str, intro: str, models: dict, build, stem: str) -> Path:
    """Run ``cells`` on each of ``models`` (``--only`` a subset) built by ``build(name)`` -> (model,
    args), print each row and write the table to ``--out``/<stem>_<UTC time>_cpu.md."""
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(models))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(models)
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# {title} ({now:%Y-%m-%d %H:%M} UTC)", "", intro, "",
             "| model | plan (h200) | optimize | train | train + budget | passes the plan applied (but dead code, CSE) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        t0 = time.perf_counter()
        row = cells(*build(name))
        print(f"{name}: {row} ({time.perf_counter() - t0:.0f} s)", flush=True)
        lines.append(f"| {name} | {row['plan']} | {row['optimize']} | {row['train']} | {row['train + budget']} | "
                     f"{row.get('applied', '')} |")
    out = Path(args.out) / f"{stem}_{now:%Y-%m-%d_%H%M%S}_cpu.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return out


def main(argv=None):
    import transformers

    table(argv, "Encoder-decoder models outside the sweep, on the CPU",
          f"torch {torch.__version__}, transformers {transformers.__version__}; tiny configs, random weights, fp32, "
          "batch 2, 12 source tokens (one row padded from 9) or 64 audio frames, 7 decoder tokens; "
          "`benchmarks/diag/diag_outside_seq2seq.py`. plan: the H200 plan's passes in strict mode + the accuracy "
          "rule; optimize: defaults; train: training=True, then memory_budget=0.6 (or the model's minimum where "
          "0.6 is below it), the loss and every parameter gradient by the rule against float64.", MODELS, build,
          "outside_seq2seq")


if __name__ == "__main__":
    main()

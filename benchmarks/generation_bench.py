"""Issue 28 benchmark: token generation with graphopt.optimize_generation against transformers'
eager generate() (DynamicCache) and transformers with a static cache and
torch.compile(mode="reduce-overhead", fullgraph=True), in one process, random bf16 weights.

    python benchmarks/generation_bench.py --model llama3-8b                 # Llama-3-8B shape, 32 layers (GPU)
    python benchmarks/generation_bench.py --model glm4-9b                   # GLM-4-9B shape, 40 layers (GPU)
    python benchmarks/generation_bench.py --model llama3-8b --full          # batch 1/8/32 x past 128/1024/4096
    python benchmarks/generation_bench.py --tiny --device cpu --out /tmp/gb  # CPU dry run, seconds
    python benchmarks/generation_bench.py --target OUT/h200_decode_fit.json  # graphopt planned with a fitted profile

Measures, for each variant:
- ms per decode step (median of --steps steps after warm-up; a step is the model call and the
  greedy token fed back) at each (batch, past length): default batch 1/8/32 at past 1024,
  ``--full`` the grid batch 1/8/32 x past 128/1024/4096. Variants: ``eager`` (the model called with
  its DynamicCache), ``compile-ro`` (a StaticCache of past + room for the new tokens, the prompt written by the
  eager model, then ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``
  steps: what ``generate(cache_implementation="static")`` runs), ``graphopt`` (the generator's
  decode step, a CUDA-graph replay, its cache sized the same);
- prefill ms of a --prefill-batch x past prompt (eager into a DynamicCache; eager into a StaticCache
  for compile-ro, as generate() prefills uncompiled; graphopt's prefill graph optimized for that
  prompt shape, ``prefill="graphopt"``, also in its end-to-end run);
- end-to-end tokens/s for --new-tokens greedy tokens after a past-long prompt at batch 1 (eager:
  ``model.generate``; compile-ro: eager prefill + compiled steps; graphopt: ``Generator.generate``),
  and whether the tokens equal eager's;
- the floors: weight bytes read per step (all parameters but the input embedding table, plus B of
  its rows) over the copy bandwidth measured here, and the same plus the KV cache bytes a step reads
  at that past length; and all parameter bytes over that bandwidth, the anchor's "weight bytes / copy
  bandwidth" (issue 28 puts 1.15x of it at about 4.4 ms for the 8B shape), which counts the input
  embedding table a step does not read.

Writes generation_<UTC date>_<gpu>.json and .md under --out (default benchmarks/results) after
every row, with date, GPU, torch/transformers/triton versions. A variant that fails is a row with
its error; the run goes on. Progress is printed as it goes. --budget-s (default 480) skips the
rows left when the time is spent (compile-ro's compilations are the slow part: one per batch
size, 35-55 s each at 8B). Every row is timed under ``torch.no_grad()``, as generate() runs. The
report ends with issue 28's targets and their verdicts (batch-1 step within 1.15x of the weight +
KV floor, and of all weight bytes, every batch size faster than compile-ro, end to end >= 3x eager
generate()).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------------- timing


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, reps: int, warmup: int) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after ``warmup`` (CUDA events per call on a GPU,
    host clock with a sync on the CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def wall_s(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def copy_bandwidth(device, dtype) -> float:
    """Bytes per second a device copy moves (read + write), measured on 1 GiB (64 MiB on the CPU)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 26) // torch.tensor([], dtype=dtype).element_size()
    src = torch.randn(n, device=device).to(dtype)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps=10, warmup=3)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


# ----------------------------------------------------------------------------------- models


def build_model(args, device, dtype):
    from graphopt.examples import decoders

    if args.tiny:
        cfg = decoders.tiny_config(args.model if args.model in decoders.FAMILIES else "llama", layers=args.layers or 2)
    elif args.model == "llama3-8b":
        cfg = decoders.llama3_8b_config(args.layers or 32)
        cfg._attn_implementation = "sdpa"
    elif args.model == "glm4-9b":
        cfg = decoders.glm4_9b_config(args.layers or 40)
    else:
        raise SystemExit(f"unknown --model {args.model!r}: llama3-8b or glm4-9b (or --tiny)")
    return decoders.build(cfg, dtype=dtype, device=device, seed=0)


def kv_bytes_per_token(model, device) -> int:
    """Key + value bytes one token adds to the cache, over all layers (from one eager call)."""
    from graphopt.examples.decoders import returned_cache

    with torch.no_grad():
        cache = returned_cache(model(torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True))
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def all_weight_bytes(model) -> int:
    """Every parameter's bytes, the input embedding table whole."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_bytes(model, batch: int) -> int:
    """Parameter bytes a decode step reads: all but the input embedding table, plus its B rows."""
    emb = model.get_input_embeddings().weight
    return all_weight_bytes(model) - emb.numel() * emb.element_size() + batch * emb.shape[1] * emb.element_size()


def _prompt(batch, length, vocab, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)


# ----------------------------------------------------------------------------------- variants


def _cache_arg(model) -> str:
    from graphopt.examples.decoders import cache_arg

    return cache_arg(model)


class Eager:
    name = "eager"

    def __init__(self, model, args, device):
        self.model, self.args, self.device = model, args, device
        self.arg = _cache_arg(model)

    def decode_ms(self, batch, past):
        from graphopt.examples.decoders import returned_cache

        m = self.model
        out = m(_prompt(batch, past, m.config.vocab_size, self.device), use_cache=True, logits_to_keep=1)
        cache = returned_cache(out)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)

        def step():
            nonlocal tok
            o = m(tok, use_cache=True, logits_to_keep=1, **{self.arg: cache})
            tok = o.logits[:, -1].argmax(-1, keepdim=True)

        return median_ms(step, self.device, self.args.steps, self.args.warmup), {}

    def prefill_ms(self, batch, past):
        m = self.model
        ids = _prompt(batch, past, m.config.vocab_size, self.device)

        def run():
            m(ids, use_cache=True, logits_to_keep=1)

        return median_ms(run, self.device, self.args.prefill_reps, 1)

    def generate(self, prompt, new):
        def run(n):
            return self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        run(4)
        out = None

        def timed():
            nonlocal out
            out = run(new)
        return wall_s(timed, self.device), out


class CompileRO:
    """transformers' static cache, the prompt prefilled eagerly, decode steps through
    torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False): what
    generate() compiles for a static cache (its CompileConfig), one compilation per batch size."""

    name = "compile-ro"

    def __init__(self, model, args, device):
        self.model, self.args, self.device = model, args, device
        self.arg = _cache_arg(model)
        self.fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def _static(self, batch, length):
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=length)

    def _prefilled(self, prompt, length, cache=None):
        """The prompt written eagerly into a StaticCache (a new one, or ``cache`` from position
        0: the same tensors keep the compiled step's CUDA graphs valid)."""
        if cache is None:
            cache = self._static(prompt.shape[0], length)
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()
        out = self.model(prompt, use_cache=True, logits_to_keep=1, **{self.arg: cache})
        return cache, out.logits[:, -1].argmax(-1, keepdim=True)

    def _step(self, cache, tok):
        torch.compiler.cudagraph_mark_step_begin()
        o = self.fwd(input_ids=tok, use_cache=True, logits_to_keep=1, **{self.arg: cache})
        return o.logits[:, -1].argmax(-1, keepdim=True)

    def decode_ms(self, batch, past):
        cache, tok = self._prefilled(_prompt(batch, past, self.model.config.vocab_size, self.device),
                                     past + self.args.room)

        def step():
            nonlocal tok
            tok = self._step(cache, tok)

        t = time.perf_counter()
        for _ in range(3):  # compilation and CUDA-graph recording
            step()
        _sync(self.device)
        compile_s = time.perf_counter() - t
        return median_ms(step, self.device, self.args.steps, self.args.warmup), {"compile_s": round(compile_s, 1)}

    def prefill_ms(self, batch, past):
        ids = _prompt(batch, past, self.model.config.vocab_size, self.device)
        cache = self._static(batch, past + self.args.room)

        def run():
            for layer in cache.layers:
                if layer.is_initialized:
                    layer.cumulative_length.zero_()
            self.model(ids, use_cache=True, logits_to_keep=1, **{self.arg: cache})

        return median_ms(run, self.device, self.args.prefill_reps, 1)

    def generate(self, prompt, new):
        cache = self._static(prompt.shape[0], prompt.shape[1] + self.args.room)

        def run(n):
            _, tok = self._prefilled(prompt, None, cache)
            toks = [tok]
            for _ in range(n - 1):
                tok = self._step(cache, tok)
                toks.append(tok)
            return torch.cat([prompt] + toks, dim=1)

        run(4)
        out = None

        def timed():
            nonlocal out
            out = run(new)
        return wall_s(timed, self.device), out


class Graphopt:
    name = "graphopt"

    def __init__(self, model, args, device):
        self.model, self.args, self.device = model, args, device
        self._gens: dict = {}

    def gen(self, length):
        """One generator per cache length (past + room), for every batch size."""
        import graphopt

        if length not in self._gens:
            self._gens.clear()
            gc.collect()
            opts = {"check_accuracy": not self.args.no_accuracy, "prefill": "graphopt"}
            if self.args.target:
                opts["target"] = self.args.target
            self._gens[length] = graphopt.optimize_generation(
                self.model, max_batch_size=max(self.args.batches + [self.args.prefill_batch, 1]), max_length=length,
                **opts)
        return self._gens[length]

    def decode_ms(self, batch, past):
        gen = self.gen(past + self.args.room)
        t = time.perf_counter()
        state = gen.decode_state(batch)
        optimize_s = time.perf_counter() - t
        for layer in state.cache.layers:
            layer.cumulative_length.fill_(past)
        state.position_ids.fill_(past)
        state.attention_mask.fill_(1)
        state.input_ids.copy_(_prompt(batch, 1, self.model.config.vocab_size, self.device))

        def step():
            logits = state.step()
            state.input_ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
            state.position_ids.add_(1)

        ms = median_ms(step, self.device, self.args.steps, self.args.warmup)
        rep = state.module.report
        extra = {"optimize_s": round(optimize_s, 1), "predicted_ms": round(rep.predicted_s_after * 1e3, 3),
                 "accuracy": ("passed" if rep.accuracy.get("passed") else "FAILED: " + str(rep.accuracy.get("reason")))
                 if rep.accuracy.get("checked") else "not checked: " + str(rep.accuracy.get("reason", "off")),
                 "cuda_graph": state.runner.decision.note(), "replays": state.runner.stats["replays"]}
        return ms, extra

    def prefill_ms(self, batch, past):
        gen = self.gen(past + self.args.room)
        ids = _prompt(batch, past, self.model.config.vocab_size, self.device)
        gen.prefill(ids)  # optimizes this prompt shape
        return median_ms(lambda: gen.prefill(ids), self.device, self.args.prefill_reps, 1)

    def generate(self, prompt, new):
        gen = self.gen(prompt.shape[1] + self.args.room)
        gen.generate(prompt, max_new_tokens=4, eos_token_id=None)  # optimizes the prefill and decode step
        out = None

        def timed():
            nonlocal out
            out = gen.generate(prompt, max_new_tokens=new, eos_token_id=None)
        return wall_s(timed, self.device), out


VARIANTS = {"eager": Eager, "compile-ro": CompileRO, "graphopt": Graphopt}


# ----------------------------------------------------------------------------------- report


def versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    out["cuda"] = torch.version.cuda
    return out


def gpu_slug(device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).replace("NVIDIA", "")
    m = re.search(r"[A-Za-z]+\d+", name)
    return (m.group(0) if m else name.strip().split()[0]).lower()


FLOOR_TARGET = 1.15  # issue 28: a batch-1 decode step within 1.15x of the weight + KV read floor
E2E_TARGET = 3.0  # and end-to-end generation at least 3x transformers' eager generate()


def verdicts(rows: list) -> list[tuple[str, str, str]]:
    """(target, measured, "pass"/"FAIL"/"—") for issue 28's targets, from the rows there are."""
    out = []
    dec = [r for r in rows if r["kind"] == "decode" and "ms" in r]
    at = {(r["variant"], r["batch"], r["past"]): r for r in dec}
    for (v, b, p), r in sorted(at.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if v != "graphopt":
            continue
        if b == 1 and r.get("floor_kv_ms"):
            ratio = r["ms"] / r["floor_kv_ms"]
            out.append((f"batch 1, past {p}: step / floor (weights + KV) <= {FLOOR_TARGET}",
                        f"{r['ms']:.3f} ms / {r['floor_kv_ms']:.3f} ms = {ratio:.3f}x",
                        "pass" if ratio <= FLOOR_TARGET else "FAIL"))
        if b == 1 and r.get("floor_all_ms"):
            ratio = r["ms"] / r["floor_all_ms"]
            out.append((f"batch 1, past {p}: step / (all weight bytes / copy rate) <= {FLOOR_TARGET}",
                        f"{r['ms']:.3f} ms / {r['floor_all_ms']:.3f} ms = {ratio:.3f}x",
                        "pass" if ratio <= FLOOR_TARGET else "FAIL"))
        c = at.get(("compile-ro", b, p))
        if c is not None:
            out.append((f"batch {b}, past {p}: faster than compile-ro", f"{r['ms']:.3f} vs {c['ms']:.3f} ms "
                        f"({c['ms'] / r['ms']:.2f}x)", "pass" if r["ms"] < c["ms"] else "FAIL"))
    e2e = {r["variant"]: r for r in rows if r["kind"] == "e2e" and "tokens_per_s" in r}
    if "graphopt" in e2e and "eager" in e2e:
        x = e2e["graphopt"]["tokens_per_s"] / e2e["eager"]["tokens_per_s"]
        out.append((f"end to end >= {E2E_TARGET:.0f}x eager generate()", f"{e2e['graphopt']['tokens_per_s']:.1f} vs "
                    f"{e2e['eager']['tokens_per_s']:.1f} tokens/s ({x:.2f}x)", "pass" if x >= E2E_TARGET else "FAIL"))
    return out


def markdown(meta: dict, rows: list) -> str:
    lines = [f"# Generation benchmark: {meta['model']} ({meta['layers']} layers, {meta['params_b']:.2f} B params, "
             f"{meta['dtype']}) on {meta['gpu']}", "",
             f"{meta['date']} · torch {meta['versions']['torch']} · transformers {meta['versions']['transformers']} · "
             f"triton {meta['versions']['triton']} · copy bandwidth {meta['copy_gbps']:.0f} GB/s · "
             f"{meta['steps']} timed steps per point (median)", ""]
    dec = [r for r in rows if r["kind"] == "decode"]
    points = sorted({(r["batch"], r["past"]) for r in dec})
    names = [v for v in VARIANTS if any(r["variant"] == v for r in dec)]
    if points:
        lines += ["## Decode step (ms)", "",
                  "| batch | past | " + " | ".join(names) + " | floor: weights | floor: weights + KV | floor: all weight bytes | graphopt / floor (w+KV) | "
                  "graphopt vs compile-ro | graphopt vs eager |",
                  "| ---: | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for b, p in points:
            at = {r["variant"]: r for r in dec if (r["batch"], r["past"]) == (b, p)}
            cells = []
            for v in names:
                r = at.get(v)
                cells.append("—" if r is None else (f"{r['ms']:.3f}" if "ms" in r else f"error: {r.get('error', '')[:60]}"))
            any_r = next(iter(at.values()))
            g, c, e = (at.get(v, {}).get("ms") for v in ("graphopt", "compile-ro", "eager"))
            fl = any_r.get("floor_kv_ms")
            lines.append(f"| {b} | {p} | " + " | ".join(cells) + f" | {any_r.get('floor_weights_ms', 0):.3f} | "
                         f"{fl or 0:.3f} | {any_r.get('floor_all_ms', 0):.3f} | " + (f"{g / fl:.3f}x" if g and fl else "—") + " | "
                         + (f"{c / g:.2f}x" if g and c else "—") + " | " + (f"{e / g:.2f}x" if g and e else "—") + " |")
        lines += [""]
        notes = [r for r in dec if r["variant"] == "graphopt" and "accuracy" in r]
        for r in notes:
            lines.append(f"- graphopt batch {r['batch']} past {r['past']}: optimized in {r.get('optimize_s')} s, "
                         f"predicted {r.get('predicted_ms')} ms, accuracy {r['accuracy']}; {r.get('cuda_graph')}")
        for r in dec:
            if r["variant"] == "compile-ro" and "compile_s" in r:
                lines.append(f"- compile-ro batch {r['batch']} past {r['past']}: first 3 steps (compile + record) "
                             f"{r['compile_s']} s")
        lines += [""]
    pre = [r for r in rows if r["kind"] == "prefill"]
    if pre:
        lines += ["## Prefill (ms)", "", "| variant | batch | prompt | ms |", "| --- | ---: | ---: | ---: |"]
        for r in pre:
            lines.append(f"| {r['variant']} | {r['batch']} | {r['past']} | "
                         + (f"{r['ms']:.2f}" if "ms" in r else f"error: {r.get('error', '')[:80]}") + " |")
        lines += [""]
    e2e = [r for r in rows if r["kind"] == "e2e"]
    if e2e:
        base = next((r.get("tokens_per_s") for r in e2e if r["variant"] == "eager"), None)
        lines += ["## End to end (batch 1, greedy)", "",
                  "| variant | prompt | new tokens | s | tokens/s | vs eager | tokens equal to eager's |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in e2e:
            if "tokens_per_s" not in r:
                lines.append(f"| {r['variant']} | {r['past']} | {r['new']} | — | — | — | error: {r.get('error', '')[:80]} |")
                continue
            lines.append(f"| {r['variant']} | {r['past']} | {r['new']} | {r['s']:.2f} | {r['tokens_per_s']:.1f} | "
                         + (f"{r['tokens_per_s'] / base:.2f}x" if base else "—") + f" | {r.get('same_as_eager', '—')} |")
        lines += [""]
    ver = verdicts(rows)
    if ver:
        lines += ["## Targets (issue 28)", "", "| target | measured | verdict |", "| --- | --- | --- |"]
        lines += [f"| {t} | {m} | {v} |" for t, m, v in ver]
        lines += [""]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help="llama3-8b | glm4-9b (with --tiny: a decoders family)")
    p.add_argument("--layers", type=int, default=None, help="cut the model to N layers")
    p.add_argument("--tiny", action="store_true", help="tiny decoder, tiny grid: a dry run")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--full", action="store_true", help="batch 1/8/32 x past 128/1024/4096")
    p.add_argument("--batches", default=None, help="comma list (default 1,8,32; tiny 1,2)")
    p.add_argument("--pasts", default=None, help="comma list (default 1024; --full 128,1024,4096; tiny 8)")
    p.add_argument("--variants", default=None, help="comma list of eager,compile-ro,graphopt (CPU default: no compile-ro)")
    p.add_argument("--new-tokens", type=int, default=None, help="end-to-end new tokens (default 256; tiny 8)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point (default 50; tiny 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--prefill-reps", type=int, default=5)
    p.add_argument("--no-accuracy", action="store_true", help="optimize without graphopt's fp64 accuracy guard")
    p.add_argument("--target", default=None, help="graphopt's cost profile (a name or a profile JSON, e.g. the "
                   "h200_decode_fit.json diag_decode_gemm.py writes); default: the device's")
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--no-prefill", action="store_true", help="no prefill rows")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the rows left after this many seconds")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.batches = [int(x) for x in args.batches.split(",")] if args.batches else ([1, 2] if args.tiny else [1, 8, 32])
    args.pasts = ([int(x) for x in args.pasts.split(",")] if args.pasts else
                  [8] if args.tiny else [128, 1024, 4096] if args.full else [1024])
    args.new_tokens = args.new_tokens or (8 if args.tiny else 256)
    args.steps = args.steps or (5 if args.tiny else 50)
    # cache room after the past: the end-to-end tokens, or the timed steps and their warm-up
    args.room = max(args.new_tokens, 3 + args.warmup + args.steps + 1)
    names = args.variants.split(",") if args.variants else (
        ["eager", "graphopt"] if device.type == "cpu" else ["eager", "graphopt", "compile-ro"])
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"unknown variant {n!r}: {', '.join(VARIANTS)}")

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"generation_{stamp}_{gpu_slug(device)}"
    log(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor()}); "
        f"results -> {stem}.{{json,md}}")

    model = build_model(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built {type(model).__name__}: {model.config.num_hidden_layers} layers, {n_params / 1e9:.2f} B params, {dtype}")
    bw = copy_bandwidth(device, dtype)
    kv_tok = kv_bytes_per_token(model, device)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s; KV cache {kv_tok / 1024:.0f} KiB per token")
    meta = {"date": stamp, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "device": str(device), "versions": versions(), "model": type(model).__name__ if args.tiny else args.model,
            "layers": model.config.num_hidden_layers, "params_b": n_params / 1e9, "dtype": str(dtype).replace("torch.", ""),
            "copy_gbps": bw / 1e9, "kv_bytes_per_token": kv_tok, "steps": args.steps, "argv": sys.argv[1:] if argv is None else argv,
            "target": args.target}
    rows: list = []

    def write():
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        stem.with_suffix(".md").write_text(markdown(meta, rows))

    def run_row(row: dict, fn) -> None:
        if time.perf_counter() - T0 > args.budget_s:
            row["error"] = f"skipped: the {args.budget_s:.0f} s budget is spent"
        else:
            try:
                with torch.no_grad():  # as generate() runs; a grad-enabled call would time autograd's overhead
                    fn(row)
            except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end of the run
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                traceback.print_exc()
        rows.append(row)
        log(json.dumps(row))
        write()

    variants = {}
    for name in names:
        try:
            variants[name] = VARIANTS[name](model, args, device)
        except Exception as e:  # noqa: BLE001
            rows.append({"kind": "setup", "variant": name, "error": f"{type(e).__name__}: {e}"})
            write()
    # the rows that matter most first (a time-limited run keeps them): per past length, the first
    # batch size for every variant, then the end-to-end runs, the other batch sizes, the prefills
    e2e_past = args.pasts[len(args.pasts) // 2]
    plan = []
    for past in args.pasts:
        for i, batch in enumerate(args.batches):
            plan += [("decode", name, batch, past) for name in variants]
            if i == 0 and past == e2e_past and not args.no_e2e:
                plan += [("e2e", name, 1, past) for name in variants]
        if not args.no_prefill:
            plan += [("prefill", name, args.prefill_batch, past) for name in variants]

    eager_tokens = None

    def decode(row, variant, batch, past):
        ms, extra = variant.decode_ms(batch, past)
        row.update(ms=ms, **extra)
        row["floor_weights_ms"] = weight_bytes(model, batch) / bw * 1e3
        row["floor_kv_ms"] = (weight_bytes(model, batch) + batch * past * kv_tok) / bw * 1e3
        row["floor_all_ms"] = all_weight_bytes(model) / bw * 1e3

    def e2e(row, variant, batch, past):
        nonlocal eager_tokens
        prompt = _prompt(1, past, model.config.vocab_size, device, seed=7)
        s, tokens = variant.generate(prompt, args.new_tokens)
        row.update(s=s, tokens_per_s=args.new_tokens / s)
        new = tokens[:, past:].cpu()
        if variant.name == "eager":
            eager_tokens = new
        elif eager_tokens is not None:
            same = (new == eager_tokens).all(0)
            first = int((~same).nonzero()[0]) if not bool(same.all()) else None
            row["same_as_eager"] = "all" if first is None else f"first {first} of {new.shape[1]}"

    def prefill(row, variant, batch, past):
        row["ms"] = variant.prefill_ms(batch, past)

    what = {"decode": "decode step", "e2e": f"end to end, {args.new_tokens} new tokens after the prompt",
            "prefill": "prefill"}
    for i, (kind, name, batch, past) in enumerate(plan, start=1):
        log(f"[{i}/{len(plan)}] {name}: {what[kind]}, batch {batch}, past {past}")
        row = {"kind": kind, "variant": name, "batch": batch, "past": past}
        if kind == "e2e":
            row["new"] = args.new_tokens
        fn = {"decode": decode, "e2e": e2e, "prefill": prefill}[kind]
        run_row(row, lambda r, fn=fn, v=variants[name], b=batch, p=past: fn(r, v, b, p))
    variants.clear()
    gc.collect()
    log(f"done; results in {stem}.json and {stem}.md")
    print(markdown(meta, rows), flush=True)
    return stem


if __name__ == "__main__":
    main()

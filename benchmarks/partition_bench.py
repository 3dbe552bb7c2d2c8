"""Issue 9 benchmark: a GLM-4-9B-shaped decoder (8 layers, bf16) as a 2-stage pipeline
(graphopt's stage plan run by torch.distributed.pipelining) against one GPU.

    torchrun --nproc-per-node 2 benchmarks/partition_bench.py --out $OUT      # 2 GPUs (NCCL)
    torchrun --nproc-per-node 2 benchmarks/partition_bench.py --tiny --out /tmp/pb   # CPU dry run (gloo)

Measures (rank 0 writes partition_bench.json + partition_bench.md to --out):
- one GPU (rank 0 alone, same global batch, plain eager): inference bs32 seq1024 and a training
  step bs8 seq1024 (forward + backward of next-token cross-entropy on the shifted logits, in fp32;
  no optimizer step);
- the 2-stage pipeline: inference with GPipe at 4, 8 and 16 micro-batches, training with GPipe
  and 1F1B at 4 and 8 micro-batches; throughput against one GPU;
- predicted vs measured per-stage forward time per micro-batch (each rank times its stage
  module alone on inputs of the micro-batch's shapes);
- correctness: the pipeline's logits vs the eager model's for the first micro-batch (relative RMSE);
- the memory-cap run: a cap of half the one-GPU predicted footprint (parameters + activations +
  outputs of the bs8 inference) per GPU; the plan must refuse one GPU and place the model across
  two; measured peak memory per GPU after the full model is freed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphopt.distributed as gd  # noqa: E402
from graphopt.pipeline import available as available_passes  # noqa: E402
from graphopt import partition  # noqa: E402
from graphopt.capture import capture  # noqa: E402
from graphopt.errors import BudgetError  # noqa: E402
from graphopt.examples import zoo  # noqa: E402


def log(rank, *a):
    print(f"[rank {rank} {time.strftime('%H:%M:%S')}]", *a, flush=True)


def build(cfg, device, dtype, seed=0):
    from transformers import Glm4ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # built on the GPU (fp32, as the zoo does), then converted
        model = Glm4ForCausalLM(cfg)
    return zoo.LogitsOnly(model.to(dtype)).eval()


def set_attention(model, impl):
    """SDPA for inference; eager attention for training, whose mask is a float tensor the
    pipeline can send with gradients (SDPA's is bool: graphopt refuses those cuts in training)."""
    model.m.config._attn_implementation = impl


def make_ids(cfg, batch, seq, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    hi = min(cfg.vocab_size, 151329)
    return torch.randint(3, hi, (batch, seq), generator=g).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup, reps, barrier=False):
    """Median seconds of fn() (with a barrier before each call for pipeline steps)."""
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(reps):
        if barrier:
            dist.barrier()
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def max_across(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device) -> float:
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else float("nan")


def check_outputs(pipe, model, ids, mb, device, world) -> dict:
    """The pipeline's logits against the eager model's, on the last rank, for the first micro-batch
    (bf16: relative RMSE, and whether every rank built the same weights)."""
    sums = [None] * world
    with torch.no_grad():
        dist.all_gather_object(sums, float(sum(p.double().sum() for p in model.parameters())))
        pipe.set_schedule("gpipe")
        out = pipe.step(ids if pipe.is_first else None)
        res = {"same_weights_on_every_rank": len(set(sums)) == 1}
        if pipe.is_last:
            ref = model(ids[:mb]).float()
            got = out[:mb].float()
            res.update(max_abs_err=float((got - ref).abs().max()),
                       relative_rmse=float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
                       finite=bool(torch.isfinite(got).all()))
            del ref, got
        del out
    box = [res]
    dist.broadcast_object_list(box, src=world - 1)
    box[0]["same_weights_on_every_rank"] = res["same_weights_on_every_rank"]
    return box[0]


def stage_inputs(pipe, ids_mb, device):
    """Inputs of this rank's stage at the micro-batch's shapes (random activations past rank 0)."""
    phs = [n for n in pipe.module.graph.nodes if n.op == "placeholder"]
    if pipe.is_first:
        return (ids_mb,)
    out = []
    for n in phs:
        v = n.meta["val"]
        if v.is_floating_point():
            out.append(torch.randn(tuple(v.shape), dtype=v.dtype, device=device))
        else:
            out.append(torch.zeros(tuple(v.shape), dtype=v.dtype, device=device))
    return tuple(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and batches (dry run)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--passes", choices=("fusion", "none"), default="fusion",
                    help="fusion (default): the stage graphs are the graph after graphopt's cleanup, fusion and "
                         "layout passes (training: those with autograd), and one GPU is also timed as "
                         "graphopt.optimize returns it; none: plain captured stage graphs")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no further pipeline configuration after this many seconds (recorded as skipped); "
                         "results are written after every configuration")
    args = ap.parse_args()

    rank, world, device = gd.init()

    if args.tiny:
        cfg = zoo.glm4_tiny_config()
        dtype = torch.bfloat16
        infer_bs, train_bs, seq = 16, 8, 32
        reps, warm = args.reps or 3, 1
        target = "cpu"
    else:
        cfg = zoo.glm4_9b_config(args.layers)
        dtype = torch.bfloat16
        infer_bs, train_bs, seq = 32, 8, 1024
        reps, warm = args.reps or 10, 2
        target = "h200"
    stage_passes = ()
    if args.passes == "fusion":
        from graphopt.pipeline import registry

        reg = registry()
        stage_passes = tuple(n for n in available_passes() if reg[n].family in ("cleanup", "fusion", "layout"))
    result = {"rank_count": world, "device": str(device), "stage_passes": list(stage_passes), "torch": torch.__version__, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "tiny": args.tiny,
              "model": f"GLM-4-9B-shaped, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, bf16 "
                       "(SDPA attention for inference, eager attention for training)",
              "loss": "next-token cross-entropy on the shifted logits, fp32 (forward + backward, no optimizer step)",
              "infer": {"batch": infer_bs, "seq": seq}, "train": {"batch": train_bs, "seq": seq}, "runs": []}
    import transformers

    result["transformers"] = transformers.__version__
    t0 = time.perf_counter()
    log(rank, f"building the model on {device}")
    model = build(cfg, device, dtype)
    nparams = sum(p.numel() for p in model.parameters())
    result["parameters"] = nparams
    result["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    log(rank, f"built {nparams / 1e9:.2f}B parameters in {time.perf_counter() - t0:.1f}s")
    ids_inf = make_ids(cfg, infer_bs, seq, device)
    ids_tr = make_ids(cfg, train_bs, seq, device, seed=2)

    # ---- one GPU: rank 0 alone, same global batch, plain eager
    if rank == 0:
        set_attention(model, "sdpa")
        with torch.no_grad():
            free(device)
            t = timed(lambda: model(ids_inf), device, warm, reps)
        result["single_infer_s"] = t
        result["single_infer_peak_bytes"] = peak(device)
        log(rank, f"one device inference bs{infer_bs}: {t * 1e3:.1f} ms")
        if stage_passes:
            import graphopt

            free(device)
            opt = graphopt.optimize(model, (ids_inf,), target=target, check_accuracy=False)
            with torch.no_grad():
                t = timed(lambda: opt(ids_inf), device, warm, reps)
            result["single_infer_graphopt_s"] = t
            log(rank, f"one device inference bs{infer_bs}, graphopt.optimize: {t * 1e3:.1f} ms")
            del opt
            free(device)
        model.train()
        set_attention(model, "eager")

        def train_step():
            zoo.next_token_loss(model(ids_tr), ids_tr).backward()
            for p in model.parameters():
                p.grad = None

        free(device)
        t = timed(train_step, device, warm, reps)
        model.eval()
        result["single_train_s"] = t
        result["single_train_peak_bytes"] = peak(device)
        log(rank, f"one device training step bs{train_bs}: {t * 1e3:.1f} ms")
    dist.barrier()

    # ---- the pipeline
    def run(pipe, schedule, ids, train):
        pipe.set_schedule(schedule)
        tgt = ids if train else None

        def step():
            pipe.step(ids if pipe.is_first else None, target=tgt if pipe.is_last else None)
            if train:
                for p in pipe.module.parameters():
                    p.grad = None

        free(device)
        t = max_across(timed(step, device, warm, reps, barrier=True))
        peaks = [None] * world
        dist.all_gather_object(peaks, peak(device))
        return t, peaks

    for train, bs, ids in ((False, infer_bs, ids_inf), (True, train_bs, ids_tr)):
        set_attention(model, "eager" if train else "sdpa")
        for mbs in ((4, 8) if train else (4, 8, 16)):
            if max_across(time.perf_counter() - t0) > args.budget_s:
                result.setdefault("skipped", []).append(f"{'training' if train else 'inference'} M={mbs}: over --budget-s")
                log(rank, f"skipping {'training' if train else 'inference'} M={mbs}: over --budget-s {args.budget_s:g}")
                continue
            log(rank, f"pipeline {'training' if train else 'inference'}: capturing at micro-batch {bs // mbs}")
            t1 = time.perf_counter()
            pipe = gd.Pipeline(model, ids, microbatches=mbs, schedule="gpipe", loss_fn=zoo.next_token_loss if train else None,
                               example_target=ids if train else None, target=target, passes=stage_passes)
            build_s = time.perf_counter() - t1
            plan = pipe.plan
            # predicted vs measured: this rank's stage forward per micro-batch, alone
            measured_stage = None
            if not train:
                x = stage_inputs(pipe, ids[: bs // mbs], device)
                with torch.no_grad():
                    measured_stage = timed(lambda: pipe.module(*x), device, warm, reps)
                del x
            stage_times = [None] * world
            dist.all_gather_object(stage_times, measured_stage)
            if not train and "correctness" not in result:
                result["correctness"] = check_outputs(pipe, model, ids, bs // mbs, device, world)
                log(rank, f"pipeline vs eager on the last rank: {result['correctness']}")
            for schedule in (("gpipe", "1f1b") if train else ("gpipe",)):
                t, peaks = run(pipe, schedule, ids, train)
                single = result.get("single_train_s" if train else "single_infer_s")
                opt1 = None if train else result.get("single_infer_graphopt_s")
                row = {"mode": "training" if train else "inference", "schedule": schedule, "microbatches": mbs,
                       "speedup_vs_one_gpu_graphopt": (opt1 / t) if opt1 else None,
                       "batch": bs, "step_s": t, "speedup_vs_one_gpu": (single / t) if single else None,
                       "peak_bytes_per_rank": peaks, "build_s": build_s,
                       "predicted_bubble": plan.bubble_fraction,
                       "predicted_step_s": plan.predicted_step_s,
                       "stages": [{"device": s.device, "nodes": len(s.nodes), "parameter_bytes": s.param_bytes,
                                   "predicted_compute_ms": s.compute_s * 1e3, "predicted_ms": s.time_s * 1e3,
                                   "predicted_memory_bytes": s.memory_bytes,
                                   "measured_forward_ms": None if stage_times[s.index] is None else stage_times[s.index] * 1e3,
                                   "error_pct": None if stage_times[s.index] is None else
                                   (s.compute_s / stage_times[s.index] - 1) * 100}
                                  for s in plan.stages],
                       "boundary_bytes": [b["bytes"] for b in plan.boundaries]}
                result["runs"].append(row)
                log(rank, f"  {row['mode']} {schedule} M={mbs}: {t * 1e3:.1f} ms "
                          f"({row['speedup_vs_one_gpu'] or float('nan'):.2f}x one GPU)")
            del pipe
            free(device)
            save(result, args.out, rank)

    set_attention(model, "sdpa")
    # ---- the memory cap: half of the one-GPU predicted footprint of bs8 inference
    log(rank, "memory-cap run")
    ids_cap = ids_inf[:train_bs]
    gm = capture(model, (ids_cap,))
    one = partition.resolve_devices([str(device) if device.type == "cuda" else "cpu"], target=target)
    foot = partition.plan_stages(gm, one).stages[0].memory_bytes
    del gm
    cap = foot / 2
    capres = {"batch": train_bs, "one_device_predicted_bytes": foot, "cap_bytes": cap}
    mbs = 8
    try:  # the same micro-batching on one device under the cap: must not fit
        gm = capture(model, (ids_cap[: train_bs // mbs],))
        partition.plan_stages(gm, partition.resolve_devices([one[0].name], target=target, memory_cap=cap),
                              microbatches=mbs)
        capres["one_device_refused"] = False
    except BudgetError as e:
        capres["one_device_refused"] = True
        capres["one_device_error"] = str(e)
    finally:
        gm = None
    # half is the cap; the last stage must also hold the merged logits (bs8 x 1024 x 151552
    # bf16 = 2.5 GB) beside the LM head, so half may not be enough: find the smallest cap per GPU
    # at which two GPUs hold the model (bisection over the plan), and run there if half is refused
    two = [f"cuda:{r}" for r in range(world)] if device.type == "cuda" else ["cpu"] * world
    gm = capture(model, (ids_cap[: train_bs // mbs],))

    def fits(c):
        try:
            partition.plan_stages(gm, partition.resolve_devices(two, target=target, memory_cap=c), microbatches=mbs)
            return True
        except BudgetError:
            return False

    lo, hi = cap, foot
    if not fits(cap):
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        capres["half_refused"] = True
        capres["smallest_two_gpu_cap_bytes"] = hi
        capres["smallest_cap_fraction"] = hi / foot
        log(rank, f"  half ({cap / 1e9:.2f} GB) cannot hold it on two GPUs; the smallest cap that can is "
                  f"{hi / 1e9:.2f} GB ({hi / foot:.0%} of one GPU's)")
        cap = hi
        capres["cap_bytes"] = cap
    gm = None
    try:
        pipe = gd.Pipeline(model, ids_cap, microbatches=mbs, schedule="gpipe", target=target, memory_cap=cap)
        del model
        model = None
        free(device)
        t, peaks = run(pipe, "gpipe", ids_cap, False)
        capres.update(ran=True, microbatches=mbs, step_s=t, peak_bytes_per_rank=peaks,
                      predicted_memory_bytes=[s.memory_bytes for s in pipe.plan.stages],
                      parameter_bytes=[s.param_bytes for s in pipe.plan.stages],
                      within_cap=all(p <= cap for p in peaks) if device.type == "cuda" else None)
        log(rank, f"  cap {cap / 1e9:.2f} GB: ran, peaks {[round(p / 1e9, 2) for p in peaks]} GB")
    except BudgetError as e:
        capres.update(ran=False, error=str(e))
        log(rank, f"  cap {cap / 1e9:.2f} GB: {e}")
    result["memory_cap"] = capres
    result["total_s"] = time.perf_counter() - t0
    save(result, args.out, rank)
    if rank == 0:
        print(markdown(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def save(result, out, rank) -> None:
    """Rank 0 writes the JSON and Markdown (after every configuration, so a cut-short run keeps
    what it measured)."""
    if rank != 0:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "partition_bench.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "partition_bench.md").write_text(markdown(result))


def markdown(r) -> str:
    gb = lambda b: "—" if b is None or b != b else f"{b / 1e9:.2f}"  # noqa: E731
    ms = lambda s: "—" if s is None else f"{s * 1e3:.1f}"  # noqa: E731
    lines = [f"# Partition benchmark ({r['date']})", "",
             f"{r['model']}; {r['parameters'] / 1e9:.2f}B parameters ({gb(r['parameter_bytes'])} GB); "
             f"{r['rank_count']} × {r['gpu']}; torch {r['torch']}, transformers {r['transformers']}, Python {r['python']}.",
             f"Inference bs{r['infer']['batch']} seq{r['infer']['seq']}; training step bs{r['train']['batch']} "
             f"seq{r['train']['seq']}: {r['loss']}.", "",
             f"Stage graphs: {'after ' + ', '.join(r['stage_passes']) if r.get('stage_passes') else 'as captured (no passes)'} "
             "(training graphs skip the inference-only passes).", "",
             f"One GPU (eager): inference {ms(r.get('single_infer_s'))} ms (peak {gb(r.get('single_infer_peak_bytes'))} GB"
             + (f"; graphopt.optimize {ms(r.get('single_infer_graphopt_s'))} ms" if r.get('single_infer_graphopt_s') else "")
             + "), "
             f"training step {ms(r.get('single_train_s'))} ms (peak {gb(r.get('single_train_peak_bytes'))} GB).", "",
             "| mode | schedule | micro-batches | step ms | × one GPU eager | × one GPU graphopt | predicted step ms | bubble | peak GB per GPU |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for x in r["runs"]:
        sp = "—" if x["speedup_vs_one_gpu"] is None else f"{x['speedup_vs_one_gpu']:.2f}"
        sg = "—" if x.get("speedup_vs_one_gpu_graphopt") is None else f"{x['speedup_vs_one_gpu_graphopt']:.2f}"
        lines.append(f"| {x['mode']} | {x['schedule']} | {x['microbatches']} | {ms(x['step_s'])} | {sp} | {sg} | "
                     f"{ms(x['predicted_step_s'])} | {x['predicted_bubble']:.0%} | "
                     f"{', '.join(gb(p) for p in x['peak_bytes_per_rank'])} |")
    lines += ["", "Per stage, inference (forward per micro-batch, each stage alone on its GPU):", "",
              "| micro-batches | stage | device | nodes | params GB | predicted ms | measured ms | error |",
              "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for x in r["runs"]:
        if x["mode"] != "inference":
            continue
        for i, s in enumerate(x["stages"]):
            meas = "—" if s["measured_forward_ms"] is None else f"{s['measured_forward_ms']:.2f}"
            err = "—" if s["error_pct"] is None else f"{s['error_pct']:+.0f}%"
            lines.append(f"| {x['microbatches']} | {i} | {s['device']} | {s['nodes']} | {gb(s['parameter_bytes'])} | "
                         f"{s['predicted_compute_ms']:.2f} | {meas} | {err} |")
    if r.get("correctness"):
        c0 = r["correctness"]
        lines += ["", f"Correctness (inference, first micro-batch, pipeline vs eager on the last GPU): relative RMSE "
                      f"{c0.get('relative_rmse', float('nan')):.2e}, max |err| {c0.get('max_abs_err', float('nan')):.3g}, "
                      f"finite {c0.get('finite')}, same weights on every rank {c0.get('same_weights_on_every_rank')}."]
    for sk in r.get("skipped", []):
        lines.append(f"skipped: {sk}")
    c = r.get("memory_cap", {})
    why = (f"half of the one-GPU predicted {gb(c.get('one_device_predicted_bytes'))} GB for bs{c.get('batch')} "
           "inference" if not c.get("half_refused") else
           f"half of the one-GPU predicted {gb(c.get('one_device_predicted_bytes'))} GB for bs{c.get('batch')} "
           f"inference cannot hold it on two GPUs (the last one also holds the merged logits); this is the "
           f"smallest cap that can, {c.get('smallest_cap_fraction', 0):.0%} of one GPU's")
    lines += ["", f"Memory cap: {gb(c.get('cap_bytes'))} GB per GPU ({why}); one GPU refused: "
                  f"{c.get('one_device_refused')}; across two: "
                  + (f"ran, {ms(c.get('step_s'))} ms, measured peak per GPU "
                     f"{', '.join(gb(p) for p in c.get('peak_bytes_per_rank', []))} GB, predicted "
                     f"{', '.join(gb(p) for p in c.get('predicted_memory_bytes', []))} GB, within cap: {c.get('within_cap')}"
                     if c.get("ran") else f"refused: {c.get('error')}"),
              "", f"total {r.get('total_s', 0):.0f} s"]
    if not c:
        lines[-3] = "Memory cap: not run yet (partial results)"
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

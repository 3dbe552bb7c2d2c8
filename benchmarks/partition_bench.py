"""Issue 9 benchmark: a GLM-4-9B-shaped decoder (8 layers, bf16) as a 2-stage pipeline
(graphopt's stage plan run by torch.distributed.pipelining) against one GPU.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 benchmarks/partition_bench.py --out $OUT           # 2 GPUs (NCCL)
    torchrun --nproc-per-node 2 benchmarks/partition_bench.py --tiny --out /tmp/pb     # CPU dry run (gloo)

The model is built once per rank and reused by every configuration. Measures (rank 0 writes
partition_bench.json + partition_bench.md to --out after every configuration; a configuration
that fails is recorded with its error and the others still run):
- one GPU (rank 0 alone, same global batch): inference bs32 seq1024 and a training step bs8
  seq1024 (forward + backward of next-token cross-entropy on the shifted logits, in fp32; no
  optimizer step), each plain eager and as graphopt.optimize returns it;
- the 2-stage pipeline: inference with GPipe at 8 micro-batches; training with 1F1B at 4
  micro-batches and interleaved 1F1B (two non-adjacent stages per GPU) at 4 and 8; throughput
  against one GPU, predicted against measured step;
- predicted vs measured per-stage times: inference (forward per micro-batch) and training
  (forward + backward per micro-batch, gradients accumulated over the step's M micro-batches and
  scaled once, as in the pipeline; the last stage with the loss), each stage alone on its GPU;
- correctness: the pipeline's logits vs the eager model's for the first micro-batch;
- the memory-cap runs (bs8 inference, 8 micro-batches): (a) the smallest cap per GPU at which
  two GPUs hold the model (bisection over the plan), (b) half the model's parameter bytes +
  the largest per-GPU working set of that plan (activations, pipeline buffers, the merged
  logits, the runtime workspace), (c) half of one GPU's predicted footprint with the outputs
  copied to the host per micro-batch (``Pipeline(outputs_to_host=True)``); and a bs8 training
  step (1F1B, 4 micro-batches) capped at half of what one GPU's training step measured at its
  peak; for each: one GPU refused, measured peak per GPU against the predicted and the cap
  ("within cap" is measured peak <= cap on every GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphopt.runtime.distributed as gd  # noqa: E402
from graphopt import partition  # noqa: E402
from graphopt.capture import capture  # noqa: E402
from graphopt.errors import BudgetError  # noqa: E402
from graphopt.examples import zoo  # noqa: E402
from graphopt.pipeline import available as available_passes  # noqa: E402


def log(rank, *a, all_ranks=False):
    """Progress on rank 0 (every rank for failures)."""
    if rank == 0 or all_ranks:
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


def gather(x) -> list:
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, x)
    return box


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device) -> float:
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else float("nan")


def check_outputs(pipe, model, ids, mb, world) -> dict:
    """The pipeline's logits against the eager model's, on the last rank, for the first micro-batch
    (bf16: relative RMSE, and whether every rank built the same weights)."""
    with torch.no_grad():
        sums = gather(float(sum(p.double().sum() for p in model.parameters())))
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


def stage_inputs(module, first, ids_mb, device, grad=False):
    """Inputs of one stage module at the micro-batch's shapes (random activations past stage 0;
    requiring gradients when ``grad``, as the pipeline's received activations do in training)."""
    if first:
        return (ids_mb,)
    out = []
    for n in (n for n in module.graph.nodes if n.op == "placeholder"):
        v = n.meta["val"]
        if v.is_floating_point():
            out.append(torch.randn(tuple(v.shape), dtype=v.dtype, device=device).requires_grad_(grad))
        else:
            out.append(torch.zeros(tuple(v.shape), dtype=v.dtype, device=device))
    return tuple(out)


def stage_forward_s(pipe, ids_mb, device, warm, reps) -> dict:
    """{stage index: seconds} of this rank's stages' forward per micro-batch, each alone."""
    res = {}
    for k, mod in zip(pipe.stage_indices, pipe.modules):
        x = stage_inputs(mod, k == 0, ids_mb, device)
        with torch.no_grad():
            res[k] = timed(lambda: mod(*x), device, warm, reps)
        x = None
    return res


def stage_train_s(pipe, ids_mb, device, warm, reps) -> dict:
    """{stage index: seconds} of this rank's stages' forward + backward per micro-batch, each alone:
    one pipeline step's worth (M micro-batches, gradients accumulated, then scaled once), / M.
    The last stage computes the loss on the micro-batch's ids; the others get random output
    gradients."""
    M, K = pipe.microbatches, pipe.plan.num_stages
    res = {}
    for k, mod in zip(pipe.stage_indices, pipe.modules):
        x = stage_inputs(mod, k == 0, ids_mb, device, grad=True)
        params = [p for p in mod.parameters() if p.requires_grad]
        with torch.no_grad():
            probe = mod(*x)
        outs = probe if isinstance(probe, tuple) else (probe,)
        grads = [torch.randn_like(o) if o.is_floating_point() else None for o in outs]
        del probe, outs

        def one():
            out = mod(*x)
            if k == K - 1:
                zoo.next_token_loss(out, ids_mb).backward()
            else:
                outs = out if isinstance(out, tuple) else (out,)
                pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

        def step():
            for _ in range(M):
                one()
            for p in params:
                if p.grad is not None:
                    p.grad.div_(M)
            for p in params:
                p.grad = None
            for t in x:
                t.grad = None

        res[k] = timed(step, device, warm, reps) / M
        x = grads = None
    return res


def runtime_workspace(device) -> dict:
    """What the runtime keeps allocated after one GEMM (forward thread) and after one backward
    (autograd's thread), measured before anything else runs: the plan's per-device reserve
    (the profile's runtime_workspace_bytes, once for inference, twice for training)."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    torch.cuda.synchronize(device)
    fwd = torch.cuda.memory_allocated(device) - base
    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize(device)
    return {"after_forward_gemm_bytes": fwd, "after_backward_bytes": torch.cuda.memory_allocated(device) - base}


def guarded(result, key, rank, out, fn):
    """Run one configuration; on an error record it (and go on to the next)."""
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a benchmark keeps the other configurations
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        result.setdefault("errors", {})[key] = msg
        log(rank, f"{key} FAILED: {msg}", all_ranks=True)
        traceback.print_exc()
    result.setdefault("config_s", {})[key] = time.perf_counter() - t
    save(result, out, rank)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and batches (dry run)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--passes", choices=("fusion", "none"), default="fusion",
                    help="fusion (default): the stage graphs are the graph after graphopt's cleanup, fusion and "
                         "layout passes (training: those with autograd); none: plain captured stage graphs")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no further configuration after this many seconds (recorded as skipped); "
                         "results are written after every configuration")
    ap.add_argument("--pipelines", default="infer:gpipe:8,train:1f1b:4,train:interleaved1f1b:4,train:interleaved1f1b:8",
                    help="pipeline configurations to run, comma-separated mode:schedule:micro-batches")
    ap.add_argument("--no-single", action="store_true", help="skip the one-GPU baselines")
    ap.add_argument("--no-cap", action="store_true", help="skip the memory-cap runs")
    ap.add_argument("--pg-timeout-s", type=float, default=420.0,
                    help="collective timeout: a rank stuck waiting for one whose configuration failed gives up after "
                         "this long (the results written so far stay)")
    args = ap.parse_args()

    if not dist.is_initialized():
        import datetime

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank, world, device = gd.init()
    if args.tiny:
        cfg = zoo.glm4_tiny_config()
        infer_bs, train_bs, seq = 16, 8, 32
        reps, warm = args.reps or 3, 1
        target = "cpu"
    else:
        cfg = zoo.glm4_9b_config(args.layers)
        infer_bs, train_bs, seq = 32, 8, 1024
        reps, warm = args.reps or 10, 2
        target = "h200"
    dtype = torch.bfloat16
    stage_passes = ()
    if args.passes == "fusion":
        from graphopt.pipeline import registry

        reg = registry()
        stage_passes = tuple(n for n in available_passes() if reg[n].family in ("cleanup", "fusion", "layout"))
    import transformers

    result = {"rank_count": world, "device": str(device), "stage_passes": list(stage_passes), "torch": torch.__version__,
              "python": platform.python_version(), "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "tiny": args.tiny,
              "model": f"GLM-4-9B-shaped, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, bf16 "
                       "(SDPA attention for inference, eager attention for training)",
              "loss": "next-token cross-entropy on the shifted logits, fp32 (forward + backward, no optimizer step)",
              "infer": {"batch": infer_bs, "seq": seq}, "train": {"batch": train_bs, "seq": seq}, "runs": []}
    t0 = time.perf_counter()
    result["runtime_workspace_measured"] = gather(runtime_workspace(device))
    prof_ws = partition.resolve_devices([str(device) if device.type == "cuda" else "cpu"], target=target)[0]
    result["runtime_workspace_profile_bytes"] = prof_ws.profile.runtime_workspace_bytes
    log(rank, f"runtime workspace measured per rank {result['runtime_workspace_measured']} "
              f"(profile: {prof_ws.profile.runtime_workspace_bytes / 2**20:.0f} MiB per thread)")
    log(rank, f"building the model on {device}")
    model = build(cfg, device, dtype)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    log(rank, f"built {result['parameters'] / 1e9:.2f}B parameters in {time.perf_counter() - t0:.1f}s")
    ids_inf = make_ids(cfg, infer_bs, seq, device)
    ids_tr = make_ids(cfg, train_bs, seq, device, seed=2)
    out = args.out

    def over_budget(what) -> bool:
        if max_across(time.perf_counter() - t0) > args.budget_s:
            result.setdefault("skipped", []).append(f"{what}: over --budget-s {args.budget_s:g}")
            log(rank, f"skipping {what}: over --budget-s {args.budget_s:g}")
            save(result, out, rank)
            return True
        return False

    # ---- one GPU: rank 0 alone, same global batch, eager and graphopt.optimize
    def one_gpu():
        import graphopt

        set_attention(model, "sdpa")
        model.eval()
        with torch.no_grad():
            free(device)
            result["single_infer_s"] = timed(lambda: model(ids_inf), device, warm, reps)
        result["single_infer_peak_bytes"] = peak(device)
        log(rank, f"one device inference bs{infer_bs}: {result['single_infer_s'] * 1e3:.1f} ms")
        save(result, out, rank)
        free(device)
        opt = graphopt.optimize(model, (ids_inf,), target=target, check_accuracy=False)
        with torch.no_grad():
            result["single_infer_graphopt_s"] = timed(lambda: opt(ids_inf), device, warm, reps)
        log(rank, f"one device inference bs{infer_bs}, graphopt.optimize: {result['single_infer_graphopt_s'] * 1e3:.1f} ms")
        opt = None
        save(result, out, rank)
        model.train()
        set_attention(model, "eager")
        params = list(model.parameters())

        def steps(fwd):
            def step():
                zoo.next_token_loss(fwd(ids_tr), ids_tr).backward()
                for p in params:
                    p.grad = None
            return step

        try:
            free(device)
            result["single_train_s"] = timed(steps(model), device, warm, reps)
            result["single_train_peak_bytes"] = peak(device)
            log(rank, f"one device training step bs{train_bs}: {result['single_train_s'] * 1e3:.1f} ms")
            save(result, out, rank)
            free(device)
            opt = graphopt.optimize(model, (ids_tr,), target=target, training=True, check_accuracy=False)
            result["single_train_graphopt_s"] = timed(steps(opt), device, warm, reps)
            log(rank, f"one device training step bs{train_bs}, graphopt.optimize: "
                      f"{result['single_train_graphopt_s'] * 1e3:.1f} ms")
            opt = None
        finally:
            model.eval()
            set_attention(model, "sdpa")
            free(device)

    if rank == 0 and not args.no_single:
        guarded(result, "one GPU", rank, out, one_gpu)
    dist.barrier()

    # ---- the pipeline
    def pipeline(train, schedule, mbs):
        bs, ids = (train_bs, ids_tr) if train else (infer_bs, ids_inf)
        set_attention(model, "eager" if train else "sdpa")
        log(rank, f"pipeline {'training' if train else 'inference'} {schedule} M={mbs}: capturing at micro-batch {bs // mbs}")
        t1 = time.perf_counter()
        pipe = gd.Pipeline(model, ids, microbatches=mbs, schedule=schedule,
                           loss_fn=zoo.next_token_loss if train else None, example_target=ids if train else None,
                           target=target, passes=stage_passes)
        build_s = max_across(time.perf_counter() - t1)
        plan = pipe.plan
        ids_mb = ids[: bs // mbs]
        try:
            if train:
                model.train()
                measured = stage_train_s(pipe, ids_mb, device, warm, reps)
            else:
                measured = stage_forward_s(pipe, ids_mb, device, warm, reps)
        finally:
            model.eval()
        stage_s = {}
        for d in gather(measured):
            stage_s.update(d)
        if not train and "correctness" not in result:
            result["correctness"] = check_outputs(pipe, model, ids, bs // mbs, world)
            log(rank, f"pipeline vs eager on the last rank: {result['correctness']}")
        tgt = ids if train else None
        params = list(pipe.parameters())

        def step():
            pipe.step(ids if pipe.is_first else None, target=tgt if pipe.is_last else None)
            if train:
                for p in params:
                    p.grad = None

        free(device)
        t = max_across(timed(step, device, warm, reps, barrier=True))
        peaks = gather(peak(device))
        single = result.get("single_train_s" if train else "single_infer_s")
        single_g = result.get("single_train_graphopt_s" if train else "single_infer_graphopt_s")
        row = {"mode": "training" if train else "inference", "schedule": schedule, "microbatches": mbs,
               "virtual_stages": plan.virtual_stages, "batch": bs, "step_s": t,
               "speedup_vs_one_gpu": (single / t) if single else None,
               "speedup_vs_one_gpu_graphopt": (single_g / t) if single_g else None,
               "peak_bytes_per_rank": peaks, "build_s": build_s,
               "predicted_bubble": plan.bubble_fraction, "predicted_step_s": plan.predicted_step_s,
               "predicted_device_ms": [d["predicted_ms"] for d in plan.device_summary],
               "predicted_memory_bytes_per_rank": [d["predicted_memory_bytes"] for d in plan.device_summary],
               "stages": [{"stage": s.index, "device": s.device, "nodes": len(s.nodes), "parameter_bytes": s.param_bytes,
                           "predicted_compute_ms": s.compute_s * 1e3, "predicted_transfer_ms": s.transfer_s * 1e3,
                           "predicted_ms": s.time_s * 1e3, "predicted_memory_bytes": s.memory_bytes,
                           "measured_ms": None if stage_s.get(s.index) is None else stage_s[s.index] * 1e3,
                           "error_pct": None if stage_s.get(s.index) is None else
                           (s.compute_s / stage_s[s.index] - 1) * 100}
                          for s in plan.stages],
               "boundary_bytes": [b["bytes"] for b in plan.boundaries]}
        result["runs"].append(row)
        log(rank, f"  {row['mode']} {schedule} M={mbs}: {t * 1e3:.1f} ms ({row['speedup_vs_one_gpu'] or float('nan'):.2f}x "
                  f"one GPU eager), predicted {plan.predicted_step_s * 1e3:.1f} ms; stages measured "
                  f"{[round(stage_s[k] * 1e3, 2) for k in sorted(stage_s)]} ms, predicted "
                  f"{[round(s.compute_s * 1e3, 2) for s in plan.stages]} ms")
        pipe = params = None

    configs = []
    for item in filter(None, (x.strip() for x in args.pipelines.split(","))):
        mode, schedule, mbs = item.split(":")
        if mode not in ("infer", "train"):
            raise SystemExit(f"--pipelines: mode must be infer or train, got {mode!r}")
        configs.append((mode == "train", schedule, int(mbs)))
    for train, schedule, mbs in configs:
        key = f"{'training' if train else 'inference'} {schedule} M={mbs}"
        if over_budget(key):
            continue
        guarded(result, key, rank, out, lambda: pipeline(train, schedule, mbs))
        free(device)
        dist.barrier()

    if args.no_cap:
        finish(result, out, rank, t0)
        return
    # ---- the memory cap (bs8 inference, 8 micro-batches; a bs8 training step, 1F1B at 4); the model is
    # freed before each run
    set_attention(model, "sdpa")
    capres = result["memory_cap"] = {"batch": train_bs, "microbatches": 8, "runs": []}
    mbs = 8
    ids_cap = ids_inf[:train_bs]
    gm_full = capture(model, (ids_cap,))
    one = partition.resolve_devices([str(device) if device.type == "cuda" else "cpu"], target=target)
    foot = partition.plan_stages(gm_full, one).stages[0].memory_bytes
    del gm_full
    capres["one_device_predicted_bytes"] = foot
    gm = capture(model, (ids_cap[: train_bs // mbs],))
    two = [f"cuda:{r}" for r in range(world)] if device.type == "cuda" else ["cpu"] * world

    def plan_at(c, devs=two, host=False):
        try:
            return partition.plan_stages(gm, partition.resolve_devices(devs, target=target, memory_cap=c),
                                         microbatches=mbs, outputs_on_host=host)
        except BudgetError:
            return None

    lo, hi = foot / 2, foot
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if plan_at(mid) else (mid, hi)
    smallest = plan_at(hi)
    work = max(d["predicted_memory_bytes"] - sum(smallest.stages[k].param_bytes for k in d["stages"])
               for d in smallest.device_summary)
    half_params = result["parameter_bytes"] / 2 + work
    capres.update(half_of_footprint_bytes=foot / 2, half_of_footprint_fits=plan_at(foot / 2) is not None,
                  half_of_footprint_fits_outputs_on_host=plan_at(foot / 2, host=True) is not None,
                  working_set_bytes=work)
    # (what, cap, outputs to host, of what footprint)
    caps = [("smallest cap two GPUs hold the model at (bisection over the plan)", hi, False),
            ("half the parameters + the largest per-GPU working set", half_params, False),
            ("half of one GPU's footprint, outputs copied to the host per micro-batch", foot / 2, True)]
    refused = {(cap, host): plan_at(cap, [one[0].name], host) is None for _, cap, host in caps}
    # training: half of what one GPU's training step measured at its peak (rank 0's one-GPU run; the
    # planner's one-device prediction where that did not run), and the planner's verdict on one GPU at that cap
    measured_t = gather(result.get("single_train_peak_bytes"))[0]
    measured_t = measured_t if measured_t and measured_t == measured_t else None  # NaN on a CPU
    tr = capres["training"] = {"batch": train_bs, "schedule": "1f1b", "microbatches": 4,
                               "one_device_measured_peak_bytes": measured_t}
    model.train()
    set_attention(model, "eager")
    try:
        gm_t = capture(model, (ids_tr,))
        tr["one_device_predicted_bytes"] = foot_t = partition.plan_stages(gm_t, one, training=True).stages[0].memory_bytes
        train_cap = (measured_t or foot_t) / 2
        try:
            partition.plan_stages(gm_t, partition.resolve_devices([one[0].name], target=target, memory_cap=train_cap),
                                  training=True)
            tr["one_device_refused"] = False
        except BudgetError as e:
            tr["one_device_refused"], tr["one_device_refusal"] = True, str(e)
    finally:
        model.eval()
        set_attention(model, "sdpa")
    gm_t = None
    smallest = gm = None  # the captured graph holds the model's parameters
    model_alive = [model]
    model = None

    def cap_run(what, cap, host):
        m = model_alive[0] if model_alive else build(cfg, device, dtype)
        model_alive.clear()
        set_attention(m, "sdpa")
        row = {"what": what, "mode": "inference", "cap_bytes": cap, "cap_fraction_of_one_gpu": cap / foot,
               "one_device_refused": refused[(cap, host)], "outputs_to_host": host}
        capres["runs"].append(row)
        pipe = gd.Pipeline(m, ids_cap, microbatches=mbs, schedule="gpipe", target=target, memory_cap=cap,
                           outputs_to_host=host)
        del m
        free(device)
        params = list(pipe.parameters())
        row["parameter_bytes_per_rank"] = gather(float(sum(p.numel() * p.element_size() for p in params)))
        del params

        def step():
            pipe.step(ids_cap if pipe.is_first else None)

        with torch.no_grad():
            t = max_across(timed(step, device, warm, reps, barrier=True))
        peaks = gather(peak(device))
        pred = [d["predicted_memory_bytes"] for d in pipe.plan.device_summary]
        row.update(ran=True, step_s=t, peak_bytes_per_rank=peaks, predicted_memory_bytes=pred,
                   predicted_step_s=pipe.plan.predicted_step_s,
                   half_of_model_parameter_bytes=result["parameter_bytes"] / 2,
                   within_cap=all(p <= cap for p in peaks) if device.type == "cuda" else None,
                   measured_minus_predicted_bytes=[p - q for p, q in zip(peaks, pred)])
        log(rank, f"  cap {cap / 1e9:.2f} GB ({what}): peaks {[round(p / 1e9, 3) for p in peaks]} GB, predicted "
                  f"{[round(p / 1e9, 3) for p in pred]} GB, within cap {row['within_cap']}, step {t * 1e3:.1f} ms")
        pipe = None

    def train_cap_run(cap):
        m = build(cfg, device, dtype)
        m.train()
        set_attention(m, "eager")
        row = {"what": "half of one GPU's measured training-step peak" if measured_t else
               "half of one GPU's predicted training footprint", "mode": "training", "cap_bytes": cap,
               "cap_fraction_of_one_gpu": cap / (measured_t or foot_t), "outputs_to_host": False,
               "one_device_refused": tr["one_device_refused"]}
        capres["runs"].append(row)
        pipe = gd.Pipeline(m, ids_tr, microbatches=tr["microbatches"], schedule=tr["schedule"],
                           loss_fn=zoo.next_token_loss, example_target=ids_tr, target=target, memory_cap=cap,
                           passes=stage_passes)
        del m
        free(device)
        params = list(pipe.parameters())
        row["parameter_bytes_per_rank"] = gather(float(sum(p.numel() * p.element_size() for p in params)))

        def step():
            pipe.step(ids_tr if pipe.is_first else None, target=ids_tr if pipe.is_last else None)
            for p in params:
                p.grad = None

        t = max_across(timed(step, device, warm, reps, barrier=True))
        peaks = gather(peak(device))
        pred = [d["predicted_memory_bytes"] for d in pipe.plan.device_summary]
        single = result.get("single_train_s")
        row.update(ran=True, step_s=t, peak_bytes_per_rank=peaks, predicted_memory_bytes=pred,
                   predicted_step_s=pipe.plan.predicted_step_s, speedup_vs_one_gpu=(single / t) if single else None,
                   within_cap=all(p <= cap for p in peaks) if device.type == "cuda" else None,
                   measured_minus_predicted_bytes=[p - q for p, q in zip(peaks, pred)])
        log(rank, f"  training cap {cap / 1e9:.2f} GB: peaks {[round(p / 1e9, 3) for p in peaks]} GB, predicted "
                  f"{[round(p / 1e9, 3) for p in pred]} GB, within cap {row['within_cap']}, step {t * 1e3:.1f} ms")
        params = pipe = None

    for what, cap, host in caps:
        if over_budget(f"memory cap {what}"):
            continue
        log(rank, f"memory-cap run: {what}, {cap / 1e9:.2f} GB per GPU")
        guarded(result, f"memory cap: {what}", rank, out, lambda: cap_run(what, cap, host))
        free(device)
        dist.barrier()
    model_alive.clear()
    free(device)
    if not over_budget("memory cap: training"):
        log(rank, f"memory-cap run: training, {train_cap / 1e9:.2f} GB per GPU")
        guarded(result, "memory cap: training", rank, out, lambda: train_cap_run(train_cap))
        free(device)
        dist.barrier()
    finish(result, out, rank, t0)


def finish(result, out, rank, t0) -> None:
    """The total time, the results written and printed (rank 0), the process group closed."""
    result["total_s"] = time.perf_counter() - t0
    save(result, out, rank)
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
    x_ = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"# Partition benchmark ({r['date']})", "",
             f"{r['model']}; {r.get('parameters', 0) / 1e9:.2f}B parameters ({gb(r.get('parameter_bytes'))} GB); "
             f"{r['rank_count']} × {r['gpu']}; torch {r['torch']}, transformers {r['transformers']}, Python {r['python']}.",
             f"Inference bs{r['infer']['batch']} seq{r['infer']['seq']}; training step bs{r['train']['batch']} "
             f"seq{r['train']['seq']}: {r['loss']}.", "",
             f"Stage graphs: {'after ' + ', '.join(r['stage_passes']) if r.get('stage_passes') else 'as captured (no passes)'} "
             "(training graphs skip the inference-only passes).", "",
             f"One GPU: inference {ms(r.get('single_infer_s'))} ms eager, {ms(r.get('single_infer_graphopt_s'))} ms "
             f"graphopt.optimize (eager peak {gb(r.get('single_infer_peak_bytes'))} GB); training step "
             f"{ms(r.get('single_train_s'))} ms eager, {ms(r.get('single_train_graphopt_s'))} ms graphopt.optimize "
             f"(eager peak {gb(r.get('single_train_peak_bytes'))} GB).", "",
             "| mode | schedule | stages per GPU | micro-batches | step ms | × one GPU eager | × one GPU graphopt | "
             "predicted step ms | bubble | peak GB per GPU | predicted GB per GPU |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for x in r["runs"]:
        lines.append(f"| {x['mode']} | {x['schedule']} | {x['virtual_stages']} | {x['microbatches']} | {ms(x['step_s'])} | "
                     f"{x_(x['speedup_vs_one_gpu'])} | {x_(x.get('speedup_vs_one_gpu_graphopt'))} | "
                     f"{ms(x['predicted_step_s'])} | {x['predicted_bubble']:.0%} | "
                     f"{', '.join(gb(p) for p in x['peak_bytes_per_rank'])} | "
                     f"{', '.join(gb(p) for p in x['predicted_memory_bytes_per_rank'])} |")
    lines += ["", "Per stage, predicted compute vs measured (each stage alone on its GPU; inference: forward per "
                  "micro-batch; training: forward + backward per micro-batch over a step's M micro-batches, gradients "
                  "accumulated and scaled, the loss on the last stage; transfers not included):", "",
              "| mode | schedule | micro-batches | stage | device | nodes | params GB | predicted ms | measured ms | error |",
              "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for x in r["runs"]:
        for s in x["stages"]:
            meas = "—" if s["measured_ms"] is None else f"{s['measured_ms']:.2f}"
            err = "—" if s["error_pct"] is None else f"{s['error_pct']:+.0f}%"
            lines.append(f"| {x['mode']} | {x['schedule']} | {x['microbatches']} | {s['stage']} | {s['device']} | "
                         f"{s['nodes']} | {gb(s['parameter_bytes'])} | {s['predicted_compute_ms']:.2f} | {meas} | {err} |")
    if r.get("correctness"):
        c0 = r["correctness"]
        lines += ["", f"Correctness (inference, first micro-batch, pipeline vs eager on the last GPU): relative RMSE "
                      f"{c0.get('relative_rmse', float('nan')):.2e}, max |err| {c0.get('max_abs_err', float('nan')):.3g}, "
                      f"finite {c0.get('finite')}, same weights on every rank {c0.get('same_weights_on_every_rank')}."]
    ws = [w for w in r.get("runtime_workspace_measured") or [] if w]
    if ws:
        lines += ["", "Runtime workspace kept allocated per GPU (measured before the model, one GEMM then one backward): "
                      + "; ".join(f"{w['after_forward_gemm_bytes'] / 2**20:.1f} MiB after a GEMM, "
                                  f"{w['after_backward_bytes'] / 2**20:.1f} MiB after a backward" for w in ws)
                      + f" (the profile reserves {r.get('runtime_workspace_profile_bytes', 0) / 2**20:.0f} MiB per thread: "
                        "once for inference, twice for training)."]
    c = r.get("memory_cap")
    if c:
        tr = c.get("training") or {}
        lines += ["", f"Memory cap (inference: bs{c['batch']}, GPipe, {c['microbatches']} micro-batches; training: "
                      f"bs{tr.get('batch', '?')}, {tr.get('schedule', '?')} at {tr.get('microbatches', '?')}; the model is "
                      f"freed before each run). One GPU's predicted inference footprint "
                      f"{gb(c.get('one_device_predicted_bytes'))} GB; half of it ({gb(c.get('half_of_footprint_bytes'))} GB) "
                      + ("fits on two GPUs" if c.get("half_of_footprint_fits") else
                         "cannot hold the model on two GPUs with the merged outputs on the last GPU (beyond its half of "
                         f"the parameters, the last GPU needs {gb(c.get('working_set_bytes'))} GB: the logits of every "
                         "micro-batch and their concatenation, activations, the pipeline's buffers, the runtime "
                         "workspace)")
                      + (", and fits with the outputs copied to the host per micro-batch"
                         if c.get("half_of_footprint_fits_outputs_on_host") else "") + ". "
                      f"One GPU's training step: {gb(tr.get('one_device_measured_peak_bytes'))} GB measured at its peak, "
                      f"{gb(tr.get('one_device_predicted_bytes'))} GB predicted.", "",
                  "| mode | cap | GB per GPU | of one GPU's footprint | one GPU refused | params GB per GPU (half the model: "
                  f"{gb(r.get('parameter_bytes', 0) / 2)}) | predicted GB per GPU | measured peak GB per GPU | "
                  "measured − predicted MB | within cap | step ms (predicted) |",
                  "| --- | --- | ---: | ---: | --- | --- | --- | --- | --- | --- | ---: |"]
        for x in c.get("runs", []):
            mode = x.get("mode", "inference")
            if not x.get("ran"):
                lines.append(f"| {mode} | {x['what']} | {gb(x['cap_bytes'])} | {x['cap_fraction_of_one_gpu']:.0%} | "
                             f"{x['one_device_refused']} | — | — | — | — | not run | — |")
                continue
            pred = f" ({ms(x['predicted_step_s'])})" if x.get("predicted_step_s") else ""
            lines.append(f"| {mode} | {x['what']} | {gb(x['cap_bytes'])} | {x['cap_fraction_of_one_gpu']:.0%} | "
                         f"{x['one_device_refused']} | {', '.join(gb(p) for p in x['parameter_bytes_per_rank'])} | "
                         f"{', '.join(gb(p) for p in x['predicted_memory_bytes'])} | "
                         f"{', '.join(gb(p) for p in x['peak_bytes_per_rank'])} | "
                         f"{', '.join(f'{d / 1e6:+.0f}' for d in x['measured_minus_predicted_bytes'])} | "
                         f"{x['within_cap']} | {ms(x['step_s'])}{pred} |")
    for sk in r.get("skipped", []):
        lines.append(f"skipped: {sk}")
    for k, e in (r.get("errors") or {}).items():
        lines.append(f"error in {k}: {e}")
    lines += ["", f"total {r.get('total_s', 0):.0f} s (per configuration: "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in (r.get("config_s") or {}).items()) + ")"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

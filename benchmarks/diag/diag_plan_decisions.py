"""Do two versions of graphopt make the same decisions? Every pass's rewrites (with their
predicted gains) and refusals (with their reasons) over a set of optimize() configurations of the
zoo (tiny models with the accuracy guard, CNNs/ViT/BERT at a few batch sizes and dtypes, planned for
h200, a100 and cpu), recorded by one checkout and compared with another's record.

    python benchmarks/diag/diag_plan_decisions.py record before.json [--new | SUBSTRING]
    (change the code)
    python benchmarks/diag/diag_plan_decisions.py record after.json
    python benchmarks/diag/diag_plan_decisions.py diff before.json after.json [REL_TOL]

``diff`` prints [DECISION] where a pass applied or refused other candidates (rewrites compared as
sets, so candidates tied in gain may come in another order) and [gains] where only predicted gains
(beyond REL_TOL, default 1e-9) or refusal reasons changed. CPU-only (planning for GPUs on the CPU),
a few minutes; the cpu rows depend on the CPU profile measured on this machine.
"""
import json, sys, time, warnings
import torch
warnings.filterwarnings("ignore")
import graphopt
from graphopt.examples import zoo

BF = torch.bfloat16
CONFIGS = [
    ("bert-tiny", {}, {"target": "h200"}),
    ("bert-tiny", {}, {"target": "a100"}),
    ("bert-tiny", {}, {"target": "cpu"}),
    ("bert-tiny", {"dtype": BF}, {"target": "h200"}),
    ("glm4-tiny", {}, {"target": "h200"}),
    ("glm4-tiny", {"dtype": BF}, {"target": "h200"}),
    ("glm4-tiny", {}, {"target": "cpu"}),
    ("glm4-tiny", {}, {"target": "h200", "training": True, "memory_budget": 0.5}),
    ("vit-tiny", {}, {"target": "h200"}),
    ("vit-tiny", {"dtype": BF}, {"target": "h200"}),
    ("vit-tiny", {}, {"target": "cpu"}),
    ("shape-branch", {}, {"target": "h200"}),
    ("shape-branch", {}, {"target": "cpu"}),
    ("shape-branch", {"dtype": BF}, {"target": "h200"}),
    ("mlp", {}, {"target": "h200"}),
    ("mlp", {}, {"target": "cpu"}),
    ("mlp", {}, {"target": "h200", "training": True}),
    ("resnet50", {}, {"target": "h200", "check_accuracy": False}),
    ("resnet50", {"dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("resnet50", {}, {"target": "a100", "check_accuracy": False}),
    ("resnet50", {}, {"target": "cpu", "check_accuracy": False}),
    ("mobilenet_v3_large", {}, {"target": "h200", "check_accuracy": False}),
    ("convnext_tiny", {}, {"target": "h200", "check_accuracy": False}),
    ("convnext_tiny", {"dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("vit_b_16", {}, {"target": "h200", "check_accuracy": False}),
    ("vit_b_16", {"dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("bert-base", {}, {"target": "h200", "check_accuracy": False}),
    ("bert-base", {"dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("bert-base", {"batch": 8, "dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("resnet50", {"batch": 32, "dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("resnet50", {"batch": 32}, {"target": "a100", "check_accuracy": False}),
    ("convnext_tiny", {"batch": 16, "dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("mobilenet_v3_large", {"batch": 16, "dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("vit_b_16", {"batch": 8, "dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("bert-base", {"batch": 8}, {"target": "h200", "check_accuracy": False}),
    ("glm4-tiny", {"batch": 64, "dtype": BF}, {"target": "h200", "check_accuracy": False}),
    ("glm4-tiny", {"batch": 8, "seq_len": 256, "dtype": BF}, {"target": "h200", "check_accuracy": False}),
]


def key(name, zkw, kw):
    return name + " " + " ".join(f"{k}={v}" for k, v in sorted({**zkw, **kw}.items()))


def record(name, zkw, kw):
    torch.manual_seed(0)
    model, inputs = zoo.get(name, **zkw)
    opt = graphopt.optimize(model, inputs, **kw)
    out = {}
    for r in opt.report.passes:
        d = r.as_dict()
        out[d["name"]] = {"status": d["status"],
                          "rewrites": [(w["pattern"], w["matched"], w["replacement"], w["predicted_gain_ms"])
                                       for w in d["rewrite_list"]],
                          "rejected": [(x["candidate"], x["reason"]) for x in d["rejected"]],
                          "notes": d["notes"]}
    return out


if __name__ == "__main__":
    if sys.argv[1] == "record":
        sel = sys.argv[3] if len(sys.argv) > 3 else ""
        import os
        res = json.load(open(sys.argv[2])) if sel == "--new" and os.path.exists(sys.argv[2]) else {}
        for n, z, k in CONFIGS:
            if sel == "--new":
                if key(n, z, k) in res:
                    continue
            elif sel and sel not in key(n, z, k):
                continue
            t = time.time()
            try:
                res[key(n, z, k)] = record(n, z, k)
            except Exception as e:
                res[key(n, z, k)] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{time.time() - t:6.1f}s {key(n, z, k)}", flush=True)
        json.dump(res, open(sys.argv[2], "w"), indent=1)
    elif sys.argv[1] == "diff":
        a, b = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
        rel = float(sys.argv[4]) if len(sys.argv) > 4 else 1e-9
        import re
        num = re.compile(r"[-+]?\d+\.\d+")
        def canon(p):
            rw = sorted((w[0], tuple(sorted(w[1]))) for w in p["rewrites"])
            rj = sorted((x[0], num.sub("#", x[1])) for x in p["rejected"])
            return p["status"], rw, rj
        nd = 0
        for k in a:
            if k not in b:
                continue
            if "error" in a[k] or "error" in b[k]:
                if a[k] != b[k]:
                    print("[ERROR]", k, a[k].get("error"), "->", b[k].get("error"))
                continue
            for p in sorted(set(a[k]) | set(b[k])):
                pa, pb = a[k].get(p), b[k].get(p)
                if pa == pb:
                    continue
                if pa is not None and pb is not None and canon(pa) == canon(pb):
                    ga = {(w[0], tuple(sorted(w[1]))): w[3] for w in pa["rewrites"]}
                    gb = {(w[0], tuple(sorted(w[1]))): w[3] for w in pb["rewrites"]}
                    gd = [(k2[0], k2[1][:3], ga[k2], gb[k2]) for k2 in ga if abs(ga[k2] - gb[k2]) > rel * max(abs(ga[k2]), 1e-12)]
                    ra = dict((x[0], x[1]) for x in pa["rejected"]); rb = dict((x[0], x[1]) for x in pb["rejected"])
                    rd = [(c, ra[c], rb[c]) for c in ra if ra[c] != rb.get(c)]
                    if not gd and not rd and pa["notes"] == pb["notes"]:
                        continue
                    print(f"[gains] {k} / {p}: {len(gd)} gains, {len(rd)} reasons differ")
                    for g in gd[:4]:
                        print("    gain", g)
                    for c, x, y in rd[:4]:
                        print("    rej ", c, ":", x, "\n      ->", y)
                    if pa["notes"] != pb["notes"]:
                        print("    notes", pa["notes"], "\n      ->", pb["notes"])
                else:
                    nd += 1
                    print(f"[DECISION] {k} / {p}")
                    if pa is None or pb is None:
                        print("   ", pa, pb); continue
                    ca, cb = canon(pa), canon(pb)
                    print("   status", ca[0], "->", cb[0])
                    sa, sb = set(ca[1]), set(cb[1])
                    print("   rewrites only before:", len(sa - sb), sorted(sa - sb)[:4])
                    print("   rewrites only after: ", len(sb - sa), sorted(sb - sa)[:4])
                    ja, jb = set(ca[2]), set(cb[2])
                    print("   rejections only before:", len(ja - jb), sorted(ja - jb)[:3])
                    print("   rejections only after: ", len(jb - ja), sorted(jb - ja)[:3])
        print("decision diffs:", nd)

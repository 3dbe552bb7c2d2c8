# Answered: How many registers do the generated flat-walk kernels of unrolled contractions take by BLOCK? 174-255 at BLOCK 1024 with 4 warps (spilling on two of five: at most 2 blocks of 128 threads per SM), 40-167 at 512, 32-80 at 256 (results/diag_pointwise_registers_2026-12-06_180126.md; Triton 3.8 here, the H100 image runs 3.6); not timed.
"""Registers and spills of graphopt's generated pointwise kernels, compiled for sm_90 on the CPU.

    python benchmarks/diag/diag_pointwise_registers.py --out DIR

For each unrolled contraction of ``diag_small_contractions.py`` (CoaT's, VOLO's and two plain ones:
8 to 32 inputs read through their strides), the plan ``pointwise_triton`` makes at each BLOCK
(elements per program, 4 warps) is compiled by Triton for an sm_90 target without a GPU and its
cubin's resource usage read with ``cuobjdump -res-usage`` (bundled with Triton): registers per
thread, stack bytes (spills), and the blocks of 128 threads that fit an SM's 65536 registers.
Writes diag_pointwise_registers_<date>.{json,md} under --out.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.cuda_ext import pointwise_triton as pt  # noqa: E402
from graphopt.cuda_ext.pointwise import parse  # noqa: E402
from diag_small_contractions import CONTRACT, _unrolled  # noqa: E402
from _timing import out_dir, table_lines, write_rows  # noqa: E402

BLOCKS = (1024, 512, 256)
_PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float16: "*fp16"}


def _compiled(pl, in_dtypes, out_dtypes):
    """The plan's kernel compiled for sm_90 (Triton's ASTSource: its pointers, scalars and constexprs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    while pl.sub is not None:
        pl = pl.sub
    sig, consts, scalars = {}, {}, iter(pl.scalars)
    for i, name in enumerate(pl.kern.arg_names):
        if i < len(in_dtypes):
            sig[name] = _PTR[in_dtypes[i]]
        elif i < len(in_dtypes) + len(out_dtypes):
            sig[name] = _PTR[out_dtypes[i - len(in_dtypes)]]
        elif name in pl.meta or name == "PDL":
            sig[name], consts[name] = "constexpr", pl.meta.get(name, False)
        else:
            sig[name] = "i64" if abs(next(scalars)) >= 2**31 else "i32"
    src = ASTSource(pl.kern, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": pl.meta.get("num_warps", 4)})


def _usage(kernel) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", text)}


def main(argv=None) -> int:
    out = out_dir(__doc__, argv)
    rows = []
    keep = pt.BLOCK
    try:
        for name, make, kw in CONTRACT:
            a, b = make(torch.device("cpu"), **kw)
            src, ins = _unrolled(a, b)
            row = {"case": name, "inputs": len(ins), "shape": f"{tuple(a.shape)}@{tuple(b.shape)}"}
            for blk in BLOCKS:
                pt.BLOCK = blk
                pt._plans.clear()
                use = _usage(_compiled(pt._make_plan(parse(src), src, ins), [t.dtype for t in ins], [a.dtype]))
                row[f"b{blk}"] = use
            rows.append(row)
            print(row, flush=True)
    finally:
        pt.BLOCK = keep
        pt._plans.clear()

    def cell(blk):
        def f(r):
            u = r[f"b{blk}"]
            fit = 65536 // (u["reg"] * 128)
            return f"{u['reg']} regs, {u['stack']} B stack, {fit} blocks/SM"
        return f

    cols = [("case", lambda r: r["case"], False), ("inputs", lambda r: str(r["inputs"]), True)] + [
        (f"BLOCK {b}", cell(b), False) for b in BLOCKS] + [("note", lambda r: "", False)]
    import triton

    head = (f"Triton {triton.__version__}, sm_90 target compiled on the CPU, torch {torch.__version__}; the flat walk "
            "with 4 warps (128 threads); blocks/SM by registers alone (65536 per SM).")
    write_rows(out, "diag_pointwise_registers", rows, table_lines("# Registers of unrolled contraction kernels", head,
                                                                  cols, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

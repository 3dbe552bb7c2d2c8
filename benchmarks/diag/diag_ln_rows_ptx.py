# Answered: Why did graphopt's row kernels (the many-rows LayerNorm, the generated pointwise row tiles) move CoaT-Tiny's rows of 152 at about a quarter of the copy rate? With a runtime width their accesses were 2-byte ones unless 16 divided the width; with the width compiled in they are 128-bit wherever a row's bytes are a multiple of 16 (results/diag_ln_rows_ptx_<date>.md). With the width passed as (H // VEC) * VEC (VEC a compile-time power of two, widths sharing a kernel) the accesses are the same (results/diag_ln_rows_ptx_2026-12-07_100649.md).
"""The global loads and stores ``ln_rows_kernel`` (and the generated pointwise kernel's row tiles) compile
to for sm_90, per row width, without a GPU.

    python benchmarks/diag/diag_ln_rows_ptx.py --out DIR

Triton specializes an integer argument only on whether it is divisible by 16, so with the width a
runtime argument the kernels' row offsets ``rows * H`` were provably 16-byte aligned only at widths
divisible by 16, and every other width got one 2-byte access per element. Both kernels now take the
width as a compile-time constant (``H`` / ``W: tl.constexpr``); this shows what that buys per width
(a bf16 row is 16-byte aligned where the width is a multiple of 8). The kernel is compiled here (ASTSource, GPUTarget cuda 90) as ``_rows`` launches it for a plain LayerNorm in bf16
(32 rows of a 256-wide block for widths up to 256, as `_rows` picks) and the PTX's accesses counted.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _timing import out_dir, table_lines, write_rows  # noqa: E402

WIDTHS = [(150, "not a multiple of 8"), (152, "CoaT-Tiny"), (160, "a multiple of 16 next to it"), (192, "DeiT-Tiny"), (200, "—"),
          (216, "—"), (320, "CoaT-Lite Small"), (384, "DeiT-Small"), (440, "—")]


def accesses(H: int) -> tuple[Counter, Counter]:
    import triton
    from triton.backends.compiler import GPUTarget

    from graphopt.cuda_ext import norm_triton as nt
    from graphopt.cuda_ext.norm_triton import next_pow2

    names = ["P", "PS", "BIAS", "X", "W", "B", "OUT", "HOUT", "R", "HV", "eps", "S", "HAS_BIAS", "HAS_X", "HAS_W",
             "HAS_B", "STORE_H", "VEC", "ROWS", "BLOCK_H"]
    types = ["*bf16", "i32", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "i32", "i32", "fp32"] + \
        ["constexpr"] * 9
    bh = next_pow2(H)
    vec = nt.row_vec(H, 2)
    consts = {"S": 0, "HAS_BIAS": False, "HAS_X": True, "HAS_W": True, "HAS_B": True, "STORE_H": False,
              "VEC": vec, "ROWS": max(1, min(128, 8192 // bh)), "BLOCK_H": bh}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("P", "BIAS", "X", "W", "B", "OUT", "HOUT")}
    if (H // vec) % 16 == 0:  # the launcher's specialization of an integer argument divisible by 16
        attrs[(names.index("HV"),)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=nt._build(), signature=dict(zip(names, types)),
                                    constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return Counter(re.findall(r"ld\.global[^ \t]*", ptx)), Counter(re.findall(r"st\.global[^ \t]*", ptx))


SOFTMAX = "%0 = input 0\n%1 = rmax %0\n%2 = sub %0 %1\n%3 = exp %2\n%4 = rsum %3\n%5 = div %3 %4\nout %5 bf16"


def pointwise_accesses(H: int) -> tuple[Counter, Counter]:
    """The same count for the generated pointwise kernel's row tiles (``pointwise_triton.generate``,
    tile2d): a bf16 softmax over rows of H of a dense [1024, H] input, as fused_pointwise launches it
    (sizes and strides runtime arguments, a unit stride specialized to 1)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    from graphopt.cuda_ext import pointwise_triton as pt

    fn = pt.get_kernel(SOFTMAX, (torch.bfloat16,), 2, False, (True,), True)
    names = [p.name for p in fn.params]
    types, consts, attrs = {}, {}, {}
    runtime = {"numel": 1024 * H, "size0": 1024, "size1": H, "st0_0": H, "WV": H // pt.row_vec(H, 2)}
    for i, n in enumerate(names):
        if n.startswith(("in", "out")):
            types[n], attrs[(i,)] = "*bf16", [["tt.divisibility", 16]]
        elif n in runtime:
            types[n] = "i32"
            if runtime[n] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            types[n] = "constexpr"
            consts[(i,)] = {"st0_1": 1, "BM": 8, "BN": 256, "VEC": pt.row_vec(H, 2), "PDL": False}[n]
    src = triton.compiler.ASTSource(fn=fn, signature=types, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return Counter(re.findall(r"ld\.global[^ \t]*", ptx)), Counter(re.findall(r"st\.global[^ \t]*", ptx))


def main(argv=None) -> int:
    import torch
    import triton

    out = out_dir(__doc__, argv or sys.argv[1:])
    rows = []
    for kernel, count in (("ln_rows_kernel", accesses), ("pw_kernel (row tiles, softmax)", pointwise_accesses)):
        for H, where in WIDTHS:
            ld, st = count(H)
            rows.append({"kernel": kernel, "H": H, "where": where,
                         "loads": ", ".join(f"{k} x{v}" for k, v in ld.most_common()),
                         "stores": ", ".join(f"{k} x{v}" for k, v in st.most_common()),
                         "vectorized": any(".v" in k for k in ld)})
            print(rows[-1], flush=True)
    cols = [("kernel", lambda r: r["kernel"], False), ("row width H", lambda r: str(r["H"]), True), ("model", lambda r: r["where"], False),
            ("global loads", lambda r: r["loads"], False), ("global stores", lambda r: r["stores"], False),
            ("vectorized", lambda r: "yes" if r["vectorized"] else "**no**", False)]
    head = (f"PTX for sm_90 from triton {triton.__version__} (torch {torch.__version__}), compiled on the CPU; "
            "ln_rows_kernel as _rows launches a bf16 LayerNorm, pw_kernel as fused_pointwise launches a bf16 softmax "
            "over rows (row tiles).")
    write_rows(out, "diag_ln_rows_ptx", rows, table_lines("# Row kernels' global accesses by row width", head,
                                                          cols, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

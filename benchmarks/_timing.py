"""CUDA-event timing shared by the small diagnostics."""
import torch


def cuda_median_ms(fn, reps: int = 10, warmup: int = 3, sleep_cycles: int = 0) -> float:
    """Median milliseconds of ``fn()`` between two CUDA events over ``reps`` calls after ``warmup``.
    ``sleep_cycles`` > 0 queues a GPU sleep first, so the events time the device work alone
    (the host enqueues ``fn`` while the GPU sleeps)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def kernel_counts(fn, width: int = 40, top: int = 6) -> str:
    """The kernels one eager call of ``fn`` launches (after a warm-up call), from torch.profiler:
    "name x count", the ``top`` most frequent, names cut to ``width`` characters."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    c = collections.Counter(e.name.replace("void ", "").replace("at::native::", "")[:width]
                            for e in prof.events() if e.device_type.name == "CUDA")
    return "; ".join(f"{k} x{v}" for k, v in c.most_common(top))


def copy_bandwidth() -> float:
    """Bytes per second a 1 GiB device-to-device copy moves (read + write): eager copies timed by
    CUDA events, as the generation benchmark measures it. Not replayed from a CUDA graph: captured,
    the copy becomes a memcpy node the copy engines run, slower than the kernel an eager copy
    launches, so a floor from it would be too low."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), reps=10, warmup=3)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def captured(fn, times: int = 1) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``times`` calls of ``fn``, captured after two warm-up calls on a side stream
    (as capture requires)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(times):
            fn()
    return g


def graph_us_per_call(fn, calls: int, replays: int = 5, reps: int = 20) -> float:
    """Median µs per call of ``fn`` (which makes ``calls`` calls) captured once into a CUDA graph and
    replayed: the kernels and the gaps between them, no host time (warmed up on a side stream)."""
    g = captured(fn)
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / replays / calls * 1e3)
    return sorted(ts)[len(ts) // 2]


def replayed_us(fn) -> float:
    """µs per call of ``fn`` (one call, run once first: lazy work outside the capture), replayed from a
    CUDA graph (:func:`graph_us_per_call`)."""
    fn()
    torch.cuda.synchronize()
    return graph_us_per_call(fn, 1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error of ``out`` against ``ref`` (float64) over the largest reference value."""
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def out_dir(doc: str, argv=None) -> str:
    """The ``--out`` directory of a diagnostic that takes nothing else (``doc``: its module
    docstring, whose first paragraph is the help text)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the .json and .md results")
    return p.parse_args(argv).out


def measure_row(rows: list, row: dict, measure) -> None:
    """``measure(row)`` fills ``row`` under inference mode; an exception (a backend or torch that
    cannot run the case) is recorded in it as "error" instead. The row is appended to ``rows`` and
    printed as JSON."""
    import json

    try:
        with torch.inference_mode():
            measure(row)
    except Exception as e:  # noqa: BLE001 - a diagnostic keeps the other cases
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"
    rows.append(row)
    print(json.dumps(row), flush=True)


def table_lines(title: str, intro: str, columns: list, rows: list) -> list:
    """A Markdown report: ``title``, ``intro`` and a table of ``rows`` (dicts) with ``columns`` as
    (header, row -> cell text, right-aligned); a cell whose key a row lacks is "—", and a row with
    an "error" shows it in the last column."""
    lines = [title, "", intro, "", "| " + " | ".join(h for h, _, _ in columns) + " |",
             "| " + " | ".join("---:" if right else "---" for _, _, right in columns) + " |"]
    for r in rows:
        cells = []
        for _, cell, _ in columns:
            try:
                cells.append(cell(r))
            except KeyError:
                cells.append("—")
        if "error" in r:
            cells[-1] = r["error"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_rows(out, stem: str, rows: list, lines: list) -> None:
    """``rows`` as ``<stem>_<UTC date>.json`` and the Markdown ``lines`` as ``.md`` under ``out``
    (created), and the Markdown printed."""
    import datetime as dt
    import json
    from pathlib import Path

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}_{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

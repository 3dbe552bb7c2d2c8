"""Building the CUDA extension: JIT build + cache, ahead-of-time build, and a compile-only check.

* :func:`build_kernels` builds ``graphopt_kernels`` (csrc/*.cu + csrc/*.cpp) with
  ``torch.utils.cpp_extension.load`` (ninja) into a cache directory keyed by torch version,
  CUDA version, GPU architecture(s) and a hash of the sources::

      $GRAPHOPT_CACHE_DIR or ~/.cache/graphopt/kernels / ext / torch2.14.1-cu13.0-sm_90-<hash> /

  A cached build is reused (loading it is a dlopen). The build runs in a child Python process
  (``_build_worker.py``), so this process's dispatcher is untouched until the finished library
  is loaded with ``torch.ops.load_library``; its ninja output goes to ``build.log`` in that
  directory and feeds ``progress_callback(done, total, message)``.
  A failed build raises :class:`graphopt.errors.KernelBuildError` with the compiler's first
  error line and the log's path.
* ``python -m graphopt.cuda_ext.build --check-compile --arch sm_80,sm_90`` compiles every
  source to an object file (nvcc for .cu, g++ for .cpp, torch's include paths) without a GPU
  and exits 1 with the first error line and the log path on failure (``make test`` runs it).
  A system toolkit is used first, else the one the dev extra installs with pip.
* ``python -m graphopt.cuda_ext.build [--arch sm_90]`` builds ahead of time (what
  ``graphopt build-kernels`` calls).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Sequence

from graphopt.errors import KernelBuildError

CSRC = Path(__file__).resolve().parent / "csrc"
EXT_NAME = "graphopt_kernels"
ProgressCallback = Callable[[int, int, str], None]


# ---------------------------------------------------------------------------------------
# locations and keys
def cache_root() -> Path:
    """``$GRAPHOPT_CACHE_DIR`` or ``~/.cache/graphopt/kernels``."""
    env = os.environ.get("GRAPHOPT_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "graphopt" / "kernels"
    return root


def source_files() -> list[Path]:
    """Every translation unit of the library: the kernel files (each registers its op's CUDA
    implementation) and the host-only ones."""
    return sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.cpp"))


def _all_sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cu", ".cpp", ".cuh", ".h"))


def source_hash() -> str:
    h = hashlib.sha256()
    for p in _all_sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def find_cuda_home() -> Path | None:
    """The CUDA toolkit root (one whose include/ holds cuda_runtime.h), or None."""
    cands: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(nvcc).resolve().parent.parent)
        try:  # nvcc may be a wrapper script: ask it where it lives
            txt = Path(nvcc).read_text(errors="ignore")[:4096]
            for m in re.finditer(r"(/[^\s\"']+)/bin/nvcc", txt):
                cands.append(Path(m.group(1)))
        except OSError:
            pass
    cands += [Path("/usr/local/cuda")] + sorted(Path("/usr/local").glob("cuda-*"), reverse=True)
    for c in cands:
        if (c / "include" / "cuda_runtime.h").exists() and (c / "bin" / "nvcc").exists():
            return c
    return None


def find_pip_cuda_home() -> Path | None:
    """The toolkit pip installs (the dev extra's ``cuda-toolkit[nvcc,cccl]``: nvcc, headers and
    CCCL under site-packages/nvidia/cu<major>, the CUDA major torch was built with), or None.
    Enough to compile the sources; linking the extension wants a full toolkit."""
    import importlib.util

    import torch

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not torch.version.cuda:
        return None
    major = torch.version.cuda.split(".")[0]
    for loc in spec.submodule_search_locations or []:
        c = Path(loc) / f"cu{major}"
        if (c / "include" / "cuda_runtime.h").exists() and (c / "bin" / "nvcc").exists():
            return c
    return None


def normalize_arch(a: str) -> str:
    """'sm_90', '90', '9.0' -> 'sm_90'."""
    a = a.strip().lower()
    if a.startswith("sm_"):
        return a
    if "." in a:
        major, minor = a.split(".", 1)
        return f"sm_{major}{minor}"
    return f"sm_{a}"


def detect_arch() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _arch_list(arch_list: Iterable[str] | str | None) -> list[str]:
    if arch_list is None:
        a = detect_arch()
        if a is None:
            raise KernelBuildError("no CUDA GPU found: pass arch_list (e.g. ['sm_90']) to build without one")
        return [a]
    if isinstance(arch_list, str):
        arch_list = arch_list.split(",")
    out = [normalize_arch(a) for a in arch_list if a.strip()]
    if not out:
        raise KernelBuildError("empty arch list")
    return out


def build_dir(archs: Sequence[str]) -> Path:
    import torch

    key = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda or 'none'}-{'_'.join(archs)}-{source_hash()}"
    return cache_root() / "ext" / key


def cached_library(arch_list: Iterable[str] | str | None = None) -> Path | None:
    """The built library for these archs (default: this GPU's) if it is in the cache."""
    try:
        archs = _arch_list(arch_list)
    except KernelBuildError:
        return None
    so = build_dir(archs) / f"{EXT_NAME}.so"
    return so if so.exists() else None


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if re.search(r"\berror\b", line, re.IGNORECASE) and not line.startswith("FAILED:"):
            return line.strip()
    for line in log.splitlines():
        if line.strip():
            return line.strip()
    return "(no output)"


# ---------------------------------------------------------------------------------------
# JIT / ahead-of-time build
def build_kernels(progress_callback: ProgressCallback | None = None,
                  arch_list: Iterable[str] | str | None = None, force: bool = False) -> Path:
    """Build (or find in the cache) the CUDA extension; return the path of the shared library.

    ``arch_list``: e.g. ``["sm_90"]`` or ``"sm_80,sm_90"``; default the GPU of this machine.
    ``progress_callback(done, total, message)`` is called as ninja finishes each step.
    Raises :class:`KernelBuildError` (compiler's first error line + full log path) on failure.
    """
    archs = _arch_list(arch_list)
    out = build_dir(archs)
    so = out / f"{EXT_NAME}.so"
    if so.exists() and not force:
        if progress_callback:
            progress_callback(1, 1, f"cached: {so}")
        return so
    cuda_home = find_cuda_home()
    if cuda_home is None:
        raise KernelBuildError("no CUDA toolkit found (nvcc and include/cuda_runtime.h); set CUDA_HOME "
                               "or install the CUDA toolkit matching torch")
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build.log"
    env = dict(os.environ)
    env["CUDA_HOME"] = str(cuda_home)
    env["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{a[3:-1]}.{a[-1]}" for a in archs)
    env.setdefault("MAX_JOBS", str(max(1, os.cpu_count() or 1)))
    env["PATH"] = f"{cuda_home / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, str(Path(__file__).with_name("_build_worker.py")), str(out), EXT_NAME,
           *[str(p) for p in source_files()]]
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(f"# {' '.join(cmd)}\n# TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} CUDA_HOME={cuda_home}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = re.match(r"\[(\d+)/(\d+)\]\s*(.*)", line)
            if m and progress_callback:
                msg = m.group(3)
                src = re.findall(r"[\w.-]+\.(?:cu|cpp)\b", msg)
                progress_callback(int(m.group(1)), int(m.group(2)), src[-1] if src else msg[:60])
        rc = proc.wait()
        log.write(f"# exit {rc} after {time.time() - t0:.1f}s\n")
    text = log_path.read_text(errors="replace")
    if rc != 0 or not so.exists():
        raise KernelBuildError(f"building the CUDA kernels failed: {_first_error(text.split(chr(10), 2)[-1])} "
                               f"(full log: {log_path})")
    return so


# ---------------------------------------------------------------------------------------
# compile-only check (CI without a GPU)
def _torch_includes(cuda_home: Path | None) -> list[str]:
    import torch

    inc = Path(torch.__file__).resolve().parent / "include"
    paths = [inc, inc / "torch" / "csrc" / "api" / "include"]
    if cuda_home is not None:
        paths.append(cuda_home / "include")
    return [f"-I{p}" for p in paths] + [f"-I{CSRC}"]


def compile_commands(archs: Sequence[str], objdir: Path, cuda_home: Path) -> list[tuple[Path, list[str]]]:
    import torch

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    common = _torch_includes(cuda_home) + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                                           f"-DTORCH_EXTENSION_NAME={EXT_NAME}"]
    nvcc = str(cuda_home / "bin" / "nvcc")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    cmds = []
    for src in source_files():
        obj = objdir / (src.name + ".o")
        if src.suffix == ".cu":
            cmd = [nvcc, "-c", str(src), "-o", str(obj), "-std=c++20", "-O3", "-Xcompiler", "-fPIC",
                   "--expt-relaxed-constexpr", *gencode, *common]
        else:
            cxx = os.environ.get("CXX", "g++")
            cmd = [cxx, "-c", str(src), "-o", str(obj), "-std=c++20", "-O2", "-fPIC", *common]
        cmds.append((src, cmd))
    return cmds


def check_compile(arch_list: Iterable[str] | str = ("sm_80", "sm_90"), jobs: int | None = None,
                  log_dir: Path | None = None, echo: Callable[[str], None] = print,
                  missing_ok: bool = False) -> int:
    """Compile every source to an object file; return 0, or 1 after printing the first error.
    Without a toolkit (a system one, or the dev extra's pip one): 1, or with ``missing_ok`` one
    line saying the check did not run and 0."""
    archs = _arch_list(arch_list)
    cuda_home = find_cuda_home() or find_pip_cuda_home()
    if cuda_home is None:
        if missing_ok:
            echo("check-compile: nvcc not found: CUDA kernels not compile-checked (pip install -e '.[dev]' "
                 "brings one on Linux, or set CUDA_HOME)")
            return 0
        echo("check-compile: no CUDA toolkit found (nvcc + include/cuda_runtime.h); set CUDA_HOME")
        return 1
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="graphopt-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cmds = compile_commands(archs, log_dir, cuda_home)
    t0 = time.time()

    def run(item):
        src, cmd = item
        t = time.time()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = log_dir / (src.name + ".log")
        log.write_text(" ".join(cmd) + "\n\n" + p.stdout)
        return src, p.returncode, p.stdout, log, time.time() - t

    failed = 0
    with ThreadPoolExecutor(max_workers=jobs or max(1, os.cpu_count() or 1)) as ex:
        for src, rc, out, log, dt in ex.map(run, cmds):
            if rc == 0:
                echo(f"  ok   {src.name:<18} {dt:5.1f}s  ({','.join(archs)})")
            else:
                failed += 1
                echo(f"  FAIL {src.name:<18} {_first_error(out)}")
                echo(f"       full log: {log}")
    echo(f"check-compile: {len(cmds) - failed}/{len(cmds)} sources compiled for {','.join(archs)} "
         f"with {cuda_home / 'bin' / 'nvcc'} in {time.time() - t0:.0f}s (objects and logs in {log_dir})")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graphopt.cuda_ext.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-compile", action="store_true", help="compile to object files only (no GPU needed)")
    ap.add_argument("--arch", default=None, help="comma-separated, e.g. sm_80,sm_90 (default: this GPU)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--if-available", action="store_true",
                    help="with --check-compile: without a CUDA toolkit, say so in one line and exit 0")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    a = ap.parse_args(argv)
    try:
        if a.check_compile:
            return check_compile(a.arch or "sm_80,sm_90", a.jobs, a.log_dir, missing_ok=a.if_available)

        def show(done: int, total: int, msg: str) -> None:
            print(f"  [{done}/{total}] {msg}", flush=True)

        so = build_kernels(show, a.arch, force=a.force)
        print(f"built {so}")
        return 0
    except KernelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

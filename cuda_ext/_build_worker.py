"""Child process of graphopt.cuda_ext.build.build_kernels: runs torch.utils.cpp_extension.load
(ninja, verbose so the parent can show progress) in a process where the graphopt ops are not
defined yet. Imports nothing from graphopt on purpose.

usage: python _build_worker.py BUILD_DIR NAME SOURCE...
"""
import os
import shutil
import sys


def main() -> int:
    build_dir, name, *sources = sys.argv[1:]
    from torch.utils import cpp_extension

    if os.environ.get("CUDA_HOME"):
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
    csrc = os.path.dirname(os.path.abspath(sources[0]))
    cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=["-O2"],
        extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
        # the C++ runtime from the shared libstdc++ that libtorch uses: on the H200 image the link
        # otherwise embedded a static copy (__cxa_throw defined in the .so, no libstdc++ NEEDED),
        # and a TORCH_CHECK thrown with it crashed the process when libtorch caught it
        extra_ldflags=["-Wl,-Bdynamic", "-lstdc++"],
        extra_include_paths=[csrc],
        build_directory=build_dir,
        is_python_module=False,
        verbose=True,
    )
    so = os.path.join(build_dir, f"{name}.so")
    if not os.path.exists(so):
        print(f"error: {so} was not produced", flush=True)
        return 1
    print(f"built {so}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

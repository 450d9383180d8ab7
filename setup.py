"""Build marlin._C with torch's cpp_extension.

Switches (environment variables):
  MARLIN_CUDA=auto|0|1   build the CUDA kernels: auto (default) when torch was built with CUDA and
                         nvcc is found (no GPU needed); 1 insists (fails otherwise); 0 never.
  TORCH_CUDA_ARCH_LIST   CUDA targets; default "8.0;8.6;8.9;9.0a;9.0+PTX". Naming 9.0a builds the
                         wgmma (Hopper) kernels and defines MARLIN_SM90A; without it H100/H200
                         run the mma.sync kernels.
  MAX_JOBS, NVCC_THREADS parallel compile jobs, and nvcc threads per job.
  MARLIN_DEBUG=1         -O0 -g host code and -lineinfo device code.
Install with `pip install --no-build-isolation .` so that the torch already installed is used.
"""

import glob
import os
import shutil

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;8.6;8.9;9.0a;9.0+PTX"


def want_cuda() -> bool:
    mode = os.environ.get("MARLIN_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"MARLIN_CUDA={mode!r}: expected auto, 0 or 1")
    if mode == "0":
        return False
    has_torch_cuda = torch.version.cuda is not None
    nvcc = cpp_extension.CUDA_HOME is not None and os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    nvcc = nvcc or shutil.which("nvcc") is not None
    if mode == "1" and not (has_torch_cuda and nvcc):
        raise SystemExit(
            f"MARLIN_CUDA=1 but torch.version.cuda={torch.version.cuda!r} and nvcc found={nvcc}: "
            "the CUDA kernels need a CUDA build of torch and nvcc"
        )
    return has_torch_cuda and nvcc


def extension():
    debug = os.environ.get("MARLIN_DEBUG", "0") == "1"
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    sources = ["csrc/torch_bindings.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    if not want_cuda():
        print("marlin: building the CPU ops only (MARLIN_CUDA=0, or no CUDA torch / nvcc)")
        return cpp_extension.CppExtension("marlin._C", sources, extra_compile_args={"cxx": cxx})
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    print(f"marlin: building CPU and CUDA ops for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    # one folder per kernel family apart from the dense one (csrc/cuda/sparse: 2:4 weights)
    sources += sorted(glob.glob("csrc/cuda/*/*.cpp")) + sorted(glob.glob("csrc/cuda/*/*.cu"))
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas=-warn-spills"]
    archs = [a.strip() for a in os.environ["TORCH_CUDA_ARCH_LIST"].replace(",", ";").split(";")]
    if any(a.split("+")[0] == "9.0a" for a in archs):
        cxx.append("-DMARLIN_SM90A")
        nvcc.append("-DMARLIN_SM90A")
    if debug:
        nvcc.append("-lineinfo")
    if "NVCC_THREADS" in os.environ:
        nvcc.append(f"--threads={os.environ['NVCC_THREADS']}")
    return cpp_extension.CUDAExtension("marlin._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc})


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
)

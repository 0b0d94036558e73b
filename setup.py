"""Build of the optional C++ (and, where CUDA torch + nvcc exist, CUDA) kernels.

* ``pip install --no-build-isolation -e .`` (or ``python setup.py build_ext --inplace``) builds
  ``ckptq._C``, the CPU kernels, against the torch already installed (hence no build isolation).
* ``ckptq._C_cuda`` (CUDA kernels) is built only where torch itself is a CUDA build
  (``torch.version.cuda``) and a CUDA toolkit is found (``CUDA_HOME`` / ``nvcc``); a GPU need not be
  present. Architectures: ``TORCH_CUDA_ARCH_LIST`` if set, else ``9.0+PTX`` (sm_90 machine code plus
  compute_90 PTX that the driver compiles for newer GPUs).
* ``CKPTQ_NO_EXT=1`` skips every extension; ``CKPTQ_NO_CUDA=1`` skips only the CUDA one;
  ``DEBUG=1`` builds with ``-O0 -g``; ``CKPTQ_NVCC_FLAGS`` adds nvcc flags (tuning experiments);
  ``CKPTQ_PTXAS_VERBOSE=1`` prints register / spill reports.

Numerics flags: no fast-math and no FMA contraction (``-ffp-contract=off``, ``--fmad=false``), so
that every multiply and add is the separate IEEE fp32 operation the reference performs.
The pure-PyTorch reference backend works without any of this.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("ckptq", "csrc")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _extensions():
    if _flag("CKPTQ_NO_EXT"):
        print("ckptq: CKPTQ_NO_EXT=1, building no extension (reference backend only)", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension as ce
    except ImportError:
        print(
            "ckptq: torch is not importable at build time (use --no-build-isolation); building no extension",
            file=sys.stderr,
        )
        return [], {}

    debug = _flag("DEBUG")
    # -g0 drops the -g that Python's own CFLAGS add (halves the build time here).
    opt = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    # -fno-trapping-math (as torch's own build) lets GCC if-convert the selects so the element loops
    # vectorize; it changes no value (no reassociation, no contraction).
    cxx = opt + ["-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fno-trapping-math", "-Wno-unused-function"]
    # -fopenmp: at::parallel_for is a header template whose OpenMP backend is a `#pragma omp parallel`
    # in ATen/ParallelOpenMP.h, so without it the CPU kernels run on one thread whatever
    # torch.get_num_threads() says. Linking with -fopenmp records libgomp.so.1, which resolves to the
    # copy torch has already loaded (one OpenMP runtime, torch's thread count). Linux/GCC only (Apple
    # clang has no -fopenmp; the kernels then run on one thread, as before).
    omp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    exts = [
        ce.CppExtension(
            "ckptq._C",
            sources=[os.path.join(CSRC, "requantize_cpu.cpp"), os.path.join(CSRC, "crc32c_cpu.cpp")],
            include_dirs=[os.path.join(ROOT, CSRC)],
            extra_compile_args={"cxx": cxx + omp},
            extra_link_args=omp,
            py_limited_api=True,
        )
    ]
    cuda_sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    if _flag("CKPTQ_NO_CUDA"):
        print("ckptq: CKPTQ_NO_CUDA=1, skipping the CUDA kernels", file=sys.stderr)
    elif torch.version.cuda is None:
        print(f"ckptq: torch {torch.__version__} is not a CUDA build, skipping the CUDA kernels", file=sys.stderr)
    elif ce.CUDA_HOME is None:
        print("ckptq: no CUDA toolkit found (set CUDA_HOME), skipping the CUDA kernels", file=sys.stderr)
    else:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0+PTX")
        nvcc = (
            (["-O0", "-g"] if debug else ["-O3"])
            + [
                "--fmad=false",  # the reference does separate multiplies and adds
                "-Xptxas=-v" if _flag("CKPTQ_PTXAS_VERBOSE") else "-lineinfo",
                "--expt-relaxed-constexpr",
            ]
            + os.environ.get("CKPTQ_NVCC_FLAGS", "").split()
        )  # tuning experiments, e.g. -DCKPTQ_OCC_POLICY=2
        exts.append(
            ce.CUDAExtension(
                "ckptq._C_cuda",
                sources=cuda_sources,
                include_dirs=[os.path.join(ROOT, CSRC)],
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                py_limited_api=True,
            )
        )
    cmd = {"build_ext": ce.BuildExtension.with_options(use_ninja=True)}
    return exts, cmd


ext_modules, cmdclass = _extensions()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp39"}} if ext_modules else {},
)

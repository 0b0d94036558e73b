"""CUDA kernels vs the reference run on the same GPU, byte for byte (skipped without CUDA).

The same pair matrix, edge inputs, crafted scales and explicit amax/scale cases as
``test_kernels.py`` (whose helpers this file reuses), on shapes that take both the vectorized
(K % 16 == 0) and the element-wise paths of the kernels, plus exhaustive sweeps of every fp32 bit
pattern through the FP8 / E2M1 / bf16 / fp16 casts. The reference runs on the GPU too: the spec's
bf16/fp16 NaN bits are those of the device's conversion, so CPU and GPU results are compared only
through the reference.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

import ckptq
from ckptq import ops
from ckptq.ops import _backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_spec = importlib.util.spec_from_file_location("_ckptq_kernel_cases", pathlib.Path(__file__).with_name("test_kernels.py"))
K = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(K)

DEV = "cuda"
SHAPES = [(2, 70, 200), (3, 256, 512), (300, 1040)]


def _need_cuda_backend():
    active, reason, _ = _backends.status("cuda")
    if not active:
        pytest.skip(f"CUDA backend not active: {reason}")


def test_cuda_backend_active():
    """On a machine with a GPU the CUDA kernels must have been built and loaded."""
    active, reason, _ = _backends.status("cuda")
    assert active, reason
    assert ops.backend_name(DEV) == "cuda"
    rep = ops.backend_report()
    assert rep["backends"]["cuda"]["active"] and rep["cuda_device"]


@pytest.fixture(scope="module")
def sources():
    cache = {}

    def get(fmt, rec, shape):
        key = (K.case_id((fmt, rec)), shape)
        if key not in cache:
            x = K.random_hp(shape, seed=len(shape) + shape[-1]).to(DEV)
            cache[key] = K.make_source(fmt, rec, x)
        return cache[key]

    return get


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dst", K.TARGETS, ids=K.case_id)
@pytest.mark.parametrize("src", K.SOURCES, ids=K.case_id)
def test_pair_bit_exact_cuda(src, dst, shape, sources):
    _need_cuda_backend()
    K.check_pair(sources(*src, shape), *dst, backend="cuda")


@pytest.mark.parametrize("dst", K.TARGETS, ids=K.case_id)
@pytest.mark.parametrize("src", K.SOURCES, ids=K.case_id)
def test_edge_values_cuda(src, dst):
    _need_cuda_backend()
    K.check_pair(K.make_source(*src, K.edge_matrix(DEV)), *dst, backend="cuda")


@pytest.mark.parametrize("dst", K.TARGETS, ids=K.case_id)
def test_crafted_scales_cuda(dst):
    _need_cuda_backend()
    for src in K.crafted_sources(DEV):
        K.check_pair(src, *dst, backend="cuda")


@pytest.mark.parametrize("src", [("bf16", {}), ("mxfp8", {}), ("nvfp4", {})], ids=K.case_id)
@pytest.mark.parametrize("case", K.amax_scale_cases(), ids=lambda c: f"{c[0]}-{list(c[1].items())}-{list(c[2])}")
def test_explicit_amax_scale_cuda(src, case):
    _need_cuda_backend()
    fmt, rec, kw = case
    x = K.random_hp((3, 20, 64), seed=11)
    x[1] *= 1e-4
    kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    K.check_pair(K.make_source(*src, x.to(DEV)), fmt, rec, backend="cuda", **kw)


SWEEPS = [
    ("fp8_tensor", {"fp8_dtype": K.E4M3}, {"scale": 1.0}),
    ("fp8_tensor", {"fp8_dtype": K.E5M2}, {"scale": 1.0}),
    ("fp8_tensor", {"fp8_dtype": K.E4M3}, {"scale": 3.0}),
    ("mxfp8", {}, {}),
    ("nvfp4", {}, {"amax": 2688.0}),
    ("bf16", {}, {}),
    ("fp16", {}, {}),
]


@pytest.mark.parametrize("dst", SWEEPS, ids=lambda c: c[0] + str(list(c[1].values())) + str(list(c[2].values())))
def test_exhaustive_fp32_sweep_cuda(dst):
    """All 2^32 fp32 bit patterns (in 16 chunks of 2^28, as (2^16, 2^12) matrices) through a cast."""
    _need_cuda_backend()
    fmt, rec, kw = dst
    for chunk in range(16):
        x = torch.arange(chunk << 28, (chunk + 1) << 28, dtype=torch.int64, device=DEV)
        x = x.to(torch.int32).view(torch.float32).view(1 << 16, 1 << 12)
        K.check_pair(x, fmt, rec, backend="cuda", **kw)
        del x
    torch.cuda.empty_cache()


def test_amax_op_cuda():
    _need_cuda_backend()
    x = K.edge_matrix(DEV)
    for src in [x, x.to(torch.bfloat16), K.make_source("nvfp4", {"two_d": True}, x), K.make_source("fp8_block", {}, x)]:
        with ops.force("reference"):
            ref = ops.amax(src)
        with ops.force("cuda"):
            got = ops.amax(src)
        assert K.bit_exact(ref, got), (ref, got)


def test_views_and_large_batch_cuda():
    _need_cuda_backend()
    x = K.random_hp((96, 160), seed=2).to(DEV)
    K.check_pair(x.t(), "nvfp4", {}, backend="cuda")
    K.check_pair(x[:, 16:144], "mxfp8", {"columnwise": True}, backend="cuda")  # storage offset
    q = K.make_source("nvfp4", {}, K.random_hp((8, 128, 1024), seed=3).to(DEV))
    K.check_pair(q[2:7], "fp8_block", {"block": (128, 128)}, backend="cuda")
    big = K.make_source("bf16", {}, K.random_hp((4, 1024, 4096), seed=5).to(DEV))
    for dst in K.TARGETS:
        K.check_pair(big, *dst, backend="cuda")


def test_unsupported_blocks_fall_back_to_the_reference_on_cuda():
    """fp8_block shapes outside the CUDA kernels' rule run the reference on the GPU, same bytes."""
    _need_cuda_backend()
    x = K.random_hp((2, 50, 300), seed=6).to(DEV)
    for rec in ({"block": (3, 100)}, {"block": (128, 256)}, {"block": (1, 8)}):
        K.check_pair(x, "fp8_block", rec, backend="cuda")
        q = K.make_source("fp8_block", rec, x)
        K.check_pair(q, "nvfp4", {}, backend="cuda")


@pytest.mark.parametrize("i", range(6))
def test_opcheck_requantize_cuda(i):
    _need_cuda_backend()
    args = K.opcheck_cases(DEV)[i]
    torch.library.opcheck(torch.ops.ckptq.requantize.default, args, test_utils=K.opcheck_utils(args))


def test_opcheck_amax_cuda():
    _need_cuda_backend()
    x = K.random_hp((2, 40, 96), seed=4).to(torch.bfloat16).to(DEV)
    torch.library.opcheck(torch.ops.ckptq.amax.default, ([x], "bf16", []))


def test_current_stream_and_device_guard_cuda():
    _need_cuda_backend()
    x = K.random_hp((64, 256), seed=8).to(DEV).to(torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q = ckptq.quantize(x, "nvfp4")
    s.synchronize()
    with ops.force("reference"):
        r = ckptq.quantize(x, "nvfp4")
    K.assert_same(r.components(), q.components(), "side stream")

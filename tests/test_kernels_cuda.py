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
from ckptq import numerics as N
from ckptq import ops
from ckptq.ops import _backends

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

_spec = importlib.util.spec_from_file_location(
    "_ckptq_kernel_cases", pathlib.Path(__file__).with_name("test_kernels.py")
)
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
    ("mxfp4", {}, {}),
    ("mxfp4", {"scale_rule": "rceil"}, {}),
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
    for src in [
        x,
        x.to(torch.bfloat16),
        K.make_source("nvfp4", {"two_d": True}, x),
        K.make_source("fp8_block", {}, x),
        K.make_source("mxfp4", {}, x),
    ]:
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
    K.check_pair(x[:, 32:96], "mxfp4", {"scale_rule": "even"}, backend="cuda")
    q = K.make_source("nvfp4", {}, K.random_hp((8, 128, 1024), seed=3).to(DEV))
    K.check_pair(q[2:7], "fp8_block", {"block": (128, 128)}, backend="cuda")
    big = K.make_source("bf16", {}, K.random_hp((4, 1024, 4096), seed=5).to(DEV))
    for dst in K.TARGETS:
        K.check_pair(big, *dst, backend="cuda")


def test_mxfp4_partial_last_block_cuda():
    """K % 32 == 16 with K % 16 == 0 (the vectorized path: the block's second segment lies past K)
    and K % 16 != 0 (the element-wise path), every scale rule, into and out of mxfp4."""
    _need_cuda_backend()
    K.check_mxfp4_partial_blocks("cuda", DEV)


def test_unsupported_blocks_fall_back_to_the_reference_on_cuda():
    """fp8_block shapes outside the CUDA kernels' rule run the reference on the GPU, same bytes."""
    _need_cuda_backend()
    x = K.random_hp((2, 50, 300), seed=6).to(DEV)
    for rec in ({"block": (3, 100)}, {"block": (128, 256)}, {"block": (1, 8)}):
        K.check_pair(x, "fp8_block", rec, backend="cuda")
        q = K.make_source("fp8_block", rec, x)
        K.check_pair(q, "nvfp4", {}, backend="cuda")


@pytest.mark.parametrize("i", range(8))
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


# ------------------------------------------------------- NVFP4 encode (magic-number E2M1 rounding, streaming kernel)
# The CUDA nvfp4 encode rounds to E2M1 with one fp32 add of a magic number (kernels.cuh,
# e2m1_magic_bits), takes block amaxes of bf16 / fp16 sources from the raw words and reads the
# encode multiplier from a per-CTA table of the 256 scale bytes. These tests put products
# x * enc on, and one or two ulps beside, every E2M1 grid point and tie, for each source dtype.
E2M1_POINTS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.5, 8.0]


def _step_ulps(x: torch.Tensor, n: int) -> torch.Tensor:
    """x moved by n ulps of its dtype (bit-pattern steps of |x|, sign kept; 0 stays >= 0)."""
    it = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype]
    bits = x.abs().view(it).to(torch.int64) + n
    bits = bits.clamp(min=0)
    return bits.to(it).view(x.dtype).copysign(x)


def near_tie_matrix(dtype, n_blocks=4096, seed=0):
    """(n_blocks, 16) of dtype and the matrix amax. Each block holds its amax A (random position) and
    15 values t / enc (rounded to dtype) moved by -2..2 ulps, for E2M1 grid points and ties t, with
    random signs (and some -0.0), never above A so that the block amax stays A; enc is the block's
    encode multiplier by the reference's formulas. The matrix amax is 336 = 2688 / 8 (S_enc = 8
    exactly) and half the blocks have an A whose scale byte is a power of two, so that their enc is
    a power of two and t / enc is exact in every dtype: those products land exactly on the ties;
    the other blocks have random A (products next to the ties, rounded in fp32)."""
    g = torch.Generator().manual_seed(seed)
    ga = torch.tensor(336.0)
    rand_a = (torch.rand(n_blocks, generator=g) + 0.5) * torch.exp2(
        torch.randint(-8, 8, (n_blocks,), generator=g).float()
    )
    pow2_a = (
        0.75
        * torch.exp2(torch.randint(-6, 9, (n_blocks,), generator=g).float())
        * (1 + (torch.rand(n_blocks, generator=g) - 0.5) / 16)
    )  # A * S_enc / 6 within 1/32 of 2^j
    amax_b = torch.where(torch.arange(n_blocks) % 2 == 0, pow2_a, rand_a).clamp(max=336.0)
    amax_b[0] = ga
    amax_b = amax_b.to(dtype).float()
    s_enc = N.nvfp4_global_encode_scale(ga)
    s = N.cast_fp8(amax_b * (s_enc * N.INV_6), torch.float8_e4m3fn)
    enc = torch.fmin(torch.reciprocal(s.float() * torch.reciprocal(s_enc)), torch.tensor(N.FLT_MAX))
    t = torch.tensor(E2M1_POINTS)[torch.randint(0, len(E2M1_POINTS), (n_blocks, 15), generator=g)]
    base = (t.double() / enc.double()[:, None]).to(dtype)
    x = _step_ulps(base, 0)
    for n in (-2, -1, 1, 2):
        pick = torch.randint(0, 6, (n_blocks, 15), generator=g) == 0
        x = torch.where(pick, _step_ulps(base, n), x)
    sign = torch.where(torch.rand(n_blocks, 15, generator=g) < 0.5, -1.0, 1.0).to(dtype)
    x = x * sign
    a = amax_b.to(dtype)[:, None]
    x = torch.where(~(x.float().abs() <= a.float()), a * sign, x)  # also inf / NaN from the ulp steps
    out = torch.cat([amax_b.to(dtype)[:, None], x], dim=1)
    perm = torch.argsort(torch.rand(n_blocks, 16, generator=g), dim=1)  # the amax anywhere in its block
    out = torch.gather(out, 1, perm)
    out.view(-1)[1::997] = -0.0
    return out, ga


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("given", [True, False], ids=["amax-given", "amax-computed"])
def test_nvfp4_e2m1_ties_cuda(dtype, given):
    """Products on and beside every E2M1 grid point and tie, 1x16 blocks; with amax= given (the
    enc of the construction) and computed by the kernel (the same, as the max block amax)."""
    _need_cuda_backend()
    x, ga = near_tie_matrix(dtype, seed=int(given) + 3 * (dtype == torch.float16))
    # (n_blocks, 16) -> (512, 128): 8 blocks per row, rows multiple of 16 and not
    x = x.reshape(512, 128).to(DEV)
    kw = {"amax": ga.to(DEV)} if given else {}
    K.check_pair(x, "nvfp4", {}, backend="cuda", **kw)
    K.check_pair(x[:500], "nvfp4", {}, backend="cuda", **kw)
    K.check_pair(x.reshape(4096, 16), "nvfp4", {"two_d": True}, backend="cuda", **kw)
    # Share of products that the construction put exactly on a tie (the case the magic add must get right).
    s_enc = N.nvfp4_global_encode_scale(ga)
    q = ckptq.quantize(x, "nvfp4", **kw)
    s = q.components()["scale"].float().cpu().reshape(-1, 1)
    enc = torch.fmin(torch.reciprocal(s * torch.reciprocal(s_enc)), torch.tensor(N.FLT_MAX))
    v = (x.float().cpu().reshape(-1, 16) * enc).abs()
    ties = torch.isin(v, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).float().mean().item()
    assert ties > 0.1, ties


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("amax", [2688.0, 1.0, 6.0 * 448.0 * 2.0**-20, 3.0e38, 1.0e-30])
def test_nvfp4_every_16bit_pattern_cuda(dtype, amax):
    """All 2^16 bf16 / fp16 bit patterns (NaN, inf, subnormals, both zeros) in 1x16 and 16x16
    blocks, under several global amaxes (so S_enc and the block scales sweep their ranges)."""
    _need_cuda_backend()
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    for shape in [(4096, 16), (256, 256), (16, 4096)]:
        xs = x.reshape(shape).to(DEV)
        K.check_pair(xs, "nvfp4", {}, backend="cuda", amax=torch.tensor(amax, device=DEV))
        K.check_pair(xs, "nvfp4", {"two_d": True}, backend="cuda", amax=torch.tensor(amax, device=DEV))
    K.check_pair(x.reshape(256, 256).to(DEV), "nvfp4", {}, backend="cuda")


def test_nvfp4_baseline_encode_switch_cuda(monkeypatch):
    """CKPTQ_NVFP4_ENCODE=baseline runs the earlier encode kernel (per-block division, threshold E2M1
    rounding; the benchmark's baseline): the same bytes as the reference and as the default kernel."""
    _need_cuda_backend()
    x = K.random_hp((3, 96, 512), seed=12).to(DEV)
    for src in (x, x.to(torch.bfloat16), K.make_source("mxfp8", {}, x)):
        for rec in ({}, {"two_d": True}):
            with ops.force("cuda"):
                new = (
                    ckptq.requantize(src, "nvfp4", **rec)
                    if isinstance(src, ckptq.QuantizedTensor)
                    else ckptq.quantize(src, "nvfp4", **rec)
                ).components()
            monkeypatch.setenv("CKPTQ_NVFP4_ENCODE", "baseline")
            K.check_pair(src, "nvfp4", rec, backend="cuda")
            with ops.force("cuda"):
                old = (
                    ckptq.requantize(src, "nvfp4", **rec)
                    if isinstance(src, ckptq.QuantizedTensor)
                    else ckptq.quantize(src, "nvfp4", **rec)
                ).components()
            monkeypatch.delenv("CKPTQ_NVFP4_ENCODE")
            K.assert_same(old, new, "baseline vs default nvfp4 encode")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (3, 70, 160),
        (5, 33, 48),
        (1, 1, 16),
        (7, 16, 16),
        (3, 2000, 2720),
        (1, 999, 4112),
        (1, 4001, 4096),
        (1, 48, 8192),
    ],
    ids=lambda s: "x".join(map(str, s)),
)
def test_nvfp4_streaming_kernel_cuda(dtype, shape, monkeypatch):
    """The streaming bf16/fp16 -> nvfp4 kernel: tiles across matrices of a batch (different
    amaxes), a partial last tile, more tiles than resident CTAs (stage reuse), the two-pass order
    (reversed) and amax= per matrix; the same bytes as the reference and as the other kernels
    (CKPTQ_NVFP4_ENCODE=tile, baseline)."""
    _need_cuda_backend()
    x = K.random_hp(shape, seed=sum(shape))
    x[0] *= 1e-3
    if shape[0] > 2:
        x[2] *= 1e4
    x = x.to(dtype).to(DEV)
    amax = (torch.rand(shape[0], generator=torch.Generator().manual_seed(1)) * 50).to(DEV)
    K.check_pair(x, "nvfp4", {}, backend="cuda")
    K.check_pair(x, "nvfp4", {}, backend="cuda", amax=amax)
    with ops.force("cuda"):
        new = ckptq.quantize(x, "nvfp4").components()
        new_amax = ckptq.quantize(x, "nvfp4", amax=amax).components()
        for mode in ("tile", "baseline"):
            monkeypatch.setenv("CKPTQ_NVFP4_ENCODE", mode)
            K.assert_same(ckptq.quantize(x, "nvfp4").components(), new, f"CKPTQ_NVFP4_ENCODE={mode}")
            K.assert_same(ckptq.quantize(x, "nvfp4", amax=amax).components(), new_amax, f"{mode}, amax=")
        monkeypatch.delenv("CKPTQ_NVFP4_ENCODE")

"""Kernel backends vs the reference (the spec), byte for byte, plus the op registry.

Every source -> target pair over {fp32, bf16, fp16, fp8_tensor, fp8_block, mxfp8, nvfp4, mxfp4} with
the recipes (fp8 e4m3/e5m2, pow2 on/off, blocks (1,128)/(128,128), columnwise copies (mxfp8, nvfp4 1x16,
fp8_block 1x128), nvfp4 two_d, the four mxfp4 scale rules), on
random, ragged and batched shapes and on edge inputs, must give the reference's bytes
(``ckptq.metrics.bit_exact`` compares ``.view(torch.uint8)``, NaN payloads included). The helpers
take a device so that ``test_kernels_cuda.py`` runs the same cases on the GPU.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import ckptq
from ckptq import numerics, ops
from ckptq.errors import CkptqError
from ckptq.metrics import bit_exact
from ckptq.ops import _backends

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

SOURCES = [
    ("fp32", {}),
    ("bf16", {}),
    ("fp16", {}),
    ("fp8_tensor", {"fp8_dtype": E4M3}),
    ("fp8_tensor", {"fp8_dtype": E5M2, "pow2": True}),
    ("fp8_block", {"block": (128, 128)}),
    ("fp8_block", {"block": (1, 128), "fp8_dtype": E5M2, "pow2": False}),
    ("mxfp8", {}),
    ("nvfp4", {}),
    ("nvfp4", {"two_d": True}),
    ("mxfp4", {}),
    ("mxfp4", {"scale_rule": "rceil"}),
]
TARGETS = [
    ("fp32", {}),
    ("bf16", {}),
    ("fp16", {}),
    ("fp8_tensor", {"fp8_dtype": E4M3}),
    ("fp8_tensor", {"fp8_dtype": E5M2, "pow2": True}),
    ("fp8_block", {"block": (128, 128)}),
    ("fp8_block", {"block": (1, 128), "fp8_dtype": E5M2, "pow2": False}),
    ("mxfp8", {}),
    ("mxfp8", {"columnwise": True}),
    ("nvfp4", {}),
    ("nvfp4", {"two_d": True}),
    ("mxfp4", {"scale_rule": "floor"}),
    ("mxfp4", {"scale_rule": "even"}),
    ("mxfp4", {"scale_rule": "ceil"}),
    ("mxfp4", {"scale_rule": "rceil"}),
    # columnwise copies the ops compute by running the rowwise kernels on x^T
    ("fp8_block", {"block": (1, 128), "columnwise": True}),
    ("nvfp4", {"columnwise": True}),
]


def case_id(c) -> str:
    fmt, rec = c
    parts = [fmt] + [f"{k}={str(v).replace('torch.float8_', '')}" for k, v in rec.items()]
    return "-".join(parts).replace(" ", "")


def random_hp(shape, dtype=torch.float32, device="cpu", seed=0) -> torch.Tensor:
    """Random values over a wide dynamic range (2^-10 .. 2^10 times N(0, 1)), some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-10, 11, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.02] = 0.0
    return x.to(dtype).to(device)


def make_source(fmt: str, rec: dict, x: torch.Tensor):
    """The source of a pair: a plain tensor for hp formats, else ``x`` quantized by the reference."""
    if fmt in HP:
        return x.to(HP[fmt])
    with ops.force("reference"):
        return ckptq.quantize(x, fmt, **rec)


def convert(src, fmt: str, rec: dict, **kw):
    """Run one pair through the registry (whatever backend is forced)."""
    if fmt in HP:
        if isinstance(src, ckptq.QuantizedTensor):
            return {"x": src.dequantize(HP[fmt])}
        sf = {v: k for k, v in HP.items()}[src.dtype]
        if ops.backend_name(src.device) == "reference":  # hp -> hp: a dequantize (fp32, NaN canonical)
            return {"x": numerics._canonical_nan(numerics._f32(src)).to(HP[fmt])}
        (y,) = torch.ops.ckptq.requantize([src], sf, [], fmt, [])
        return {"x": y}
    return ckptq.requantize(src, fmt, **rec, **kw).components()


def assert_same(ref: dict, got: dict, what: str):
    assert list(ref) == list(got), f"{what}: components {list(got)} != {list(ref)}"
    for name in ref:
        r, g = ref[name], got[name]
        assert r.dtype == g.dtype and r.shape == g.shape, (
            f"{what}/{name}: {g.dtype}{tuple(g.shape)} vs {r.dtype}{tuple(r.shape)}"
        )
        rb, gb = r.contiguous().reshape(-1).view(torch.uint8), g.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(rb, gb):  # on the tensors' device; same check as ckptq.metrics.bit_exact
            rb, gb = rb.cpu(), gb.cpu()
            bad = (rb != gb).nonzero().flatten()
            raise AssertionError(
                f"{what}/{name}: {bad.numel()} of {rb.numel()} bytes differ; first at byte {bad[0].item()}: "
                f"kernel {gb[bad[0]].item():#04x} vs reference {rb[bad[0]].item():#04x}"
            )


def check_pair(src, dst_fmt, dst_rec, backend: str, **kw):
    with ops.force("reference"):
        ref = convert(src, dst_fmt, dst_rec, **kw)
    with ops.force(backend):
        got = convert(src, dst_fmt, dst_rec, **kw)
    assert_same(ref, got, f"{type(src).__name__} -> {dst_fmt}{dst_rec}")


def special_values(device="cpu") -> torch.Tensor:
    """fp32 edge values: zeros of both signs, +-inf, NaN (both signs), fp32 subnormals, values at
    and beyond the FP8 / E2M1 saturation points, ties of the E2M1 and FP8 grids."""
    bits = [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00000,
        0x00000001,
        0x80000001,
        0x007FFFFF,
        0x00400000,
        0x7F7FFFFF,
        0xFF7FFFFF,
    ]
    vals = [
        448.0,
        464.0,
        480.0,
        -479.9,
        57344.0,
        61440.0,
        6.0,
        5.0,
        3.5,
        2.5,
        1.75,
        1.25,
        0.75,
        0.25,
        -0.25,
        -0.1,
        2.0**-9,
        2.0**-10,
        1.5 * 2.0**-10,
        2.0**-16,
        2.0**-17,
        1e-30,
        1e30,
    ]
    t = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([t, torch.tensor(vals, dtype=torch.float32)]).to(device)


def edge_matrix(device="cpu") -> torch.Tensor:
    """A (3, 40, 160) batch: matrix 0 holds the special values among random ones (so blocks see
    NaN, inf, saturation, subnormals), matrix 1 is all zeros (amax 0), matrix 2 is tiny subnormals."""
    x = random_hp((3, 40, 160), seed=7)
    s = special_values()
    x[0].view(-1)[torch.arange(s.numel()) * 97 % x[0].numel()] = s
    x[1] = 0.0
    x[1, 3, 5] = -0.0
    x[2] = x[2] * 1e-41
    return x.to(device)


# ----------------------------------------------------------------------------- CPU tests
def _need_cpu():
    active, reason, _ = _backends.status("cpu")
    if not active:
        pytest.skip(f"C++ CPU backend not active: {reason}")


SHAPES = [(2, 70, 200), (32, 256)]


@pytest.fixture(scope="module")
def sources():
    cache = {}

    def get(fmt, rec, shape, device="cpu"):
        key = (case_id((fmt, rec)), shape, str(device))
        if key not in cache:
            cache[key] = make_source(fmt, rec, random_hp(shape, seed=len(shape) + shape[-1], device=device))
        return cache[key]

    return get


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dst", TARGETS, ids=case_id)
@pytest.mark.parametrize("src", SOURCES, ids=case_id)
def test_pair_bit_exact_cpu(src, dst, shape, sources):
    _need_cpu()
    check_pair(sources(*src, shape), *dst, backend="cpu")


@pytest.mark.parametrize("dst", TARGETS, ids=case_id)
@pytest.mark.parametrize(
    "src", [s for s in SOURCES if s[0] in HP or s[0] in ("mxfp8", "nvfp4", "fp8_block", "mxfp4")], ids=case_id
)
def test_edge_values_cpu(src, dst):
    """NaN, +-inf, -0.0, subnormals, saturation, an all-zero matrix (amax 0), tiny matrices."""
    _need_cpu()
    check_pair(make_source(*src, edge_matrix()), *dst, backend="cpu")


def crafted_sources(device="cpu"):
    """Quantized sources with special scales a quantizer never writes: E8M0 bytes 0/254/255 (mxfp8, mxfp4),
    NVFP4 amax NaN/inf/0 and NaN block scales, FP8 scale_inv inf/NaN/0/negative, FP8 NaN data."""
    g = torch.Generator().manual_seed(3)
    m, k = 34, 96
    out = []
    data = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
    mx_scale = torch.randint(0, 256, (m, k // 32), generator=g, dtype=torch.uint8)
    mx_scale[0, :] = torch.tensor([0, 254, 255])
    out.append(
        ckptq.from_components(
            {"format": "mxfp8", "version": 1, "shape": [m, k], "dtype": "bfloat16", "recipe": {}},
            {"data": data.view(E4M3), "scale": mx_scale},
        )
    )
    out.append(
        ckptq.from_components(
            {"format": "mxfp4", "version": 1, "shape": [m, k], "dtype": "float32", "recipe": {}},
            {"data": torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8), "scale": mx_scale},
        )
    )
    for amax in (float("nan"), float("inf"), 0.0, 3.5):
        nv_scale = torch.randint(0, 256, (m, k // 16), generator=g, dtype=torch.uint8)
        nv_scale[1, 0] = 0x7F  # NaN block scale
        out.append(
            ckptq.from_components(
                {"format": "nvfp4", "version": 1, "shape": [m, k], "dtype": "float32", "recipe": {}},
                {
                    "data": torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8),
                    "scale": nv_scale.view(E4M3),
                    "amax": torch.tensor(amax),
                },
            )
        )
    si = torch.tensor([[float("inf"), float("nan"), 0.0]]).expand(1, 3).clone()
    si = torch.cat([si, torch.tensor([[-2.0, 1e-30, 3.0]])])
    out.append(
        ckptq.from_components(
            {
                "format": "fp8_block",
                "version": 1,
                "shape": [m, k],
                "dtype": "float32",
                "recipe": {"block": [32, 32], "fp8_dtype": "float8_e4m3fn"},
            },
            {"data": data.view(E4M3), "scale_inv": si[:, :3].repeat(1, 1)[: -(-m // 32), : k // 32].contiguous()},
        )
    )
    out.append(
        ckptq.from_components(
            {
                "format": "fp8_tensor",
                "version": 1,
                "shape": [m, k],
                "dtype": "float32",
                "recipe": {"fp8_dtype": "float8_e5m2"},
            },
            {"data": data.view(E5M2), "scale_inv": torch.tensor(0.5)},
        )
    )
    return [q.to(device) for q in out]


@pytest.mark.parametrize("dst", TARGETS, ids=case_id)
def test_crafted_scales_cpu(dst):
    _need_cpu()
    for src in crafted_sources():
        check_pair(src, *dst, backend="cpu")


def amax_scale_cases():
    nan, inf = float("nan"), float("inf")
    return [
        ("nvfp4", {}, {"amax": 0.0}),
        ("nvfp4", {}, {"amax": 1.0}),  # below the real amax: saturation at 6
        ("nvfp4", {"two_d": True}, {"amax": nan}),
        ("nvfp4", {}, {"amax": inf}),
        ("nvfp4", {}, {"amax": torch.tensor([3.0, 1e-3, 1e30])}),  # one per matrix
        ("nvfp4", {"columnwise": True}, {"amax": torch.tensor([3.0, 1e-3, 1e30])}),  # the copy shares it
        ("fp8_tensor", {}, {"amax": 0.5}),
        ("fp8_tensor", {"fp8_dtype": E5M2, "pow2": True}, {"amax": torch.tensor([nan, inf, 2.0])}),
        ("fp8_tensor", {}, {"scale": 1e6}),  # saturation
        ("fp8_tensor", {}, {"scale": 0.0}),
        ("fp8_tensor", {"fp8_dtype": E5M2}, {"scale": torch.tensor([nan, -1.0, 3.0])}),
        ("fp8_tensor", {}, {"amax": 2.0, "scale": 4.0}),  # scale wins
        ("fp8_tensor", {"eps": 1e-3}, {}),
        ("fp8_block", {"eps": 1e-3, "block": (16, 32)}, {}),
    ]


@pytest.mark.parametrize("src", [("bf16", {}), ("mxfp8", {}), ("nvfp4", {})], ids=case_id)
@pytest.mark.parametrize("case", amax_scale_cases(), ids=lambda c: f"{c[0]}-{list(c[1].items())}-{list(c[2])}")
def test_explicit_amax_scale_cpu(src, case):
    _need_cpu()
    fmt, rec, kw = case
    x = random_hp((3, 20, 64), seed=11)
    x[1] *= 1e-4
    check_pair(make_source(*src, x), fmt, rec, backend="cpu", **kw)


def cast_sweep(device="cpu") -> torch.Tensor:
    """Every bf16 bit pattern as fp32, plus random fp32 bit patterns (all exponents, all mantissas)."""
    hi = torch.arange(-(2**15), 2**15, dtype=torch.int32) << 16
    rnd = torch.randint(-(2**31), 2**31 - 1, (2**17,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    return torch.cat([hi, rnd.to(torch.int32)]).view(torch.float32).reshape(-1, 256).to(device)


@pytest.mark.parametrize(
    "dst",
    [
        ("fp8_tensor", {"fp8_dtype": E4M3}, {"scale": 1.0}),
        ("fp8_tensor", {"fp8_dtype": E5M2}, {"scale": 1.0}),
        ("mxfp8", {}, {}),
        ("nvfp4", {}, {"amax": 2688.0}),
        ("mxfp4", {}, {}),
        ("mxfp4", {"scale_rule": "even"}, {}),
        ("mxfp4", {"scale_rule": "rceil"}, {}),
        ("bf16", {}, {}),
        ("fp16", {}, {}),
    ],
    ids=lambda c: c[0] + str(list(c[1].values())),
)
def test_cast_sweep_cpu(dst):
    """All 65536 bf16-representable fp32 patterns and 128K random ones through each cast."""
    _need_cpu()
    fmt, rec, kw = dst
    check_pair(cast_sweep(), fmt, rec, backend="cpu", **kw)


def test_amax_op_cpu():
    _need_cpu()
    x = edge_matrix()
    for src in [
        x,
        x.to(torch.float16),
        make_source("nvfp4", {"two_d": True}, x),
        make_source("mxfp8", {}, x),
        make_source("mxfp4", {}, x),
    ]:
        with ops.force("reference"):
            ref = ops.amax(src)
        with ops.force("cpu"):
            got = ops.amax(src)
        assert bit_exact(ref, got), (ref, got)
        assert got.shape == (3,)


def check_mxfp4_partial_blocks(backend: str, device="cpu"):
    for shape in ((3, 40, 80), (64, 48), (5, 18)):
        x = random_hp(shape, seed=shape[-1]).to(device)
        for rule in numerics.MXFP4_SCALE_RULES:
            for src in (x, x.to(torch.bfloat16), make_source("mxfp8", {}, x)):
                check_pair(src, "mxfp4", {"scale_rule": rule}, backend=backend)
            q = make_source("mxfp4", {"scale_rule": rule}, x)
            for dst in (("bf16", {}), ("fp32", {}), ("nvfp4", {}), ("mxfp8", {})):
                check_pair(q, *dst, backend=backend)


def test_mxfp4_partial_last_block_cpu():
    _need_cpu()
    check_mxfp4_partial_blocks("cpu")


def test_noncontiguous_and_views_cpu():
    _need_cpu()
    x = random_hp((64, 96), seed=2)
    check_pair(x.t(), "nvfp4", {}, backend="cpu")  # (96, 64) transposed view
    check_pair(x[:, 16:80], "mxfp8", {"columnwise": True}, backend="cpu")  # storage offset
    check_pair(x[:, 32:96], "mxfp4", {"scale_rule": "even"}, backend="cpu")
    q = make_source("fp8_block", {"block": (1, 128)}, random_hp((4, 256, 256), seed=3))
    check_pair(q[1:3], "nvfp4", {}, backend="cpu")  # slice of a batch: views of the components


# ------------------------------------------------------------------------------- op checks
def opcheck_cases(device="cpu"):
    x = random_hp((2, 40, 96), seed=4, device=device).to(torch.bfloat16)
    nv = make_source("nvfp4", {}, x.float().cpu()).to(device)
    mx = make_source("mxfp8", {}, x.float().cpu()).to(device)
    mx4 = make_source("mxfp4", {"scale_rule": "even"}, x.float().cpu()).to(device)
    amax = torch.tensor([1.0, 2.0], device=device)
    return [
        ([x], "bf16", [], "nvfp4", [1, 16], None, False, 0.0, False, None, None),
        ([x], "bf16", [], "fp8_block", [128, 128], E4M3, True, 0.0, False, None, None),
        ([x], "bf16", [], "fp8_tensor", [], E5M2, False, 0.0, False, amax, None),
        (
            [mx._components["data"], mx._components["scale"]],
            "mxfp8",
            [1, 32],
            "nvfp4",
            [16, 16],
            None,
            False,
            0.0,
            False,
            None,
            None,
        ),
        (
            [mx._components["data"], mx._components["scale"]],
            "mxfp8",
            [1, 32],
            "mxfp8",
            [1, 32],
            None,
            False,
            0.0,
            True,
            None,
            None,
        ),
        (
            [nv._components["data"], nv._components["scale"], nv._components["amax"]],
            "nvfp4",
            [1, 16],
            "bf16",
            [],
            None,
            False,
            0.0,
            False,
            None,
            None,
        ),
        ([x], "bf16", [], "mxfp4", [1, 32], None, False, 0.0, False, None, None, "rceil"),
        ([mx4._components["data"], mx4._components["scale"]], "mxfp4", [1, 32], "fp32", []),
    ]


def opcheck_utils(args):
    # opcheck's schema test compares inputs with ops that have no float8 CPU kernels; with fp8
    # inputs it runs the fake-tensor, autograd-registration and AOT-dispatch tests only.
    if any(t.dtype in (E4M3, E5M2) for t in args[0]):
        return ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("i", range(8))
def test_opcheck_requantize_cpu(i):
    _need_cpu()
    args = opcheck_cases()[i]
    torch.library.opcheck(torch.ops.ckptq.requantize.default, args, test_utils=opcheck_utils(args))


def test_opcheck_amax_cpu():
    _need_cpu()
    x = random_hp((2, 40, 96), seed=4).to(torch.float16)
    torch.library.opcheck(torch.ops.ckptq.amax.default, ([x], "fp16", []))


def test_op_errors_cpu():
    _need_cpu()
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="unknown target format 'nvfp5'"):
        torch.ops.ckptq.requantize([x], "fp32", [], "nvfp5", [])
    with pytest.raises(RuntimeError, match="has dtype"):
        torch.ops.ckptq.requantize([x], "bf16", [], "nvfp4", [1, 16])
    with pytest.raises(RuntimeError, match="K must be even"):
        torch.ops.ckptq.requantize([torch.randn(4, 33)], "fp32", [], "nvfp4", [1, 16])
    with pytest.raises(RuntimeError, match="needs fp8_dtype"):
        torch.ops.ckptq.requantize([x], "fp32", [], "fp8_block", [1, 128])
    with pytest.raises(RuntimeError, match="scale_inv' has shape"):
        torch.ops.ckptq.requantize([x.to(E4M3), torch.ones(3)], "fp8_tensor", [], "fp32", [])


def test_empty_matrices_follow_the_reference():
    x = torch.zeros(0, 64)
    q = ckptq.quantize(x, "mxfp8")
    assert q._components["scale"].shape == (0, 2)
    with pytest.raises((RuntimeError, IndexError)):  # the reference's amax of an empty tensor is undefined
        ckptq.quantize(x, "nvfp4")


# ------------------------------------------------------------------------------ registry
@pytest.fixture
def clean_backends(monkeypatch):
    monkeypatch.delenv("CKPTQ_BACKEND", raising=False)
    _backends.reset()
    yield
    _backends.reset()


def test_backend_report_shape(clean_backends):
    r = ops.backend_report()
    assert r["torch"] == torch.__version__
    assert set(r["backends"]) == {"reference", "cpu", "cuda"}
    for b in r["backends"].values():
        assert isinstance(b["active"], bool) and isinstance(b["reason"], str) and b["reason"]
    assert r["backends"]["reference"]["active"] is True
    if torch.version.cuda is None:
        assert not r["backends"]["cuda"]["active"] and "not a CUDA build" in r["backends"]["cuda"]["reason"]


def test_forcing_backends(clean_backends, monkeypatch):
    monkeypatch.setenv("CKPTQ_BACKEND", "reference")
    assert ops.backend_name("cpu") == "reference"
    assert ops.backend_report()["forced"] == "reference"
    monkeypatch.setenv("CKPTQ_BACKEND", "tpu")
    with pytest.raises(CkptqError, match="not a backend"):
        ops.backend_name("cpu")
    monkeypatch.setenv("CKPTQ_BACKEND", "cuda")
    assert ops.backend_name("cpu") == "reference"  # a forced kernel backend serves only its device
    monkeypatch.delenv("CKPTQ_BACKEND")
    with ops.force("reference"):
        assert ops.backend_name("cpu") == "reference"
    assert ops.backend_name("meta") == "reference"


def test_broken_extension_degrades_with_one_warning(clean_backends, monkeypatch):
    monkeypatch.setitem(_backends._MODULES, "cpu", "ckptq._C_does_not_exist")
    x = random_hp((8, 64), seed=1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = ckptq.quantize(x, "nvfp4")
        b = ckptq.quantize(x, "mxfp8")
        assert ops.backend_name("cpu") == "reference"
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning) and "ckptq" in str(w.message)]
    assert len(msgs) == 1 and "cpu kernels are unavailable" in msgs[0], msgs
    assert not ops.backend_report()["backends"]["cpu"]["active"]
    with ops.force("reference"):
        assert bit_exact(a._components["data"], ckptq.quantize(x, "nvfp4")._components["data"])
        assert bit_exact(b._components["scale"], ckptq.quantize(x, "mxfp8")._components["scale"])
    monkeypatch.setenv("CKPTQ_BACKEND", "cpu")  # forcing a missing backend is an error, not a fallback
    with pytest.raises(CkptqError, match="not active"):
        ckptq.quantize(x, "nvfp4")


def test_registry_uses_kernels_for_quantize_dequantize_requantize(clean_backends, monkeypatch):
    """The public entry points reach torch.ops.ckptq.requantize when a kernel backend is active."""
    _need_cpu()
    calls = []
    real = torch.ops.ckptq.requantize

    class Spy:
        def __call__(self, *a, **k):
            calls.append((a[1], a[3]))
            return real(*a, **k)

    monkeypatch.setattr(torch.ops.ckptq, "requantize", Spy())
    x = random_hp((16, 64), seed=9).to(torch.bfloat16)
    q = ckptq.quantize(x, "nvfp4")
    q.dequantize(torch.bfloat16)
    ckptq.requantize(q, "fp8_block", block=(1, 128))
    assert calls == [("bf16", "nvfp4"), ("nvfp4", "bf16"), ("nvfp4", "fp8_block")]


def test_requantize_keeps_logical_dtype_and_recipe():
    x = random_hp((2, 48, 64), seed=12).to(torch.bfloat16)
    q = ckptq.quantize(x, "mxfp8", columnwise=True)
    out = ckptq.requantize(q, "nvfp4", two_d=True)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and out.recipe.two_d
    with pytest.raises(ckptq.UnsupportedFormatError):
        ckptq.requantize(q, "mxfp8", amax=1.0)
    with pytest.raises(ckptq.QuantizationError):
        ckptq.requantize(ckptq.quantize(torch.randn(4, 33), "fp8_tensor"), "nvfp4")


def test_float64_dequantize_is_fp32_math_then_cast():
    _need_cpu()
    q = make_source("nvfp4", {}, random_hp((8, 32), seed=13))
    with ops.force("reference"):
        ref = q.dequantize(torch.float64)
    with ops.force("cpu"):
        got = q.dequantize(torch.float64)
    assert bit_exact(ref, got)


def test_cuda_support_rule_matches_docs():
    """Blocks the CUDA kernels take; the rest runs on the reference (on the GPU)."""
    args = ops.kernel_args
    from ckptq.formats import make_recipe

    ok = ops._cuda_supports
    hp = args("bf16", None)
    assert ok(hp, args("fp8_block", make_recipe("fp8_block", block=(128, 128))))
    assert ok(hp, args("fp8_block", make_recipe("fp8_block", block=(1, 512))))
    assert not ok(hp, args("fp8_block", make_recipe("fp8_block", block=(128, 256))))
    assert not ok(hp, args("fp8_block", make_recipe("fp8_block", block=(3, 128))))
    assert not ok(args("fp8_block", make_recipe("fp8_block", block=(1, 8))), hp)
    assert math.prod((1,)) == 1


PRODUCER_NVFP4 = [
    ("nvfp4", {"per_tensor": "global_scale_inv"}),
    ("nvfp4", {"per_tensor": "global_scale", "two_d": True}),
]


@pytest.mark.parametrize("dst", TARGETS + PRODUCER_NVFP4, ids=case_id)
@pytest.mark.parametrize("src", PRODUCER_NVFP4, ids=case_id)
def test_producer_nvfp4_source_cpu(src, dst):
    """From an NVFP4 tensor in a producer's global-scale convention (the kernels take ckptq's amax
    only; ops decodes it through the reference): the CPU backend gives the reference's bytes, and
    requantize equals quantize(dequantize(src)) as for every other pair."""
    _need_cpu()
    src_t = make_source(*src, random_hp((3, 48, 64)))
    check_pair(src_t, *dst, backend="cpu")
    if dst[0] not in HP:
        with ops.force("cpu"):
            want = ckptq.quantize(src_t.dequantize(torch.float32), dst[0], **dst[1]).components()
        assert_same(want, convert(src_t, *dst), "requantize vs quantize(dequantize)")


@pytest.mark.parametrize("src", SOURCES, ids=case_id)
def test_producer_nvfp4_target_cpu(src):
    """Into the producer conventions: the CPU backend gives the reference's bytes."""
    _need_cpu()
    for dst in PRODUCER_NVFP4:
        check_pair(make_source(*src, random_hp((2, 32, 64))), *dst, backend="cpu")

"""The quantized tensor subclasses and ``ckptq.quantize``: layouts, overrides, errors, the ops that
checkpointing needs (and only those), serialization and DTensor.

Expected component layouts are written here from the component tables of docs/formats.md (``_layout``),
not taken from the formats' own ``component_specs``, so a drift of either is caught.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re

import pytest
import torch
from _helpers import assert_same_bytes, assert_same_components, raw_bytes

import ckptq
from ckptq import numerics as N

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

CASES = [
    ("fp8_tensor", {}),
    ("fp8_tensor", {"fp8_dtype": E5M2, "pow2": True}),
    ("fp8_block", {}),
    ("fp8_block", {"block": (1, 128)}),
    ("mxfp8", {}),
    ("mxfp8", {"columnwise": True}),
    ("nvfp4", {}),
    ("nvfp4", {"two_d": True}),
    ("mxfp4", {}),
    ("mxfp4", {"scale_rule": "rceil"}),
    ("fp8_block", {"block": (1, 128), "columnwise": True}),
    ("nvfp4", {"columnwise": True}),
]
IDS = [f"{f}-" + ",".join(f"{k}={v}" for k, v in r.items()) for f, r in CASES]
CLASSES = {
    "fp8_tensor": ckptq.Float8Tensor,
    "fp8_block": ckptq.Float8BlockTensor,
    "mxfp8": ckptq.MXFP8Tensor,
    "nvfp4": ckptq.NVFP4Tensor,
    "mxfp4": ckptq.MXFP4Tensor,
}
# (288, 400): 288 = 2*128 + 32 and 400 = 3*128 + 16 = 12*32 + 16 are ragged for the 128 and 32 blocks
# and multiples of 16: every format has a partial block somewhere.
SHAPE = (288, 400)


def _layout(fmt: str, recipe: dict, shape) -> dict:
    """docs/formats.md (sections 3-7 and 8): component -> (dtype, per component dim: (logical dim, divisor))."""
    nb = len(shape) - 2
    batch = [(d, 1) for d in range(nb)]
    m, k = nb, nb + 1
    if fmt == "fp8_tensor":
        fp8 = recipe.get("fp8_dtype", E4M3)
        return {"data": (fp8, batch + [(m, 1), (k, 1)]), "scale_inv": (torch.float32, batch)}
    if fmt == "fp8_block":
        bm, bk = recipe.get("block", (128, 128))
        fp8 = recipe.get("fp8_dtype", E4M3)
        out = {
            "data": (fp8, batch + [(m, 1), (k, 1)]),
            "scale_inv": (torch.float32, batch + [(m, bm), (k, bk)]),
        }
        if recipe.get("columnwise"):  # x^T with (bm, bk) blocks, stored untransposed: (bk, bm) blocks
            out["columnwise_data"] = (fp8, batch + [(m, 1), (k, 1)])
            out["columnwise_scale_inv"] = (torch.float32, batch + [(m, bk), (k, bm)])
        return out
    if fmt == "mxfp8":
        out = {
            "data": (E4M3, batch + [(m, 1), (k, 1)]),
            "scale": (torch.uint8, batch + [(m, 1), (k, 32)]),
        }
        if recipe.get("columnwise"):
            out["columnwise_data"] = (E4M3, batch + [(m, 1), (k, 1)])
            out["columnwise_scale"] = (torch.uint8, batch + [(m, 32), (k, 1)])
        return out
    if fmt == "nvfp4":
        out = {
            "data": (torch.uint8, batch + [(m, 1), (k, 2)]),
            "scale": (E4M3, batch + [(m, 16 if recipe.get("two_d") else 1), (k, 16)]),
            "amax": (torch.float32, batch),
        }
        if recipe.get("columnwise"):  # x^T with 1x16 blocks, stored untransposed: packed along M
            out["columnwise_data"] = (torch.uint8, batch + [(m, 2), (k, 1)])
            out["columnwise_scale"] = (E4M3, batch + [(m, 16), (k, 1)])
        return out
    if fmt == "mxfp4":
        return {
            "data": (torch.uint8, batch + [(m, 1), (k, 2)]),
            "scale": (torch.uint8, batch + [(m, 1), (k, 32)]),
        }
    raise AssertionError(fmt)


def _cdiv(a, b):
    return -(-a // b)


def _expected_shapes(fmt, recipe, shape):
    return {
        n: (dt, tuple(_cdiv(shape[d], q) for d, q in dims)) for n, (dt, dims) in _layout(fmt, recipe, shape).items()
    }


def _alignment(fmt, recipe, shape):
    out = [1] * len(shape)
    for _, dims in _layout(fmt, recipe, shape).values():
        for d, q in dims:
            out[d] = math.lcm(out[d], q)
    return out


def _expected_narrow(qt, fmt, recipe, dim, start, length):
    """The components of ``qt.narrow(dim, start, length)`` cut by hand from the full components."""
    out = {}
    comps = qt.components()
    for name, (_, dims) in _layout(fmt, recipe, tuple(qt.shape)).items():
        t = comps[name]
        for cdim, (d, q) in enumerate(dims):
            if d == dim:
                lo, hi = start // q, _cdiv(start + length, q)
                if length == 0:  # an empty cut is an empty tensor: no blocks at all
                    lo = hi = min(_cdiv(start, q), t.shape[cdim])
                t = t.narrow(cdim, lo, hi - lo)
        out[name] = t
    return out


def _randn(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def quantized():
    """One quantized (288, 400) tensor per case, shared by the read-only tests."""
    x = _randn(SHAPE, seed=1) * 3
    return {i: ckptq.quantize(x, f, **r) for i, (f, r) in zip(IDS, CASES, strict=False)}


# =============================================================================================== #
# Layouts: logical shape and dtype, ceil-sized scale grids, batch dims                            #
# =============================================================================================== #
@pytest.mark.parametrize("fmt, recipe", CASES, ids=IDS)
@pytest.mark.parametrize("shape", [(288, 400), (5, 34), (1, 2), (3, 40, 18), (2, 1, 17, 48)])
def test_component_layout(fmt, recipe, shape, backend):
    if fmt in ("nvfp4", "mxfp4") and shape[-1] % 2:
        pytest.skip("odd K is an error for nvfp4 and mxfp4 (tested below)")
    x = _randn(shape, seed=2, dtype=torch.bfloat16)
    if fmt == "nvfp4" and recipe.get("columnwise") and shape[-2] % 2:  # its copy is packed along M
        with pytest.raises(ckptq.QuantizationError, match=r"dim .* not a multiple of 2: component 'columnwise_data'"):
            ckptq.quantize(x, fmt, **recipe)
        return
    qt = ckptq.quantize(x, fmt, **recipe)
    assert type(qt) is CLASSES[fmt]
    assert isinstance(qt, ckptq.QuantizedTensor) and isinstance(qt, torch.Tensor)
    assert tuple(qt.shape) == shape and qt.dtype == torch.bfloat16 and qt.ndim == len(shape)
    assert qt.device == torch.device("cpu") and not qt.requires_grad
    comps = qt.components()
    want = _expected_shapes(fmt, recipe, shape)
    assert sorted(comps) == sorted(want)
    for name, (dt, shp) in want.items():
        assert comps[name].dtype == dt, name
        assert tuple(comps[name].shape) == shp, name
    assert list(qt.block_alignment()) == _alignment(fmt, recipe, shape)
    d = qt.descriptor()
    assert d["format"] == fmt and d["shape"] == list(shape) and d["dtype"] == "bfloat16"
    assert {n: tuple(c["shape"]) for n, c in d["components"].items()} == {n: s for n, (_, s) in want.items()}


def test_ragged_grids_explicit(backend):
    # fp8_block 128x128 on (130, 200): ceil(130/128) x ceil(200/128) = 2 x 2
    assert ckptq.quantize(_randn((130, 200)), "fp8_block").components()["scale_inv"].shape == (2, 2)
    # fp8_block 1x128 on (130, 200): 130 x 2
    assert ckptq.quantize(_randn((130, 200)), "fp8_block", block=(1, 128)).components()["scale_inv"].shape == (130, 2)
    # mxfp8 on (5, 40): 5 x ceil(40/32) = 5 x 2; columnwise ceil(5/32) x 40 = 1 x 40
    c = ckptq.quantize(_randn((5, 40)), "mxfp8", columnwise=True).components()
    assert c["scale"].shape == (5, 2) and c["columnwise_scale"].shape == (1, 40)
    # nvfp4 on (20, 18): data 20 x 9, scale 20 x ceil(18/16) = 20 x 2; 16x16: 2 x 2
    c = ckptq.quantize(_randn((20, 18)), "nvfp4").components()
    assert c["data"].shape == (20, 9) and c["scale"].shape == (20, 2) and c["amax"].shape == ()
    assert ckptq.quantize(_randn((20, 18)), "nvfp4", two_d=True).components()["scale"].shape == (2, 2)


def test_ragged_block_amax_covers_only_real_elements(backend):
    # The partial block's amax is over real elements only: a (1, 130) row with 1x128 blocks whose last
    # block holds [0.5, -0.25] gets scale 448/0.5 -> pow2 512, scale_inv 2^-9 (padding never counts).
    x = torch.full((1, 130), 100.0)
    x[0, 128:] = torch.tensor([0.5, -0.25])
    c = ckptq.quantize(x, "fp8_block", block=(1, 128)).components()
    assert c["scale_inv"][0, 1].item() == 2.0**-9
    assert c["data"][0, 128:].float().tolist() == [256.0, -128.0]


@pytest.mark.parametrize("fmt, recipe", CASES, ids=IDS)
def test_batch_dims_are_independent_matrices(fmt, recipe, backend):
    # (E, M, K) == stacking E independent 2-D quantizations, byte for byte; per-tensor values gain
    # the batch dim. Experts get very different magnitudes so their scales differ.
    e, m, k = 3, 40, 96
    x = _randn((e, m, k), seed=3) * torch.tensor([1e-3, 1.0, 50.0]).reshape(e, 1, 1)
    qt = ckptq.quantize(x, fmt, **recipe)
    per = [ckptq.quantize(x[i], fmt, **recipe) for i in range(e)]
    for name, t in qt.components().items():
        want = torch.stack([p.components()[name] for p in per])
        assert_same_bytes(t, want, name)
    for name in qt.per_tensor_names():
        assert qt.components()[name].shape == (e,)
        assert len(set(qt.components()[name].tolist())) == e, f"{name} must differ per expert"
    assert_same_bytes(qt.dequantize(), torch.stack([p.dequantize() for p in per]), "dequantize")


# =============================================================================================== #
# amax= / scale= overrides                                                                        #
# =============================================================================================== #
def test_fp8_tensor_scale_override(backend):
    x = _randn((2, 8, 16), seed=4)
    qt = ckptq.quantize(x, "fp8_tensor", scale=4.0)
    c = qt.components()
    assert c["scale_inv"].tolist() == [0.25, 0.25]
    assert_same_bytes(c["data"], N.cast_fp8(x * 4.0, E4M3), "data")
    per = ckptq.quantize(x, "fp8_tensor", scale=torch.tensor([2.0, 8.0]))
    assert per.components()["scale_inv"].tolist() == [0.5, 0.125]
    assert_same_bytes(per.components()["data"][1], N.cast_fp8(x[1] * 8.0, E4M3), "data[1]")
    # scale wins over amax
    both = ckptq.quantize(x, "fp8_tensor", scale=4.0, amax=1.0)
    assert_same_components(both, qt, "scale over amax")


def test_fp8_tensor_amax_override(backend):
    x = _randn((8, 16), seed=5)
    qt = ckptq.quantize(x, "fp8_tensor", amax=7.0)
    want_scale = N.fp8_scale_from_amax(torch.tensor(7.0), 448.0, pow2=False)
    assert qt.components()["scale_inv"].item() == torch.reciprocal(want_scale).item()
    # per-batch amax
    x3 = _randn((2, 8, 16), seed=5)
    qb = ckptq.quantize(x3, "fp8_tensor", amax=torch.tensor([7.0, 0.5]))
    assert qb.components()["scale_inv"].tolist() == [
        torch.reciprocal(N.fp8_scale_from_amax(torch.tensor(a), 448.0, pow2=False)).item() for a in (7.0, 0.5)
    ]


@pytest.mark.parametrize("fmt, recipe", [("nvfp4", {}), ("nvfp4", {"two_d": True}), ("fp8_tensor", {})])
def test_shards_with_global_amax_equal_narrow_of_whole(fmt, recipe, backend):
    # What the amax override is for: shards quantized with the reduced global amax hold exactly the
    # bytes of the corresponding block-aligned narrow of the whole tensor.
    x = _randn((64, 96), seed=6)
    whole = ckptq.quantize(x, fmt, **recipe)
    amax = x.abs().amax()
    for dim, start, n in [(1, 0, 48), (1, 48, 48), (0, 32, 32)]:
        shard = ckptq.quantize(x.narrow(dim, start, n), fmt, amax=amax, **recipe)
        assert_same_components(shard, whole.narrow(dim, start, n), f"shard {dim}/{start}")


def test_nvfp4_amax_override_is_stored(backend):
    x = _randn((4, 32), seed=7)
    qt = ckptq.quantize(x, "nvfp4", amax=100.0)
    assert qt.components()["amax"].item() == 100.0
    q3 = ckptq.quantize(_randn((2, 4, 32)), "nvfp4", amax=torch.tensor([1.0, 2.0]))
    assert q3.components()["amax"].tolist() == [1.0, 2.0]


# =============================================================================================== #
# Errors                                                                                          #
# =============================================================================================== #
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("k", [1, 17, 33])
def test_fp4_odd_k_raises(fmt, k, backend):
    with pytest.raises(ckptq.QuantizationError, match="odd") as ei:
        ckptq.quantize(torch.randn(4, k), fmt)
    assert fmt in str(ei.value) and f"(4, {k})" in str(ei.value)
    with pytest.raises(ckptq.QuantizationError, match="odd"):
        ckptq.requantize(ckptq.quantize(torch.randn(4, k), "fp8_tensor"), fmt)


BAD_OPTIONS = [
    ("nvfp4", {"foo": 1}),
    ("mxfp8", {"block": (1, 32)}),
    ("fp8_tensor", {"block": (128, 128)}),
    ("fp8_tensor", {"fp8_dtype": torch.float16}),
    ("fp8_block", {"fp8_dtype": torch.bfloat16}),
    ("fp8_block", {"fp8_dtype": "float8_e4m3fn"}),
    ("fp8_block", {"block": (0, 128)}),
    ("fp8_block", {"block": (128,)}),
    ("fp8_block", {"block": (128, 128, 1)}),
    ("fp8_block", {"block": 128}),
    ("fp8_block", {"pow2": "no"}),  # a truthy string must not switch pow2 on
    ("fp8_tensor", {"pow2": None}),
    ("fp8_tensor", {"eps": -1.0}),
    ("fp8_tensor", {"eps": float("nan")}),
    ("fp8_block", {"eps": "0"}),
    ("mxfp8", {"columnwise": "yes"}),
    ("nvfp4", {"two_d": "yes"}),
    ("mxfp4", {"scale_rule": "round_up"}),
    ("mxfp4", {"scale_rule": "FLOOR"}),
    ("mxfp4", {"amax": 1.0}),
    ("mxfp4", {"scale": 1.0}),
    ("mxfp4", {"two_d": True}),
    ("nvfp4", {"columnwise": "yes"}),
    ("fp8_block", {"columnwise": "yes", "block": (1, 128)}),
    ("nvfp4", {"two_d": True, "columnwise": True}),  # 16x16: the copy is the transpose, nothing to store
    ("fp8_block", {"columnwise": True}),  # 128x128: likewise
    ("fp8_block", {"columnwise": True, "block": (32, 32)}),
    ("fp8_block", {"amax": 1.0}),
    ("mxfp8", {"amax": 1.0}),
    ("mxfp8", {"scale": 1.0}),
    ("nvfp4", {"scale": 1.0}),
    ("fp8_block", {"scale": 2.0}),
    ("int4", {}),
    ("fp4", {}),
]


@pytest.mark.parametrize("fmt, options", BAD_OPTIONS, ids=[f"{f}-{o}" for f, o in BAD_OPTIONS])
def test_bad_recipe_options_raise(fmt, options):
    with pytest.raises(ckptq.UnsupportedFormatError) as ei:
        ckptq.quantize(torch.randn(4, 256), fmt, **options)
    assert fmt in str(ei.value)


@pytest.mark.parametrize("fmt, recipe", [("nvfp4", {}), ("fp8_block", {"block": (1, 128)})])
def test_descriptor_without_columnwise_key_reads_as_rowwise_only(fmt, recipe):
    """Descriptors written before the nvfp4 / fp8_block ``columnwise`` option existed (and those of
    tensors without the copy now: the option is left out at its default)."""
    qt = ckptq.quantize(_randn((64, 256)), fmt, **recipe)
    d = qt.descriptor()
    assert "columnwise" not in d["recipe"]  # left out at its default: the descriptor older ckptq wrote
    back = ckptq.from_components(d, qt.components())
    assert back.recipe == qt.recipe and not back.recipe.columnwise
    assert_same_components(back, qt, "old descriptor")
    d["recipe"]["columnwise"] = False  # explicit is read the same
    assert ckptq.from_components(d, qt.components()).recipe == qt.recipe
    assert ckptq.quantize(_randn((64, 256)), fmt, columnwise=True, **recipe).descriptor()["recipe"]["columnwise"]


@pytest.mark.parametrize("fmt, recipe", [("nvfp4", {}), ("fp8_block", {"block": (1, 128)})])
def test_columnwise_copy_is_the_transposed_encoding(fmt, recipe, backend):
    """The stored columnwise copy is the rowwise encoding of x^T (same amax), transposed back, and
    rowwise_only() drops exactly it; requantize into the recipe computes the same bytes."""
    x = _randn((2, 96, 256), seed=4) * torch.logspace(-2, 1, 96)[:, None]
    qt = ckptq.quantize(x, fmt, columnwise=True, **recipe)
    t = ckptq.quantize(x.mT.contiguous(), fmt, **recipe).components()
    c = qt.components()
    scale = "scale" if fmt == "nvfp4" else "scale_inv"
    assert_same_bytes(c["columnwise_data"], t["data"].mT, "columnwise_data")
    assert_same_bytes(c[f"columnwise_{scale}"], t[scale].mT, f"columnwise_{scale}")
    row = qt.rowwise_only()
    assert_same_components(row, ckptq.quantize(x, fmt, **recipe), "rowwise_only")
    assert row.rowwise_only() is row
    src = ckptq.quantize(x, "mxfp8")
    assert_same_components(
        ckptq.requantize(src, fmt, columnwise=True, **recipe),
        ckptq.quantize(src.dequantize(), fmt, columnwise=True, **recipe),
        "requantize",
    )


def test_flag_options_accept_bools_and_ints():
    assert ckptq.quantize(torch.randn(4, 32), "nvfp4", two_d=1).recipe.two_d is True
    assert ckptq.quantize(torch.randn(4, 32), "fp8_block", pow2=0).recipe.pow2 is False


@pytest.mark.parametrize(
    "x",
    [torch.ones(4, 32, dtype=torch.int32), torch.ones(32), torch.ones(4, 32, dtype=torch.float64), torch.tensor(1.0)],
    ids=["int32", "1-D", "float64", "0-D"],
)
def test_bad_inputs_raise(x):
    with pytest.raises(ckptq.QuantizationError):
        ckptq.quantize(x, "fp8_tensor")


def test_quantizing_a_quantized_tensor_raises():
    qt = ckptq.quantize(torch.randn(4, 32), "nvfp4")
    with pytest.raises(ckptq.QuantizationError, match="requantize"):
        ckptq.quantize(qt, "mxfp8")


# =============================================================================================== #
# Input and output dtypes                                                                         #
# =============================================================================================== #
@pytest.mark.parametrize("fmt, recipe", CASES, ids=IDS)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_quantize_from_half_types(fmt, recipe, src, backend):
    # Inputs are converted to fp32 first: the same values in fp32 give the same bytes.
    x = _randn((32, 64), seed=8, dtype=src)
    qt = ckptq.quantize(x, fmt, **recipe)
    assert qt.dtype == src
    assert_same_components(qt, ckptq.quantize(x.float(), fmt, **recipe), f"from {src}")


@pytest.mark.parametrize("fmt, recipe", CASES, ids=IDS)
def test_dequantize_dtypes(quantized, fmt, recipe, backend):
    qt = quantized[IDS[CASES.index((fmt, recipe))]]
    hp = qt.dequantize()
    assert hp.dtype == torch.float32 and tuple(hp.shape) == SHAPE and type(hp) is torch.Tensor
    assert_same_bytes(qt.dequantize(torch.float32), hp, "fp32")
    for dt in (torch.bfloat16, torch.float16):
        out = qt.dequantize(dt)
        assert type(out) is torch.Tensor
        assert_same_bytes(out, hp.to(dt), str(dt))  # fp32 math, one cast at the end


# =============================================================================================== #
# The subclass: ops that checkpointing needs                                                      #
# =============================================================================================== #
def _storage_ptrs(qt):
    return {k: v.untyped_storage().data_ptr() for k, v in qt.components().items()}


@pytest.mark.parametrize("case", IDS)
def test_detach_to_cpu(quantized, case):
    qt = quantized[case]
    d = qt.detach()
    assert type(d) is type(qt) and d.shape == qt.shape and d.dtype == qt.dtype and d.recipe == qt.recipe
    assert_same_components(d, qt, "detach")
    assert qt.to("cpu") is qt and qt.cpu() is qt  # already there: torch returns self
    c = qt.to("cpu", copy=True)
    assert type(c) is type(qt)
    assert_same_components(c, qt, "to(copy=True)")
    assert all(a != b for a, b in zip(_storage_ptrs(c).values(), _storage_ptrs(qt).values(), strict=False))
    assert qt.to(torch.device("cpu"), qt.dtype) is qt


@pytest.mark.parametrize("case", IDS)
def test_to_meta_keeps_layout(quantized, case):
    qt = quantized[case]
    m = qt.to("meta")
    assert type(m) is type(qt) and m.device.type == "meta" and m.shape == qt.shape
    assert {k: (v.dtype, v.shape) for k, v in m.components().items()} == {
        k: (v.dtype, v.shape) for k, v in qt.components().items()
    }


@pytest.mark.parametrize("case", IDS)
def test_clone_is_an_independent_copy(quantized, case):
    qt = quantized[case]
    c = qt.clone()
    assert type(c) is type(qt)
    assert_same_components(c, qt, "clone")
    before = {k: raw_bytes(v).clone() for k, v in qt.components().items()}
    for v in c.components().values():
        v.view(torch.uint8).zero_() if v.dim() else v.zero_()
    for k, v in qt.components().items():
        assert torch.equal(raw_bytes(v), before[k]), f"clone shares '{k}'"


@pytest.mark.parametrize("case", IDS)
def test_new_empty_empty_like_zeros_like(quantized, case):
    qt = quantized[case]
    fmt, recipe = CASES[IDS.index(case)]
    e = torch.empty_like(qt)
    assert type(e) is type(qt) and e.shape == qt.shape and e.dtype == qt.dtype and e.recipe == qt.recipe
    assert {k: (v.dtype, v.shape) for k, v in e.components().items()} == {
        k: (v.dtype, v.shape) for k, v in qt.components().items()
    }
    z = torch.zeros_like(qt)
    assert type(z) is type(qt)
    assert all(raw_bytes(v).eq(0).all() for v in z.components().values())
    z2 = torch.zeros_like(qt, device="cpu")
    assert type(z2) is type(qt)
    new_shape = (64, 32)
    n = qt.new_empty(new_shape)
    assert type(n) is type(qt) and tuple(n.shape) == new_shape and n.dtype == qt.dtype
    want = _expected_shapes(fmt, recipe, new_shape)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in n.components().items()} == want
    with pytest.raises(NotImplementedError):
        qt.new_empty(new_shape, dtype=torch.float16 if qt.dtype != torch.float16 else torch.float32)


@pytest.mark.parametrize("case", IDS)
def test_copy_same_layout_copies_raw_bytes(quantized, case):
    qt = quantized[case]
    dst = torch.zeros_like(qt)
    out = dst.copy_(qt)
    assert out is dst
    assert_same_components(dst, qt, "copy_")
    # a block-aligned narrow into a tensor of the narrow's layout
    part = qt.narrow(0, 128, 128)
    dst2 = qt.new_empty(tuple(part.shape))
    dst2.copy_(part)
    assert_same_components(dst2, part, "copy_ of a narrow")


def test_copy_mismatched_layout_raises(quantized):
    nv, nv2d, mx = quantized[IDS[6]], quantized[IDS[7]], quantized[IDS[4]]
    with pytest.raises(NotImplementedError, match="copy_"):
        torch.zeros_like(nv).copy_(nv2d)  # same format, other recipe
    with pytest.raises(NotImplementedError, match="copy_"):
        torch.zeros_like(nv).copy_(mx)  # other format
    with pytest.raises(NotImplementedError, match="copy_"):
        nv.new_empty((16, 400)).copy_(nv.narrow(0, 0, 32))  # other shape
    with pytest.raises(NotImplementedError, match="copy_"):
        torch.zeros_like(nv).copy_(torch.randn(SHAPE))  # plain -> quantized: never a silent quantize
    with pytest.raises(NotImplementedError, match="copy_"):
        torch.empty(SHAPE).copy_(nv)  # quantized -> plain: never a silent dequantize


@pytest.mark.parametrize("case", IDS)
def test_is_pinned(quantized, case):
    assert quantized[case].is_pinned() is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs a CUDA runtime")
@pytest.mark.parametrize("case", IDS)
def test_pin_memory(quantized, case):
    qt = quantized[case]
    p = qt.pin_memory()
    assert type(p) is type(qt) and p.is_pinned()
    assert_same_components(p, qt, "pin_memory")


# ----------------------------------------------------------------------------------------------- #
# narrow / slicing                                                                                 #
# ----------------------------------------------------------------------------------------------- #
# (dim, start, length), aligned for every format on (288, 400): multiples of 128 or the dim's end.
ALIGNED_CUTS = [(0, 128, 128), (0, 256, 32), (0, 0, 288), (1, 128, 128), (1, 384, 16), (1, 0, 256), (0, 128, 0)]


@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("dim, start, length", ALIGNED_CUTS)
def test_narrow_aligned_keeps_raw_bytes(quantized, case, dim, start, length, backend):
    qt = quantized[case]
    fmt, recipe = CASES[IDS.index(case)]
    part = qt.narrow(dim, start, length)
    assert type(part) is type(qt) and part.recipe == qt.recipe and part.dtype == qt.dtype
    want_shape = list(SHAPE)
    want_shape[dim] = length
    assert list(part.shape) == want_shape
    want = _expected_narrow(qt, fmt, recipe, dim, start, length)
    for name, t in part.components().items():
        assert_same_bytes(t, want[name], f"{case} narrow({dim}, {start}, {length}) '{name}'")
    # decode is block-local: the narrow dequantizes to the same values as the whole, cut
    assert_same_bytes(part.dequantize(), qt.dequantize().narrow(dim, start, length), "dequantize")


@pytest.mark.parametrize("case", IDS)
def test_slicing_syntax(quantized, case):
    qt = quantized[case]
    assert_same_components(qt[128:256], qt.narrow(0, 128, 128), "[128:256]")
    assert_same_components(qt[:, 128:], qt.narrow(1, 128, 272), "[:, 128:]")
    assert_same_components(qt[-32:], qt.narrow(0, 256, 32), "[-32:]")
    assert_same_components(qt[:, :256][128:], qt.narrow(1, 0, 256).narrow(0, 128, 160), "chained")


def test_narrow_fp8_tensor_anywhere(quantized):
    qt = quantized[IDS[0]]  # one scale per tensor: no block to split
    part = qt.narrow(0, 3, 7).narrow(1, 5, 11)
    assert_same_bytes(part.components()["data"], qt.components()["data"][3:10, 5:16], "data")
    assert_same_bytes(part.components()["scale_inv"], qt.components()["scale_inv"], "scale_inv")


def test_narrow_batch_and_3d(backend):
    x = _randn((4, 64, 96), seed=9)
    for fmt, recipe in CASES:
        qt = ckptq.quantize(x, fmt, **recipe)
        for dim, start, n in [(0, 1, 2), (1, 32, 32), (2, 32, 64)]:
            if _alignment(fmt, recipe, x.shape)[dim] > 1 and (start % _alignment(fmt, recipe, x.shape)[dim]):
                continue
            part = qt.narrow(dim, start, n)
            want = _expected_narrow(qt, fmt, recipe, dim, start, n)
            for name, t in part.components().items():
                assert_same_bytes(t, want[name], f"{fmt} {recipe} narrow({dim},{start},{n}) {name}")


UNALIGNED = [
    # (case index, dim, start, length, boundary, block)
    (2, 0, 64, 64, 64, 128),  # fp8_block 128x128, rows
    (2, 1, 0, 100, 100, 128),  # fp8_block, end boundary
    (3, 1, 128, 64, 192, 128),  # fp8_block 1x128 along K
    (4, 1, 16, 32, 16, 32),  # mxfp8 along K
    (5, 0, 16, 32, 16, 32),  # mxfp8 columnwise copy has 32x1 blocks: rows too
    (6, 1, 8, 16, 8, 16),  # nvfp4 along K
    (6, 1, 16, 1, 17, 16),  # nvfp4: odd cut would also split a packed byte
    (7, 0, 8, 16, 8, 16),  # nvfp4 16x16 along M
    (8, 1, 16, 32, 16, 32),  # mxfp4 along K
    (9, 1, 32, 1, 33, 32),  # mxfp4: odd cut would also split a packed byte
    (10, 0, 64, 64, 64, 128),  # fp8_block 1x128 columnwise copy has 128x1 blocks: rows too
    (11, 0, 8, 16, 8, 16),  # nvfp4 1x16 columnwise copy has 16x1 blocks: rows too
]


@pytest.mark.parametrize("idx, dim, start, length, boundary, block", UNALIGNED)
def test_narrow_unaligned_raises_sharding_error(quantized, idx, dim, start, length, boundary, block):
    qt = quantized[IDS[idx]]
    with pytest.raises(ckptq.ShardingError) as ei:
        qt.narrow(dim, start, length)
    msg = str(ei.value)
    assert re.search(rf"\bdim {dim}\b", msg), msg
    assert re.search(rf"\b{boundary}\b", msg), msg
    assert re.search(rf"\b{block}\b", msg), msg
    with pytest.raises(ckptq.ShardingError):
        qt[(slice(None),) * dim + (slice(start, start + length),)]


@pytest.mark.parametrize("idx, dim", [(3, 0), (4, 0), (6, 0)])
def test_unblocked_dims_cut_anywhere(quantized, idx, dim):
    # 1x128 fp8_block, rowwise-only MXFP8 and 1x16 NVFP4 have no block along M.
    qt = quantized[IDS[idx]]
    fmt, recipe = CASES[idx]
    part = qt.narrow(dim, 3, 5)
    want = _expected_narrow(qt, fmt, recipe, dim, 3, 5)
    for name, t in part.components().items():
        assert_same_bytes(t, want[name], name)


# ----------------------------------------------------------------------------------------------- #
# Everything else raises                                                                           #
# ----------------------------------------------------------------------------------------------- #
OTHER_OPS = [
    ("add", lambda q: q + 1),
    ("mul", lambda q: q * 2.0),
    ("mm", lambda q: torch.matmul(q, torch.randn(q.shape[-1], 4, dtype=q.dtype))),
    ("mm", lambda q: torch.mm(q, torch.randn(q.shape[-1], 4, dtype=q.dtype))),
    ("sum", lambda q: q.sum()),
    ("abs", lambda q: q.abs()),
    ("cat", lambda q: torch.cat([q, q])),
    ("select", lambda q: q[0]),
    ("view", lambda q: q.view(-1)),
    ("t", lambda q: q.t()),
    ("dequantize", lambda q: q.to(torch.float16)),  # a dtype change would dequantize: refused
    ("dequantize", lambda q: q.half()),
    # F.linear decomposes to aten.t first: the error names the first op that reaches the tensor
    ("aten.t", lambda q: torch.nn.functional.linear(torch.randn(2, q.shape[-1], dtype=q.dtype), q)),
]


@pytest.mark.parametrize("case", [IDS[0], IDS[2], IDS[5], IDS[7]])
@pytest.mark.parametrize("name, op", OTHER_OPS, ids=[f"{n}{i}" for i, (n, _) in enumerate(OTHER_OPS)])
def test_other_ops_raise_not_implemented(quantized, case, name, op):
    qt = quantized[case]
    with pytest.raises(NotImplementedError) as ei:
        op(qt)
    assert name in str(ei.value)


# =============================================================================================== #
# Serialization                                                                                   #
# =============================================================================================== #
@pytest.mark.parametrize("case", IDS)
def test_from_components_roundtrip(quantized, case):
    qt = quantized[case]
    d = qt.descriptor()
    s = json.dumps(d)  # JSON-serializable
    for desc in (d, json.loads(s)):
        back = ckptq.from_components(desc, qt.components())
        assert type(back) is type(qt) and back.shape == qt.shape and back.dtype == qt.dtype
        assert back.recipe == qt.recipe
        assert_same_components(back, qt, "from_components")
    assert d["version"] == 1


def test_from_components_rejects_wrong_components(quantized):
    qt = quantized[IDS[6]]
    comps = qt.components()
    with pytest.raises(ckptq.CheckpointFormatError):
        ckptq.from_components(qt.descriptor(), {k: v for k, v in comps.items() if k != "amax"})
    with pytest.raises(ckptq.CheckpointFormatError):
        ckptq.from_components(qt.descriptor(), {**comps, "scale": comps["scale"][:, :-1]})
    with pytest.raises(ckptq.CheckpointFormatError):
        ckptq.from_components({**qt.descriptor(), "version": 99}, comps)
    with pytest.raises(ckptq.CheckpointFormatError):
        ckptq.from_components({**qt.descriptor(), "recipe": {"two_d": "yes"}}, comps)


@pytest.mark.parametrize("case", IDS)
def test_deepcopy(quantized, case):
    qt = quantized[case]
    c = copy.deepcopy(qt)
    assert type(c) is type(qt) and c.shape == qt.shape and c.dtype == qt.dtype and c.recipe == qt.recipe
    assert_same_components(c, qt, "deepcopy")
    assert all(a != b for a, b in zip(_storage_ptrs(c).values(), _storage_ptrs(qt).values(), strict=False))


@pytest.mark.parametrize("case", IDS)
def test_torch_save_load(quantized, case, tmp_path):
    # torch.load's default (weights_only=True): ckptq allow-lists the one function a pickled
    # QuantizedTensor names, as torchao allow-lists its tensor classes
    qt = quantized[case]
    path = tmp_path / "qt.pt"
    torch.save({"w": qt, "part": qt.narrow(1, 128, 128)}, path)
    back = torch.load(path)
    for k, ref in (("w", qt), ("part", qt.narrow(1, 128, 128))):
        b = back[k]
        assert type(b) is type(ref) and b.shape == ref.shape and b.dtype == ref.dtype and b.recipe == ref.recipe
        assert_same_components(b, ref, f"torch.load {k}")


def test_torch_load_allows_only_the_rebuild_function():
    """The only ckptq global torch's weights_only unpickler may resolve: the function that checks
    builtins and plain tensors through ``from_components`` (no class, nothing that runs other code)."""
    from ckptq.formats.base import _rebuild_quantized

    ours = [g for g in torch.serialization.get_safe_globals() if getattr(g, "__module__", "").startswith("ckptq")]
    assert ours == [_rebuild_quantized]


@pytest.mark.parametrize("case", IDS)
def test_traceable_wrapper_protocol(quantized, case):
    # __tensor_flatten__ names must be attributes: torch's transform_subclass (used by compile,
    # fake tensors, subclass-aware utilities) rebuilds the tensor through them.
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass, transform_subclass

    qt = quantized[case]
    assert is_traceable_wrapper_subclass(qt)
    names, _ = qt.__tensor_flatten__()
    assert all(isinstance(getattr(qt, n), torch.Tensor) for n in names)
    back = transform_subclass(qt, lambda name, t: t.clone())
    assert type(back) is type(qt) and back.shape == qt.shape and back.recipe == qt.recipe
    assert_same_components(back, qt, "transform_subclass")
    with pytest.raises(AttributeError):
        _ = qt.no_such_attribute


def test_nan_payload_survives_serialization(backend):
    x = torch.ones(2, 32)
    x[0, 3] = float("nan")
    for fmt in ("fp8_tensor", "mxfp8", "nvfp4"):
        qt = ckptq.quantize(x, fmt)
        assert_same_components(copy.deepcopy(qt), qt, fmt)
        assert_same_components(ckptq.from_components(qt.descriptor(), qt.components()), qt, fmt)


# =============================================================================================== #
# DTensor on a one-process gloo mesh                                                              #
# =============================================================================================== #
@pytest.fixture
def gloo_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", IDS)
def test_dtensor_from_local(gloo_mesh, quantized, case):
    from torch.distributed.tensor import DTensor, Shard

    qt = quantized[case]
    local = qt.narrow(0, 128, 128)
    dt = DTensor.from_local(local, gloo_mesh, [Shard(0)])
    assert isinstance(dt, DTensor) and tuple(dt.shape) == (128, 400) and dt.dtype == qt.dtype
    assert dt.placements == (Shard(0),)
    back = dt.to_local()
    assert type(back) is type(qt) and back.shape == local.shape and back.recipe == qt.recipe
    assert_same_components(back, local, "to_local")
    assert ckptq.formats.base.unwrap_quantized(dt) is not None


# =============================================================================================== #
# Properties over random shapes                                                                   #
# =============================================================================================== #
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _shaped_case(draw):
    i = draw(st.integers(0, len(CASES) - 1))
    fmt, recipe = CASES[i]
    columnwise = recipe.get("columnwise", False)
    if fmt == "fp8_block":  # a columnwise copy of square blocks is refused (it is the transpose)
        blocks = [(1, 128), (4, 8), (3, 5)] + ([] if columnwise else [(16, 16)])
        recipe = {**recipe, "block": draw(st.sampled_from(blocks))}
    batch = draw(st.lists(st.integers(1, 3), max_size=1))
    m = draw(st.integers(1, 35)) * 2 if fmt == "nvfp4" and columnwise else draw(st.integers(1, 70))
    k = draw(st.integers(1, 50)) * 2
    return fmt, recipe, (*batch, m, k), draw(st.integers(0, 2**16))


@settings(
    max_examples=int(os.environ.get("CKPTQ_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # `backend` is a context only
)
@given(case=_shaped_case(), data=st.data())
def test_property_layout_roundtrip_and_cuts(case, data, backend):
    fmt, recipe, shape, seed = case
    x = _randn(shape, seed=seed) * 10
    qt = ckptq.quantize(x, fmt, **recipe)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in qt.components().items()} == _expected_shapes(fmt, recipe, shape)
    back = ckptq.from_components(json.loads(json.dumps(qt.descriptor())), qt.components())
    assert_same_components(back, qt, "roundtrip")
    full = qt.dequantize()
    assert tuple(full.shape) == shape
    align = _alignment(fmt, recipe, shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    size, a = shape[dim], align[dim]
    start = data.draw(st.integers(0, size))
    end = data.draw(st.integers(start, size))
    aligned = (start % a == 0 or start == size) and (end % a == 0 or end == size)
    if end == start:
        aligned = True  # empty cuts are always fine
    if aligned:
        part = qt.narrow(dim, start, end - start)
        want = _expected_narrow(qt, fmt, recipe, dim, start, end - start)
        for name, t in part.components().items():
            assert_same_bytes(t, want[name], name)
        assert_same_bytes(part.dequantize(), full.narrow(dim, start, end - start), "dequantize")
    else:
        with pytest.raises(ckptq.ShardingError):
            qt.narrow(dim, start, end - start)


# ------------------------------------------------------------------ NVFP4 global-scale conventions
def test_nvfp4_per_tensor_conventions():
    """Each convention stores its producer's value of the amax (docs/formats.md: ModelOpt/torchao
    amax / 2688, compressed-tensors 2688 / amax) over the same codes and block scales, decodes in its
    producer's op order, and round-trips through its descriptor and pickle."""
    x = torch.randn(3, 32, 64) * 5
    base = ckptq.quantize(x, "nvfp4")
    amax = base.components()["amax"]
    # what the producers compute from an fp32 amax (docs/formats.md): ModelOpt / torchao
    # amax.float() / (6.0 * 448.0); compressed-tensors 448.0 * 6.0 / amax, i.e. reciprocal * 2688
    want = {"global_scale_inv": amax / (6.0 * 448.0), "global_scale": 448.0 * 6.0 / amax}
    for pt, value in want.items():
        qt = ckptq.quantize(x, "nvfp4", per_tensor=pt)
        c = qt.components()
        assert list(c) == ["data", "scale", pt] and qt.descriptor()["recipe"]["per_tensor"] == pt
        assert_same_bytes(c["data"], base.components()["data"])
        assert_same_bytes(c["scale"], base.components()["scale"])
        assert_same_bytes(c[pt], value)
        s = c["scale"].float()
        mult = s * value[:, None, None] if pt == "global_scale_inv" else s / value[:, None, None]
        codes = N.e2m1_decode(N.unpack_fp4(c["data"]))
        assert_same_bytes(qt.dequantize(torch.float32), codes * mult.repeat_interleave(16, -1))
        assert_same_components(ckptq.from_components(qt.descriptor(), qt.components()), qt)
        assert_same_components(copy.deepcopy(qt), qt)
        assert_same_components(qt[:, 16:], ckptq.from_components(qt.descriptor(), qt.components())[:, 16:])
    with pytest.raises(ckptq.UnsupportedFormatError, match="per_tensor='scale_2' is not supported"):
        ckptq.quantize(x, "nvfp4", per_tensor="scale_2")


def test_nvfp4_with_per_tensor_keeps_codes_and_bounds_the_decode():
    """with_per_tensor keeps data and scale bytes and picks the value whose decode is closest; over
    300 random tensors (8 binades either side of 1) the decodes differ by at most 2 fp32 ulps
    (at most the figure it reports), and converting back to amax gives ckptq's decode where the
    conversion was exact."""
    g = torch.Generator().manual_seed(3)
    worst = {"global_scale_inv": 0, "global_scale": 0}
    for _ in range(300):
        x = torch.randn(16, 64, generator=g) * 2.0 ** int(torch.randint(-8, 9, (), generator=g))
        qt = ckptq.quantize(x, "nvfp4")
        for pt in worst:
            other, u = qt.with_per_tensor(pt)
            assert_same_bytes(other.components()["data"], qt.components()["data"])
            assert_same_bytes(other.components()["scale"], qt.components()["scale"])
            a, b = other.dequantize(torch.float32), qt.dequantize(torch.float32)
            # u covers every E2M1 value with every block scale that occurs: the codes present are a subset
            assert int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max()) <= u
            worst[pt] = max(worst[pt], u)
            if u == 0:
                back, u2 = other.with_per_tensor("amax")
                assert u2 == 0 and torch.equal(back.dequantize(), b)
    assert qt.with_per_tensor("amax") == (qt, 0)
    assert 0 < max(worst.values()) <= 2, worst


def test_columnwise_on_grid_drops_only_an_off_grid_copy():
    """Shards whose columnwise blocks (along M) are off the global grid, while their rowwise blocks
    are on it, give no global copy: rowwise_only(); else the tensor itself."""
    x = _randn((256, 256), seed=6)

    def rows(*cuts):
        return [((a, 0), (b - a, 256)) for a, b in zip(cuts, cuts[1:], strict=False)]

    bk = ckptq.quantize(x, "fp8_block", block=(1, 128), columnwise=True)
    assert bk.columnwise_on_grid((256, 256), rows(0, 128, 256)) is bk
    assert bk.columnwise_on_grid((256, 256), rows(0, 80, 160, 256)).recipe == bk.rowwise_only().recipe
    nv = ckptq.quantize(x, "nvfp4", columnwise=True)
    assert nv.columnwise_on_grid((256, 256), rows(0, 16, 256)) is nv
    assert not nv.columnwise_on_grid((256, 256), rows(0, 8, 256)).recipe.columnwise
    cols = [((0, 0), (256, 8)), ((0, 8), (256, 248))]  # the rowwise 1x16 blocks are cut: kept (the cut raises later)
    assert nv.columnwise_on_grid((256, 256), cols) is nv
    plain = ckptq.quantize(x, "nvfp4")
    assert plain.columnwise_on_grid((256, 256), rows(0, 8, 256)) is plain

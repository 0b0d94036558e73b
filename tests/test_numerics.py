"""Numerics of the five formats against the spec (docs/formats.md).

Layers, from the bottom up:

1. Element codecs, table-driven (one row per case, ties commented): FP8 E4M3 / E5M2 casts, E2M1,
   E8M0; then the fp32 -> FP8 cast swept against an *independent* reference built here from the bit
   fields of all 256 codes (nearest finite code, ties to the even code, saturation), so torch's
   cast is verified rather than assumed.
2. Scale rules: ``fp8_scale_from_amax`` and the NVFP4 global encode scale, edge cases included.
3. Whole formats against a scalar re-implementation of docs/formats.md written in this file
   with numpy fp32 arithmetic (no ckptq code involved), bit for bit, on random and special inputs.
4. Fixed small inputs whose bytes are derived by hand in the comments.
5. amax 0 / inf / NaN per format, with the exact scales docs/formats.md prescribes.
6. SQNR floors of dequantize(quantize(x)) on Gaussian inputs, each with its reasoning.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _helpers import assert_same_bytes

import ckptq
from ckptq import numerics as N
from ckptq.metrics import sqnr_db

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
NAN = float("nan")
INF = float("inf")


def _bits(v: float) -> int:
    """fp32 bit pattern of a Python float."""
    return int(np.array(v, dtype=np.float32).view(np.uint32))


def _from_bits(b: int) -> float:
    return float(np.array(b, dtype=np.uint32).view(np.float32))


# =============================================================================================== #
# Independent FP8 reference: values of every code from its bit fields                             #
# =============================================================================================== #
def _fp8_magnitudes(ebits: int, mbits: int, bias: int, ieee_specials: bool) -> np.ndarray:
    """Values of the non-negative finite codes 0, 1, 2, ... (index == code), float64.

    E4M3 ("fn"): no inf, only 0x7F is NaN -> codes 0..126. E5M2 (IEEE-like): exponent 31 is inf/NaN
    -> codes 0..123. Exponent field 0 is subnormal: m * 2^(1 - bias - mbits).
    """
    vals = []
    for code in range(128):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if ieee_specials and e == (1 << ebits) - 1:
            break
        if not ieee_specials and code == 0x7F:
            break
        if e == 0:
            vals.append(m * 2.0 ** (1 - bias - mbits))
        else:
            vals.append((1 + m / 2**mbits) * 2.0 ** (e - bias))
    return np.array(vals, dtype=np.float64)


FP8_REF = {E4M3: _fp8_magnitudes(4, 3, 7, False), E5M2: _fp8_magnitudes(5, 2, 15, True)}


def fp8_ref_codes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> FP8 code by exhaustive nearest finite value, ties to the even code, saturating.

    NaN maps to 0x7F (E4M3) / 0x7E (E5M2) with the sign bit; callers compare NaN by ``isnan``.
    Differences are taken in float64: exact wherever two candidates are close (both operands have
    few significant bits and nearby exponents), which is the only place a wrong pick could happen.
    """
    vals = torch.from_numpy(FP8_REF[dtype])
    a = x.to(torch.float64).abs()
    hi = torch.searchsorted(vals, a).clamp(max=len(vals) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    pick = torch.where(a >= vals[-1], torch.full_like(pick, len(vals) - 1), pick)  # satfinite, +-inf
    pick = torch.where(torch.isnan(x), torch.full_like(pick, 0x7F if dtype == E4M3 else 0x7E), pick)
    return pick.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 7)


def fp8_ref_decode(codes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Codes (uint8) -> fp32 values through the table (NaN codes -> NaN)."""
    vals = FP8_REF[dtype]
    mag = codes & 0x7F
    out = np.where(mag < len(vals), vals[np.minimum(mag, len(vals) - 1)], np.nan)
    out = np.where(codes & 0x80, -out, out)
    return out.astype(np.float32)


def assert_codes_equal(got: np.ndarray, want: np.ndarray, dtype: torch.dtype, what: str = "data") -> None:
    """FP8 codes equal, except that any NaN code matches any NaN code (NaN stays NaN; this comparison
    leaves the NaN's payload and sign aside: torch writes 0x7F for E5M2, IEEE's quiet NaN would be
    0x7E)."""

    def canon(c):
        c = np.asarray(c, dtype=np.uint8)
        return np.where(np.isnan(fp8_ref_decode(c, dtype)), np.uint8(0xFF), c)

    np.testing.assert_array_equal(canon(got), canon(want), err_msg=what)


def np_cast_fp8(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """numpy fp32 array -> FP8 codes (uint8) with the independent reference."""
    return fp8_ref_codes(torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)), dtype).numpy()


def test_reference_tables_are_the_formats():
    e4, e5 = FP8_REF[E4M3], FP8_REF[E5M2]
    assert (len(e4), e4[-1], e4[1], e4[8]) == (127, 448.0, 2.0**-9, 2.0**-6)
    assert (len(e5), e5[-1], e5[1], e5[4]) == (124, 57344.0, 2.0**-16, 2.0**-14)
    assert np.all(np.diff(e4) > 0) and np.all(np.diff(e5) > 0)


# =============================================================================================== #
# 1. FP8 casts, table-driven                                                                      #
# =============================================================================================== #
E4M3_CASES = [
    # (input, expected code, why)
    (0.0, 0x00, "+0"),
    (-0.0, 0x80, "-0 keeps its sign"),
    (1.0, 0x38, "exponent 7 + bias 7"),
    (1.0625, 0x38, "tie 1.0 (m=0) / 1.125 (m=1) -> even m=0"),
    (1.1875, 0x3A, "tie 1.125 (m=1) / 1.25 (m=2) -> even m=2"),
    (1.06, 0x38, "below the 1.0625 midpoint"),
    (1.07, 0x39, "above the 1.0625 midpoint"),
    (-2.5, 0xC2, "negative normal 1.25 * 2"),
    (232.0, 0x76, "tie 224 (m=6) / 240 (m=7) -> even 224"),
    (448.0, 0x7E, "largest finite"),
    (449.0, 0x7E, "rounds to 448"),
    (464.0, 0x7E, "tie 448 / 480: RNE gives 480 (not finite) -> saturate to 448"),
    (1.0e6, 0x7E, "saturate"),
    (INF, 0x7E, "+inf saturates to +448"),
    (-INF, 0xFE, "-inf saturates to -448"),
    (-1.0e30, 0xFE, "negative saturate"),
    (2.0**-6, 0x08, "smallest normal"),
    (7.5 * 2.0**-9, 0x08, "tie max subnormal 7*2^-9 (0x07) / min normal 8*2^-9 (0x08) -> even 0x08"),
    (6.5 * 2.0**-9, 0x06, "tie subnormals 6 / 7 -> even 6"),
    (3 * 2.0**-10, 0x02, "tie subnormals 1 / 2 (1.5*2^-9) -> even 2"),
    (2.0**-9, 0x01, "smallest subnormal"),
    (2.0**-10, 0x00, "tie 0 / 2^-9 -> even 0"),
    (-(2.0**-10), 0x80, "tie to -0, sign kept"),
    (1.0001 * 2.0**-10, 0x01, "just above the 0 / 2^-9 midpoint"),
    (-1.0e-30, 0x80, "underflow to -0"),
    (1.0e-45, 0x00, "fp32 subnormal input underflows to +0"),
]

E5M2_CASES = [
    (0.0, 0x00, "+0"),
    (-0.0, 0x80, "-0 keeps its sign"),
    (1.0, 0x3C, "exponent 15 + bias 15"),
    (1.125, 0x3C, "tie 1.0 (m=0) / 1.25 (m=1) -> even m=0"),
    (1.375, 0x3E, "tie 1.25 (m=1) / 1.5 (m=2) -> even m=2"),
    (1.875, 0x40, "tie 1.75 (m=3) / 2.0 (next exponent, m=0) -> even 2.0"),
    (-3.0, 0xC2, "negative normal 1.5 * 2"),
    (57344.0, 0x7B, "largest finite"),
    (61439.0, 0x7B, "below the 57344 / 65536 midpoint"),
    (61440.0, 0x7B, "tie 57344 / 65536 (inf): RNE gives inf -> saturate"),
    (1.0e9, 0x7B, "saturate"),
    (INF, 0x7B, "+inf saturates to +57344"),
    (-INF, 0xFB, "-inf saturates to -57344"),
    (2.0**-14, 0x04, "smallest normal"),
    (3.5 * 2.0**-16, 0x04, "tie max subnormal 3*2^-16 / min normal 4*2^-16 -> even 4"),
    (2.5 * 2.0**-16, 0x02, "tie subnormals 2 / 3 -> even 2"),
    (2.0**-16, 0x01, "smallest subnormal"),
    (2.0**-17, 0x00, "tie 0 / 2^-16 -> even 0"),
    (-(2.0**-17), 0x80, "tie to -0, sign kept"),
    (3 * 2.0**-17, 0x02, "tie subnormals 1 / 2 -> even 2"),
    (-1.0e-30, 0x80, "underflow to -0"),
]


@pytest.mark.parametrize("value, code, why", E4M3_CASES, ids=[c[2] for c in E4M3_CASES])
def test_cast_e4m3_table(value, code, why):
    got = N.cast_fp8(torch.tensor([value], dtype=torch.float32), E4M3).view(torch.uint8).item()
    assert got == code, f"{value!r} ({why}): got 0x{got:02X}, expected 0x{code:02X}"
    assert fp8_ref_codes(torch.tensor([value]), E4M3).item() == code  # the reference agrees


@pytest.mark.parametrize("value, code, why", E5M2_CASES, ids=[c[2] for c in E5M2_CASES])
def test_cast_e5m2_table(value, code, why):
    got = N.cast_fp8(torch.tensor([value], dtype=torch.float32), E5M2).view(torch.uint8).item()
    assert got == code, f"{value!r} ({why}): got 0x{got:02X}, expected 0x{code:02X}"
    assert fp8_ref_codes(torch.tensor([value]), E5M2).item() == code


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_nan_stays_nan(dtype, src):
    x = torch.tensor([NAN, -NAN, 1.0], dtype=src)
    out = N.cast_fp8(x, dtype).float()
    assert torch.isnan(out[:2]).all() and out[2].item() == 1.0


def _sweep_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Random fp32 bit patterns (every class: normal, subnormal, inf, huge), Gaussians over 2^-30..2^20,
    every midpoint between adjacent codes (ties, both signs) and the fp32 neighbours of each."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    anyfp = bits.view(torch.float32)
    scaled = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-30, 21, (200_000,), generator=g).float())
    vals = torch.from_numpy(FP8_REF[dtype])
    mids = ((vals[1:] + vals[:-1]) / 2).float()
    mids = torch.cat([mids, (vals[-1] * 1.0625).float().reshape(1)])  # the midpoint above max
    up = torch.nextafter(mids, torch.tensor(INF))
    down = torch.nextafter(mids, torch.tensor(0.0))
    specials = torch.tensor([0.0, -0.0, INF, -INF, FLT_MAX, -FLT_MAX, 1e-45, -1e-45])
    near = torch.cat([mids, up, down, vals.float()])
    return torch.cat([anyfp, scaled, near, -near, specials])


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_matches_independent_reference(dtype):
    x = _sweep_inputs(dtype)
    nan = torch.isnan(x)
    got = N.cast_fp8(x, dtype)
    assert torch.isnan(got[nan].float()).all(), "NaN must stay NaN"
    got_codes = got[~nan].view(torch.uint8)
    want = fp8_ref_codes(x[~nan], dtype)
    bad = (got_codes != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} mismatches, e.g. x={x[~nan][bad[:5]].tolist()} got "
        f"{got_codes[bad[:5]].tolist()} want {want[bad[:5]].tolist()}"
    )
    # torch's own cast (no clamp) inside the finite range is RNE too: what cast_fp8 relies on.
    fin = x[~nan]
    fin = fin[fin.abs() <= float(FP8_REF[dtype][-1])]
    assert torch.equal(fin.to(dtype).view(torch.uint8), fp8_ref_codes(fin, dtype))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_decode_of_every_code(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = codes.view(dtype).float().numpy()
    want = fp8_ref_decode(codes.numpy(), dtype)
    finite = ~np.isnan(want)
    if dtype == E5M2:  # 0x7C / 0xFC are +-inf in E5M2; the table treats exponent 31 as non-finite
        assert got[0x7C] == INF and got[0xFC] == -INF
        finite[[0x7C, 0xFC]] = False
        want[[0x7C, 0xFC]] = got[[0x7C, 0xFC]]
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(got[~finite & ~np.isinf(got)]).all()


# =============================================================================================== #
# E2M1                                                                                            #
# =============================================================================================== #
E2M1_CASES = [
    # (input, code, why) -- code = sign << 3 | index into {0, .5, 1, 1.5, 2, 3, 4, 6}
    (0.0, 0x0, "+0"),
    (0.25, 0x0, "tie 0 / 0.5 -> even index 0"),
    (0.2500001, 0x1, "just above the tie"),
    (0.3, 0x1, "nearest 0.5"),
    (0.5, 0x1, "exact"),
    (0.75, 0x2, "tie 0.5 (idx 1) / 1.0 (idx 2) -> even idx 2"),
    (0.7499999, 0x1, "just below the tie"),
    (1.0, 0x2, "exact"),
    (1.25, 0x2, "tie 1.0 (idx 2) / 1.5 (idx 3) -> even idx 2"),
    (1.2500001, 0x3, "just above the tie"),
    (1.5, 0x3, "exact"),
    (1.75, 0x4, "tie 1.5 (idx 3) / 2.0 (idx 4) -> even idx 4"),
    (2.0, 0x4, "exact"),
    (2.5, 0x4, "tie 2 (idx 4) / 3 (idx 5) -> even idx 4"),
    (2.5000002, 0x5, "just above the tie"),
    (3.0, 0x5, "exact"),
    (3.5, 0x6, "tie 3 (idx 5) / 4 (idx 6) -> even idx 6"),
    (3.4999998, 0x5, "just below the tie"),
    (4.0, 0x6, "exact"),
    (5.0, 0x6, "tie 4 (idx 6) / 6 (idx 7) -> even idx 6"),
    (5.0000005, 0x7, "> 5 -> 6"),
    (5.5, 0x7, "> 5 -> 6"),
    (6.0, 0x7, "max"),
    (-0.1, 0x8, "rounds to -0: sign bit kept"),
    (-0.0, 0x8, "-0"),
    (-0.75, 0xA, "negative tie -> -1.0"),
    (-2.5, 0xC, "negative tie -> -2.0"),
    (-5.0, 0xE, "negative tie -> -4.0"),
    (-6.0, 0xF, "-max"),
    (NAN, 0x7, "NaN -> +6 (code 0x7)"),
]


@pytest.mark.parametrize("value, code, why", E2M1_CASES, ids=[c[2] for c in E2M1_CASES])
def test_e2m1_encode_table(value, code, why):
    got = N.e2m1_encode(torch.tensor([value], dtype=torch.float32)).item()
    assert got == code, f"{value!r} ({why}): got 0x{got:X}, expected 0x{code:X}"


def test_e2m1_decode_every_code():
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = N.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == want
    assert torch.equal(torch.signbit(got), torch.arange(16) >= 8)  # -0.0 for code 8


def _e2m1_ref(v: np.ndarray) -> np.ndarray:
    """Independent E2M1: nearest grid value of |v|, ties to the even index; sign bit; NaN -> 7."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    a = np.abs(v.astype(np.float64))
    d = np.abs(a[..., None] - grid)
    best = d.min(axis=-1, keepdims=True)
    cand = d == best
    # among equally near candidates prefer the even index (at most two candidates, adjacent)
    even = cand & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(axis=-1), even.argmax(axis=-1), cand.argmax(axis=-1))
    code = idx.astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)
    return np.where(np.isnan(v), np.uint8(7), code).astype(np.uint8)


def test_e2m1_encode_matches_independent_reference():
    g = torch.Generator().manual_seed(3)
    v = (torch.rand(50_000, generator=g) * 12 - 6).float()
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(INF)), torch.nextafter(mids, torch.tensor(0.0))])
    v = torch.cat([v, near, -near, grid, -grid, torch.tensor([NAN])])
    np.testing.assert_array_equal(N.e2m1_encode(v).numpy(), _e2m1_ref(v.numpy()))


def test_fp4_nibble_order(backend):
    # [0.5, 6.0] -> codes [0x1, 0x7]; element 2i goes in the low nibble: byte = 0x1 | 0x7 << 4 = 0x71.
    codes = N.e2m1_encode(torch.tensor([[0.5, 6.0]]))
    packed = N.pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x71]]
    assert N.unpack_fp4(packed).tolist() == [[0x1, 0x7]]
    # and through the format: a 1x16 block with amax 6 has enc == 1 exactly (see the NVFP4 hand case)
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 0.5, 6.0
    assert ckptq.quantize(x, "nvfp4").components()["data"][0, 0].item() == 0x71


def test_pack_unpack_roundtrip_all_pairs():
    codes = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).reshape(4, 128)
    packed = N.pack_fp4(codes)
    assert packed.shape == (4, 64)
    assert torch.equal(N.unpack_fp4(packed), codes)
    assert torch.equal(packed, codes[:, 0::2] + 16 * codes[:, 1::2])


# =============================================================================================== #
# E8M0                                                                                            #
# =============================================================================================== #
E8M0_CASES = [
    # (fp32 bit pattern, expected byte, why)
    (_bits(0.0), 0, "0 -> 0"),
    (_bits(INF), 254, "inf -> 254"),
    (0x7FC00000, 255, "NaN -> 255"),
    (_bits(1.0), 127, "exact power of two: not bumped"),
    (_bits(2.0**-126), 1, "smallest normal 2^-126: not bumped"),
    (_bits(2.0**127), 254, "2^127: not bumped"),
    (_bits(1.5), 128, "mantissa != 0: exponent rounded up"),
    (_bits(1.0) + 1, 128, "1 + 1 ulp rounds up"),
    (_bits(0.75), 127, "0.75 -> 2^0"),
    (_bits(3.0), 129, "3 -> 2^2"),
    (_bits(2.0**-126) + 1, 2, "smallest normal + 1 ulp -> 2^-125"),
    (_bits(1.5 * 2.0**127), 254, "exponent 254 with mantissa: clamp, no bump to 255"),
    (0x7F7FFFFF, 254, "FLT_MAX -> 254"),
    (0x00400000, 0, "subnormal 2^-127 (m == 0x400000): not bumped"),
    (0x00400001, 1, "subnormal m = 0x400001 > 0x400000: bumped to 2^-126"),
    (0x007FFFFF, 1, "largest subnormal: bumped"),
    (0x00200000, 0, "subnormal 2^-128: not bumped"),
    (0x00000001, 0, "smallest subnormal: not bumped"),
]


@pytest.mark.parametrize("bits, byte, why", E8M0_CASES, ids=[c[2] for c in E8M0_CASES])
def test_e8m0_encode_table(bits, byte, why):
    v = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = N.e8m0_from_fp32(v)
    assert got.dtype == torch.uint8
    assert got.item() == byte, f"bits 0x{bits:08X} ({why}): got {got.item()}, expected {byte}"


@pytest.mark.parametrize(
    "byte, bits",
    [
        (0, 0x00400000),  # byte 0 means 2^-127 (an fp32 subnormal), not 0
        (1, 0x00800000),  # 2^-126
        (126, _bits(0.5)),
        (127, _bits(1.0)),
        (128, _bits(2.0)),
        (254, _bits(2.0**127)),
    ],
)
def test_e8m0_decode_table(byte, bits):
    got = N.e8m0_to_fp32(torch.tensor([byte], dtype=torch.uint8))
    assert got.view(torch.int32).item() == bits


def test_e8m0_decode_255_is_nan():
    assert torch.isnan(N.e8m0_to_fp32(torch.tensor([255], dtype=torch.uint8))).all()


@pytest.mark.parametrize(
    "byte, value",
    [(0, 2.0**127), (127, 1.0), (128, 0.5), (253, 2.0**-126), (254, 2.0**-127), (255, NAN)],
)
def test_e8m0_encode_multiplier(byte, value):
    # 2^(127 - e) (TE exp2f_rcp): e = 254 -> 2^-127 (subnormal), e = 255 -> NaN
    got = N.pow2_from_e8m0_rcp(torch.tensor([byte], dtype=torch.uint8)).item()
    assert (math.isnan(got) and math.isnan(value)) or got == value


def test_e8m0_is_the_rounded_up_exponent():
    # For every normal v: 2^(e-127) >= v > 2^(e-128), i.e. the exponent of v rounded up.
    g = torch.Generator().manual_seed(5)
    v = torch.rand(20_000, generator=g) * torch.exp2(torch.randint(-125, 126, (20_000,), generator=g).float())
    v = v[v >= 2.0**-126]
    e = N.e8m0_from_fp32(v).to(torch.float64)
    v64 = v.to(torch.float64)
    assert (torch.exp2(e - 127) >= v64).all() and (torch.exp2(e - 128) < v64).all()


# =============================================================================================== #
# 2. Scale rules                                                                                  #
# =============================================================================================== #
def _f32(v: float) -> float:
    return float(F32(v))


FP8_SCALE_CASES = [
    # (amax, fp8_max, pow2, eps, expected scale, why)
    (0.0, 448.0, False, 0.0, 1.0, "amax 0 -> 1"),
    (INF, 448.0, False, 0.0, 1.0, "amax inf -> 1 (TE kernel; TE's python ref gives 0)"),
    (NAN, 448.0, False, 0.0, 1.0, "amax NaN -> 1"),
    (0.0, 448.0, True, 0.0, 1.0, "special 1 is a power of two already"),
    (NAN, 448.0, False, 0.5, 1.0, "NaN < eps is false: stays NaN -> 1"),
    (1.0, 448.0, False, 0.0, 448.0, "448 / 1"),
    (1.0, 448.0, True, 0.0, 256.0, "448 -> bits & 0xFF800000 -> 256 (rounded down)"),
    (3.0, 448.0, False, 0.0, _f32(F32(448) / F32(3)), "fp32 division 448/3 = 149.33334"),
    (3.0, 448.0, True, 0.0, 128.0, "149.3 -> 128"),
    (448.0, 448.0, True, 0.0, 1.0, "exact power of two kept"),
    (0.0, 448.0, False, 1e-3, _f32(F32(448) / F32(1e-3)), "amax = max(0, eps) = eps"),
    (0.0, 448.0, True, 1e-3, 262144.0, "448000 -> 2^18"),
    (0.5, 448.0, False, 1e-3, 896.0, "amax above eps: eps unused"),
    (1e-38, 448.0, False, 0.0, FLT_MAX, "448/1e-38 overflows to inf -> FLT_MAX"),
    (1e-45, 448.0, False, 0.0, FLT_MAX, "subnormal amax: overflow -> FLT_MAX"),
    (1e-38, 448.0, True, 0.0, 2.0**127, "FLT_MAX rounded down to 2^127"),
    (2.0, 57344.0, False, 0.0, 28672.0, "E5M2 max 57344"),
    (FLT_MAX, 448.0, False, 0.0, _f32(F32(448) / F32(FLT_MAX)), "huge amax: tiny (subnormal) scale"),
]


@pytest.mark.parametrize("amax, fp8_max, pow2, eps, scale, why", FP8_SCALE_CASES, ids=[c[5] for c in FP8_SCALE_CASES])
def test_fp8_scale_from_amax_table(amax, fp8_max, pow2, eps, scale, why):
    got = N.fp8_scale_from_amax(torch.tensor([amax]), fp8_max, pow2=pow2, eps=eps)
    assert got.dtype == torch.float32
    assert got.view(torch.int32).item() == _bits(scale), f"{why}: got {got.item()!r}, want {scale!r}"


NVFP4_SENC_CASES = [
    # (amax, S_enc, why)
    (0.0, 1.0, "amax 0 -> 1"),
    (INF, 1.0, "2688/inf = 0 -> 1"),
    (NAN, FLT_MAX, "2688/NaN = NaN; fminf(NaN, FLT_MAX) = FLT_MAX (NaN then propagates via amax)"),
    (2688.0, 1.0, "2688/2688"),
    (10.5, 256.0, "2688/10.5 exact"),
    (6.0, 448.0, "2688/6 exact"),
    (3.0, 896.0, "2688/3"),
    (1e-38, FLT_MAX, "overflow to inf -> min(inf, FLT_MAX)"),
    (7.0, _f32(F32(2688) / F32(7)), "fp32 division"),
]


@pytest.mark.parametrize("amax, s_enc, why", NVFP4_SENC_CASES, ids=[c[2] for c in NVFP4_SENC_CASES])
def test_nvfp4_global_encode_scale_table(amax, s_enc, why):
    got = N.nvfp4_global_encode_scale(torch.tensor([amax]))
    assert got.view(torch.int32).item() == _bits(s_enc), f"{why}: got {got.item()!r}"


@pytest.mark.parametrize("name, denom", [("INV_448", 448), ("INV_6", 6), ("INV_2688", 2688)])
def test_fp32_constants_are_correctly_rounded(name, denom):
    # "1/448 as the fp32 constant" = what C's 1.0f / 448.0f gives: the correctly rounded quotient.
    assert getattr(N, name).view(torch.int32).item() == _bits(F32(1) / F32(denom))


# =============================================================================================== #
# 3. Scalar spec of each format (numpy fp32, written from docs/formats.md only)                   #
# =============================================================================================== #
_NP_FLT_MAX = np.finfo(np.float32).max
_INV_448 = F32(1) / F32(448)
_INV_6 = F32(1) / F32(6)
_INV_2688 = F32(1) / F32(2688)
_E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_fp8_scale(amax, fp8_max, pow2, eps):
    amax = F32(amax)
    if amax < F32(eps):  # amax = max(amax, eps)
        amax = F32(eps)
    if amax == 0 or np.isinf(amax) or np.isnan(amax):
        scale = F32(1)
    else:
        scale = F32(fp8_max) / amax
        if np.isinf(scale):
            scale = _NP_FLT_MAX
    if pow2:
        scale = np.array(np.array(scale, np.float32).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return F32(scale)


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_fp8_block(x, block, dtype, pow2, eps):
    """x: (M, K) float32. Returns data codes (M, K) uint8, scale_inv (Mb, Kb) float32."""
    bm, bk = block
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    codes = np.zeros((m, k), np.uint8)
    sinv = np.zeros((mb, kb), np.float32)
    for i in range(mb):
        for j in range(kb):
            blk = x[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]  # ragged edges: real elements only
            scale = _spec_fp8_scale(np.max(np.abs(blk)), N.FP8_MAX[dtype], pow2, eps)
            codes[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk] = np_cast_fp8(blk * scale, dtype)
            sinv[i, j] = F32(1) / scale
    return codes, sinv


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_fp8_block_decode(codes, sinv, block, dtype):
    bm, bk = block
    vals = fp8_ref_decode(codes, dtype)
    mult = np.repeat(np.repeat(sinv, bm, 0), bk, 1)[: codes.shape[0], : codes.shape[1]]
    return (vals * mult).astype(np.float32)


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_e8m0(v):
    v = F32(v)
    if np.isnan(v):
        return 255
    if np.isinf(v):
        return 254
    if v == 0:
        return 0
    b = int(np.array(v, np.float32).view(np.uint32))
    e, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    if m != 0 and not (e == 0 and m <= 0x400000):
        e += 1
    return min(e, 254)


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_pow2(n):
    return np.ldexp(F32(1), n).astype(np.float32)


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_mxfp8(x, block=(1, 32)):
    bm, bk = block
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    codes = np.zeros((m, k), np.uint8)
    e8 = np.zeros((mb, kb), np.uint8)
    for i in range(mb):
        for j in range(kb):
            blk = x[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]
            e = _spec_e8m0(np.max(np.abs(blk)) * _INV_448)  # v = amax * (1/448), fp32 multiply
            mult = F32(NAN) if e == 255 else _spec_pow2(127 - e)
            codes[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk] = np_cast_fp8(blk * mult, E4M3)
            e8[i, j] = e
    return codes, e8


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_mxfp8_decode(codes, e8):
    vals = fp8_ref_decode(codes, E4M3)
    mult = np.where(e8 == 255, np.float32(NAN), np.ldexp(np.float32(1), e8.astype(np.int32) - 127))
    mult = np.repeat(mult.astype(np.float32), 32, 1)[:, : codes.shape[1]]
    return (vals * mult).astype(np.float32)


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_nvfp4(x, two_d, amax=None):
    """Returns codes (M, K) uint8 (unpacked), scale codes (Mb, Kb) uint8 (E4M3), amax float32."""
    bm, bk = (16, 16) if two_d else (1, 16)
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    a = F32(np.max(np.abs(x))) if amax is None else F32(amax)
    s_enc = F32(2688) / a  # 2688 / amax
    s_enc = np.fmin(s_enc, _NP_FLT_MAX)  # fminf: NaN -> FLT_MAX
    if a == 0 or s_enc == 0:
        s_enc = F32(1)
    s_dec = F32(1) / s_enc
    codes = np.zeros((m, k), np.uint8)
    scodes = np.zeros((mb, kb), np.uint8)
    for i in range(mb):
        for j in range(kb):
            sl = (slice(i * bm, (i + 1) * bm), slice(j * bk, (j + 1) * bk))
            blk = x[sl]
            sc = np_cast_fp8(np.array([np.max(np.abs(blk)) * (s_enc * _INV_6)], np.float32), E4M3)[0]
            s = fp8_ref_decode(np.array([sc], np.uint8), E4M3)[0]
            enc = np.fmin(F32(1) / (F32(s) * s_dec), _NP_FLT_MAX)
            codes[sl] = _e2m1_ref(np.clip(blk * enc, F32(-6), F32(6)))
            scodes[i, j] = sc
    return codes, scodes, a


@np.errstate(all="ignore")  # IEEE inf/NaN results are intended
def _spec_nvfp4_decode(codes, scodes, amax, two_d):
    bm, bk = (16, 16) if two_d else (1, 16)
    s = fp8_ref_decode(scodes, E4M3)
    mult = (s * F32(amax)) * _INV_2688
    mult = np.repeat(np.repeat(mult, bm, 0), bk, 1)[: codes.shape[0], : codes.shape[1]]
    return (_E2M1_GRID[codes] * mult).astype(np.float32)


def _spec_input(shape, seed, specials=True):
    """Gaussians with a random binary exponent per row (so scales span many binades), plus, in the
    second matrix of the batch, a zero block row, and values that are exactly representable."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, k = shape
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, (*batch, m, 1), generator=g).float())
    if specials:
        x[..., 0, :] = 0.0  # a zero row: zero blocks (amax 0) for 1-D formats
        x[..., 1, : min(k, 5)] = torch.tensor([448.0, -0.0, 2.0**-9, 6.0, -1.5])[: min(k, 5)]
    return x


def _with_nan_inf(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[..., 2, 1] = INF
    x[..., 3, 2] = NAN
    x[..., 4, 3] = -INF
    return x


SPEC_SHAPES = [(2, 37, 70), (18, 48)]


@pytest.mark.parametrize("shape", SPEC_SHAPES)
@pytest.mark.parametrize(
    "block, dtype, pow2, eps",
    [
        ((128, 128), E4M3, True, 0.0),
        ((1, 128), E4M3, True, 0.0),
        ((8, 16), E4M3, False, 0.0),
        ((8, 16), E5M2, True, 2.0**-20),
        ((5, 7), E4M3, False, 1e-30),
    ],
)
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "naninf"])
def test_fp8_block_matches_spec(shape, block, dtype, pow2, eps, nonfinite, backend):
    x = _spec_input(shape, seed=11)
    if nonfinite:
        x = _with_nan_inf(x)
    qt = ckptq.quantize(x, "fp8_block", block=block, fp8_dtype=dtype, pow2=pow2, eps=eps)
    c = qt.components()
    deq = qt.dequantize().numpy()
    for b in range(int(np.prod(shape[:-2], dtype=np.int64))):
        xm = x.reshape(-1, *shape[-2:])[b].numpy()
        codes, sinv = _spec_fp8_block(xm, block, dtype, pow2, eps)
        assert_codes_equal(c["data"].reshape(-1, *shape[-2:])[b].view(torch.uint8).numpy(), codes, dtype)
        got_sinv = c["scale_inv"].reshape(-1, *sinv.shape)[b].numpy()
        np.testing.assert_array_equal(got_sinv.view(np.uint32), sinv.view(np.uint32))
        want = _spec_fp8_block_decode(codes, sinv, block, dtype)
        np.testing.assert_array_equal(deq.reshape(-1, *shape[-2:])[b], want)  # NaN == NaN here


@pytest.mark.parametrize("shape", SPEC_SHAPES)
@pytest.mark.parametrize("dtype, pow2, eps", [(E4M3, False, 0.0), (E4M3, True, 0.0), (E5M2, False, 1e-3)])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "naninf"])
def test_fp8_tensor_matches_spec(shape, dtype, pow2, eps, nonfinite, backend):
    x = _spec_input(shape, seed=12)
    if nonfinite:
        x = _with_nan_inf(x)
    qt = ckptq.quantize(x, "fp8_tensor", fp8_dtype=dtype, pow2=pow2, eps=eps)
    c = qt.components()
    assert c["scale_inv"].shape == tuple(shape[:-2])
    deq = qt.dequantize().numpy().reshape(-1, *shape[-2:])
    for b in range(int(np.prod(shape[:-2], dtype=np.int64))):
        xm = x.reshape(-1, *shape[-2:])[b].numpy()
        scale = _spec_fp8_scale(np.max(np.abs(xm)), N.FP8_MAX[dtype], pow2, eps)
        codes = np_cast_fp8(xm * scale, dtype)
        sinv = F32(1) / scale
        assert_codes_equal(c["data"].reshape(-1, *shape[-2:])[b].view(torch.uint8).numpy(), codes, dtype)
        assert c["scale_inv"].reshape(-1)[b].view(torch.int32).item() == int(np.array(sinv).view(np.int32))
        np.testing.assert_array_equal(deq[b], (fp8_ref_decode(codes, dtype) * sinv).astype(np.float32))


@pytest.mark.parametrize("shape", SPEC_SHAPES + [(3, 100)])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "naninf"])
def test_mxfp8_matches_spec(shape, nonfinite, backend):
    x = _spec_input(shape, seed=13)
    if nonfinite:
        x = _with_nan_inf(x) if shape[-2] > 4 else x
    # tiny and subnormal block maxima exercise the E8M0 subnormal rule
    x[..., 0, :32] = 2.0**-120
    x[..., 0, 32:64] = 2.0**-118
    qt = ckptq.quantize(x, "mxfp8", columnwise=True)
    c = qt.components()
    deq = qt.dequantize().numpy().reshape(-1, *shape[-2:])
    for b in range(int(np.prod(shape[:-2], dtype=np.int64))):
        xm = x.reshape(-1, *shape[-2:])[b].numpy()
        codes, e8 = _spec_mxfp8(xm)
        assert_codes_equal(c["data"].reshape(-1, *shape[-2:])[b].view(torch.uint8).numpy(), codes, E4M3)
        np.testing.assert_array_equal(c["scale"].reshape(-1, *e8.shape)[b].numpy(), e8)
        np.testing.assert_array_equal(deq[b], _spec_mxfp8_decode(codes, e8))
        # columnwise copy: 32x1 blocks, quantized independently from x
        ccodes, ce8 = _spec_mxfp8(xm, block=(32, 1))
        assert_codes_equal(c["columnwise_data"].reshape(-1, *shape[-2:])[b].view(torch.uint8).numpy(), ccodes, E4M3)
        np.testing.assert_array_equal(c["columnwise_scale"].reshape(-1, *ce8.shape)[b].numpy(), ce8)


@pytest.mark.parametrize("shape", [(2, 37, 70), (18, 48), (33, 18)])
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "naninf"])
def test_nvfp4_matches_spec(shape, two_d, nonfinite, backend):
    x = _spec_input(shape, seed=14)
    if nonfinite:
        x = _with_nan_inf(x)
    qt = ckptq.quantize(x, "nvfp4", two_d=two_d)
    c = qt.components()
    deq = qt.dequantize().numpy().reshape(-1, *shape[-2:])
    for b in range(int(np.prod(shape[:-2], dtype=np.int64))):
        xm = x.reshape(-1, *shape[-2:])[b].numpy()
        codes, scodes, amax = _spec_nvfp4(xm, two_d)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        np.testing.assert_array_equal(c["data"].reshape(-1, *packed.shape)[b].numpy(), packed)
        assert_codes_equal(c["scale"].reshape(-1, *scodes.shape)[b].view(torch.uint8).numpy(), scodes, E4M3)
        assert c["amax"].reshape(-1)[b].view(torch.int32).item() == int(np.array(amax).view(np.int32))
        np.testing.assert_array_equal(deq[b], _spec_nvfp4_decode(codes, scodes, amax, two_d))


@pytest.mark.parametrize("shape", [(2, 38, 70), (18, 48)])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "naninf"])
def test_columnwise_copy_matches_spec(shape, fmt, nonfinite, backend):
    """NVFP4 1x16 and FP8-block 1x128 columnwise copies: x^T encoded by the rowwise spec (NVFP4 with
    the tensor's amax), stored untransposed (docs/formats.md; TE's columnwise buffers)."""
    x = _spec_input(shape, seed=16)
    if nonfinite:
        x = _with_nan_inf(x)
    recipe = {"block": (1, 128)} if fmt == "fp8_block" else {}
    qt = ckptq.quantize(x, fmt, columnwise=True, **recipe)
    c = {k: v.reshape(-1, *v.shape[-2:]) if v.ndim >= 2 else v.reshape(-1) for k, v in qt.components().items()}
    for b in range(int(np.prod(shape[:-2], dtype=np.int64))):
        xt = x.reshape(-1, *shape[-2:])[b].numpy().T.copy()
        if fmt == "nvfp4":
            codes, scodes, _ = _spec_nvfp4(xt, False, amax=c["amax"][b].item())
            np.testing.assert_array_equal(N.unpack_fp4(c["columnwise_data"][b].mT.contiguous()).numpy(), codes)
            assert_codes_equal(c["columnwise_scale"][b].mT.contiguous().view(torch.uint8).numpy(), scodes, E4M3)
        else:
            codes, sinv = _spec_fp8_block(xt, (1, 128), E4M3, True, 0.0)
            assert_codes_equal(c["columnwise_data"][b].mT.contiguous().view(torch.uint8).numpy(), codes, E4M3)
            got = c["columnwise_scale_inv"][b].mT.contiguous().numpy()
            np.testing.assert_array_equal(got.view(np.uint32), sinv.view(np.uint32))


@pytest.mark.parametrize("amax", [0.5, 3.0, 1e-3, 0.0, INF])
def test_nvfp4_amax_override_matches_spec(amax, backend):
    x = _spec_input((20, 64), seed=15, specials=False)
    qt = ckptq.quantize(x, "nvfp4", amax=amax)
    codes, scodes, a = _spec_nvfp4(x.numpy(), False, amax=amax)
    c = qt.components()
    np.testing.assert_array_equal(N.unpack_fp4(c["data"]).numpy(), codes)
    assert_codes_equal(c["scale"].view(torch.uint8).numpy(), scodes, E4M3)
    assert c["amax"].view(torch.int32).item() == _bits(amax)
    np.testing.assert_array_equal(qt.dequantize().numpy(), _spec_nvfp4_decode(codes, scodes, a, False))


# =============================================================================================== #
# 4. Fixed small inputs, bytes derived by hand                                                    #
# =============================================================================================== #
def _u8(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


def test_hand_fp8_tensor_explicit_scale(backend):
    # scale = 2 (encode multiplier) -> scale_inv = 1/2 = 0.5; data = sat_rne(x * 2):
    #   1.0 * 2 = 2.0     -> E4M3 exponent 1+7 = 8, m = 0           -> 0x40
    #  -3.3 * 2 = -6.6    -> in [4, 8) the step is 0.5: 6.5 is nearest; 6.5 = 1.625 * 4 -> exp 9, m 5
    #                        -> 0x80 | 9<<3 | 5                     -> 0xCD
    #   500 * 2 = 1000    -> saturates to 448 = 1.75 * 2^8           -> 0x7E
    #  1e-3 * 2 = 0.002   -> subnormal range (step 2^-9 = 0.001953): nearest is 1 * 2^-9 -> 0x01
    x = torch.tensor([[1.0, -3.3], [500.0, 1e-3]])
    qt = ckptq.quantize(x, "fp8_tensor", scale=2.0)
    c = qt.components()
    assert _u8(c["data"]) == [[0x40, 0xCD], [0x7E, 0x01]]
    assert c["scale_inv"].shape == () and c["scale_inv"].item() == 0.5
    # decode: data * 0.5 = [[1, -3.25], [224, 2^-10]]
    assert qt.dequantize().tolist() == [[1.0, -3.25], [224.0, 2.0**-10]]


def test_hand_fp8_tensor_amax_and_pow2(backend):
    # amax = 3 (own max): scale = 448/3 = 149.33334 (fp32), scale_inv = 1/149.33334;
    # 3 * 149.33334 = 448.00003 -> 448 (0x7E).  With pow2: scale = 128, 3 * 128 = 384 = 1.5 * 2^8
    # -> exp 15, m 4 -> 0x7C; scale_inv = 2^-7 exactly.
    x = torch.tensor([[3.0, -1.0]])
    plain = ckptq.quantize(x, "fp8_tensor")
    p2 = ckptq.quantize(x, "fp8_tensor", pow2=True)
    assert _u8(plain.components()["data"])[0][0] == 0x7E
    assert plain.components()["scale_inv"].view(torch.int32).item() == _bits(F32(1) / (F32(448) / F32(3)))
    # -1 * 128 = -128 = -2^7 -> exp 14 -> 0xF0
    assert _u8(p2.components()["data"]) == [[0x7C, 0xF0]]
    assert p2.components()["scale_inv"].item() == 2.0**-7
    assert p2.dequantize().tolist() == [[3.0, -1.0]]
    # amax= override: amax 7 -> scale 64 (pow2 of 64.0), 3 * 64 = 192 = 1.5 * 2^7 -> 0x74
    ov = ckptq.quantize(x, "fp8_tensor", amax=7.0, pow2=True)
    assert ov.components()["scale_inv"].item() == 1 / 64 and _u8(ov.components()["data"])[0][0] == 0x74


def test_hand_fp8_block_2x2_ragged(backend):
    # block (2, 2) on a 3x3 input: a ceil(3/2) x ceil(3/2) = 2x2 scale grid, pow2 on (default).
    x = torch.tensor(
        [
            [1.0, -0.5, 3.0],
            [0.25, 0.0, -2.0],
            [100.0, 7.0, 0.1],
        ]
    )
    # block (0,0) = {1, -0.5, 0.25, 0}: amax 1 -> scale 448 -> pow2 256, scale_inv 2^-8
    #   data 256 (2^8: exp 15 -> 0x78), -128 (0xF0), 64 (2^6: exp 13 -> 0x68), 0 (0x00)
    # block (0,1) = {3, -2} (ragged, one column): amax 3 -> 149.3 -> 128, scale_inv 2^-7
    #   data 384 (1.5 * 2^8 -> 0x7C), -256 (0xF8)
    # block (1,0) = {100, 7} (ragged, one row): amax 100 -> 4.48 -> 4, scale_inv 0.25
    #   data 400: between 384 (m=4) and 416 (m=5), a tie -> even 384 (0x7C); 28 = 1.75 * 2^4 -> exp 11,
    #   m 6 -> 0x5E
    # block (1,1) = {0.1}: amax 0.1 -> 448 / 0.1 = 4480 -> 4096, scale_inv 2^-12
    #   data 0.1 * 4096 = 409.6 -> nearest 416 = 1.625 * 2^8 -> 0x7D
    qt = ckptq.quantize(x, "fp8_block", block=(2, 2))
    c = qt.components()
    assert _u8(c["data"]) == [[0x78, 0xF0, 0x7C], [0x68, 0x00, 0xF8], [0x7C, 0x5E, 0x7D]]
    assert c["scale_inv"].tolist() == [[2.0**-8, 2.0**-7], [0.25, 2.0**-12]]
    # decode: 384 * 0.25 = 96 (100 lost to the tie), 416 * 2^-12 = 0.1015625
    assert qt.dequantize().tolist() == [[1.0, -0.5, 3.0], [0.25, 0.0, -2.0], [96.0, 7.0, 0.1015625]]
    # pow2 off: block (0,0) scale = 448 exactly, data 448 (0x7E), -224 (1.75 * 2^7 -> 0xF6), 112 (0x6E)
    qn = ckptq.quantize(x, "fp8_block", block=(2, 2), pow2=False)
    assert _u8(qn.components()["data"])[0][:2] == [0x7E, 0xF6] and _u8(qn.components()["data"])[1][0] == 0x6E
    assert qn.components()["scale_inv"][0, 0].view(torch.int32).item() == _bits(F32(1) / F32(448))


def test_hand_mxfp8(backend):
    # Shape (2, 64): two rows of two 1x32 blocks. v = amax * fl(1/448) with fl(1/448) = 0x1.24924ap-9.
    x = torch.zeros(2, 64)
    # row 0, block 0: amax 448 -> v = 448 * fl(1/448) = 1 + 4.5e-8 -> rounds to 1.0 in fp32 (half ulp
    #   of 1 is 6e-8): E = 127, m = 0 -> e = 127 (not bumped); multiplier 2^0; data = e4m3(x).
    x[0, :4] = torch.tensor([448.0, -1.0, 0.3, 1.0625])
    # row 0, block 1: amax 449 -> v = 1.0022 (m != 0) -> e = 128; multiplier 2^-1.
    #   449 / 2 = 224.5 -> step 16 in [128, 256): 224 = 1.75 * 2^7 -> 0x76;  -3 / 2 = -1.5 -> 0xBC
    x[0, 32:34] = torch.tensor([449.0, -3.0])
    # row 1, block 0: amax 1.75 -> v = 1.75 * fl(1/448) = 1.75 * 9586981 * 2^-32 = (2^24 + 0.75) * 2^-32;
    #   fp32 spacing at 2^24 is 2 (in those units), so v rounds to 2^-8 exactly -> m = 0 -> e = 119,
    #   multiplier 2^8: 1.75 * 256 = 448 -> 0x7E; 0.5 * 256 = 128 -> 0x70
    x[1, :2] = torch.tensor([1.75, 0.5])
    # row 1, block 1: all zero -> v = 0 -> e = 0, multiplier 2^127, data 0.
    qt = ckptq.quantize(x, "mxfp8")
    c = qt.components()
    assert c["scale"].tolist() == [[127, 128], [119, 0]]
    d = c["data"].view(torch.uint8)
    # 448 -> 0x7E; -1 -> 0xB8; 0.3 -> step 2^-5 in [0.25, 0.5): 0.3125 (m=2) nearest -> 0x2A;
    # 1.0625 -> tie 1 / 1.125 -> even 1.0 -> 0x38
    assert d[0, :4].tolist() == [0x7E, 0xB8, 0x2A, 0x38]
    assert d[0, 32:34].tolist() == [0x76, 0xBC]
    assert d[1, :2].tolist() == [0x7E, 0x70]
    assert d[1, 32:].eq(0).all()
    deq = qt.dequantize()
    # decode 224 * 2^(128-127) = 448, the 0.3 came back as 0.3125, zero block: 0 * 2^-127 = 0
    assert deq[0, :4].tolist() == [448.0, -1.0, 0.3125, 1.0] and deq[0, 32:34].tolist() == [448.0, -3.0]
    assert deq[1, :2].tolist() == [1.75, 0.5] and deq[1, 32:].eq(0).all()


def test_hand_mxfp8_subnormal_scale_rule(backend):
    # amax 2^-120 -> v = 2^-120 * 0x1.24924ap-9 = 0x1.24924ap-129, an fp32 subnormal with mantissa
    #   field 0x124924 <= 0x400000 -> not bumped -> e = 0 (2^-127 >= v); multiplier 2^127:
    #   2^-120 * 2^127 = 2^7 = 128 -> 0x70; decode 128 * 2^-127 = 2^-120 exactly.
    # amax 2^-118 -> v = 0x1.24924ap-127, mantissa field 0x492492 > 0x400000 -> bumped -> e = 1;
    #   multiplier 2^126: 2^-118 * 2^126 = 256 -> 0x78. (Without the bump, e = 0 would give 512 and saturate.)
    x = torch.zeros(1, 64)
    x[0, 0] = 2.0**-120
    x[0, 32] = 2.0**-118
    qt = ckptq.quantize(x, "mxfp8")
    assert qt.components()["scale"].tolist() == [[0, 1]]
    assert qt.components()["data"].view(torch.uint8)[0, [0, 32]].tolist() == [0x70, 0x78]
    assert qt.dequantize()[0, [0, 32]].tolist() == [2.0**-120, 2.0**-118]


def test_hand_mxfp8_extreme_bytes_decode():
    # byte 0 decodes as 2^-127 (not 0), byte 255 as NaN, byte 254 as 2^127.
    data = torch.tensor([[1.0] * 32 + [2.0] * 32 + [0.5] * 32], dtype=torch.float32).to(E4M3)
    scale = torch.tensor([[0, 255, 254]], dtype=torch.uint8)
    out = N.dequantize_mxfp8(data, scale)
    assert out[0, 0].item() == 2.0**-127
    assert torch.isnan(out[0, 32:64]).all()
    assert out[0, 64].item() == 2.0**126


def test_hand_nvfp4(backend):
    # Shape (2, 32): four 1x16 blocks. Tensor amax = 10.5 -> S_enc = 2688 / 10.5 = 256 exactly,
    # S_dec = 1/256; S_enc * fl(1/6) = 256 * 0x1.555556p-3 = 42.666668 (exact: a power-of-two multiple).
    # Block scale s = e4m3(amax_b * 42.666668):
    #   row 0 block 0: amax_b 3    -> 128.0000... rounds to 128.0 in fp32 -> s = 128 (2^7 -> 0x70);
    #                  enc = 1 / (128 * 2^-8) = 2 exactly; decode mult (128 * 10.5) * fl(1/2688) = 0.5.
    #   row 0 block 1: amax_b 10.5 -> 448.00001 rounds to 448.0 -> s = 448 (0x7E);
    #                  enc = fl(1 / 1.75) = 0x1.24924ap-1 = 0.5714286; decode mult = 1.75.
    #   row 1 block 0: amax_b 5    -> 213.33 -> E4M3 step 16 in [128, 256): 208 = 1.625 * 2^7 -> 0x75;
    #                  enc = 1 / (208 / 256) = 1 / 0.8125 = 1.2307693.
    #   row 1 block 1: all zero    -> s = 0 (0x00); enc = min(1 / 0, FLT_MAX) = FLT_MAX; codes 0.
    x = torch.zeros(2, 32)
    # row 0 block 0: x = t / 2, so x * enc = t exactly:
    #   t = 0, 0.25 (tie -> 0), 0.75 (tie -> 1.0: code 2), 1.25 (tie -> 1.0: 2), 1.75 (tie -> 2.0: 4),
    #   2.5 (tie -> 2.0: 4), 3.5 (tie -> 4.0: 6), 5 (tie -> 4.0: 6), 6 (7), -0.1 (-0: 0x8), -0 (0x8),
    #   5.5 (> 5 -> 6: 7), 0.3 (0.5: 1), -6 (0xF), 2.9 (3.0: 5), 1.0 (2)
    t0 = [0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.1, -0.0, 5.5, 0.3, -6, 2.9, 1.0]
    x[0, :16] = torch.tensor(t0) / 2
    # row 0 block 1: x = 1.75 * t; x * fl(1/1.75) in fp32 (hex checked by hand):
    #   10.5 -> 6.0000005, clamped to 6 -> 7;  -10.5 -> 0xF;  1.75 -> 1.0 -> 2;
    #   0.4375 -> 0.25 exactly (0.4375 * 0x1.24924ap-1 = 0.25000001 rounds to 0x1p-2): tie -> 0;
    #   2.1875 -> 1.25 exactly: tie -> 2;  4.375 -> 2.5 exactly: tie -> 4;  8.75 -> 5.0 exactly: tie -> 6;
    #   0.875 -> 0.5 -> 1;  3.5 -> 2.0 -> 4;  7.0 -> 4.0 -> 6;  5.25 -> 3.0000002 -> 5;
    #   2.625 -> 1.5000001 -> 3;  -1.3125 -> -0.75000006 -> -1.0: 0xA;  6.125 -> 3.5000002 -> 6;
    #   3.0625 -> 1.7500001 -> 4;  0 -> 0
    x[0, 16:] = torch.tensor(
        [10.5, -10.5, 1.75, 0.4375, 2.1875, 4.375, 8.75, 0.875, 3.5, 7.0, 5.25, 2.625, -1.3125, 6.125, 3.0625, 0.0]
    )
    # row 1 block 0 (enc 1.2307693): 5 -> 6.15, clamp 6 -> 7;  4 -> 4.92 -> 6 (4.0);  2 -> 2.46 -> 4;
    #   2.1 -> 2.58 -> 5;  -1 -> -1.23 -> 0xA;  0.2 -> 0.246 -> 0;  0.21 -> 0.258 -> 1;  rest 0
    x[1, :7] = torch.tensor([5.0, 4.0, 2.0, 2.1, -1.0, 0.2, 0.21])
    qt = ckptq.quantize(x, "nvfp4")
    c = qt.components()
    assert c["amax"].shape == () and c["amax"].item() == 10.5
    assert _u8(c["scale"]) == [[0x70, 0x7E], [0x75, 0x00]]
    codes = [
        [0, 0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 7, 1, 0xF, 5, 2] + [7, 0xF, 2, 0, 2, 4, 6, 1, 4, 6, 5, 3, 0xA, 6, 4, 0],
        [7, 6, 4, 5, 0xA, 0, 1] + [0] * 25,
    ]
    assert N.unpack_fp4(c["data"]).tolist() == codes
    # packed, element 2i in the low nibble: (0,0) 0x00, (2,2) 0x22, (4,4) 0x44, (6,6) 0x66, (7,8) 0x87, ...
    assert c["data"][0].tolist() == [0x00, 0x22, 0x44, 0x66, 0x87, 0x78, 0xF1, 0x25,
                                     0xF7, 0x02, 0x42, 0x16, 0x64, 0x35, 0x6A, 0x04]  # fmt: skip
    # decode: e2m1 * ((s * 10.5) * fl(1/2688)): block mults 0.5, 1.75, 208*10.5/2688 = 0.8125, 0
    deq = qt.dequantize()
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    want = torch.cat([e2m1[torch.tensor(codes[0][:16])] * 0.5, e2m1[torch.tensor(codes[0][16:])] * 1.75])
    assert deq[0].tolist() == want.tolist()
    assert deq[1, :7].tolist() == [4.875, 3.25, 1.625, 2.4375, -0.8125, 0.0, 0.40625]


def test_hand_nvfp4_one_block_amax6_enc_is_one(backend):
    # amax 6 (one block): S_enc = 448, s = e4m3(6 * fl(448 * fl(1/6))) = e4m3(448.00003) = 448;
    # S_dec = fl(1/448); 448 * S_dec = 1 + 4.5e-8 -> 1.0 -> enc = 1: codes are e2m1(x) directly;
    # decode mult (448 * 6) * fl(1/2688) = 2688 * fl(1/2688) = 1 + 1.9e-8 -> 1.0.
    vals = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.1, -0.0, 5.5, 0.3, -6.0, 2.9, 1.0]
    qt = ckptq.quantize(torch.tensor([vals]), "nvfp4")
    assert _u8(qt.components()["scale"]) == [[0x7E]]
    assert N.unpack_fp4(qt.components()["data"]).tolist() == [[0, 0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 7, 1, 0xF, 5, 2]]
    assert qt.dequantize().tolist() == [[0, 0, 1, 1, 2, 2, 4, 4, 6, -0.0, -0.0, 6, 0.5, -6, 3, 1]]


def test_nvfp4_operation_order_block_scale(backend):
    # docs/formats.md: s = e4m3(amax_b * (S_enc * (1/6))), the product S_enc * (1/6) first. Inputs found by
    # a search for a pair where the order decides the byte (all values are exact fp32):
    #   A = 54.81887435913086 (tensor amax), b = 3.7932701110839844 (block amax)
    #   S_enc = 2688 / A; b * (S_enc * fl(1/6)) = 31.0 exactly: a tie between E4M3 30 (m=7) and
    #   32 (m=0) -> even -> 32 = 2^5 -> exponent 12 -> byte 0x60.
    #   (b * S_enc) * fl(1/6) would be 30.999998 -> 30 (0x5F).
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 54.81887435913086, 3.7932701110839844
    qt = ckptq.quantize(x, "nvfp4")
    assert _u8(qt.components()["scale"]) == [[0x7E, 0x60]]
    _, scodes, _ = _spec_nvfp4(x.numpy(), False)
    assert scodes.tolist() == [[0x7E, 0x60]]


def test_nvfp4_operation_order_encode_multiplier(backend):
    # docs/formats.md: enc = min(1 / (float(s) * S_dec), FLT_MAX), not S_enc / s. Found by a search:
    #   A = 42.90931701660156, block amax b = 36.255470275878906 -> s = 384 (0x7C);
    #   x = 4.597426891326904: x * (1 / (384 * S_dec)) = 0.74999994 -> nearest 0.5 -> code 1,
    #   whereas x * (S_enc / 384) = 0.75000006 -> 1.0 -> code 2.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16], x[0, 17] = 42.90931701660156, 36.255470275878906, 4.597426891326904
    qt = ckptq.quantize(x, "nvfp4")
    assert _u8(qt.components()["scale"]) == [[0x7E, 0x7C]]
    assert N.unpack_fp4(qt.components()["data"])[0, 17].item() == 0x1
    codes, _, _ = _spec_nvfp4(x.numpy(), False)
    assert codes[0, 17] == 0x1


# =============================================================================================== #
# 5. amax 0 / inf / NaN per format                                                                #
# =============================================================================================== #
def _x_special(kind: str, shape=(4, 64)) -> torch.Tensor:
    x = torch.linspace(-2, 3, shape[0] * shape[1]).reshape(shape)
    if kind == "zero":
        return torch.zeros(shape)
    if kind == "inf":
        x[1, 5] = INF
    if kind == "nan":
        x[1, 5] = NAN
    return x


@pytest.mark.parametrize("kind", ["zero", "inf", "nan"])
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_tensor_special_amax_gives_scale_one(kind, pow2, backend):
    x = _x_special(kind)
    qt = ckptq.quantize(x, "fp8_tensor", pow2=pow2)
    c = qt.components()
    assert c["scale_inv"].item() == 1.0  # scale 1 -> scale_inv 1
    # data = sat_rne(x * 1): the unscaled cast
    ref = N.cast_fp8(x, E4M3)
    assert_same_bytes(c["data"], ref, "data")
    if kind == "inf":
        assert c["data"][1, 5].float().item() == 448.0
    if kind == "nan":
        assert torch.isnan(qt.dequantize()[1, 5])


@pytest.mark.parametrize("amax", [0.0, INF, NAN])
def test_fp8_tensor_special_amax_override(amax, backend):
    x = torch.tensor([[1.5, -300.0], [1000.0, 0.01]])
    c = ckptq.quantize(x, "fp8_tensor", amax=amax).components()
    assert c["scale_inv"].item() == 1.0
    assert c["data"].float().tolist() == [[1.5, -288.0], [448.0, 0.009765625]]


def test_fp8_tensor_eps(backend):
    # all-zero input: amax 0 -> max(0, eps) = eps = 2^-10 -> scale 448 * 2^10 = 458752 (exact),
    # scale_inv = fl(1 / 458752); with pow2: 458752 = 1.75 * 2^18 -> 2^18, scale_inv 2^-18.
    c = ckptq.quantize(torch.zeros(2, 4), "fp8_tensor", eps=2.0**-10).components()
    assert c["scale_inv"].view(torch.int32).item() == _bits(F32(1) / F32(458752))
    assert c["data"].view(torch.uint8).eq(0).all()
    c = ckptq.quantize(torch.zeros(2, 4), "fp8_tensor", eps=2.0**-10, pow2=True).components()
    assert c["scale_inv"].item() == 2.0**-18
    # eps below the real amax changes nothing
    x = torch.tensor([[3.0, -1.0]])
    assert_same_bytes(
        ckptq.quantize(x, "fp8_tensor", eps=1.0).components()["scale_inv"],
        ckptq.quantize(x, "fp8_tensor").components()["scale_inv"],
        "eps < amax",
    )


def test_fp8_block_special_amax_per_block(backend):
    # (4, 4) with (2, 2) blocks: zero block, inf block, NaN block, a normal block (amax 1)
    x = torch.zeros(4, 4)
    x[0:2, 2:4] = torch.tensor([[1.0, INF], [-2.0, 0.5]])
    x[2:4, 0:2] = torch.tensor([[NAN, 1.0], [3.0, -4.0]])
    x[2:4, 2:4] = torch.tensor([[1.0, -0.5], [0.25, 0.0]])
    for pow2 in (False, True):
        qt = ckptq.quantize(x, "fp8_block", block=(2, 2), pow2=pow2)
        c = qt.components()
        normal = 2.0**-8 if pow2 else _f32(F32(1) / F32(448))
        # zero -> scale 1; inf -> 1; NaN -> 1; amax 1 -> 448 (pow2: 256)
        assert c["scale_inv"].tolist() == [[1.0, 1.0], [1.0, normal]]
        d = c["data"].float()
        assert d[0:2, 0:2].eq(0).all()
        assert d[0:2, 2:4].tolist() == [[1.0, 448.0], [-2.0, 0.5]]  # unscaled; inf saturates
        assert torch.isnan(d[2, 0]) and d[2:4, 0:2].flatten()[1:].tolist() == [1.0, 3.0, -4.0]


def test_fp8_block_eps_per_block(backend):
    x = torch.zeros(2, 256)
    x[0, 128] = 1.0
    c = ckptq.quantize(x, "fp8_block", block=(1, 128), eps=2.0**-4).components()
    # zero blocks: amax = eps = 1/16 -> 448 * 16 = 7168 -> pow2 4096 -> scale_inv 2^-12
    # the block with amax 1 is unaffected by eps: 448 -> 256
    assert c["scale_inv"].tolist() == [[2.0**-12, 2.0**-8], [2.0**-12, 2.0**-12]]


def test_mxfp8_special_amax_per_block(backend):
    x = torch.ones(1, 128)
    x[0, :32] = 0.0  # zero block -> e = 0
    x[0, 40] = INF  # inf block -> v = inf -> e = 254, multiplier 2^-127
    x[0, 70] = NAN  # NaN block -> e = 255, data NaN, decode NaN
    # block 3: amax 1 -> v = fl(1/448) = 0x1.24924ap-9 -> E = 118, m != 0 -> e = 119
    qt = ckptq.quantize(x, "mxfp8")
    c = qt.components()
    assert c["scale"].tolist() == [[0, 254, 255, 119]]
    d = c["data"].float()
    assert d[0, :32].eq(0).all()
    # inf * 2^-127 = inf -> saturates to 448; 1 * 2^-127 underflows to 0
    assert d[0, 40].item() == 448.0 and d[0, 32:40].eq(0).all()
    assert torch.isnan(d[0, 64:96]).all()
    assert d[0, 96:].eq(256.0).all()
    deq = qt.dequantize()
    assert deq[0, :32].eq(0).all() and torch.isnan(deq[0, 64:96]).all() and deq[0, 96:].eq(1.0).all()
    assert deq[0, 40].item() == INF  # 448 * 2^127 overflows fp32


def test_nvfp4_all_zero(backend):
    # amax 0 -> S_enc = 1; every block scale e4m3(0) = 0; enc = min(1/0, FLT_MAX); codes 0; decode 0.
    qt = ckptq.quantize(torch.zeros(3, 32), "nvfp4")
    c = qt.components()
    assert c["amax"].item() == 0.0
    assert c["scale"].view(torch.uint8).eq(0).all() and c["data"].eq(0).all()
    assert qt.dequantize().eq(0).all() and not torch.signbit(qt.dequantize()).any()


def test_nvfp4_inf_amax(backend):
    # amax inf -> S_enc = 2688/inf = 0 -> 1 (S_dec = 1). Block with inf: s = e4m3(inf / 6) = 448 (0x7E);
    # block [0, 16:32] of ones: s = e4m3(1 * fl(1/6)) = e4m3(0.16666667): E4M3 step 2^-6 in
    # [0.125, 0.25) (biased exponent 4): 0.171875 = 1.375 * 2^-3 (m=3) nearest -> 4<<3 | 3 = 0x23;
    # enc = 1/0.171875 = 5.818182; 1 * 5.82 -> 6 (code 7).
    x = torch.ones(1, 32)
    x[0, 3] = INF
    qt = ckptq.quantize(x, "nvfp4")
    c = qt.components()
    assert c["amax"].item() == INF
    assert _u8(c["scale"]) == [[0x7E, 0x23]]
    codes = N.unpack_fp4(c["data"])[0]
    # block 0: enc = 1/448; inf -> clamp 6 (code 7); 1/448 -> 0.0022 -> 0
    assert codes[3].item() == 7 and codes[:3].eq(0).all()
    assert codes[16:].eq(7).all()


def test_nvfp4_nan_amax_propagates(backend):
    # amax NaN -> S_enc = fminf(NaN, FLT_MAX) = FLT_MAX; the NaN block's scale is NaN; the stored amax
    # is NaN, so every dequantized value is NaN (TE: "propagates").
    x = torch.ones(1, 32)
    x[0, 20] = NAN
    qt = ckptq.quantize(x, "nvfp4")
    c = qt.components()
    assert math.isnan(c["amax"].item())
    s = c["scale"].float()[0]
    assert s[0].item() == 448.0 and torch.isnan(s[1])  # ones * FLT_MAX/6 saturates to 448
    assert torch.isnan(qt.dequantize()).all()


# =============================================================================================== #
# 6. SQNR floors on Gaussian inputs                                                               #
# =============================================================================================== #
# The floors and their reasoning: tests/_bounds.py (one place for every SQNR bound of the suite).
from _bounds import (  # noqa: E402
    FLOOR_E4M3,
    FLOOR_E5M2,
    FLOOR_MXFP4,
    FLOOR_MXFP4_CEIL,
    FLOOR_NVFP4_1D,
    FLOOR_NVFP4_2D,
)

SQNR_CASES = [
    ("fp8_tensor", {}, FLOOR_E4M3, 3),
    ("fp8_tensor", {"pow2": True}, FLOOR_E4M3, 3),
    ("fp8_tensor", {"fp8_dtype": E5M2}, FLOOR_E5M2, 2),
    ("fp8_block", {}, FLOOR_E4M3, 3),
    ("fp8_block", {"pow2": False}, FLOOR_E4M3, 3),
    ("fp8_block", {"block": (1, 128)}, FLOOR_E4M3, 3),
    ("fp8_block", {"fp8_dtype": E5M2}, FLOOR_E5M2, 2),
    ("mxfp8", {}, FLOOR_E4M3, 3),
    ("nvfp4", {}, FLOOR_NVFP4_1D, None),
    ("nvfp4", {"two_d": True}, FLOOR_NVFP4_2D, None),
    ("mxfp4", {}, FLOOR_MXFP4, None),
    ("mxfp4", {"scale_rule": "even"}, FLOOR_MXFP4, None),
    ("mxfp4", {"scale_rule": "ceil"}, FLOOR_MXFP4_CEIL, None),
    ("mxfp4", {"scale_rule": "rceil"}, FLOOR_MXFP4, None),
]


def _float_model_db(x: torch.Tensor, p: int) -> float:
    x = x.double().flatten()
    x = x[x != 0]
    e = torch.floor(torch.log2(x.abs()))
    return 6.0206 * p + 10 * math.log10(12 * (x**2).mean().item() / (4.0**e).mean().item())


def _nvfp4_model_db(x: torch.Tensor, two_d: bool) -> float:
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    bm, bk = (16, 16) if two_d else (1, 16)
    m, k = x.shape
    xb = x.double().reshape(m // bm, bm, k // bk, bk)
    amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    v = xb / amax * 6
    q = grid[torch.bucketize(v.abs(), (grid[1:] + grid[:-1]) / 2)] * v.sign() * amax / 6
    return 20 * math.log10(xb.norm().item() / (xb - q).norm().item())


def _mxfp4_model_db(x: torch.Tensor, rule: str) -> float:
    """float64 model: per 1x32 block the power-of-two scale of the rule (from log2 of the amax,
    computed here in float64), E2M1 nearest with saturation at 6."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    m, k = x.shape
    xb = x.double().reshape(m, k // 32, 32)
    amax = xb.abs().amax(dim=2, keepdim=True)
    if rule == "rceil":
        e = torch.ceil(torch.log2(amax / 6))
    else:
        if rule == "even":  # amax rounded to one mantissa bit, half up
            f = torch.floor(torch.log2(amax))
            amax = torch.round(amax / 2**f * 2) / 2 * 2**f
        e = (torch.ceil if rule == "ceil" else torch.floor)(torch.log2(amax)) - 2
    v = (xb / 2**e).clamp(-6, 6)
    q = grid[torch.bucketize(v.abs(), (grid[1:] + grid[:-1]) / 2)] * v.sign() * 2**e
    return 20 * math.log10(xb.norm().item() / (xb - q).norm().item())


@pytest.fixture(scope="module")
def gaussian():
    return torch.randn(256, 512, generator=torch.Generator().manual_seed(2024))


@pytest.mark.parametrize("fmt, recipe, floor, p", SQNR_CASES, ids=[f"{c[0]}-{c[1]}" for c in SQNR_CASES])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_sqnr_floor(gaussian, fmt, recipe, floor, p, src, backend):
    x = gaussian.to(src)
    qt = ckptq.quantize(x, fmt, **recipe)
    ref = x.float()
    got = sqnr_db(ref, qt.dequantize(torch.float32))
    if p is not None:
        model = _float_model_db(ref, p)
    elif fmt == "mxfp4":
        model = _mxfp4_model_db(ref, recipe.get("scale_rule", "floor"))
    else:
        model = _nvfp4_model_db(ref, recipe.get("two_d", False))
    assert got >= floor, f"{fmt} {recipe}: SQNR {got:.2f} dB < floor {floor} dB (model {model:.2f} dB)"
    assert got <= model + 1.0, f"{fmt} {recipe}: SQNR {got:.2f} dB above the model {model:.2f} dB + 1"
    assert floor <= model - 1.0, "floor must sit below the model"
    # dequantizing to bf16 / fp16 costs next to nothing (>= 50 dB extra rounding)
    for dt in (torch.bfloat16, torch.float16):
        assert sqnr_db(ref, qt.dequantize(dt).float()) >= got - 0.1


@pytest.mark.parametrize("n", [1, 1000, (1 << 18) + 7, 3 * (1 << 18)])
def test_sqnr_db_in_slices_is_the_one_shot_formula(n):
    """``sqnr_db`` sums a slice at a time; the value is the fp64 formula over the whole tensor
    (to 1e-12 relative: only the summation order differs), and its special cases stay."""
    import math

    g = torch.Generator().manual_seed(n)
    ref = torch.randn(n, generator=g)
    approx = ref + 1e-2 * torch.randn(n, generator=g)
    r, a = ref.double(), approx.double()
    want = 20 * math.log10(torch.linalg.vector_norm(r).item() / torch.linalg.vector_norm(r - a).item())
    assert sqnr_db(ref, approx) == pytest.approx(want, rel=1e-12)
    assert sqnr_db(ref, ref.clone()) == float("inf")
    bad = approx.clone()
    bad[n // 2] = float("nan")
    assert math.isnan(sqnr_db(ref, bad))


# =============================================================================================== #
# 7. MXFP4: scale rules, nibble order, and the producers' own code                               #
# =============================================================================================== #
# (amax, floor, even, ceil, rceil): E8M0 bytes of docs/formats.md "7. mxfp4", derived by hand.
MXFP4_SCALES = [
    (6.0, 127, 127, 128, 127),  # 1.5 * 2^2: floor 2 - 2 = 0; even: mantissa .5 + .25 < 1 stays; ceil 3 - 2; 6/6 = 1
    (7.0, 127, 128, 128, 128),  # 1.75 * 2^2: even rounds up to 2^3; rceil 7/6 = 1.17 -> 2^1
    (4.0, 127, 127, 127, 127),  # 2^2 exactly: every rule 0; rceil 4/6 = 0.67 -> 2^0
    (1.0, 125, 125, 125, 125),  # 2^0: E - 2 = -2; rceil 1/6 = 0.167 = 2^-2.58 -> 2^-2
    (0.0, 0, 0, 0, 0),  # all-zero block: the smallest scale
    (1e-45, 0, 0, 0, 0),  # subnormal amax: clamped at byte 0 (2^-127)
    (FLT_MAX, 252, 253, 253, 253),  # E = 254: floor 252; even/ceil carry to E' = 255 -> 253; FLT_MAX/6 = 2^125.4 -> 126
    (INF, 254, 254, 254, 254),  # written rule: +inf -> 254 for every rule
    (NAN, 255, 255, 255, 255),  # NaN -> 255: the block decodes to NaN
]


@pytest.mark.parametrize("amax, floor, even, ceil, rceil", MXFP4_SCALES)
def test_mxfp4_scale_rules_table(amax, floor, even, ceil, rceil):
    a = torch.tensor([amax], dtype=torch.float32)
    for rule, want in zip(N.MXFP4_SCALE_RULES, (floor, even, ceil, rceil), strict=True):
        assert N.mxfp4_scale_from_amax(a, rule).item() == want, (amax, rule)


def test_mxfp4_hand_block(backend):
    # one block of 32: amax 5 -> floor scale byte 127 - 0 (E(5) = 2, 2 - 2 = 0): codes are e2m1(x)
    x = torch.tensor([[0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.3, -1.0, -6.5] + [0.0] * 20])
    q = ckptq.quantize(x, "mxfp4")
    c = q.components()
    assert c["scale"].tolist() == [[127]]
    # ties to even: .25 -> 0, .75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; -6.5 saturates
    codes = [0x0, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8, 0x9, 0xA, 0xF]
    want = [codes[2 * i] | codes[2 * i + 1] << 4 for i in range(6)] + [0] * 10
    assert c["data"].tolist() == [want]
    # rceil: 5/6 -> 2^0 as well; ceil: 2^(3 - 2) = 2 -> byte 128, values halved before rounding
    assert ckptq.quantize(x, "mxfp4", scale_rule="ceil").components()["scale"].tolist() == [[128]]


def test_mxfp4_nibble_order_and_decode():
    # byte 0x21: low nibble code 1 (0.5) is element 0, high nibble code 2 (1.0) is element 1
    data = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)
    for byte, mult in ((127, 1.0), (130, 8.0), (0, 2.0**-127)):
        scale = torch.tensor([[byte]], dtype=torch.uint8)
        x = N.dequantize_mxfp4(data, scale)
        assert x[0, :2].tolist() == [0.5 * mult, 1.0 * mult]
    assert torch.isnan(N.dequantize_mxfp4(data, torch.tensor([[255]], dtype=torch.uint8))).all()


def test_mxfp4_nonfinite_inputs(backend):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    x[0, 3] = NAN
    x[1, 40] = INF
    x[2, 5] = -INF
    x[2, 6] = NAN  # NaN wins over inf in a block
    for rule in N.MXFP4_SCALE_RULES:
        q = ckptq.quantize(x, "mxfp4", scale_rule=rule)
        c = q.components()
        assert c["scale"].tolist()[0][0] == 255 and c["scale"].tolist()[1][1] == 254
        assert c["scale"].tolist()[2][0] == 255
        assert (N.unpack_fp4(c["data"])[0, :32] == 7).all()  # NaN block: every code 0x7
        codes1 = N.unpack_fp4(c["data"])[1, 32:]
        assert codes1[8].item() == 7  # +inf saturates to +6
        y = q.dequantize()
        assert torch.isnan(y[0, :32]).all() and torch.isnan(y[2, :32]).all()
        assert y[1, 40].item() == INF  # 6 * 2^127 overflows fp32: +inf decodes to +inf again


@pytest.mark.parametrize("rule", ["floor", "even", "rceil"])
def test_mxfp4_requantize_to_itself_keeps_values(rule, backend):
    # floor/even/rceil give a block whose largest code is 6 or 4 its own scale again (and a block of
    # smaller codes a lower scale that holds every value): re-encoding keeps the values exactly.
    q = ckptq.quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(3)), "mxfp4", scale_rule=rule)
    assert_same_bytes(ckptq.requantize(q, "mxfp4", scale_rule=rule).dequantize(), q.dequantize())


def _mx_input():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 256)
    x[0, :32] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_scale_rules_equal_torchao(dtype, backend):
    """Each rule is the torchao 0.18 ScaleCalculationMode of its name, byte for byte (to_mx, FP4)."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = _mx_input().to(dtype)
    for rule in N.MXFP4_SCALE_RULES:
        scale, data = to_mx(x.clone(), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(rule))
        c = ckptq.quantize(x, "mxfp4", scale_rule=rule).components()
        assert_same_bytes(scale.view(torch.uint8), c["scale"], f"{rule} scale")
        assert_same_bytes(data.view(torch.uint8), c["data"], f"{rule} data")


def test_mxfp4_even_rule_equals_compressed_tensors_scales():
    """compressed-tensors 0.20 generate_mx_scales (its MXFP4 observer's scale) is the even rule."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    x = _mx_input().to(torch.bfloat16)
    amax = x.view(64, 8, 32).abs().amax(-1)
    want = generate_mx_scales(amax, 4).to(torch.uint8)
    assert_same_bytes(ckptq.quantize(x, "mxfp4", scale_rule="even").components()["scale"], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_decode_equals_transformers(dtype, backend):
    """transformers 5.24's own MXFP4 unpacking (gpt-oss ``*_blocks`` (E, N, G, 16) + ``*_scales``
    (E, N, G); low nibble = even element; ldexp by scale - 127), transposed back, is our decode."""
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    x = torch.randn(2, 24, 96, generator=torch.Generator().manual_seed(5)) * 3
    q = ckptq.quantize(x, "mxfp4", scale_rule="rceil")
    c = q.components()
    blocks = c["data"].reshape(2, 24, 3, 16)
    got = convert_moe_packed_tensors(blocks, c["scale"], dtype=dtype)  # (E, K, N)
    assert_same_bytes(got.transpose(1, 2).contiguous(), q.dequantize(dtype))

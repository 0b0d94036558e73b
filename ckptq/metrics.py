"""Error metrics for lossy paths (SQNR in dB, max abs error), shared by tests, the CLI and examples,
and the SQNR floor each pair of encodings allows (:func:`sqnr_bound`, what ``ckptq verify A B``
judges a lossy pair by)."""

from __future__ import annotations

import math

import torch

__all__ = ["sqnr_db", "max_abs_error", "bit_exact", "SQNR_FLOORS", "REENCODE_FLOORS", "encoding_of", "sqnr_bound"]


#: Elements per step of :func:`sqnr_db`: its fp64 temporaries (2 MiB each) stay in cache instead of
#: three full-size fp64 copies of the inputs (measured here on a 4096x4096 pair: 136 ms before).
_SQNR_STEP = 1 << 18


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 * log10(||ref|| / ||ref - approx||)`` in dB, the sums
    of squares accumulated in fp64 (a slice at a time).

    Returns ``inf`` when ``approx`` equals ``ref`` exactly, ``nan`` if either holds NaN. Same
    definition as torchao's ``compute_error``.

    Raises:
        ValueError: the shapes differ.
    """
    if ref.shape != approx.shape:
        raise ValueError(f"sqnr_db: shapes differ, {tuple(ref.shape)} vs {tuple(approx.shape)}")
    r, a = ref.detach().reshape(-1), approx.detach().reshape(-1)
    sums = torch.zeros(2, dtype=torch.float64, device=r.device)  # signal, noise: on the tensors' device
    for i in range(0, r.numel(), _SQNR_STEP):
        rs = r[i : i + _SQNR_STEP].to(torch.float64)
        d = rs - a[i : i + _SQNR_STEP].to(torch.float64)
        sums[0] += torch.dot(rs, rs)
        sums[1] += torch.dot(d, d)
    signal, noise = sums.tolist()  # one host sync (a CUDA tensor is not synced per slice)
    if math.isnan(noise) or math.isnan(signal):
        return float("nan")
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


def max_abs_error(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """``max |ref - approx|`` in fp64 (0.0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    return (ref.detach().to(torch.float64) - approx.detach().to(torch.float64)).abs().max().item()


def bit_exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors have the same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().cpu(), b.detach().contiguous().cpu()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


# SQNR floors of the lossy paths (quantize, requantize, re-encode, cast), each with its reason; the
# test suite takes its bounds from here (tests/_bounds.py), and ``ckptq verify A B`` judges a pair of
# different encodings by them.
#
# Model for a float format with p explicit mantissa bits, round to nearest, no overflow or underflow:
# for x in [2^e, 2^(e+1)) the error is uniform over one ulp 2^(e-p), variance 4^(e-p) / 12, so
#   SQNR = 10 log10(E[x^2] / E[4^(e-p) / 12]) = 6.02 p + 10 log10(12 E[x^2] / E[4^floor(log2|x|)]).
# The last term depends only on the shape of the distribution: 14.5 dB for a mantissa uniform in a
# binade; for a Gaussian (measured on 4M samples: 13.44 dB) the energy-carrying values sit low in
# their binades. Hence E4M3 (p = 3): 31.5 dB, E5M2 (p = 2): 25.5 dB, bfloat16 (p = 7): 55.6 dB,
# float16 (p = 10): 73.6 dB, float32 (p = 23): 151.9 dB (the last three measured: 55.59, 73.67, 151.93).
# Per-tensor, blockwise, pow2 and E8M0 scaling do not change this: scaling by any factor keeps the
# relative error of normal values, and a Gaussian's values below amax * 2^-15 (where E4M3 turns
# subnormal) carry < 1e-9 of its energy. Dequantizing to bf16/fp16 adds a rounding with 8/11
# significant bits (>= 50 dB), negligible.
# NVFP4 (E2M1, one mantissa bit but only three binades plus 0.5): the model is an ideal E2M1 RNE
# quantizer with the exact block scale amax_b / 6: 20.5 dB for 1x16 blocks, 19.1 dB for 16x16 (one
# amax over 256 values leaves more values in the coarse region below 1). E4M3 rounding of the block
# scale (relative error <= 2^-4) and the clamp at 6 cost ~0.15 dB more.
# Floors: model - 1.5 dB (a quarter of a bit). The SQNR estimate on 131k samples moves < 0.1 dB
# with the seed, so the margin is all for effects the model leaves out; a bug costing one bit --
# truncation instead of RNE (error uniform over a whole ulp: 4x the variance), a lost mantissa bit,
# a block scale off by 2x for NVFP4 -- costs ~6 dB and fails.

#: Encoding -> (floor in dB of SQNR(x, decode(encode(x))) on Gaussian-like data, reason).
SQNR_FLOORS: dict[str, tuple[float, str]] = {
    "e4m3": (30.0, "E4M3 elements (3 mantissa bits, any scaling): model 31.5 dB - 1.5"),
    "e5m2": (24.0, "E5M2 elements (2 mantissa bits, any scaling): model 25.5 dB - 1.5"),
    "nvfp4": (19.0, "NVFP4 1x16 blocks (E2M1 under an E4M3 scale of amax/6): model 20.5 dB - 1.5"),
    "nvfp4_2d": (17.5, "NVFP4 16x16 blocks (one amax over 256 values): model 19.1 dB - 1.5"),
    "mxfp4": (17.0, "MXFP4 1x32 blocks (E2M1, E8M0 scale; floor/even/rceil rules): model 18.7 dB - 1.7"),
    "mxfp4_ceil": (15.0, "MXFP4 with the ceil scale rule (up to one binade of E2M1 range unused): model 16.8 dB - 1.8"),
    "bfloat16": (54.0, "a bfloat16 cast (7 mantissa bits): model 55.6 dB - 1.5"),
    "float16": (72.0, "a float16 cast (10 mantissa bits): model 73.6 dB - 1.5"),
    "float32": (150.0, "a float32 cast (23 mantissa bits): model 151.9 dB - 1.5"),
    "float64": (math.inf, "float64 values: the reference"),
}

# Re-encoding values that are already quantized (requantize into another format or block grid):
# the second rounding costs at most the target format's own error, and the source's error adds
# (uncorrelated) on top; floors = the target's model floor minus a few dB for that sum.
#: Coarser encoding of a quantized pair -> (floor in dB of the pair's SQNR, reason).
REENCODE_FLOORS: dict[str, tuple[float, str]] = {
    "e4m3": (25.0, "E4M3 values re-encoded under other scales or blocks (a second E4M3 rounding)"),
    "nvfp4": (15.0, "values re-encoded to or from NVFP4 (E2M1 under 1x16 or 16x16 E4M3 scales): ~19-20 dB model"),
    "mxfp4": (14.5, "values re-encoded to or from MXFP4 (E2M1 under 1x32 E8M0 scales): ~16.5 (ceil) to 19 dB model"),
}


def encoding_of(x) -> str:
    """The element encoding of ``x`` for :func:`sqnr_bound`: ``"nvfp4"``, ``"nvfp4_2d"``, ``"mxfp4"``,
    ``"mxfp4_ceil"``, ``"e4m3"`` or ``"e5m2"`` for a quantized tensor (fp8 formats by their element
    dtype), else the plain
    dtype's name (``"bfloat16"``, ``"float32"``, ``"int64"``, ...; ``float8_e4m3fn`` -> ``"e4m3"``)."""
    fmt = getattr(x, "FORMAT", None)
    if fmt == "nvfp4":
        return "nvfp4_2d" if getattr(x.recipe, "two_d", False) else "nvfp4"
    if fmt == "mxfp4":
        return "mxfp4_ceil" if x.recipe.scale_rule == "ceil" else "mxfp4"
    if fmt is not None:
        fp8 = getattr(x.recipe, "fp8_dtype", torch.float8_e4m3fn)
        return "e5m2" if fp8 == torch.float8_e5m2 else "e4m3"
    name = str(x.dtype).removeprefix("torch.")
    return {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}.get(name, name)


def sqnr_bound(a: str, b: str, *, quantized: tuple[bool, bool] = (False, False)) -> tuple[float, str] | None:
    """The SQNR floor (dB) that a pair of tensors of encodings ``a`` and ``b`` (:func:`encoding_of`)
    holding the same values allows, and its reason; None when no bound is known.

    Both quantized (``quantized=(True, True)``): one set of values is a re-encoding of the other,
    so the floor is :data:`REENCODE_FLOORS` of the coarser side (MXFP4, then NVFP4, then E4M3; a pair
    with an E5M2 side and no FP4 side has none). Otherwise: the looser of the two sides'
    :data:`SQNR_FLOORS` (a quantized tensor vs its high-precision values, or two plain float dtypes).
    """
    if all(quantized):
        for enc in ("mxfp4", "nvfp4", "e4m3"):
            if enc in (a.removesuffix("_2d").removesuffix("_ceil"), b.removesuffix("_2d").removesuffix("_ceil")):
                if enc == "e4m3" and "e5m2" in (a, b):
                    return None
                return REENCODE_FLOORS[enc]
        return None
    if a not in SQNR_FLOORS or b not in SQNR_FLOORS:
        return None
    return min(SQNR_FLOORS[a], SQNR_FLOORS[b], key=lambda f: f[0])

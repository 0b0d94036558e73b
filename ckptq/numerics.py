"""Reference numerics: the spec every backend (C++, CUDA) must match bit for bit.

Pure PyTorch, vectorized, on plain tensors. All scale math is fp32 in exactly the operation order of
docs/formats.md (the written spec), which follows TransformerEngine's kernels (TE ``main`` at d0067d0):

* ``common/recipe/recipe_common.cuh::compute_scale_from_amax`` (FP8 per-tensor and blockwise scales),
* ``common/util/ptx_arch_spec.cuh::float_to_e8m0`` and ``ptx.cuh::exp2f_rcp`` (MXFP8 E8M0 scales),
* ``common/cast/nvfp4/core_nvfp4.cuh`` and ``dequantize_nvfp4.cuh`` (NVFP4 two-level scales).

MXFP4 follows the OCP Microscaling Formats (MX) v1.0 specification (section 6.3, the floor scale
rule) and the round-up scale rules the producers use, named as torchao 0.18 names them
(``torchao/prototype/mx_formats/config.py::ScaleCalculationMode``); docs/formats.md, "7. `mxfp4`".

"min(a, FLT_MAX)" below is C's ``fminf``: a NaN operand yields the other operand (``torch.fmin``).
NaN: every NaN the spec writes is canonical -- fp32 0x7FC00000 (amaxes, dequantized values), FP8
0x7F, E2M1 0x7, E8M0 255 -- so that the bytes do not depend on which NaN torch's kernels propagate
(its CPU fp16->fp32 conversion gives different NaN bits in the vectorized body and the tail; CPU
reductions give 0x7FC00000 or 0xFFFFFFFF by layout; a product of two NaNs carries the one the
compiler's operand order picks); a bf16/fp16 output NaN is what torch's conversion of 0x7FC00000
gives on the device.
Shapes: the last two dims of every input are the matrix (M, K) with K the reduction dim; leading dims
are batch dims (experts, grouped GEMMs) with their own scales, so per-tensor values have the batch
shape (``()`` for a 2-D tensor).
"""

from __future__ import annotations

import torch

from .chunks import blocked_view, unblock

__all__ = [
    "HP_FORMATS",
    "FP8_MAX",
    "FLT_MAX",
    "cast_fp8",
    "fp8_scale_from_amax",
    "e8m0_from_fp32",
    "e8m0_to_fp32",
    "pow2_from_e8m0_rcp",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "nvfp4_global_encode_scale",
    "quantize_fp8_tensor",
    "dequantize_fp8_tensor",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "NVFP4_PER_TENSOR",
    "nvfp4_per_tensor_from_amax",
    "nvfp4_block_multiplier",
    "nvfp4_convert_per_tensor",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "MXFP4_SCALE_RULES",
    "mxfp4_scale_from_amax",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "columnwise_copy",
]

#: The high-precision dtypes: what ckptq quantizes from, dequantizes to and stores high-precision
#: entries as, each with its short name (the name the ``ckptq::requantize`` op gives it as a format).
HP_FORMATS: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLT_MAX = torch.finfo(torch.float32).max
_F32 = torch.float32

# fp32 constants, each the float nearest to the rational (what `1.0f / 448.0f` gives in C).
INV_448 = torch.tensor(1.0 / 448.0, dtype=_F32)
INV_6 = torch.tensor(1.0 / 6.0, dtype=_F32)
INV_2688 = torch.tensor(1.0 / 2688.0, dtype=_F32)
NVFP4_SCALE_NUMERATOR = 2688.0  # 6 (E2M1 max) * 448 (E4M3 max), exact in fp32
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=_F32
)
_POW2_MASK = -8388608  # 0xFF800000 as int32: keep sign and exponent, clear the mantissa


def _canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """Every NaN of the fp32 ``x`` becomes the canonical quiet NaN (0x7FC00000)."""
    return torch.where(torch.isnan(x), torch.full((), float("nan"), dtype=_F32, device=x.device), x)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == _F32 else x.to(_F32)


def _amax(x: torch.Tensor, dim) -> torch.Tensor:
    """``x.abs().amax(dim)``, fp32; NaN propagates as the canonical NaN (torch's CPU reductions
    return 0x7FC00000 or 0xFFFFFFFF depending on the memory layout, and NVFP4 stores the amax)."""
    return _canonical_nan(x.abs().amax(dim=dim))


def cast_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> FP8 with round-to-nearest-even and saturation to +-max finite (E4M3 448, E5M2 57344).

    NaN stays NaN: every NaN becomes the canonical 0x7F, as TE's ``cvt.rn.satfinite`` writes it
    (which NaN a product of two NaNs carries, and so its sign, depends on the compiler's operand
    order). The sign of zero is kept, subnormals round correctly. The explicit clamp makes inf
    saturate on every torch version.
    """
    m = FP8_MAX[fp8_dtype]
    return _canonical_nan(_f32(x)).clamp(-m, m).to(fp8_dtype)


def fp8_scale_from_amax(amax: torch.Tensor, fp8_max: float, *, pow2: bool, eps: float = 0.0) -> torch.Tensor:
    """FP8 encode scale from amax (TE ``compute_scale_from_amax``), elementwise over ``amax``.

    Order: ``amax = max(amax, eps)``; amax 0, inf or NaN -> scale 1; else ``scale = fp8_max / amax``
    (fp32 division); an overflow to inf -> FLT_MAX; with ``pow2`` the mantissa bits are cleared
    (``bits & 0xFF800000``, rounds down to a power of two). Returns fp32 of amax's shape.
    """
    amax = _f32(amax)
    amax = torch.where(amax < eps, torch.tensor(eps, dtype=_F32), amax)
    special = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.tensor(fp8_max, dtype=_F32) / torch.where(special, torch.ones_like(amax), amax)
    scale = torch.where(torch.isinf(scale), torch.tensor(FLT_MAX, dtype=_F32), scale)
    scale = torch.where(special, torch.ones_like(scale), scale)
    if pow2:
        scale = (scale.view(torch.int32) & _POW2_MASK).view(_F32)
    return scale


def e8m0_from_fp32(v: torch.Tensor) -> torch.Tensor:
    """E8M0 byte for a non-negative fp32 value, exponent rounded up (TE ``float_to_e8m0``).

    Take v's exponent field E and mantissa m: ``e = E + 1`` if m != 0, except when E == 0xFE
    (saturate) or for subnormals with m <= 0x400000; NaN -> 255, inf -> 254, 0 -> 0. Returns uint8.
    """
    v = _f32(v)
    bits = v.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    bump = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    e = exp + bump.to(torch.int32)
    e = torch.where(torch.isinf(v), torch.full_like(e, 254), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 255), e)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    return e.to(torch.uint8)


def _pow2_from_biased(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) as exact fp32 for biased in [-23, 255]; 255 -> NaN (int32 tensor in)."""
    normal = (biased.clamp(1, 254) << 23).view(_F32)
    sub_shift = (22 + biased).clamp(0, 22)  # biased 0 -> 2^-127 = bit 22; biased -22 -> bit 0
    sub = (torch.ones_like(biased) << sub_shift).view(_F32)
    out = torch.where(biased >= 1, normal, sub)
    out = torch.where(biased < -22, torch.zeros_like(out), out)
    return torch.where(biased >= 255, torch.full_like(out, float("nan")), out)


def e8m0_to_fp32(e: torch.Tensor) -> torch.Tensor:
    """Decode multiplier of an E8M0 byte: ``2^(e - 127)``; byte 0 is 2^-127, byte 255 is NaN."""
    return _pow2_from_biased(e.to(torch.int32))


def pow2_from_e8m0_rcp(e: torch.Tensor) -> torch.Tensor:
    """Encode multiplier ``2^(127 - e)`` (TE ``exp2f_rcp``): e=254 -> 2^-127, e=255 -> NaN."""
    e = e.to(torch.int32)
    out = _pow2_from_biased(254 - e)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 4-bit code (uint8 in 0..15), round half to even, input already clamped to +-6.

    code = signbit(v) << 3 | index into {0, .5, 1, 1.5, 2, 3, 4, 6}; ties 0.25->0, 0.75->1, 1.25->1,
    1.75->2, 2.5->2, 3.5->4, 5->4; -0.1 and -0.0 give 0x8; NaN gives 0x7 (+6).
    """
    a = v.abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)).to(
        torch.uint8
    )
    code = idx | (torch.signbit(v).to(torch.uint8) << 3)
    return torch.where(torch.isnan(v), torch.full_like(code, 7), code)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8 0..15) -> fp32 value."""
    return E2M1_VALUES.to(code.device)[code.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes (..., K) uint8, K even, into (..., K/2): element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: (..., K/2) uint8 -> codes (..., K)."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _matrix_amax(x: torch.Tensor) -> torch.Tensor:
    """amax over the last two dims (NaN propagates as the canonical NaN): batch shape, fp32."""
    return _amax(_f32(x), (-2, -1))


# --------------------------------------------------------------------------------------------- #
# fp8_tensor                                                                                     #
# --------------------------------------------------------------------------------------------- #
def quantize_fp8_tensor(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    pow2: bool = False,
    eps: float = 0.0,
    amax: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-tensor FP8 (current scaling). x (..., M, K) -> data fp8 (..., M, K), scale_inv fp32 (...).

    ``scale`` (encode multiplier) wins over ``amax``; otherwise amax is computed over each matrix.
    ``data = sat_rne(x * scale)``, ``scale_inv = 1 / scale``.
    """
    x = _f32(x)
    batch = x.shape[:-2]
    if scale is None:
        a = _matrix_amax(x) if amax is None else _f32(torch.as_tensor(amax, device=x.device)).expand(batch).clone()
        scale = fp8_scale_from_amax(a, FP8_MAX[fp8_dtype], pow2=pow2, eps=eps)
    else:
        scale = _f32(torch.as_tensor(scale, device=x.device)).expand(batch).clone()
    data = cast_fp8(x * scale[..., None, None], fp8_dtype)
    return {"data": data, "scale_inv": torch.reciprocal(scale)}


def dequantize_fp8_tensor(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = _F32) -> torch.Tensor:
    """``x = float(data) * scale_inv`` in fp32 (NaN canonical), then cast to ``dtype``."""
    return _canonical_nan(data.to(_F32) * scale_inv[..., None, None]).to(dtype)


# --------------------------------------------------------------------------------------------- #
# fp8_block (1x128 / 128x128)                                                                    #
# --------------------------------------------------------------------------------------------- #
def quantize_fp8_block(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    pow2: bool = True,
    eps: float = 0.0,
    columnwise: bool = False,
) -> dict[str, torch.Tensor]:
    """Blockwise FP8. x (..., M, K) -> data fp8 (..., M, K), scale_inv fp32 (..., ceil(M/bm), ceil(K/bk)).

    Per block (ragged edges: amax over real elements only) the FP8 scale rule of
    :func:`fp8_scale_from_amax` with ``pow2`` (default on, as TE's ``Float8BlockScaling``).
    With ``columnwise`` also the columnwise copy (:func:`columnwise_copy`): columnwise_data fp8
    (..., M, K) and columnwise_scale_inv fp32 (..., ceil(M/bk), ceil(K/bm)), the rowwise encoding
    of x^T with the same block, transposed back (TE's 1-D ``Float8BlockwiseQTensor`` columnwise).
    """
    xb = blocked_view(_f32(x), block)
    amax = _amax(xb, (-3, -1))
    scale = fp8_scale_from_amax(amax, FP8_MAX[fp8_dtype], pow2=pow2, eps=eps)
    data = cast_fp8(xb * scale[..., :, None, :, None], fp8_dtype)
    out = {"data": unblock(data, x.shape), "scale_inv": torch.reciprocal(scale)}
    if columnwise:
        t = quantize_fp8_block(x.mT.contiguous(), block, fp8_dtype, pow2=pow2, eps=eps)
        out.update(columnwise_copy(t, {"columnwise_data": "data", "columnwise_scale_inv": "scale_inv"}))
    return out


def columnwise_copy(transposed: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The columnwise components of x from the rowwise components of x^T (``transposed``, each
    of shape (..., K', M')): ``{columnwise name: transposed[rowwise name].mT}``, contiguous.

    This is how TransformerEngine defines the columnwise copy of NVFP4 1x16 and 1-D blockwise FP8
    tensors: the transpose of the high-precision input quantized rowwise (TE ``main`` d0067d0,
    ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`` ``NVFP4QuantizerRef._quantize``
    and ``tests/pytorch/references/blockwise_quantizer_reference.py`` ``_quantize_vector_tiling``,
    which TE's tests match byte for byte against its kernels). ckptq stores it untransposed.
    """
    return {cw: transposed[rw].mT.contiguous() for cw, rw in names.items()}


def dequantize_fp8_block(
    data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = _F32
) -> torch.Tensor:
    """``x = float(data) * scale_inv[block]`` in fp32 (NaN canonical), then cast to ``dtype``."""
    xb = blocked_view(data.to(_F32), block)
    return _canonical_nan(unblock(xb * scale_inv[..., :, None, :, None], data.shape)).to(dtype)


# --------------------------------------------------------------------------------------------- #
# mxfp8 (1x32 E8M0; optional 32x1 columnwise copy)                                               #
# --------------------------------------------------------------------------------------------- #
def _mx_quantize_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    xb = blocked_view(x, block)
    amax = _amax(xb, (-3, -1))
    e = e8m0_from_fp32(amax * INV_448)  # v = amax_block * (1/448): a multiply by the fp32 constant
    mult = pow2_from_e8m0_rcp(e)  # exact 2^(127 - e)
    data = cast_fp8(xb * mult[..., :, None, :, None], torch.float8_e4m3fn)
    return unblock(data, x.shape), e


def quantize_mxfp8(x: torch.Tensor, *, columnwise: bool = False) -> dict[str, torch.Tensor]:
    """MXFP8 (OCP MX, E4M3 elements, E8M0 scales, TE/cuBLAS rounding of the scale up).

    x (..., M, K) -> data e4m3 (..., M, K), scale uint8 (..., M, ceil(K/32)); with ``columnwise``
    also columnwise_data e4m3 (..., M, K) and columnwise_scale uint8 (..., ceil(M/32), K), quantized
    independently from x with 32x1 blocks.
    """
    x = _f32(x)
    out = {}
    out["data"], out["scale"] = _mx_quantize_blocks(x, (1, 32))
    if columnwise:
        out["columnwise_data"], out["columnwise_scale"] = _mx_quantize_blocks(x, (32, 1))
    return out


def dequantize_mxfp8(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = _F32, *, block: tuple[int, int] = (1, 32)
) -> torch.Tensor:
    """``x = float(data) * 2^(scale - 127)`` (NaN canonical); byte 0 means 2^-127, byte 255 NaN."""
    xb = blocked_view(data.to(_F32), block)
    return _canonical_nan(unblock(xb * e8m0_to_fp32(scale)[..., :, None, :, None], data.shape)).to(dtype)


# --------------------------------------------------------------------------------------------- #
# nvfp4 (E2M1 data, E4M3 block scales 1x16 or 16x16, fp32 amax)                                 #
# --------------------------------------------------------------------------------------------- #
def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 2688 / amax``; ``min(S_enc, FLT_MAX)`` (fminf); amax 0 or S_enc 0 (amax inf) -> 1.

    Order as TE ``compute_global_encode_scaling_factor_FP4``. fp32, amax's shape.
    """
    amax = _f32(amax)
    s_enc = torch.tensor(NVFP4_SCALE_NUMERATOR, dtype=_F32) / amax
    s_enc = torch.fmin(s_enc, torch.tensor(FLT_MAX, dtype=_F32))
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


#: The NVFP4 per-tensor (global) value conventions: the component a tensor stores and how its decode
#: uses it (docs/formats.md, "6. `nvfp4`", "Global-scale conventions"). ``amax``: ckptq's and
#: TransformerEngine's; ``global_scale_inv``: a decode multiplier ``amax / 2688`` (ModelOpt
#: ``weight_scale_2``, torchao ``per_tensor_scale``); ``global_scale``: an encode multiplier
#: ``2688 / amax`` (compressed-tensors ``weight_global_scale``).
NVFP4_PER_TENSOR = ("amax", "global_scale_inv", "global_scale")


def nvfp4_per_tensor_from_amax(amax: torch.Tensor, per_tensor: str) -> torch.Tensor:
    """The per-tensor value a convention stores for an fp32 ``amax`` (any shape; fp32 out):
    ``amax`` itself; ``global_scale_inv = fl32(amax / 2688)`` (ModelOpt
    ``NVFP4QTensor.get_weights_scaling_factor_2``, torchao ``per_tensor_amax_to_scale``: a tensor
    divided by a Python float, a true division); ``global_scale = fl32(fl32(1 / amax) * 2688)``, 1
    where that is not finite (compressed-tensors ``generate_gparam``: ``448.0 * 6.0 / amax`` with
    Python floats, which torch evaluates as ``amax.reciprocal() * 2688``; then
    ``nan_to_num(..., nan=1, posinf=1)``)."""
    a = _f32(amax)
    if per_tensor == "amax":
        return a.clone()
    n = torch.tensor(NVFP4_SCALE_NUMERATOR, dtype=_F32, device=a.device)
    if per_tensor == "global_scale_inv":
        return a / n
    if per_tensor == "global_scale":
        g = torch.reciprocal(a) * n
        return torch.where(torch.isfinite(g), g, torch.ones_like(g))
    raise ValueError(f"unknown nvfp4 per-tensor convention {per_tensor!r}; one of {NVFP4_PER_TENSOR}")


def nvfp4_block_multiplier(scale: torch.Tensor, value: torch.Tensor, per_tensor: str) -> torch.Tensor:
    """fp32 decode multiplier of each block: ``scale`` (E4M3 or its fp32 values, (..., R, C)) and the
    per-tensor ``value`` (batch shape (...)) of convention ``per_tensor``, each in its producer's op
    order: ``amax``: ``fl32(fl32(s * amax) * INV_2688)`` (TE ``dequantize_nvfp4.cuh``);
    ``global_scale_inv``: ``fl32(s * g)`` (ModelOpt ``NVFP4QTensor.dequantize``: ``scale * double_scale``;
    torchao ``get_hp_scales``: ``per_tensor_scale * scale``, the same product); ``global_scale``:
    ``fl32(s / g)`` (compressed-tensors ``_dequantize``: ``scale / global_scale``)."""
    s = scale.to(_F32)
    v = _f32(value)[..., None, None]
    if per_tensor == "amax":
        return (s * v) * INV_2688
    if per_tensor == "global_scale_inv":
        return s * v
    if per_tensor == "global_scale":
        return s / v
    raise ValueError(f"unknown nvfp4 per-tensor convention {per_tensor!r}; one of {NVFP4_PER_TENSOR}")


_E2M1_POS = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=_F32)
_NEIGHBOURS = 4  # fp32 neighbours tried on each side by nvfp4_convert_per_tensor


def _nvfp4_amax_of(value: torch.Tensor, per_tensor: str) -> torch.Tensor:
    """The amax a convention's value stands for (exact arithmetic inverted once in fp32)."""
    n = torch.tensor(NVFP4_SCALE_NUMERATOR, dtype=_F32)
    return {"amax": value, "global_scale_inv": value * n, "global_scale": n / value}[per_tensor]


def nvfp4_convert_per_tensor(value: torch.Tensor, src: str, dst: str, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The per-tensor value of convention ``dst`` whose decode is closest to that of ``value``
    (convention ``src``) over the block scales occurring in ``scale`` (E4M3, (..., R, C)); fp32 of
    ``value``'s batch shape, and the largest difference of the two decodes in fp32 ulps over all
    matrices (0: bit-exact; -1: no matrix with a finite positive value to compare).

    Per matrix: the value ``dst`` derives from the amax ``value`` stands for
    (:func:`nvfp4_per_tensor_from_amax`) and its 4 fp32 neighbours on each side; the first with the
    smallest largest difference, nearest first. The codes and block scales are not changed, so a
    decode of them with the result is within the returned ulps of the decode with ``value``.
    """
    device = value.device
    value = _f32(value).cpu()
    scale = scale.cpu()
    batch = tuple(value.shape)
    out = torch.empty(batch, dtype=_F32)
    worst = -1
    flat_v, flat_s = value.reshape(-1), scale.reshape((-1,) + tuple(scale.shape[-2:]))
    for i in range(flat_v.numel()):
        v = flat_v[i]
        base = nvfp4_per_tensor_from_amax(_nvfp4_amax_of(v, src), dst)
        if not (torch.isfinite(v) and v > 0 and torch.isfinite(base) and base > 0):
            out.view(-1)[i] = base
            continue
        bytes_ = torch.unique(flat_s[i].contiguous().view(torch.uint8) & 0x7F)
        occurring = bytes_[(bytes_ != 0) & (bytes_ != 0x7F)].view(torch.float8_e4m3fn).to(_F32)[None, :]
        ref = _E2M1_POS[:, None] * nvfp4_block_multiplier(occurring, v, src)
        bits = int(base.view(torch.int32))
        best, best_u = base, None
        for k in [0] + [sgn * j for j in range(1, _NEIGHBOURS + 1) for sgn in (1, -1)]:
            if not 0 < bits + k < 0x7F800000:
                continue
            cand = torch.tensor(bits + k, dtype=torch.int32).view(_F32)
            got = _E2M1_POS[:, None] * nvfp4_block_multiplier(occurring, cand, dst)
            u = int((got.view(torch.int32).long() - ref.view(torch.int32).long()).abs().max()) if got.numel() else 0
            if best_u is None or u < best_u:
                best, best_u = cand, u
            if u == 0:
                break
        out.view(-1)[i] = best
        worst = max(worst, best_u)
    return out.to(device), worst


def quantize_nvfp4(
    x: torch.Tensor, *, two_d: bool = False, amax: torch.Tensor | None = None, columnwise: bool = False
) -> dict[str, torch.Tensor]:
    """NVFP4. x (..., M, K), K even -> data uint8 (..., M, K/2), scale e4m3 (..., M, ceil(K/16)) or
    (..., ceil(M/16), ceil(K/16)) with ``two_d``, amax fp32 (...).

    Order: ``S_enc`` (:func:`nvfp4_global_encode_scale`), ``S_dec = 1 / S_enc``; per block
    ``s = e4m3_rne_sat(amax_block * (S_enc * (1/6)))``; ``enc = min(1 / (float(s) * S_dec), FLT_MAX)``;
    ``code = e2m1_rne(clamp(x * enc, -6, 6))``. ``amax`` overrides the tensor's own amax so that
    shards of one tensor share it. With ``columnwise`` (1x16 only; M even) also the columnwise
    copy (:func:`columnwise_copy`): x^T encoded rowwise with the same amax (TE's columnwise amax
    equals the rowwise one without a Hadamard transform), transposed back: columnwise_data uint8
    (..., M/2, K), rows 2i and 2i+1 in the low and high nibble, columnwise_scale e4m3
    (..., ceil(M/16), K).
    """
    x = _f32(x)
    batch = x.shape[:-2]
    a = _matrix_amax(x) if amax is None else _f32(torch.as_tensor(amax, device=x.device)).expand(batch).clone()
    s_enc = nvfp4_global_encode_scale(a)
    s_dec = torch.reciprocal(s_enc)
    block = (16, 16) if two_d else (1, 16)
    xb = blocked_view(x, block)
    amax_b = _amax(xb, (-3, -1))
    s = cast_fp8(amax_b * (s_enc * INV_6)[..., None, None], torch.float8_e4m3fn)
    enc = torch.fmin(torch.reciprocal(s.to(_F32) * s_dec[..., None, None]), torch.tensor(FLT_MAX, dtype=_F32))
    v = (xb * enc[..., :, None, :, None]).clamp(-6.0, 6.0)
    codes = unblock(e2m1_encode(v), x.shape)
    out = {"data": pack_fp4(codes), "scale": s, "amax": a}
    if columnwise:
        t = quantize_nvfp4(x.mT.contiguous(), amax=a)
        out.update(columnwise_copy(t, {"columnwise_data": "data", "columnwise_scale": "scale"}))
    return out


def dequantize_nvfp4(
    data: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype = _F32,
    *,
    two_d: bool = False,
    per_tensor: str = "amax",
) -> torch.Tensor:
    """``x = fl32(e2m1(code) * m)`` with the block multiplier ``m`` of :func:`nvfp4_block_multiplier`
    (``amax`` convention: ``(float(s) * amax) * (1/2688)``, TE's dequantize kernel order; uses amax,
    not S_dec), fp32 (NaN canonical) then cast to ``dtype``. ``amax`` is the per-tensor value of
    convention ``per_tensor``."""
    codes = unpack_fp4(data)
    block = (16, 16) if two_d else (1, 16)
    mult = nvfp4_block_multiplier(scale, amax, per_tensor)
    xb = blocked_view(e2m1_decode(codes), block)
    return _canonical_nan(unblock(xb * mult[..., :, None, :, None], codes.shape)).to(dtype)


# --------------------------------------------------------------------------------------------- #
# mxfp4 (E2M1 data packed two per byte, E8M0 scales per 1x32 block)                             #
# --------------------------------------------------------------------------------------------- #
#: The MXFP4 scale rules (the names of torchao 0.18 ``ScaleCalculationMode``, lower case):
#: ``floor`` OCP MX v1.0 6.3; ``even`` torchao EVEN = compressed-tensors 0.20 ``generate_mx_scales``;
#: ``ceil`` torchao CEIL; ``rceil`` torchao RCEIL = NVIDIA cuBLAS/TE and triton_kernels
#: ``downcast_to_mxfp`` ROUND_UP (gpt-oss; transformers' ``quantize_to_mxfp4``).
MXFP4_SCALE_RULES = ("floor", "even", "ceil", "rceil")
E2M1_EMAX = 2  # exponent of the largest E2M1 power of two: 4 = 2^2 (6 = 1.5 * 2^2)
_EVEN_ROUND = 1 << 21  # half an ulp of a 1-bit mantissa (E2M1's) in fp32's 23-bit field


def mxfp4_scale_from_amax(amax: torch.Tensor, rule: str = "floor") -> torch.Tensor:
    """E8M0 scale byte (uint8) of an MXFP4 block from its fp32 amax, elementwise.

    Finite amax (``E`` = amax's fp32 exponent field, ``m`` its mantissa field):

    * ``floor`` (OCP MX v1.0 6.3): ``max(E - 2, 0)``, i.e. ``2^(floor(log2 amax) - 2)``;
    * ``even``: ``E`` is taken after rounding amax to one mantissa bit (``bits + 2^21``, mantissa
      cleared), then ``max(E' - 2, 0)``;
    * ``ceil``: ``max(E + (m != 0) - 2, 0)``, i.e. ``2^(ceil(log2 amax) - 2)``;
    * ``rceil``: ``d = amax / 6`` (fp32 division) rounded up to a power of two (TE ``float_to_e8m0``
      of ``d``: 2^ceil(log2 d), d <= 2^-127 -> 0, saturating at 254).

    Every rule: amax NaN -> 255 (the block decodes to NaN), amax +inf -> 254; amax 0 -> 0.
    """
    amax = _f32(amax)
    if rule == "rceil":
        e = e8m0_from_fp32(amax / torch.tensor(6.0, dtype=_F32))
    else:
        bits = amax.view(torch.int32)
        if rule == "even":
            bits = (bits + _EVEN_ROUND) & 0x7F800000
        exp = (bits >> 23) & 0xFF
        if rule == "ceil":
            exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        elif rule not in ("floor", "even"):
            raise ValueError(f"unknown mxfp4 scale rule {rule!r}; one of {MXFP4_SCALE_RULES}")
        e = (exp - E2M1_EMAX).clamp(0, 254).to(torch.uint8)
    e = torch.where(torch.isinf(amax), torch.full_like(e, 254), e)
    return torch.where(torch.isnan(amax), torch.full_like(e, 255), e)


def quantize_mxfp4(x: torch.Tensor, *, scale_rule: str = "floor") -> dict[str, torch.Tensor]:
    """MXFP4 (OCP MX v1.0: E2M1 elements, one E8M0 scale per 1x32 block along K).

    x (..., M, K), K even -> data uint8 (..., M, K/2) (element 2i in the low nibble), scale uint8
    (..., M, ceil(K/32)). Per block: ``s = mxfp4_scale_from_amax(amax_block, scale_rule)``;
    ``code = e2m1_rne(clamp(x * 2^(127 - s), -6, 6))`` (an exact power-of-two multiply, then
    round-to-nearest-even with saturation; +-inf elements saturate to +-6). A block holding a NaN
    gets scale 255 and every code of the block is 0x7.
    """
    x = _f32(x)
    xb = blocked_view(x, (1, 32))
    s = mxfp4_scale_from_amax(_amax(xb, (-3, -1)), scale_rule)
    v = (xb * pow2_from_e8m0_rcp(s)[..., :, None, :, None]).clamp(-6.0, 6.0)
    return {"data": pack_fp4(unblock(e2m1_encode(v), x.shape)), "scale": s}


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = _F32) -> torch.Tensor:
    """``x = e2m1(code) * 2^(scale - 127)`` in fp32 (exact; NaN canonical; byte 0 means 2^-127,
    byte 255 NaN), then cast to ``dtype``. data (..., M, K/2), scale (..., M, ceil(K/32))."""
    codes = unpack_fp4(data)
    xb = blocked_view(e2m1_decode(codes), (1, 32))
    return _canonical_nan(unblock(xb * e8m0_to_fp32(scale)[..., :, None, :, None], codes.shape)).to(dtype)

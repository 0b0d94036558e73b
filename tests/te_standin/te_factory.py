"""Build TE-shaped stand-in tensors with realistic bytes (test helper; not part of the stand-in TE).

Numerics come from ``ckptq.quantize`` (ckptq follows TE's kernels), then the results are laid out in
TE's buffers by explicit index computations (padding filled with random NONZERO bytes, since TE's
padding is undefined; GEMM swizzle by TE's index map). Columnwise copies:
* Float8Tensor: ``_transpose`` = data.T (Hopper);
* MXFP8 1-D: the 32x1-block copy of ``ckptq.quantize(x, "mxfp8", columnwise=True)``;
* FP8 block 1-D: ``x.T`` quantized with (1, 128) blocks; 2-D: exact transpose of data and scales;
* NVFP4 2-D: transpose of the rowwise codes and tile scales; 1-D: ``x.T`` quantized with the same
  global amax; RHT: ``x.T`` rotated in 16-element groups (bf16) then quantized with its own amax.
"""

from __future__ import annotations

import torch
import transformer_engine_torch as tex
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor._standin_layout import cdiv, random_bytes, rup, swizzle
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
from transformer_engine.pytorch.tensor.float8_tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
)
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor

import ckptq

__all__ = ["make_te_tensor", "garbage_like", "te_buffers", "padding_masks", "zero_padding", "KINDS"]

_FP8 = {"E4M3": (torch.float8_e4m3fn, DType.kFloat8E4M3), "E5M2": (torch.float8_e5m2, DType.kFloat8E5M2)}
KINDS = {
    "float8": "Float8Tensor",
    "Float8Tensor": "Float8Tensor",
    "mxfp8": "MXFP8Tensor",
    "MXFP8Tensor": "MXFP8Tensor",
    "nvfp4": "NVFP4Tensor",
    "NVFP4Tensor": "NVFP4Tensor",
    "float8_blockwise": "Float8BlockwiseQTensor",
    "blockwise": "Float8BlockwiseQTensor",
    "Float8BlockwiseQTensor": "Float8BlockwiseQTensor",
}


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    out[:, 0::2], out[:, 1::2] = packed & 0xF, packed >> 4
    return out


def _scale_buffer(
    compact: torch.Tensor,
    padded: tuple[int, int],
    gen: torch.Generator,
    *,
    swizzled: bool = False,
    transposed_swizzle: bool = False,
) -> torch.Tensor:
    """A TE scale buffer of shape ``padded`` holding ``compact`` at [:r, :c], random nonzero padding;
    swizzled (of the padded matrix, or of its transpose) when asked. Same dtype as ``compact``."""
    buf = random_bytes(padded, gen, compact.dtype)
    buf[: compact.shape[0], : compact.shape[1]] = compact
    if swizzled:
        mat = buf.t().contiguous() if transposed_swizzle else buf
        buf = swizzle(mat).reshape(padded)
    return buf


def _fp8(fp8_dtype):
    if isinstance(fp8_dtype, str):
        return _FP8[fp8_dtype.upper()]
    for torch_dtype, te in _FP8.values():
        if fp8_dtype in (torch_dtype, te, int(te)):
            return torch_dtype, te
    raise ValueError(fp8_dtype)


def make_te_tensor(
    x: torch.Tensor,
    kind: str,
    *,
    fp8_dtype="E4M3",
    block_scaling_dim: int = 2,
    rowwise: bool = True,
    columnwise: bool = True,
    swizzled: bool = False,
    two_d: bool = False,
    rht: bool = False,
    flavor: str = "main",
    amax: float | None = None,
    delayed: bool = False,
    force_pow_2_scales: bool | None = None,
    amax_epsilon: float = 0.0,
    seed: int = 0,
):
    """A stand-in TE tensor quantizing the 2-D high-precision ``x`` (its dtype is the fake dtype).

    kind: ``float8`` | ``mxfp8`` | ``nvfp4`` | ``float8_blockwise`` (or TE's class names).
    ``flavor="2974"`` gives #2974-era objects: ``transformer_engine_torch.DType`` in ``_fp8_dtype``
    and quantizer ``dtype``, quantizer ``__dict__`` without later keys, shorter pickle payloads.
    """
    cls = KINDS[kind]
    assert x.ndim == 2, "TE flattens leading dims; the stand-in factory takes (M, K)"
    m, k = x.shape
    gen = torch.Generator().manual_seed(seed)
    xf = x.float()
    if cls == "Float8Tensor":
        tdt, te_dt = _fp8(fp8_dtype)
        pow2 = bool(force_pow_2_scales)
        if delayed:
            # Delayed scaling: the scale comes from the amax history (here: this amax), 1/scale stored.
            a = xf.abs().max() if amax is None else torch.tensor(amax, dtype=torch.float32)
            scale = torch.tensor(torch.finfo(tdt).max, dtype=torch.float32) / a
            qt = ckptq.quantize(x, "fp8_tensor", fp8_dtype=tdt, scale=scale)
            q = Float8Quantizer(scale.reshape(1).float(), torch.zeros(1), te_dt, rowwise=rowwise, columnwise=columnwise)
        else:
            qt = ckptq.quantize(x, "fp8_tensor", fp8_dtype=tdt, pow2=pow2, eps=amax_epsilon, amax=amax)
            q = Float8CurrentScalingQuantizer(
                te_dt, None, rowwise=rowwise, columnwise=columnwise, force_pow_2_scales=pow2, amax_epsilon=amax_epsilon
            )
        c = qt.components()
        data = _u8(c["data"])
        t = Float8Tensor(
            shape=x.shape,
            dtype=x.dtype,
            data=data if rowwise else None,
            fp8_scale_inv=c["scale_inv"].reshape(1).clone(),
            fp8_dtype=te_dt,
            data_transpose=data.t().contiguous() if columnwise else None,
            quantizer=q,
        )
    elif cls == "MXFP8Tensor":
        assert m % 32 == 0 and k % 32 == 0, "TE MXFP8 needs M, K % 32 == 0"
        tdt, te_dt = _fp8(fp8_dtype)
        assert tdt == torch.float8_e4m3fn, "ckptq quantizes MXFP8 E4M3 only"
        c = ckptq.quantize(x, "mxfp8", columnwise=columnwise).components()
        q = MXFP8Quantizer(te_dt, rowwise=rowwise, columnwise=columnwise)
        t = MXFP8Tensor(
            shape=x.shape,
            dtype=x.dtype,
            fp8_dtype=te_dt,
            quantizer=q,
            with_gemm_swizzled_scales=swizzled,
            rowwise_data=_u8(c["data"]) if rowwise else None,
            rowwise_scale_inv=_scale_buffer(c["scale"], (rup(m, 128), rup(k // 32, 4)), gen, swizzled=swizzled)
            if rowwise
            else None,
            columnwise_data=_u8(c["columnwise_data"]) if columnwise else None,
            columnwise_scale_inv=_scale_buffer(
                c["columnwise_scale"], (rup(m // 32, 4), rup(k, 128)), gen, swizzled=swizzled, transposed_swizzle=True
            )
            if columnwise
            else None,
        )
    elif cls == "NVFP4Tensor":
        assert m % 16 == 0 and k % 16 == 0, "TE NVFP4 needs M, K % 16 == 0"
        q = NVFP4Quantizer(
            rowwise=rowwise, columnwise=columnwise, with_rht=rht, with_post_rht_amax=rht, with_2d_quantization=two_d
        )
        a = None if amax is None else torch.tensor(amax, dtype=torch.float32)
        c = ckptq.quantize(x, "nvfp4", two_d=two_d, amax=a).components()
        s_rows = c["scale"].repeat_interleave(16, 0)[:m] if two_d else c["scale"]
        row_scale_shape = (rup(m, 128), rup(cdiv(k, 16), 4))
        col_scale_shape = (rup(k, 128), rup(cdiv(m, 16), 4))
        col_data = col_scale = col_amax = None
        if columnwise:
            if rht:
                xt = (x.t().contiguous().to(torch.bfloat16).reshape(-1, 16) @ q.rht_matrix).reshape(k, m)
                cc = ckptq.quantize(xt.float(), "nvfp4").components()
                col_data, col_scale, col_amax = cc["data"], cc["scale"], cc["amax"]
            elif two_d:
                col_data = _pack(_unpack(c["data"]).t().contiguous())
                col_scale = c["scale"].t().repeat_interleave(16, 0)[:k]
                col_amax = c["amax"]
            else:
                cc = ckptq.quantize(x.t().contiguous(), "nvfp4", amax=c["amax"]).components()
                col_data, col_scale, col_amax = cc["data"], cc["scale"], cc["amax"]
        t = NVFP4Tensor(
            shape=x.shape,
            dtype=x.dtype,
            fp4_dtype=DType.kFloat4E2M1,
            quantizer=q,
            with_gemm_swizzled_scales=swizzled,
            rowwise_data=c["data"].clone() if rowwise else None,
            rowwise_scale_inv=_scale_buffer(_u8(s_rows), row_scale_shape, gen, swizzled=swizzled) if rowwise else None,
            amax_rowwise=c["amax"].reshape(1).clone() if rowwise else None,
            columnwise_data=col_data.clone() if columnwise else None,
            columnwise_scale_inv=_scale_buffer(_u8(col_scale), col_scale_shape, gen, swizzled=swizzled)
            if columnwise
            else None,
            amax_columnwise=col_amax.reshape(1).clone() if columnwise else None,
        )
    else:
        tdt, te_dt = _fp8(fp8_dtype)
        pow2 = True if force_pow_2_scales is None else bool(force_pow_2_scales)
        q = Float8BlockQuantizer(
            te_dt,
            rowwise=rowwise,
            columnwise=columnwise,
            amax_epsilon=amax_epsilon,
            force_pow_2_scales=pow2,
            block_scaling_dim=block_scaling_dim,
        )
        opts = dict(fp8_dtype=tdt, pow2=pow2, eps=amax_epsilon)
        mb, kb = cdiv(m, 128), cdiv(k, 128)
        if block_scaling_dim == 2:
            c = ckptq.quantize(x, "fp8_block", block=(128, 128), **opts).components()
            row_scale = _scale_buffer(c["scale_inv"], (mb, rup(kb, 4)), gen)
            col_data = _u8(c["data"]).t().contiguous()
            col_scale = _scale_buffer(c["scale_inv"].t().contiguous(), (kb, rup(mb, 4)), gen)
        else:
            c = ckptq.quantize(x, "fp8_block", block=(1, 128), **opts).components()
            row_scale = _scale_buffer(c["scale_inv"].t().contiguous(), (kb, rup(m, 4)), gen)
            cc = ckptq.quantize(x.t().contiguous(), "fp8_block", block=(1, 128), **opts).components()
            col_data = _u8(cc["data"])
            col_scale = _scale_buffer(cc["scale_inv"].t().contiguous(), (mb, rup(k, 4)), gen)
        t = Float8BlockwiseQTensor(
            shape=x.shape,
            dtype=x.dtype,
            fp8_dtype=te_dt,
            quantizer=q,
            is_2D_scaled=block_scaling_dim == 2,
            rowwise_data=_u8(c["data"]) if rowwise else None,
            rowwise_scale_inv=row_scale if rowwise else None,
            columnwise_data=col_data if columnwise else None,
            columnwise_scale_inv=col_scale if columnwise else None,
        )
    if flavor == "2974":
        _to_2974(t)
    else:
        assert flavor == "main", flavor
    return t


# Quantizer keys that #2974-era TE (2026-05-22) did not have yet.
_LATER_KEYS = {
    "MXFP8Quantizer": ("with_2d_quantization",),
    "NVFP4Quantizer": ("nvfp4_use_4over6", "nvfp4_e4m3_max", "nvfp4_4over6_err_mode"),
}


def _to_2974(t) -> None:
    t._standin_flavor = "2974"
    for attr in ("_fp8_dtype", "_fp4_dtype"):
        if attr in t.__dict__:
            setattr(t, attr, tex.DType(int(getattr(t, attr))))
    q = t._quantizer
    if q is not None:
        q.dtype = tex.DType(int(q.dtype))
        for key in _LATER_KEYS.get(type(q).__name__, ()):
            del q.__dict__[key]
    if type(t).__name__ == "NVFP4Tensor":
        del t._nvfp4_use_4over6, t._nvfp4_e4m3_max


def te_buffers(t) -> dict[str, torch.Tensor]:
    """The tensor's held inner buffers by attribute name."""
    return {k: v for k, v in t._buffers().items() if v is not None}


def _padding_mask(buf: torch.Tensor, compact: tuple[int, int], swizzled: bool, transposed_swizzle: bool = False):
    mask = torch.ones(buf.shape, dtype=torch.uint8)
    mask[: compact[0], : compact[1]] = 0
    if swizzled:
        mat = mask.t().contiguous() if transposed_swizzle else mask
        mask = swizzle(mat).reshape(buf.shape)
    return mask.bool()


def padding_masks(t) -> dict[str, torch.Tensor]:
    """For each held scale buffer, a bool mask of its padding positions (in its stored layout)."""
    m, k = t.shape
    name = type(t).__name__
    b = te_buffers(t)
    out = {}
    sw = bool(getattr(t, "_with_gemm_swizzled_scales", False))
    if name == "MXFP8Tensor":
        if "_rowwise_scale_inv" in b:
            out["_rowwise_scale_inv"] = _padding_mask(b["_rowwise_scale_inv"], (m, k // 32), sw)
        if "_columnwise_scale_inv" in b:
            out["_columnwise_scale_inv"] = _padding_mask(b["_columnwise_scale_inv"], (m // 32, k), sw, True)
    elif name == "NVFP4Tensor":
        if "_rowwise_scale_inv" in b:
            out["_rowwise_scale_inv"] = _padding_mask(b["_rowwise_scale_inv"], (m, cdiv(k, 16)), sw)
        if "_columnwise_scale_inv" in b:
            out["_columnwise_scale_inv"] = _padding_mask(b["_columnwise_scale_inv"], (k, cdiv(m, 16)), sw)
    elif name == "Float8BlockwiseQTensor":
        mb, kb = cdiv(m, 128), cdiv(k, 128)
        row, col = ((mb, kb), (kb, mb)) if t._is_2D_scaled else ((kb, m), (mb, k))
        if "_rowwise_scale_inv" in b:
            out["_rowwise_scale_inv"] = _padding_mask(b["_rowwise_scale_inv"], row, False)
        if "_columnwise_scale_inv" in b:
            out["_columnwise_scale_inv"] = _padding_mask(b["_columnwise_scale_inv"], col, False)
    return out


def zero_padding(t) -> dict[str, torch.Tensor]:
    """Copies of the held buffers with every padding byte zeroed (what an in-place insert writes)."""
    masks = padding_masks(t)
    out = {}
    for k, v in te_buffers(t).items():
        v = v.clone()
        if k in masks:
            v[masks[k]] = 0
        out[k] = v
    return out


def garbage_like(t, seed: int = 1):
    """A fresh stand-in tensor of ``t``'s class, layout, flags and quantizer whose buffers hold
    random bytes (amax and scale_inv included)."""
    gen = torch.Generator().manual_seed(seed)
    return t._rebuild(lambda b: random_bytes(b.shape, gen, b.dtype))

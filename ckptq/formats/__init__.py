"""Quantized formats: ``fp8_tensor``, ``fp8_block``, ``mxfp8``, ``nvfp4``, ``mxfp4`` (spec: docs/formats.md)."""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..errors import QuantizationError, UnsupportedFormatError
from ..numerics import HP_FORMATS
from .base import FORMATS, QuantizedTensor, format_class, from_components
from .fp8 import Float8BlockRecipe, Float8BlockTensor, Float8Recipe, Float8Tensor
from .mxfp4 import MXFP4Recipe, MXFP4Tensor
from .mxfp8 import MXFP8Recipe, MXFP8Tensor
from .nvfp4 import NVFP4Recipe, NVFP4Tensor

__all__ = [
    "QuantizedTensor",
    "Float8Tensor",
    "Float8BlockTensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "MXFP4Tensor",
    "Float8Recipe",
    "Float8BlockRecipe",
    "MXFP8Recipe",
    "NVFP4Recipe",
    "MXFP4Recipe",
    "FORMATS",
    "quantize",
    "requantize",
    "from_components",
    "format_class",
    "make_recipe",
]


def make_recipe(fmt: str, **options: Any):
    """Build the recipe dataclass of ``fmt`` from keyword options; unknown keys raise."""
    cls = format_class(fmt)
    try:
        return cls.Recipe(**options)
    except TypeError:
        import dataclasses

        known = [f.name for f in dataclasses.fields(cls.Recipe)]
        raise UnsupportedFormatError(
            f"{fmt}: unknown recipe option(s) {sorted(set(options) - set(known))}; "
            f"{fmt} takes {known} (plus amax=/scale= where the format has a per-tensor value)"
        ) from None


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    amax: Any | None = None,
    scale: Any | None = None,
    **recipe: Any,
) -> QuantizedTensor:
    """Quantize a high-precision tensor.

    Args:
        x: fp32, bf16 or fp16 tensor of shape (..., M, K); K is the reduction dim, leading dims are
            batch dims with their own scales.
        fmt: ``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"``, ``"fp8_block"`` or ``"fp8_tensor"``.
        amax: NVFP4 / fp8_tensor: use this per-tensor amax (fp32 scalar or batch-shaped) instead of
            the tensor's own, so that the shards of one tensor share it (as after an amax
            all-reduce over the shard group).
        scale: fp8_tensor: use this encode multiplier (``scale_inv = 1 / scale``).
        **recipe: the format's options: ``fp8_dtype``, ``pow2``, ``eps`` (fp8 formats),
            ``block=(1, 128)`` (fp8_block), ``two_d=True`` (nvfp4), ``columnwise=True`` (mxfp8,
            nvfp4 1x16, fp8_block with bm != bk: also store the separately quantized columnwise copy),
            ``scale_rule="floor"|"even"|"ceil"|"rceil"`` (mxfp4).

    Returns:
        The format's QuantizedTensor subclass with ``x``'s shape and dtype.

    Raises:
        QuantizationError: ``x`` is not a float tensor of rank >= 2, or K is odd for NVFP4 / MXFP4 (M
            too for NVFP4 with a columnwise copy).
        UnsupportedFormatError: unknown format or recipe option.
    """
    cls = format_class(fmt)
    rec = make_recipe(fmt, **recipe)
    if not isinstance(x, torch.Tensor) or isinstance(x, QuantizedTensor):
        raise QuantizationError(
            f"quantize expects a plain high-precision tensor, got {type(x).__name__}; use "
            f"ckptq.requantize for quantized inputs"
        )
    if x.dtype not in HP_FORMATS or x.ndim < 2:
        raise QuantizationError(
            f"{fmt}: cannot quantize a {x.dtype} tensor of shape {tuple(x.shape)}; expected "
            f"float32/bfloat16/float16 of rank >= 2 (..., M, K)"
        )
    cls.check_overrides(x.shape, amax, scale)
    cls.check_shape(x.shape, rec)
    comps = ops.quantize(cls, x, rec, amax=amax, scale=scale)
    return cls(comps, x.shape, x.dtype, rec)


def requantize(
    src: torch.Tensor,
    fmt: str,
    *,
    amax: Any | None = None,
    scale: Any | None = None,
    **recipe: Any,
) -> QuantizedTensor:
    """Convert ``src`` (quantized or high precision) to ``fmt`` with ``recipe``.

    The logical dtype of the result is ``src.dtype``. The result equals, byte for byte,
    ``ckptq.quantize(src.dequantize(torch.float32), fmt, amax=..., scale=..., **recipe)``; the
    kernel backends compute it in one fused pass without the high-precision intermediate.

    Raises:
        UnsupportedFormatError: unknown format or recipe option, ``amax=``/``scale=`` where the
            format has no per-tensor value.
        QuantizationError: nvfp4 / mxfp4 with an odd last dim (or nvfp4 with an odd M and a columnwise copy).
    """
    if not isinstance(src, QuantizedTensor):
        hp = src if src.dtype in HP_FORMATS else src.float()
        out = quantize(hp, fmt, amax=amax, scale=scale, **recipe)
        if out.dtype != src.dtype:
            out = type(out)(out._components, out.shape, src.dtype, out.recipe)
        return out
    cls = format_class(fmt)
    rec = make_recipe(fmt, **recipe)
    cls.check_overrides(src.shape, amax, scale)
    cls.check_shape(src.shape, rec)
    comps = ops.requantize(src, cls, rec, amax=amax, scale=scale)
    return cls(comps, src.shape, src.dtype, rec)

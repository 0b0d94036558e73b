"""MXFP8 (`mxfp8`): E4M3 elements, one E8M0 scale per 1x32 block along K.

Layout (docs/formats.md, "5. `mxfp8`"), logical (..., M, K): ``data`` e4m3 (..., M, K); ``scale`` E8M0
stored as uint8 (..., M, ceil(K/32)); optional independently quantized columnwise copy (TE 1-D MXFP8):
``columnwise_data`` e4m3 (..., M, K) and ``columnwise_scale`` uint8 (..., ceil(M/32), K).
Numerics: :func:`ckptq.numerics.quantize_mxfp8` (TE ``float_to_e8m0`` scale rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import numerics, ops
from ..chunks import ComponentSpec, DimMap
from .base import QuantizedTensor, check_recipe_flag

__all__ = ["MXFP8Recipe", "MXFP8Tensor"]

MX_BLOCK = 32


@dataclass(frozen=True)
class MXFP8Recipe:
    """``mxfp8`` options: ``columnwise`` stores the 32x1-block columnwise copy too."""

    columnwise: bool = False

    def __post_init__(self):
        check_recipe_flag(self, "mxfp8", "columnwise")


class MXFP8Tensor(QuantizedTensor):
    """MXFP8 tensor; ``x = float(data) * 2^(scale - 127)`` (byte 0 -> 2^-127, 255 -> NaN)."""

    FORMAT = "mxfp8"
    Recipe = MXFP8Recipe
    SOURCE_COMPONENTS = ("data", "scale")
    SCALE_COMPONENT = "scale"

    @classmethod
    def kernel_args(cls, recipe: MXFP8Recipe) -> dict:
        return ops.make_kernel_args(cls.FORMAT, block=(1, MX_BLOCK), columnwise=recipe.columnwise)

    @classmethod
    def recipe_from_kernel_args(cls, block, fp8_dtype, pow2, eps, columnwise, scale_rule="") -> MXFP8Recipe:
        return MXFP8Recipe(columnwise=columnwise)

    @classmethod
    def decode_scale(cls, t: torch.Tensor) -> torch.Tensor:
        """E8M0 bytes -> fp32 powers of two (255 -> NaN)."""
        return numerics.e8m0_to_fp32(t)

    @classmethod
    def component_specs(cls, shape: Sequence[int], recipe: MXFP8Recipe) -> list[ComponentSpec]:
        nd = len(shape)
        batch = tuple(DimMap(d) for d in range(nd - 2))
        m, k = nd - 2, nd - 1
        specs = [
            ComponentSpec("data", torch.float8_e4m3fn, batch + (DimMap(m), DimMap(k))),
            ComponentSpec("scale", torch.uint8, batch + (DimMap(m), DimMap(k, MX_BLOCK))),
        ]
        if recipe.columnwise:
            specs += [
                ComponentSpec("columnwise_data", torch.float8_e4m3fn, batch + (DimMap(m), DimMap(k))),
                ComponentSpec("columnwise_scale", torch.uint8, batch + (DimMap(m, MX_BLOCK), DimMap(k))),
            ]
        return specs

    @classmethod
    def _reference_quantize(cls, x, recipe: MXFP8Recipe, amax=None, scale=None):
        return numerics.quantize_mxfp8(x, columnwise=recipe.columnwise)

    @classmethod
    def _reference_dequantize(cls, comps, recipe, dtype):
        # The rowwise copy is the canonical value; the columnwise copy is kept for bit-exact resume.
        return numerics.dequantize_mxfp8(comps["data"], comps["scale"], dtype)

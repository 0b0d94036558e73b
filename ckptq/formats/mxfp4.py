"""MXFP4 (`mxfp4`): E2M1 elements packed two per byte, one E8M0 scale per 1x32 block along K.

Layout (docs/formats.md, "7. `mxfp4`"), logical (..., M, K), K even: ``data`` uint8 (..., M, K/2) with
element 2i in the low nibble (OCP MX v1.0; transformers 5.24 ``integrations/mxfp4.py`` unpacks
``blk & 0x0F`` to the even element); ``scale`` E8M0 stored as uint8 (..., M, ceil(K/32)).
Numerics: :func:`ckptq.numerics.quantize_mxfp4` (OCP MX v1.0, scale rule chosen by the recipe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import numerics, ops
from ..chunks import ComponentSpec, DimMap
from ..errors import QuantizationError
from .base import QuantizedTensor, check_recipe_value

__all__ = ["MXFP4Recipe", "MXFP4Tensor"]

MX_BLOCK = 32


@dataclass(frozen=True)
class MXFP4Recipe:
    """``mxfp4`` options: ``scale_rule``, how a block's E8M0 scale follows from its amax.

    ``"floor"`` (default): OCP MX v1.0 section 6.3, ``2^(floor(log2 amax) - 2)`` (torchao
    ``ScaleCalculationMode.FLOOR``, its default); ``"even"``: amax rounded to one mantissa bit first
    (torchao EVEN; compressed-tensors 0.20 ``generate_mx_scales``); ``"ceil"``:
    ``2^(ceil(log2 amax) - 2)`` (torchao CEIL); ``"rceil"``: ``2^ceil(log2(amax / 6))`` (torchao
    RCEIL, NVIDIA cuBLAS/TE, triton_kernels ``downcast_to_mxfp`` ROUND_UP as gpt-oss used).
    Exact rules: :func:`ckptq.numerics.mxfp4_scale_from_amax`.
    """

    scale_rule: str = "floor"

    def __post_init__(self):
        check_recipe_value("mxfp4", "scale_rule", self.scale_rule, numerics.MXFP4_SCALE_RULES)


class MXFP4Tensor(QuantizedTensor):
    """MXFP4 tensor; ``x = e2m1(code) * 2^(scale - 127)`` (scale byte 0 -> 2^-127, 255 -> NaN).

    K must be even (two E2M1 codes per byte); cuts along K fall on multiples of 32.
    """

    FORMAT = "mxfp4"
    Recipe = MXFP4Recipe
    SOURCE_COMPONENTS = ("data", "scale")
    SCALE_COMPONENT = "scale"

    @classmethod
    def kernel_args(cls, recipe: MXFP4Recipe) -> dict:
        return ops.make_kernel_args(cls.FORMAT, block=(1, MX_BLOCK), scale_rule=recipe.scale_rule)

    @classmethod
    def recipe_from_kernel_args(cls, block, fp8_dtype, pow2, eps, columnwise, scale_rule="") -> MXFP4Recipe:
        return MXFP4Recipe(scale_rule=scale_rule or "floor")

    @classmethod
    def check_overrides(cls, shape, amax=None, scale=None) -> None:
        """Also raises QuantizationError for an odd K (E2M1 values are packed two per byte)."""
        if shape[-1] % 2:
            raise QuantizationError(
                f"mxfp4: the last dim of shape {tuple(shape)} is odd ({shape[-1]}); E2M1 values are "
                f"packed two per byte, so K must be even. Pad K or choose another format."
            )
        super().check_overrides(shape, amax, scale)

    @classmethod
    def decode_scale(cls, t: torch.Tensor) -> torch.Tensor:
        """E8M0 bytes -> fp32 powers of two (255 -> NaN)."""
        return numerics.e8m0_to_fp32(t)

    @classmethod
    def component_specs(cls, shape: Sequence[int], recipe: MXFP4Recipe) -> list[ComponentSpec]:
        nd = len(shape)
        batch = tuple(DimMap(d) for d in range(nd - 2))
        m, k = nd - 2, nd - 1
        return [
            ComponentSpec("data", torch.uint8, batch + (DimMap(m), DimMap(k, 2, exact=True))),
            ComponentSpec("scale", torch.uint8, batch + (DimMap(m), DimMap(k, MX_BLOCK))),
        ]

    @classmethod
    def _reference_quantize(cls, x, recipe: MXFP4Recipe, amax=None, scale=None):
        return numerics.quantize_mxfp4(x, scale_rule=recipe.scale_rule)

    @classmethod
    def _reference_dequantize(cls, comps, recipe, dtype):
        return numerics.dequantize_mxfp4(comps["data"], comps["scale"], dtype)

"""NVFP4 (`nvfp4`): E2M1 elements packed two per byte, E4M3 block scales, fp32 per-tensor amax.

Layout (docs/formats.md, "6. `nvfp4`"), logical (..., M, K), K even: ``data`` uint8 (..., M, K/2) with
element 2i in the low nibble; ``scale`` float8_e4m3fn (..., M, ceil(K/16)) for 1x16 blocks, or
(..., ceil(M/16), ceil(K/16)) for 16x16 blocks (``two_d``); ``amax`` fp32 (...).
Numerics: :func:`ckptq.numerics.quantize_nvfp4` (TE ``core_nvfp4.cuh`` order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import numerics, ops
from ..chunks import ComponentSpec, DimMap
from ..errors import QuantizationError
from .base import QuantizedTensor, check_recipe_flag

__all__ = ["NVFP4Recipe", "NVFP4Tensor"]

NVFP4_BLOCK = 16


@dataclass(frozen=True)
class NVFP4Recipe:
    """``nvfp4`` options: ``two_d`` uses 16x16 blocks (TE's default for weights) instead of 1x16."""

    two_d: bool = False

    def __post_init__(self):
        check_recipe_flag(self, "nvfp4", "two_d")


class NVFP4Tensor(QuantizedTensor):
    """NVFP4 tensor; ``x = e2m1(code) * ((float(scale) * amax) * (1/2688))``.

    Cuts must fall on multiples of 16 along K (and along M with ``two_d``); the shards of one
    tensor must share ``amax`` (quantize them with ``amax=`` the reduced global value).
    """

    FORMAT = "nvfp4"
    Recipe = NVFP4Recipe
    SOURCE_COMPONENTS = ("data", "scale", "amax")
    PER_TENSOR_OVERRIDES = frozenset({"amax"})
    SCALE_COMPONENT = "scale"

    @classmethod
    def kernel_args(cls, recipe: NVFP4Recipe) -> dict:
        return ops.make_kernel_args(cls.FORMAT, block=(NVFP4_BLOCK if recipe.two_d else 1, NVFP4_BLOCK))

    @classmethod
    def recipe_from_kernel_args(cls, block, fp8_dtype, pow2, eps, columnwise, scale_rule="") -> NVFP4Recipe:
        return NVFP4Recipe(two_d=bool(block) and int(block[0]) > 1)

    @classmethod
    def check_overrides(cls, shape, amax=None, scale=None) -> None:
        """Also raises QuantizationError for an odd K (E2M1 values are packed two per byte)."""
        if shape[-1] % 2:
            raise QuantizationError(
                f"nvfp4: the last dim of shape {tuple(shape)} is odd ({shape[-1]}); E2M1 values are "
                f"packed two per byte, so K must be even. Pad K or choose another format."
            )
        super().check_overrides(shape, amax, scale)

    @classmethod
    def component_specs(cls, shape: Sequence[int], recipe: NVFP4Recipe) -> list[ComponentSpec]:
        nd = len(shape)
        batch = tuple(DimMap(d) for d in range(nd - 2))
        m, k = nd - 2, nd - 1
        bm = NVFP4_BLOCK if recipe.two_d else 1
        return [
            ComponentSpec("data", torch.uint8, batch + (DimMap(m), DimMap(k, 2, exact=True))),
            ComponentSpec("scale", torch.float8_e4m3fn, batch + (DimMap(m, bm), DimMap(k, NVFP4_BLOCK))),
            ComponentSpec("amax", torch.float32, batch),
        ]

    @classmethod
    def _reference_quantize(cls, x, recipe: NVFP4Recipe, amax=None, scale=None):
        return numerics.quantize_nvfp4(x, two_d=recipe.two_d, amax=amax)

    @classmethod
    def _reference_dequantize(cls, comps, recipe, dtype):
        return numerics.dequantize_nvfp4(comps["data"], comps["scale"], comps["amax"], dtype, two_d=recipe.two_d)

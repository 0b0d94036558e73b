"""NVFP4 (`nvfp4`): E2M1 elements packed two per byte, E4M3 block scales, fp32 per-tensor amax.

Layout (docs/formats.md, "6. `nvfp4`"), logical (..., M, K), K even: ``data`` uint8 (..., M, K/2) with
element 2i in the low nibble; ``scale`` float8_e4m3fn (..., M, ceil(K/16)) for 1x16 blocks, or
(..., ceil(M/16), ceil(K/16)) for 16x16 blocks (``two_d``); ``amax`` fp32 (...); with ``columnwise``
(1x16) also ``columnwise_data`` uint8 (..., M/2, K) and ``columnwise_scale`` e4m3 (..., ceil(M/16), K).
Numerics: :func:`ckptq.numerics.quantize_nvfp4` (TE ``core_nvfp4.cuh`` order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import numerics, ops
from ..chunks import ComponentSpec, DimMap
from ..errors import QuantizationError, UnsupportedFormatError
from .base import QuantizedTensor, check_recipe_flag

__all__ = ["NVFP4Recipe", "NVFP4Tensor"]

NVFP4_BLOCK = 16


@dataclass(frozen=True)
class NVFP4Recipe:
    """``nvfp4`` options: ``two_d`` uses 16x16 blocks (TE's default for weights) instead of 1x16;
    ``columnwise`` (1x16 only) also stores the columnwise copy (x^T encoded with 1x16 blocks, TE's
    ``_columnwise_*`` buffers). With 16x16 blocks that copy is the exact transpose: not stored."""

    two_d: bool = False
    columnwise: bool = False

    def __post_init__(self):
        check_recipe_flag(self, "nvfp4", "two_d")
        check_recipe_flag(self, "nvfp4", "columnwise")
        if self.two_d and self.columnwise:
            raise UnsupportedFormatError(
                "nvfp4: columnwise=True with two_d=True: the columnwise copy of 16x16 blocks is the exact "
                "transpose of the rowwise one (derived on insertion), so there is nothing to store; drop columnwise."
            )


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
    COLUMNWISE_FROM_TRANSPOSE = {"columnwise_data": "data", "columnwise_scale": "scale"}
    ADDED_RECIPE_OPTIONS = frozenset({"columnwise"})

    @classmethod
    def kernel_args(cls, recipe: NVFP4Recipe) -> dict:
        return ops.make_kernel_args(cls.FORMAT, block=(NVFP4_BLOCK if recipe.two_d else 1, NVFP4_BLOCK))

    @classmethod
    def recipe_from_kernel_args(cls, block, fp8_dtype, pow2, eps, columnwise) -> NVFP4Recipe:
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
        specs = [
            ComponentSpec("data", torch.uint8, batch + (DimMap(m), DimMap(k, 2, exact=True))),
            ComponentSpec("scale", torch.float8_e4m3fn, batch + (DimMap(m, bm), DimMap(k, NVFP4_BLOCK))),
            ComponentSpec("amax", torch.float32, batch),
        ]
        if recipe.columnwise:  # x^T encoded rowwise, stored untransposed: packed and blocked along M
            specs += [
                ComponentSpec("columnwise_data", torch.uint8, batch + (DimMap(m, 2, exact=True), DimMap(k))),
                ComponentSpec("columnwise_scale", torch.float8_e4m3fn, batch + (DimMap(m, NVFP4_BLOCK), DimMap(k))),
            ]
        return specs

    @classmethod
    def _reference_quantize(cls, x, recipe: NVFP4Recipe, amax=None, scale=None):
        return numerics.quantize_nvfp4(x, two_d=recipe.two_d, amax=amax, columnwise=recipe.columnwise)

    @classmethod
    def _reference_dequantize(cls, comps, recipe, dtype):
        return numerics.dequantize_nvfp4(comps["data"], comps["scale"], comps["amax"], dtype, two_d=recipe.two_d)

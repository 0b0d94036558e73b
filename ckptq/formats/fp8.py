"""FP8 per-tensor (`fp8_tensor`) and blockwise (`fp8_block`, 1x128 / 128x128) formats.

Layouts (docs/formats.md, "3. `fp8_tensor`" and "4. `fp8_block`"), logical (..., M, K):
* ``fp8_tensor``: ``data`` fp8 (..., M, K); ``scale_inv`` fp32 (...) -- one decode multiplier per matrix.
* ``fp8_block``: ``data`` fp8 (..., M, K); ``scale_inv`` fp32 (..., ceil(M/bm), ceil(K/bk)); with
  ``columnwise`` also ``columnwise_data`` fp8 (..., M, K), ``columnwise_scale_inv`` fp32 (..., ceil(M/bk), ceil(K/bm)).
Numerics: :mod:`ckptq.numerics` (TE ``compute_scale_from_amax``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import numerics, ops
from ..chunks import ComponentSpec, DimMap
from ..errors import UnsupportedFormatError
from .base import QuantizedTensor, check_recipe_flag, check_recipe_value

__all__ = ["Float8Recipe", "Float8Tensor", "Float8BlockRecipe", "Float8BlockTensor"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _identity_dims(ndim: int) -> tuple[DimMap, ...]:
    return tuple(DimMap(d) for d in range(ndim))


def _check_eps(recipe, fmt: str) -> None:
    eps = recipe.eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise UnsupportedFormatError(f"{fmt}: eps={eps!r} must be a finite number >= 0 (amax floor).")
    object.__setattr__(recipe, "eps", float(eps))


@dataclass(frozen=True)
class Float8Recipe:
    """``fp8_tensor`` options: element dtype (E4M3 or E5M2), power-of-2 scale rounding (default off,
    as TE current scaling), amax epsilon."""

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    pow2: bool = False
    eps: float = 0.0

    def __post_init__(self):
        check_recipe_value("fp8_tensor", "fp8_dtype", self.fp8_dtype, _FP8_DTYPES)
        check_recipe_flag(self, "fp8_tensor", "pow2")
        _check_eps(self, "fp8_tensor")


class Float8Tensor(QuantizedTensor):
    """FP8 with one scale per matrix (TE ``Float8Tensor``, delayed or current scaling).

    Components: ``data`` fp8 (..., M, K) and ``scale_inv`` fp32 (...), ``x = float(data) * scale_inv``.
    Any cut is aligned (the scale is per tensor); the shards of one tensor must share ``scale_inv``.
    """

    FORMAT = "fp8_tensor"
    Recipe = Float8Recipe
    SOURCE_COMPONENTS = ("data", "scale_inv")
    PER_TENSOR_OVERRIDES = frozenset({"amax", "scale"})
    SCALE_COMPONENT = "scale_inv"

    @classmethod
    def kernel_args(cls, recipe: Float8Recipe) -> dict:
        return ops.make_kernel_args(cls.FORMAT, fp8_dtype=recipe.fp8_dtype, pow2=recipe.pow2, eps=recipe.eps)

    @classmethod
    def recipe_from_kernel_args(cls, block, fp8_dtype, pow2, eps, columnwise, scale_rule="") -> Float8Recipe:
        return Float8Recipe(fp8_dtype=fp8_dtype, pow2=pow2, eps=eps)

    @classmethod
    def component_specs(cls, shape: Sequence[int], recipe: Float8Recipe) -> list[ComponentSpec]:
        nd = len(shape)
        return [
            ComponentSpec("data", recipe.fp8_dtype, _identity_dims(nd)),
            ComponentSpec("scale_inv", torch.float32, _identity_dims(nd - 2)),
        ]

    @classmethod
    def _reference_quantize(cls, x, recipe: Float8Recipe, amax=None, scale=None):
        return numerics.quantize_fp8_tensor(
            x, recipe.fp8_dtype, pow2=recipe.pow2, eps=recipe.eps, amax=amax, scale=scale
        )

    @classmethod
    def _reference_dequantize(cls, comps, recipe, dtype):
        return numerics.dequantize_fp8_tensor(comps["data"], comps["scale_inv"], dtype)


@dataclass(frozen=True)
class Float8BlockRecipe:
    """``fp8_block`` options: block (128, 128) (weights) or (1, 128); E4M3/E5M2; power-of-2 scales
    (default on, as TE ``Float8BlockScaling``); amax epsilon; ``columnwise`` (non-square blocks)
    also stores the columnwise copy: x^T encoded with the same block (TE's 1-D ``_columnwise_*``)."""

    block: tuple[int, int] = (128, 128)
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    pow2: bool = True
    eps: float = 0.0
    columnwise: bool = False

    def __post_init__(self):
        check_recipe_value("fp8_block", "fp8_dtype", self.fp8_dtype, _FP8_DTYPES)
        check_recipe_flag(self, "fp8_block", "pow2")
        check_recipe_flag(self, "fp8_block", "columnwise")
        _check_eps(self, "fp8_block")
        try:
            block = tuple(int(b) for b in self.block)
        except (TypeError, ValueError):
            block = ()
        if len(block) != 2 or min(block) < 1:
            raise UnsupportedFormatError(
                f"fp8_block: block={self.block!r} must be two positive ints, e.g. (128, 128) or (1, 128)"
            )
        object.__setattr__(self, "block", block)
        if self.columnwise and block[0] == block[1]:
            raise UnsupportedFormatError(
                f"fp8_block: columnwise=True with the square block {block}: its columnwise copy is the exact "
                f"transpose of the rowwise one (derived on insertion), so there is nothing to store; drop columnwise."
            )


class Float8BlockTensor(QuantizedTensor):
    """FP8 with one fp32 decode multiplier per (bm, bk) block (TE ``Float8BlockwiseQTensor``,
    DeepSeek-V3 ``weight_scale_inv``), compact ceil-sized scale grid."""

    FORMAT = "fp8_block"
    Recipe = Float8BlockRecipe
    SOURCE_COMPONENTS = ("data", "scale_inv")
    SCALE_COMPONENT = "scale_inv"
    COLUMNWISE_FROM_TRANSPOSE = {"columnwise_data": "data", "columnwise_scale_inv": "scale_inv"}
    ADDED_RECIPE_OPTIONS = frozenset({"columnwise"})

    @classmethod
    def kernel_args(cls, recipe: Float8BlockRecipe) -> dict:
        return ops.make_kernel_args(
            cls.FORMAT, block=recipe.block, fp8_dtype=recipe.fp8_dtype, pow2=recipe.pow2, eps=recipe.eps
        )

    @classmethod
    def recipe_from_kernel_args(cls, block, fp8_dtype, pow2, eps, columnwise, scale_rule="") -> Float8BlockRecipe:
        return Float8BlockRecipe(block=tuple(block), fp8_dtype=fp8_dtype, pow2=pow2, eps=eps)

    @classmethod
    def component_specs(cls, shape: Sequence[int], recipe: Float8BlockRecipe) -> list[ComponentSpec]:
        nd = len(shape)
        bm, bk = recipe.block
        batch = _identity_dims(nd - 2)
        specs = [
            ComponentSpec("data", recipe.fp8_dtype, _identity_dims(nd)),
            ComponentSpec("scale_inv", torch.float32, batch + (DimMap(nd - 2, bm), DimMap(nd - 1, bk))),
        ]
        if recipe.columnwise:  # x^T encoded with (bm, bk) blocks, stored untransposed: (bk, bm) blocks of x
            specs += [
                ComponentSpec("columnwise_data", recipe.fp8_dtype, _identity_dims(nd)),
                ComponentSpec("columnwise_scale_inv", torch.float32, batch + (DimMap(nd - 2, bk), DimMap(nd - 1, bm))),
            ]
        return specs

    @classmethod
    def _reference_quantize(cls, x, recipe: Float8BlockRecipe, amax=None, scale=None):
        return numerics.quantize_fp8_block(
            x, recipe.block, recipe.fp8_dtype, pow2=recipe.pow2, eps=recipe.eps, columnwise=recipe.columnwise
        )

    @classmethod
    def _reference_dequantize(cls, comps, recipe, dtype):
        return numerics.dequantize_fp8_block(comps["data"], comps["scale_inv"], recipe.block, dtype)

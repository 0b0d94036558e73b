"""NVFP4 (`nvfp4`): E2M1 elements packed two per byte, E4M3 block scales, one fp32 per-tensor value.

Layout (docs/formats.md, "6. `nvfp4`"), logical (..., M, K), K even: ``data`` uint8 (..., M, K/2) with
element 2i in the low nibble; ``scale`` float8_e4m3fn (..., M, ceil(K/16)) for 1x16 blocks, or
(..., ceil(M/16), ceil(K/16)) for 16x16 blocks (``two_d``); the per-tensor value fp32 (...) named by
the recipe's ``per_tensor`` convention: ``amax`` (ckptq's and TransformerEngine's), ``global_scale_inv``
(ModelOpt ``weight_scale_2``, torchao ``per_tensor_scale``) or ``global_scale`` (compressed-tensors
``weight_global_scale``), decoded in that producer's own fp32 op order
(:func:`ckptq.numerics.nvfp4_block_multiplier`); with ``columnwise`` (1x16, ``amax`` only) also
``columnwise_data`` uint8 (..., M/2, K) and ``columnwise_scale`` e4m3 (..., ceil(M/16), K).
Numerics: :func:`ckptq.numerics.quantize_nvfp4` (TE ``core_nvfp4.cuh`` order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import numerics, ops
from ..chunks import ComponentSpec, DimMap
from ..errors import QuantizationError, UnsupportedFormatError
from .base import QuantizedTensor, check_recipe_flag, check_recipe_value

__all__ = ["NVFP4Recipe", "NVFP4Tensor"]

NVFP4_BLOCK = 16


@dataclass(frozen=True)
class NVFP4Recipe:
    """``nvfp4`` options: ``two_d`` uses 16x16 blocks (TE's default for weights) instead of 1x16;
    ``per_tensor`` names the per-tensor component and its decode (``numerics.NVFP4_PER_TENSOR``):
    ``"amax"`` (ckptq's own, the default), ``"global_scale_inv"`` or ``"global_scale"`` (a producer's
    global scale kept as it was stored, see docs/formats.md); ``columnwise`` (1x16 blocks and ``amax``
    only: TransformerEngine's) also stores the columnwise copy (x^T encoded with 1x16 blocks, TE's
    ``_columnwise_*`` buffers). With 16x16 blocks that copy is the exact transpose: not stored."""

    two_d: bool = False
    per_tensor: str = "amax"
    columnwise: bool = False

    def __post_init__(self):
        check_recipe_flag(self, "nvfp4", "two_d")
        check_recipe_value("nvfp4", "per_tensor", self.per_tensor, numerics.NVFP4_PER_TENSOR)
        check_recipe_flag(self, "nvfp4", "columnwise")
        if self.two_d and self.columnwise:
            raise UnsupportedFormatError(
                "nvfp4: columnwise=True with two_d=True: the columnwise copy of 16x16 blocks is the exact "
                "transpose of the rowwise one (derived on insertion), so there is nothing to store; drop columnwise."
            )
        if self.columnwise and self.per_tensor != "amax":
            raise UnsupportedFormatError(
                f"nvfp4: columnwise=True with per_tensor={self.per_tensor!r}: a stored columnwise copy is "
                f"TransformerEngine's, which uses the amax convention; drop columnwise or use per_tensor='amax'."
            )


class NVFP4Tensor(QuantizedTensor):
    """NVFP4 tensor; ``x = e2m1(code) * ((float(scale) * amax) * (1/2688))`` (``per_tensor="amax"``),
    ``e2m1(code) * (float(scale) * global_scale_inv)`` or ``e2m1(code) * (float(scale) / global_scale)``.

    Cuts must fall on multiples of 16 along K (and along M with ``two_d``); the shards of one
    tensor must share the per-tensor value (quantize them with ``amax=`` the reduced global value).
    The C++/CUDA kernels take the ``amax`` convention only: the others decode and encode through
    the reference (:meth:`kernel_supports`), which is exact by construction.
    """

    FORMAT = "nvfp4"
    Recipe = NVFP4Recipe
    SOURCE_COMPONENTS = ("data", "scale", "amax")
    PER_TENSOR_OVERRIDES = frozenset({"amax"})
    SCALE_COMPONENT = "scale"
    COLUMNWISE_FROM_TRANSPOSE = {"columnwise_data": "data", "columnwise_scale": "scale"}
    ADDED_RECIPE_OPTIONS = frozenset({"columnwise"})

    @classmethod
    def _recipe_to_json(cls, recipe, *, every_option: bool = False) -> dict:
        """ckptq's own convention is written as before the field existed (no ``per_tensor`` key:
        ``amax``), so its descriptors are unchanged; a producer's convention is named."""
        out = super()._recipe_to_json(recipe, every_option=every_option)
        if not every_option and out.get("per_tensor") == "amax":
            del out["per_tensor"]
        return out

    @classmethod
    def kernel_supports(cls, recipe: NVFP4Recipe) -> bool:
        return recipe.per_tensor == "amax"

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
        specs = [
            ComponentSpec("data", torch.uint8, batch + (DimMap(m), DimMap(k, 2, exact=True))),
            ComponentSpec("scale", torch.float8_e4m3fn, batch + (DimMap(m, bm), DimMap(k, NVFP4_BLOCK))),
            ComponentSpec(recipe.per_tensor, torch.float32, batch),
        ]
        if recipe.columnwise:  # x^T encoded rowwise, stored untransposed: packed and blocked along M
            specs += [
                ComponentSpec("columnwise_data", torch.uint8, batch + (DimMap(m, 2, exact=True), DimMap(k))),
                ComponentSpec("columnwise_scale", torch.float8_e4m3fn, batch + (DimMap(m, NVFP4_BLOCK), DimMap(k))),
            ]
        return specs

    @classmethod
    def _reference_quantize(cls, x, recipe: NVFP4Recipe, amax=None, scale=None):
        """ckptq's encode from the amax ``a`` (docs/formats.md); a producer convention then stores its
        own value of ``a`` (:func:`ckptq.numerics.nvfp4_per_tensor_from_amax`)."""
        comps = numerics.quantize_nvfp4(x, two_d=recipe.two_d, amax=amax, columnwise=recipe.columnwise)
        if recipe.per_tensor != "amax":
            comps[recipe.per_tensor] = numerics.nvfp4_per_tensor_from_amax(comps.pop("amax"), recipe.per_tensor)
        return comps

    @classmethod
    def _reference_dequantize(cls, comps, recipe, dtype):
        p = recipe.per_tensor
        return numerics.dequantize_nvfp4(
            comps["data"], comps["scale"], comps[p], dtype, two_d=recipe.two_d, per_tensor=p
        )

    def with_recipe(self, recipe: NVFP4Recipe) -> tuple[NVFP4Tensor, int] | None:
        """:meth:`with_per_tensor` when ``recipe`` differs from this tensor's only in ``per_tensor``."""
        if (
            not isinstance(recipe, NVFP4Recipe)
            or dataclasses.replace(self.recipe, per_tensor=recipe.per_tensor) != recipe
        ):
            return None
        return self.with_per_tensor(recipe.per_tensor)

    def with_per_tensor(self, per_tensor: str) -> tuple[NVFP4Tensor, int]:
        """The same ``data`` and ``scale`` bytes with the per-tensor value in convention ``per_tensor``
        (a producer's layout holds one convention), and the largest difference of the two decodes in
        fp32 ulps (0: bit-exact; -1: amax 0/inf/NaN, not comparable).

        Same convention: ``self`` (no copy), 0. Otherwise, per matrix, among the value that
        convention derives (``amax / 2688``, ``2688 / amax``, ``g * 2688``, ...) and its 4 fp32
        neighbours on each side, the one whose decode of every block scale occurring in the matrix
        is closest to this tensor's decode (ties: the nearest). Not a requantization: the codes and
        block scales are kept.
        """
        src = self.recipe.per_tensor
        if per_tensor == src:
            return self, 0
        rec = dataclasses.replace(self.recipe, per_tensor=per_tensor)  # other options kept
        value, worst = numerics.nvfp4_convert_per_tensor(
            self._components[src], src, per_tensor, self._components["scale"]
        )
        comps = {k: v for k, v in self._components.items() if k != src}  # every other component as is
        comps[per_tensor] = value
        comps = {s.name: comps[s.name] for s in self.component_specs(self.shape, rec)}  # canonical order
        return NVFP4Tensor(comps, self.shape, self.dtype, rec), worst

"""Quantize on save: plain high-precision (DTensor) shards to a ckptq format, without gathering.

A team training in bf16 under FSDP2 / TP can write compact checkpoints for evaluation and serving:
each rank quantizes its own shard on its own device. Formats with a per-tensor value (NVFP4's
``amax``, FP8 per-tensor's ``scale_inv``) first all-reduce the shards' amax (MAX) over the tensor's
mesh, so every shard uses the global value; block formats need shard cuts on their block grid.
Either way the stored bytes are those of ``ckptq.quantize`` of the whole tensor on one process.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import chunks
from ..errors import QuantizationError, UnsupportedFormatError
from ..formats import format_class, make_recipe, quantize
from ..formats.base import QuantizedTensor
from ..numerics import HP_FORMATS
from ..ops import amax as matrix_amax
from ._common import local_box

__all__ = ["quantize_state_dict", "QuantizeRules"]

logger = logging.getLogger("ckptq")

#: ``{fqn_glob: "nvfp4" | {"format": "fp8_block", "block": (1, 128), ...}}``
QuantizeRules = Mapping[str, str | Mapping[str, Any]]


def _rule(fqn: str, rules: QuantizeRules) -> tuple[str, dict] | None:
    for pattern, spec in rules.items():
        if fnmatch.fnmatchcase(fqn, pattern):
            if isinstance(spec, str):
                return spec, {}
            spec = dict(spec)
            try:
                return spec.pop("format"), spec
            except KeyError:
                raise UnsupportedFormatError(
                    f"quantize rule '{pattern}': {spec} has no 'format' (e.g. {{'format': 'fp8_block', "
                    f"'block': (1, 128)}})"
                ) from None
    return None


def validate_rules(rules: QuantizeRules) -> None:
    """Check every rule's format and recipe options now (UnsupportedFormatError names the rule)."""
    for pattern in rules:
        fmt, recipe = _rule(pattern, {pattern: rules[pattern]})
        try:
            make_recipe(fmt, **recipe)
        except UnsupportedFormatError as e:
            raise UnsupportedFormatError(f"quantize rule '{pattern}': {e}") from None


def _global_amax(obj: Any, local: torch.Tensor) -> torch.Tensor:
    """The amax of the whole tensor (fp32, per matrix): the local shard's, all-reduced (MAX) over
    every dim of the DTensor's mesh (replicas hold equal values, so MAX over all is the global)."""
    a = matrix_amax(local)
    if isinstance(obj, DTensor):
        import torch.distributed as dist

        mesh = obj.device_mesh
        for d in range(mesh.ndim):
            if mesh.size(d) > 1:
                dist.all_reduce(a, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
    return a


def quantize_state_dict(state_dict: Mapping[str, Any], rules: QuantizeRules) -> dict:
    """A copy of a flat ``state_dict`` in which every float tensor of rank >= 2 whose FQN matches a
    glob of ``rules`` (first match, insertion order) is quantized on its own device.

    A DTensor stays a DTensor of the same mesh and placements whose local tensor is the quantized
    shard; a plain tensor becomes a ckptq tensor. Formats with a per-tensor value (``nvfp4``,
    ``fp8_tensor``) use the global amax (an all-reduce MAX over the mesh: a collective, so every rank
    must call this with the same tensors in the same order). The result equals, byte for byte, the
    box of ``ckptq.quantize(full_tensor, fmt, **recipe)`` each rank holds. Use it before
    ``dcp.async_save`` so that staging copies the compact bytes; :class:`QuantizedSavePlanner`
    (``quantize=``) calls it for ``dcp.save``.

    Args:
        state_dict: flat FQN -> value (as DCP's planners see it).
        rules: ``{glob: "nvfp4"}`` or ``{glob: {"format": "fp8_block", "block": (1, 128)}}``.

    Returns:
        A new dict (values that no rule matches, already quantized values, non-float tensors and
        tensors of rank < 2 are passed through unchanged; the last two are logged once each).

    Raises:
        UnsupportedFormatError: a rule names an unknown format or recipe option.
        ShardingError: a shard's box cuts the format's blocks (names the tensor, dim, cut and block),
            or a DTensor shard is not one contiguous box.
        QuantizationError: e.g. NVFP4 / MXFP4 with an odd last dim (names the tensor and its rule).
    """
    validate_rules(rules)
    out = {}
    for fqn, obj in state_dict.items():
        found = _rule(fqn, rules) if isinstance(obj, torch.Tensor) else None
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        if found is None or isinstance(local, QuantizedTensor):
            out[fqn] = obj
            continue
        if local.dtype not in HP_FORMATS or obj.ndim < 2:
            logger.info(
                "ckptq: quantize rule matched '%s' (%s %s), which is not a float matrix; saved as is",
                fqn,
                local.dtype,
                tuple(obj.shape),
            )
            out[fqn] = obj
            continue
        fmt, recipe = found
        cls = format_class(fmt)
        rec = make_recipe(fmt, **recipe)
        global_shape = tuple(obj.shape)
        try:  # shape rules of the format (an odd K for FP4), on the global shape
            cls.check_overrides(global_shape)
        except QuantizationError as e:
            raise QuantizationError(f"tensor '{fqn}' (quantize rule {fmt}): {e}") from None
        box = local_box(obj, fqn)
        chunks.check_aligned(cls.component_specs(global_shape, rec), global_shape, box, fqn=fqn, fmt=fmt)
        amax = _global_amax(obj, local) if "amax" in cls.PER_TENSOR_OVERRIDES else None
        qt = quantize(local, fmt, amax=amax, **recipe)
        if isinstance(obj, DTensor):
            out[fqn] = DTensor.from_local(
                qt, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        else:
            out[fqn] = qt
    return out

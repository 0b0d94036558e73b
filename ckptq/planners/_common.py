"""Pieces shared by the save and load planners: local boxes of DTensors and the mode rules.

The checkpoint contract they write and read is :mod:`ckptq.contract`.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from ..chunks import Box
from ..placement import dtensor_box, shard_box

__all__ = ["all_boxes", "local_box", "local_tensor", "mode_for"]


def local_box(obj: torch.Tensor, fqn: str | None = None) -> Box:
    """The logical box this process holds of ``obj``: a DTensor's shard (the box DCP stores; raises
    ShardingError when the shard is not one contiguous box, see :func:`ckptq.placement.shard_box`),
    or the whole of a plain tensor."""
    if isinstance(obj, DTensor):
        return dtensor_box(obj, fqn=fqn)
    return (0,) * obj.ndim, tuple(obj.shape)


def all_boxes(obj: torch.Tensor, fqn: str | None = None) -> list[Box]:
    """The logical box of every shard of ``obj`` (every coordinate of a DTensor's mesh, in rank
    order), or the whole of a plain tensor: what each rank's :func:`local_box` is."""
    if not isinstance(obj, DTensor):
        return [local_box(obj)]
    sizes = tuple(obj.device_mesh.shape)
    return [
        shard_box(obj.shape, sizes, coord, obj.placements, fqn=fqn)
        for coord in itertools.product(*(range(n) for n in sizes))
    ]


def local_tensor(obj: torch.Tensor) -> torch.Tensor:
    """``obj``'s local data (a DTensor's ``_local_tensor``, else ``obj``)."""
    return obj._local_tensor if isinstance(obj, DTensor) else obj


def mode_for(fqn: str, default: str, rules: Mapping[str, str] | None) -> str:
    """Mode of ``fqn``: the first glob in ``rules`` (insertion order) that matches, else ``default``."""
    for pattern, mode in (rules or {}).items():
        if fnmatch.fnmatchcase(fqn, pattern):
            return mode
    return default

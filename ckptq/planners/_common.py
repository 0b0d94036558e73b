"""Pieces shared by the save and load planners: the checkpoint contract and local boxes.

Checkpoint contract ("ckptq layout v1" inside an ordinary DCP checkpoint):

* a quantized tensor ``w`` saved natively becomes one DCP tensor entry per component, named
  ``f"{w}.{component}"`` (``w.data``, ``w.scale``, ``w.amax``, ...), with the component's global size
  and one chunk per saving shard;
* saved in high precision, ``w`` is an ordinary tensor entry of the chosen dtype;
* ``metadata.planner_data["__ckptq__"]`` holds, as builtins only, ``{"version": 1, "world_size": N,
  "tensors": {fqn: descriptor}}`` where a descriptor is ``QuantizedTensor.descriptor()`` plus
  ``"mode"`` and, for native entries, each component's ``"fqn"``; high-precision entries carry
  ``"stored_dtype"``.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Optional

import torch
from torch.distributed.tensor import DTensor

from ..chunks import Box
from ..errors import CheckpointFormatError, UnsupportedFormatError
from ..layout import dtensor_box

__all__ = [
    "CKPTQ_KEY",
    "CONTRACT_VERSION",
    "MODES",
    "component_fqn",
    "local_box",
    "local_tensor",
    "mode_for",
    "ckptq_planner_data",
]

CKPTQ_KEY = "__ckptq__"
CONTRACT_VERSION = 1
MODES = ("native", "high_precision")


def component_fqn(fqn: str, component: str) -> str:
    """DCP key of one component of a natively saved quantized tensor."""
    return f"{fqn}.{component}"


def local_box(obj: torch.Tensor, fqn: Optional[str] = None) -> Box:
    """The logical box this process holds of ``obj``: a DTensor's shard (the box DCP stores; raises
    ShardingError when the shard is not one contiguous box, see :func:`ckptq.layout.shard_box`),
    or the whole of a plain tensor."""
    if isinstance(obj, DTensor):
        return dtensor_box(obj, fqn=fqn)
    return (0,) * obj.ndim, tuple(obj.shape)


def local_tensor(obj: torch.Tensor) -> torch.Tensor:
    """``obj``'s local data (a DTensor's ``_local_tensor``, else ``obj``)."""
    return obj._local_tensor if isinstance(obj, DTensor) else obj


def mode_for(fqn: str, default: str, rules: Optional[Mapping[str, str]]) -> str:
    """Mode of ``fqn``: the first glob in ``rules`` (insertion order) that matches, else ``default``."""
    for pattern, mode in (rules or {}).items():
        if fnmatch.fnmatchcase(fqn, pattern):
            return mode
    return default


def validate_mode(mode: str, where: str) -> str:
    if mode not in MODES:
        raise UnsupportedFormatError(f"{where}: mode '{mode}' is not one of {list(MODES)}")
    return mode


def ckptq_planner_data(planner_data: Any) -> dict:
    """The ``__ckptq__`` record of a checkpoint's planner_data (empty if it has none).

    Raises:
        CheckpointFormatError: the record is malformed or from a newer contract version.
    """
    if not isinstance(planner_data, Mapping) or CKPTQ_KEY not in planner_data:
        return {"version": CONTRACT_VERSION, "world_size": None, "tensors": {}}
    rec = planner_data[CKPTQ_KEY]
    if not isinstance(rec, Mapping) or not isinstance(rec.get("tensors"), Mapping):
        raise CheckpointFormatError(f"malformed '{CKPTQ_KEY}' record in checkpoint metadata: {rec!r}")
    if int(rec.get("version", 0)) > CONTRACT_VERSION:
        raise CheckpointFormatError(
            f"checkpoint written by a newer ckptq (contract version {rec.get('version')}, this "
            f"ckptq reads {CONTRACT_VERSION}); upgrade ckptq"
        )
    return dict(rec)

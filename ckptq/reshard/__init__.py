"""Offline resharding and format conversion of DCP checkpoints, streaming tensor by tensor.

``reshard_checkpoint(src, dst, mesh=..., plan=...)`` lays a checkpoint out for a target mesh: each
target rank's chunks go into its own storage file (``__{rank}_0.distcp``), so a rank reads one file
at load time. It needs no process group. Every tensor is planned first (:mod:`.plan`: placements,
boxes, block alignment, bytes per rank) and nothing is written if any native tensor would be cut
inside a block (unless told to export those tensors in high precision). Then (:mod:`.run`) tensors
whose bytes do not change are copied by byte range, and the others are read whole and transformed
(:mod:`.transform`: ``mode``, ``to``, grouped stack/split) and cut into their target chunks. Peak
memory is about one source tensor plus its transformed copy plus one chunk, whatever the checkpoint
size. Output goes to a temporary sibling directory renamed into place when complete.

Modules: :mod:`.options` (:class:`ReshardOptions`, :func:`reshard_checkpoint`), :mod:`.plan`,
:mod:`.transform`, :mod:`.run`; the file map and writer thread are :mod:`ckptq.io.pipeline`,
the process-group protocol :mod:`ckptq.distributed`.
"""

from __future__ import annotations

from ..parse import HP_DTYPES
from .options import ReshardOptions, reshard_checkpoint
from .plan import ReshardPlan, TensorJob, plan_reshard
from .run import run_reshard

__all__ = [
    "ReshardOptions",
    "reshard_checkpoint",
    "TensorJob",
    "ReshardPlan",
    "plan_reshard",
    "run_reshard",
    "HP_DTYPES",
]

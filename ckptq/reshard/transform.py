"""Whole-tensor transformation of a job whose bytes change: read, stack/split, re-encode or dequantize.

Only jobs that cannot be copied by byte range come here (:mod:`ckptq.reshard.run`): each reads its
source tensor(s) whole (:func:`read_source`, on the reader thread of :func:`ckptq.io.device.prefetch`)
and :func:`transform` computes the output on the device the source was moved to, so peak memory is
about two source tensors (this one and the next, read meanwhile) plus a transformed copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..checkpoint import CheckpointView
from ..formats import format_class, requantize
from ..formats.base import QuantizedTensor, slice_box
from ..metrics import sqnr_db
from .plan import TensorJob

__all__ = ["read_source", "computes", "transform"]


def read_source(view: CheckpointView, job: TensorJob) -> Any:
    """The job's source tensor, whole, on the host: its one source, or the stack of its grouped
    members, or member ``job.member`` of a stacked source (byte moves only; nothing is computed)."""
    parts = [view.read(e.fqn) for e in job.sources]
    if len(parts) > 1:  # grouped stack: per-member components gain a leading batch dim
        if isinstance(parts[0], QuantizedTensor):
            q0 = parts[0]
            comps = {k: torch.stack([p._components[k] for p in parts]) for k in q0._components}
            src: Any = type(q0)(comps, (len(parts),) + tuple(q0.shape), q0.dtype, q0.recipe)
        else:
            src = torch.stack(parts)
    else:
        src = parts[0]
    del parts
    if job.member is not None:  # grouped split: member i of the leading (batch) dim
        i = job.member
        if isinstance(src, QuantizedTensor):
            sub = slice_box(src, ((i,) + (0,) * (src.ndim - 1), (1,) + tuple(src.shape[1:])))
            src = type(sub)({k: v[0] for k, v in sub._components.items()}, tuple(src.shape[1:]), src.dtype, src.recipe)
        else:
            src = src[i]
    return src


def computes(job: TensorJob, src: Any) -> bool:
    """Whether :func:`transform` runs kernels on ``src`` (re-encodes or dequantizes it), i.e. whether
    it is worth moving to a compute device; False where its bytes are kept (a cast of a plain
    tensor is not counted: it stays on the host)."""
    if not isinstance(src, QuantizedTensor):
        return False
    if job.out != "quantized":
        return True
    cls = format_class(job.out_format)
    return not (isinstance(src, cls) and src.recipe == cls._recipe_from_json(job.out_recipe))


def transform(src: Any, job: TensorJob) -> tuple[Any, float | None]:
    """``src`` (from :func:`read_source`, on any device) as the job's output tensor (on the same
    device), plus the SQNR (dB) of its values against the source's when it was re-encoded (else
    None). The kernels of ``src``'s device run (:mod:`ckptq.ops`: the same bytes on every backend)."""
    if job.out == "quantized":
        cls = format_class(job.out_format)
        recipe = cls._recipe_from_json(job.out_recipe)
        if isinstance(src, cls) and src.recipe == recipe:
            return src, None
        out = requantize(src, job.out_format, **dataclasses.asdict(recipe))
        if out.dtype != job.out_dtype:
            out = type(out)(out._components, out.shape, job.out_dtype, out.recipe)
        ref = src.dequantize(torch.float32) if isinstance(src, QuantizedTensor) else src.float()
        return out, sqnr_db(ref, out.dequantize(torch.float32))
    values = src.dequantize(job.out_dtype) if isinstance(src, QuantizedTensor) else src
    return (values.to(job.out_dtype) if values.dtype != job.out_dtype else values), None

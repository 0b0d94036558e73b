"""The op registry: one entry point for quantize / dequantize / requantize, whatever the backend.

Backends, in order of preference: ``cuda`` and ``cpu`` (C++ kernels in ``ckptq/csrc``, when built;
exposed as the ``torch.ops.ckptq.requantize`` / ``torch.ops.ckptq.amax`` custom ops, see
:mod:`ckptq.ops._library`) and ``reference`` (pure PyTorch, :mod:`ckptq.numerics`, always there;
the spec). Every backend produces the same bytes as the reference. The kernels fuse decode
(source format) and encode (target format) into one pass over the data; per-tensor targets
(``fp8_tensor``, ``nvfp4`` without ``amax=``) first reduce the amax over the source.

The entry points take QuantizedTensor subclasses (and their instances) and use their hooks
(``kernel_args``, ``SOURCE_COMPONENTS``, ``component_specs``, ``_reference_quantize`` /
``_reference_dequantize``); the formats register themselves (:func:`register_format`), so this
package never imports :mod:`ckptq.formats`. Override validation is the caller's
(``QuantizedTensor.check_overrides``).

``CKPTQ_BACKEND=reference|cpu|cuda`` forces one (details in :mod:`ckptq.ops._backends`);
:func:`force` does the same for a ``with`` block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import numerics
from . import _backends
from ._backends import force
from ._library import FORMATS, HP_FORMATS, format_class, register_format

__all__ = [
    "quantize",
    "dequantize",
    "requantize",
    "amax",
    "crc32c",
    "crc32c_available",
    "backend_name",
    "backend_report",
    "force",
    "kernel_args",
    "make_kernel_args",
    "register_format",
    "FORMATS",
    "format_class",
]


def backend_name(device: torch.device | str = "cpu") -> str:
    """The backend that serves tensors on ``device``: ``"cuda"``, ``"cpu"`` or ``"reference"``.

    Raises:
        CkptqError: ``CKPTQ_BACKEND`` names an unknown backend, or forces one that is not active.
    """
    return _backends.select(device)


def backend_report() -> dict:
    """What ``ckptq doctor`` prints: torch version and, per backend, whether it is active and why not.

    ``{"torch": "2.13.0+cpu", "torch_cuda": None, "cuda_device": None, "forced": None,
    "backends": {"reference": {"active": True, "reason": "..."}, "cpu": {"active": True,
    "reason": "...", "path": ".../_C.abi3.so"}, "cuda": {"active": False, "reason": "..."}}}``
    """
    return _backends.report()


# ------------------------------------------------------------------------------ op arguments
def make_kernel_args(
    fmt: str,
    *,
    block: Sequence[int] = (),
    fp8_dtype: torch.dtype | None = None,
    pow2: bool = False,
    eps: float = 0.0,
    columnwise: bool = False,
    scale_rule: str = "",
) -> dict:
    """The ``ckptq::requantize`` arguments describing one side (source or target) of the op:
    ``{"format", "block", "fp8_dtype", "pow2", "eps", "columnwise", "scale_rule"}``, unused ones at
    their defaults (``scale_rule``: the mxfp4 E8M0 scale rule, ``""`` elsewhere)."""
    return {
        "format": fmt,
        "block": [int(b) for b in block],
        "fp8_dtype": fp8_dtype,
        "pow2": bool(pow2),
        "eps": float(eps),
        "columnwise": bool(columnwise),
        "scale_rule": str(scale_rule),
    }


def kernel_args(fmt: str, recipe: Any = None) -> dict:
    """The ``ckptq::requantize`` arguments describing format ``fmt`` with ``recipe``.

    Returns ``{"format", "block", "fp8_dtype", "pow2", "eps", "columnwise", "scale_rule"}``; ``recipe`` is the
    format's recipe dataclass (ignored for the high-precision formats ``fp32``/``bf16``/``fp16``).
    A quantized format answers through its class's ``kernel_args`` hook.
    """
    cls = FORMATS.get(fmt)
    return make_kernel_args(fmt) if cls is None else cls.kernel_args(recipe)


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _cuda_supports(src: dict, dst: dict) -> bool:
    """Block shapes the CUDA kernels take (every default block; exotic fp8_block shapes use the
    reference): power-of-two blocks, column blocks of 16..512, and a target block that fits the
    kernel's tile (bm <= 4 * 256 / max(8, bk / 16) rows)."""
    if src["format"] == "fp8_block":
        bm, bk = src["block"]
        if not (_pow2(bm) and _pow2(bk) and bk >= 16):
            return False
    if dst["format"] == "fp8_block":
        bm, bk = dst["block"]
        if not (_pow2(bm) and _pow2(bk) and 16 <= bk <= 512 and bm <= 1024 // max(8, bk // 16)):
            return False
    return True


def _source(qt) -> tuple[dict, list[torch.Tensor]]:
    """The op arguments and the source component list of a QuantizedTensor (its class's hooks)."""
    cls = type(qt)
    return cls.kernel_args(qt.recipe), [qt._components[n] for n in cls.SOURCE_COMPONENTS]


def _is_quantized(x: Any) -> bool:
    return isinstance(x, tuple(FORMATS.values()))


def _per_matrix(value: Any, batch: tuple, device: torch.device) -> torch.Tensor:
    """An ``amax=``/``scale=`` override as the reference takes it: fp32, expanded to the batch shape."""
    return numerics._f32(torch.as_tensor(value)).expand(batch).contiguous().to(device)


def _run(src_list, src: dict, dst: dict, *, amax=None, scale=None) -> list[torch.Tensor]:
    return torch.ops.ckptq.requantize(
        src_list,
        src["format"],
        src["block"],
        dst["format"],
        dst["block"],
        dst["fp8_dtype"],
        dst["pow2"],
        dst["eps"],
        dst["columnwise"],
        amax,
        scale,
        dst["scale_rule"],
    )


def _use_kernel(backend: str, src: dict, dst: dict, shape) -> bool:
    if backend == "reference" or math.prod(shape) == 0:
        return False  # empty tensors: the reference decides (it raises where amax is undefined)
    return backend != "cuda" or _cuda_supports(src, dst)


# -------------------------------------------------------------------------------- entry points
def _encode(cls, src_list, src: dict, recipe: Any, shape, device, amax, scale) -> dict[str, torch.Tensor]:
    """Run the kernel from ``src_list`` to ``cls`` with ``recipe``; the target's components by name."""
    batch = tuple(shape[:-2])
    a = None if amax is None or scale is not None else _per_matrix(amax, batch, device)
    s = None if scale is None else _per_matrix(scale, batch, device)
    outs = _run(src_list, src, cls.kernel_args(recipe), amax=a, scale=s)
    return {spec.name: t for spec, t in zip(cls.component_specs(shape, recipe), outs, strict=False)}


def _columnwise(cls, recipe: Any) -> Any | None:
    """The rowwise recipe whose encoding of x^T is ``recipe``'s stored columnwise copy, when the
    ops compute that copy by running the kernels on x^T (``cls.COLUMNWISE_FROM_TRANSPOSE``); else None."""
    row = cls.rowwise_recipe(recipe)
    return row if cls.COLUMNWISE_FROM_TRANSPOSE and row is not recipe else None


def _add_columnwise(cls, out: dict, x: torch.Tensor, row_recipe: Any, amax, scale) -> dict[str, torch.Tensor]:
    """``out`` plus the columnwise components: the rowwise kernels on x^T (``x`` high precision),
    transposed back (:func:`ckptq.numerics.columnwise_copy`; the same overrides, so the same amax)."""
    t = quantize(cls, x.mT.contiguous(), row_recipe, amax=amax, scale=scale)
    return {**out, **numerics.columnwise_copy(t, cls.COLUMNWISE_FROM_TRANSPOSE)}  # columnwise last, as the specs


def quantize(cls, x: torch.Tensor, recipe: Any, *, amax=None, scale=None) -> dict[str, torch.Tensor]:
    """Components of ``x`` (fp32/bf16/fp16, shape (..., M, K)) quantized as ``cls`` (a
    QuantizedTensor subclass) with ``recipe``; ``amax``/``scale`` override the per-matrix value
    (see :func:`ckptq.quantize`). Returns ``{component name: tensor}`` in canonical order. A
    columnwise copy that is the rowwise encoding of x^T (nvfp4, fp8_block) runs the kernels twice."""
    backend = _backends.select(x.device)
    src = kernel_args(HP_FORMATS.get(x.dtype, ""))
    if (
        x.dtype not in HP_FORMATS
        or not cls.kernel_supports(recipe)
        or not _use_kernel(backend, src, cls.kernel_args(recipe), x.shape)
    ):
        return cls._reference_quantize(x, recipe, amax=amax, scale=scale)
    row = _columnwise(cls, recipe)
    out = _encode(cls, [x], src, row or recipe, x.shape, x.device, amax, scale)
    return out if row is None else _add_columnwise(cls, out, x, row, amax, scale)


def dequantize(qt, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """High-precision values of the QuantizedTensor ``qt`` (fp32 math, cast to ``dtype`` at the
    end), shape ``qt.shape``."""
    backend = _backends.select(qt.device)
    if not type(qt).kernel_supports(qt.recipe):
        return type(qt)._reference_dequantize(qt._components, qt.recipe, dtype)
    src, comps = _source(qt)
    dst = kernel_args(HP_FORMATS.get(dtype, "fp32"))
    if not _use_kernel(backend, src, dst, qt.shape):
        return type(qt)._reference_dequantize(qt._components, qt.recipe, dtype)
    (x,) = _run(comps, src, dst)
    return x if x.dtype == dtype else x.to(dtype)  # e.g. float64: fp32 math, then the cast


def requantize(qt, cls, recipe: Any, *, amax=None, scale=None) -> dict[str, torch.Tensor]:
    """Components of the QuantizedTensor ``qt`` re-encoded as ``cls`` with ``recipe`` (``amax``/
    ``scale`` as in :func:`quantize`); ``{component name: tensor}`` in canonical order.

    Equal, byte for byte, to ``quantize(cls, dequantize(qt, torch.float32), recipe, ...)``, which
    is what runs where no kernel takes the pair (reference backend, empty tensors, blocks the CUDA
    kernels do not take); a kernel backend fuses decode and encode into one pass. Overrides are
    not validated here (see ``QuantizedTensor.check_overrides``).
    """
    backend = _backends.select(qt.device)
    if not (type(qt).kernel_supports(qt.recipe) and cls.kernel_supports(recipe)):
        return quantize(cls, dequantize(qt, torch.float32), recipe, amax=amax, scale=scale)
    src, comps = _source(qt)
    if not _use_kernel(backend, src, cls.kernel_args(recipe), qt.shape):
        return quantize(cls, dequantize(qt, torch.float32), recipe, amax=amax, scale=scale)
    row = _columnwise(cls, recipe)
    out = _encode(cls, comps, src, row or recipe, qt.shape, qt.device, amax, scale)
    return out if row is None else _add_columnwise(cls, out, dequantize(qt, torch.float32), row, amax, scale)


def amax(src) -> torch.Tensor:
    """Per-matrix amax of ``src``'s (decoded) values (a QuantizedTensor or a plain tensor): fp32 of
    the batch shape, NaN propagates.

    This is the amax an ``nvfp4`` or ``fp8_tensor`` target computes; reduce it over the shards of
    one tensor (e.g. ``all_reduce(MAX)``) and pass it as ``amax=`` so that all shards share scales.
    """
    backend = _backends.select(src.device)
    quantized = _is_quantized(src)
    if quantized and not type(src).kernel_supports(src.recipe):
        return numerics._matrix_amax(dequantize(src, torch.float32))
    if quantized:
        s, comps = _source(src)
    else:
        s, comps = kernel_args(HP_FORMATS.get(src.dtype, "")), [src]
    if s["format"] and _use_kernel(backend, s, kernel_args("fp32"), src.shape):
        return torch.ops.ckptq.amax(comps, s["format"], s["block"])
    hp = dequantize(src, torch.float32) if quantized else src
    return numerics._matrix_amax(hp)


def crc32c_available(device: torch.device | str) -> bool:
    """Whether :func:`crc32c` serves tensors on ``device`` now: a CUDA device by default, the CPU
    only when ``CKPTQ_BACKEND=cpu`` is forced (tests; for CPU tensors the ``crc32c`` package is
    faster); never when ``CKPTQ_BACKEND=reference`` or the extension (with this op) is not built."""
    dev = torch.device(device).type
    f = _backends.forced()
    if not ((dev == "cuda" and f in (None, "cuda")) or (dev == "cpu" and f == "cpu")):
        return False
    return _backends.status(dev)[0] and torch._C._dispatch_has_kernel_for_dispatch_key(
        "ckptq::crc32c", _backends._DISPATCH_KEY[dev]
    )


def crc32c(data: torch.Tensor, value: int = 0, *, segment: int = 0) -> torch.Tensor | None:
    """The crc32c of ``data``'s bytes computed by the compiled kernel where ``data`` is
    (``ckptq::crc32c``: the elements row-major as the little-endian bytes of the dtype, continued
    from ``value``, the convention of :func:`ckptq.checksums.checksum`), as a 0-dim ``int64``
    tensor on ``data``'s device, enqueued on its current stream (not waited for); or ``None``
    where :func:`crc32c_available` says no kernel serves it. ``segment``: bytes per
    independently hashed piece (0: chosen for the device; the value does not depend on it).
    """
    if not crc32c_available(data.device):
        return None
    return torch.ops.ckptq.crc32c(data, int(value), int(segment))

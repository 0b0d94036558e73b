"""The op registry: one entry point for quantize / dequantize / requantize, whatever the backend.

Backends, in order of preference: ``cuda`` and ``cpu`` (C++ kernels in ``ckptq/csrc``, when built;
exposed as the ``torch.ops.ckptq.requantize`` / ``torch.ops.ckptq.amax`` custom ops, see
:mod:`ckptq.ops._library`) and ``reference`` (pure PyTorch, :mod:`ckptq.formats.numerics`, always
there; the spec). Every backend produces the same bytes as the reference. The kernels fuse decode
(source format) and encode (target format) into one pass over the data; per-tensor targets
(``fp8_tensor``, ``nvfp4`` without ``amax=``) first reduce the amax over the source.

``CKPTQ_BACKEND=reference|cpu|cuda`` forces one (details in :mod:`ckptq.ops._backends`);
:func:`force` does the same for a ``with`` block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..errors import QuantizationError, UnsupportedFormatError
from . import _backends
from ._backends import force
from ._library import HP_FORMATS

if TYPE_CHECKING:
    from ..formats.base import QuantizedTensor

__all__ = [
    "quantize",
    "dequantize",
    "requantize",
    "amax",
    "backend_name",
    "backend_report",
    "force",
    "kernel_args",
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
def kernel_args(fmt: str, recipe: Any) -> dict:
    """The ``ckptq::requantize`` arguments describing format ``fmt`` with ``recipe``.

    Returns ``{"format", "block", "fp8_dtype", "pow2", "eps", "columnwise"}``; ``recipe`` is the
    format's recipe dataclass (ignored for the high-precision formats ``fp32``/``bf16``/``fp16``).
    """
    out = {"format": fmt, "block": [], "fp8_dtype": None, "pow2": False, "eps": 0.0, "columnwise": False}
    if fmt == "fp8_tensor":
        out.update(fp8_dtype=recipe.fp8_dtype, pow2=bool(recipe.pow2), eps=float(recipe.eps))
    elif fmt == "fp8_block":
        out.update(block=[int(b) for b in recipe.block], fp8_dtype=recipe.fp8_dtype, pow2=bool(recipe.pow2),
                   eps=float(recipe.eps))
    elif fmt == "mxfp8":
        out.update(block=[1, 32], columnwise=bool(recipe.columnwise))
    elif fmt == "nvfp4":
        out.update(block=[16, 16] if recipe.two_d else [1, 16])
    return out


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _cuda_supports(src: dict, dst: dict) -> bool:
    """Block shapes the CUDA kernels take (all of DESIGN.md's; exotic fp8_block shapes use the
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


def _source_components(qt: "QuantizedTensor") -> list[torch.Tensor]:
    names = {"fp8_tensor": ("data", "scale_inv"), "fp8_block": ("data", "scale_inv"), "mxfp8": ("data", "scale"),
             "nvfp4": ("data", "scale", "amax")}[qt.FORMAT]
    return [qt._components[n] for n in names]


def _per_matrix(value: Any, batch: tuple, device: torch.device) -> torch.Tensor:
    """An ``amax=``/``scale=`` override as the reference takes it: fp32, expanded to the batch shape."""
    from ..formats import numerics

    return numerics._f32(torch.as_tensor(value)).expand(batch).contiguous().to(device)


def _run(src_list, src: dict, dst: dict, *, amax=None, scale=None) -> list[torch.Tensor]:
    return torch.ops.ckptq.requantize(
        src_list, src["format"], src["block"], dst["format"], dst["block"], dst["fp8_dtype"], dst["pow2"],
        dst["eps"], dst["columnwise"], amax, scale,
    )


def _use_kernel(backend: str, src: dict, dst: dict, shape) -> bool:
    if backend == "reference" or math.prod(shape) == 0:
        return False  # empty tensors: the reference decides (it raises where amax is undefined)
    return backend != "cuda" or _cuda_supports(src, dst)


# -------------------------------------------------------------------------------- entry points
def quantize(cls, x: torch.Tensor, recipe: Any, *, amax=None, scale=None) -> dict[str, torch.Tensor]:
    """Components of ``x`` (fp32/bf16/fp16, shape (..., M, K)) quantized as ``cls`` (a
    QuantizedTensor subclass) with ``recipe``; ``amax``/``scale`` override the per-matrix value
    (see :func:`ckptq.quantize`). Returns ``{component name: tensor}`` in canonical order."""
    backend = _backends.select(x.device)
    src = kernel_args(HP_FORMATS.get(x.dtype, ""), None)
    dst = kernel_args(cls.FORMAT, recipe)
    if x.dtype not in HP_FORMATS or not _use_kernel(backend, src, dst, x.shape):
        return cls._reference_quantize(x, recipe, amax=amax, scale=scale)
    batch = tuple(x.shape[:-2])
    a = None if amax is None or scale is not None else _per_matrix(amax, batch, x.device)
    s = None if scale is None else _per_matrix(scale, batch, x.device)
    outs = _run([x], src, dst, amax=a, scale=s)
    return {spec.name: t for spec, t in zip(cls.component_specs(x.shape, recipe), outs)}


def dequantize(qt: "QuantizedTensor", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """High-precision values of ``qt`` (fp32 math, cast to ``dtype`` at the end), shape ``qt.shape``."""
    backend = _backends.select(qt.device)
    src = kernel_args(qt.FORMAT, qt.recipe)
    dst = kernel_args(HP_FORMATS.get(dtype, "fp32"), None)
    if not _use_kernel(backend, src, dst, qt.shape):
        return type(qt)._reference_dequantize(qt._components, qt.recipe, dtype)
    (x,) = _run(_source_components(qt), src, dst)
    return x if x.dtype == dtype else x.to(dtype)  # e.g. float64: fp32 math, then the cast


def amax(src: "QuantizedTensor | torch.Tensor") -> torch.Tensor:
    """Per-matrix amax of ``src``'s (decoded) values: fp32 of the batch shape, NaN propagates.

    This is the amax an ``nvfp4`` or ``fp8_tensor`` target computes; reduce it over the shards of
    one tensor (e.g. ``all_reduce(MAX)``) and pass it as ``amax=`` so that all shards share scales.
    """
    from ..formats import QuantizedTensor as QT, numerics

    backend = _backends.select(src.device)
    if isinstance(src, QT):
        s = kernel_args(src.FORMAT, src.recipe)
        comps = _source_components(src)
    else:
        s = kernel_args(HP_FORMATS.get(src.dtype, ""), None)
        comps = [src]
    if s["format"] and _use_kernel(backend, s, kernel_args("fp32", None), src.shape):
        return torch.ops.ckptq.amax(comps, s["format"], s["block"])
    hp = src.dequantize(torch.float32) if isinstance(src, QT) else src
    return numerics._matrix_amax(hp)


def requantize(
    src: "QuantizedTensor | torch.Tensor",
    fmt: str,
    *,
    amax: Optional[Any] = None,
    scale: Optional[Any] = None,
    **recipe: Any,
) -> "QuantizedTensor":
    """Convert ``src`` (quantized or high precision) to ``fmt`` with ``recipe``.

    The logical dtype of the result is ``src.dtype``. The result equals, byte for byte,
    ``ckptq.quantize(src.dequantize(torch.float32), fmt, amax=..., scale=..., **recipe)``; the
    kernel backends compute it in one fused pass without the high-precision intermediate.

    Raises:
        UnsupportedFormatError: unknown format or recipe option, ``amax=``/``scale=`` where the
            format has no per-tensor value.
        QuantizationError: nvfp4 with an odd last dim.
    """
    from ..formats import QuantizedTensor as QT, format_class, make_recipe, quantize as _quantize

    if not isinstance(src, QT):
        hp = src
        out = _quantize(hp.float() if hp.dtype not in HP_FORMATS else hp, fmt, amax=amax, scale=scale, **recipe)
        if out.dtype != src.dtype:
            out = type(out)(out._components, out.shape, src.dtype, out.recipe)
        return out

    cls = format_class(fmt)
    rec = make_recipe(fmt, **recipe)
    if amax is not None and fmt not in ("nvfp4", "fp8_tensor"):
        raise UnsupportedFormatError(f"{fmt}: amax= applies only to nvfp4 and fp8_tensor")
    if scale is not None and fmt != "fp8_tensor":
        raise UnsupportedFormatError(f"{fmt}: scale= applies only to fp8_tensor")
    if fmt == "nvfp4" and src.shape[-1] % 2:
        raise QuantizationError(
            f"nvfp4: the last dim of shape {tuple(src.shape)} is odd ({src.shape[-1]}); E2M1 values are "
            f"packed two per byte, so K must be even. Pad K or choose another format."
        )
    backend = _backends.select(src.device)
    s, d = kernel_args(src.FORMAT, src.recipe), kernel_args(fmt, rec)
    if not _use_kernel(backend, s, d, src.shape):
        hp = src.dequantize(torch.float32)
        out = _quantize(hp, fmt, amax=amax, scale=scale, **recipe)
        return type(out)(out._components, out.shape, src.dtype, out.recipe)
    batch = tuple(src.shape[:-2])
    a = None if amax is None or scale is not None else _per_matrix(amax, batch, src.device)
    sc = None if scale is None else _per_matrix(scale, batch, src.device)
    outs = _run(_source_components(src), s, d, amax=a, scale=sc)
    comps = {spec.name: t for spec, t in zip(cls.component_specs(src.shape, rec), outs)}
    return cls(comps, src.shape, src.dtype, rec)

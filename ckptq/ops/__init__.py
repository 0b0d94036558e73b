"""The op registry: one entry point for quantize / dequantize / requantize, whatever the backend.

Backends, in order of preference: ``cuda`` and ``cpu`` (C++ kernels in ``ckptq/csrc``, when built)
and ``reference`` (pure PyTorch, :mod:`ckptq.formats.numerics`, always there; the spec).
``CKPTQ_BACKEND=reference|cpu|cuda`` forces one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from ..formats.base import QuantizedTensor

__all__ = ["quantize", "dequantize", "requantize", "backend_name", "backend_report"]


def backend_name(device: torch.device | str = "cpu") -> str:
    """The backend that serves tensors on ``device`` (``reference`` until kernels are built)."""
    return "reference"


def backend_report() -> dict:
    """What ``ckptq doctor`` prints: torch version and, per backend, whether it is active and why not.

    ``{"torch": "2.13.0+cpu", "forced": None, "backends": {"reference": {"active": True, "reason":
    "..."}, "cpu": {...}, "cuda": {...}}}``
    """
    return {
        "torch": torch.__version__,
        "forced": None,
        "backends": {
            "reference": {"active": True, "reason": "pure PyTorch, always available"},
            "cpu": {"active": False, "reason": "C++ kernels not built yet"},
            "cuda": {"active": False, "reason": "CUDA kernels not built yet"},
        },
    }


def quantize(cls, x: torch.Tensor, recipe: Any, *, amax=None, scale=None) -> dict[str, torch.Tensor]:
    """Components of ``x`` quantized as ``cls`` (a QuantizedTensor subclass) with ``recipe``."""
    return cls._reference_quantize(x, recipe, amax=amax, scale=scale)


def dequantize(qt: "QuantizedTensor", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """High-precision values of ``qt`` (fp32 math, cast to ``dtype`` at the end)."""
    return type(qt)._reference_dequantize(qt._components, qt.recipe, dtype)


def requantize(
    src: "QuantizedTensor | torch.Tensor",
    fmt: str,
    *,
    amax: Optional[Any] = None,
    scale: Optional[Any] = None,
    **recipe: Any,
) -> "QuantizedTensor":
    """Convert ``src`` (quantized or high precision) to ``fmt`` with ``recipe``.

    The logical dtype of the result is ``src.dtype``. Decode and encode follow the reference
    numerics; kernel backends fuse them into one pass.
    """
    from ..formats import QuantizedTensor as QT, quantize as _quantize

    hp = src.dequantize(torch.float32) if isinstance(src, QT) else src
    out = _quantize(hp.float() if hp.dtype not in (torch.float32, torch.bfloat16, torch.float16) else hp,
                    fmt, amax=amax, scale=scale, **recipe)
    if out.dtype != src.dtype:
        out = type(out)(out._components, out.shape, src.dtype, out.recipe)
    return out

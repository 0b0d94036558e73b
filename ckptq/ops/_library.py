"""Schemas and fake (meta) kernels of the ``ckptq`` custom ops.

The schemas are defined here, in Python, so that they exist whether or not a compiled backend
loaded; the C++ extensions (``ckptq._C`` for CPU, ``ckptq._C_cuda`` for CUDA) register only their
implementations (``TORCH_LIBRARY_IMPL(ckptq, CPU|CUDA, m)``). The fake kernels give output shapes
and dtypes for FakeTensor / ``torch.compile`` / meta tensors.

Ops:

``ckptq::requantize(Tensor[] src, str src_format, int[] src_block, str dst_format, int[] dst_block,
ScalarType? fp8_dtype=None, bool pow2=False, float eps=0.0, bool columnwise=False, Tensor? amax=None,
Tensor? scale=None, str scale_rule="") -> Tensor[]``
    Decode ``src`` (the components of ``src_format``, canonical order) and encode it as
    ``dst_format`` in one pass; returns the target's components in canonical order. Formats:
    ``fp32``, ``bf16``, ``fp16`` (one plain tensor), ``fp8_tensor`` (data, scale_inv),
    ``fp8_block`` (data, scale_inv; block ``[bm, bk]``), ``mxfp8`` (data, scale; plus
    columnwise_data, columnwise_scale as a target with ``columnwise``; block ``[1, 32]``),
    ``nvfp4`` (data, scale, amax; block ``[1, 16]`` or ``[16, 16]``), ``mxfp4`` (data, scale; block
    ``[1, 32]``). ``fp8_dtype`` is the element dtype of an fp8 target; ``pow2`` and ``eps`` its
    scale options; ``amax`` (nvfp4, fp8_tensor) and ``scale`` (fp8_tensor) override the per-matrix
    value (fp32, one value per matrix); ``scale_rule`` is an mxfp4 target's E8M0 scale rule
    (``floor``, ``even``, ``ceil``, ``rceil``; ``""`` means ``floor``).

``ckptq::amax(Tensor[] src, str src_format, int[] src_block) -> Tensor``
    The amax of each matrix of the decoded source (fp32, batch shape; NaN propagates as the
    canonical NaN), i.e. what an nvfp4 / fp8_tensor target would use.

``ckptq::crc32c(Tensor data, int value=0, int segment=0) -> Tensor``
    The crc32c (ckptq.checksums' convention: the `crc32c` package's ``crc32c(bytes, value)``) of
    ``data``'s elements, row-major, as the little-endian bytes of its dtype, continued from
    ``value``; a 0-dim int64 tensor on ``data``'s device (computed there: no copy of the data to the
    host). The range is hashed in pieces of ``segment`` bytes (0: chosen for the device) combined in
    GF(2) (``ckptq/csrc/crc32c.h``); the value does not depend on ``segment``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import CkptqError, UnsupportedFormatError
from ..numerics import HP_FORMATS

__all__ = [
    "REQUANTIZE_SCHEMA",
    "AMAX_SCHEMA",
    "CRC32C_SCHEMA",
    "HP_FORMATS",
    "FORMATS",
    "register_format",
    "format_class",
    "logical_shape",
    "output_specs",
]

REQUANTIZE_SCHEMA = (
    "requantize(Tensor[] src, str src_format, int[] src_block, str dst_format, int[] dst_block, "
    "ScalarType? fp8_dtype=None, bool pow2=False, float eps=0.0, bool columnwise=False, "
    'Tensor? amax=None, Tensor? scale=None, str scale_rule="") -> Tensor[]'
)
AMAX_SCHEMA = "amax(Tensor[] src, str src_format, int[] src_block) -> Tensor"
CRC32C_SCHEMA = "crc32c(Tensor data, int value=0, int segment=0) -> Tensor"

#: high-precision format name used by the ops -> dtype (the inverse of :data:`HP_FORMATS`)
_HP_DTYPES = {v: k for k, v in HP_FORMATS.items()}

#: The format registry: quantized format name -> its QuantizedTensor subclass, filled by
#: :func:`register_format` (the formats register themselves, so that ops never imports
#: :mod:`ckptq.formats`; ``ckptq.formats.FORMATS`` is this dict).
FORMATS: dict[str, type] = {}


def register_format(cls: type) -> type:
    """Make the QuantizedTensor subclass ``cls`` known to the ops under ``cls.FORMAT``.

    The ops use its hooks: ``kernel_args`` / ``recipe_from_kernel_args`` (the op arguments),
    ``SOURCE_COMPONENTS`` (the kernels' source order), ``component_specs`` (output shapes and
    dtypes) and ``_reference_quantize`` / ``_reference_dequantize`` (the reference backend).
    """
    FORMATS[cls.FORMAT] = cls
    return cls


def format_class(fmt: str) -> type:
    """The QuantizedTensor subclass of the quantized format named ``fmt``.

    Raises:
        UnsupportedFormatError: no format of that name is registered (high-precision names too).
    """
    try:
        return FORMATS[fmt]
    except KeyError:
        raise UnsupportedFormatError(f"unknown format '{fmt}'; ckptq supports {sorted(FORMATS)}") from None


def _recipe(cls: type, block, fp8_dtype=None, pow2=False, eps=0.0, columnwise=False, scale_rule=""):
    """``cls``'s recipe from op arguments; an invalid combination fails as the kernels do (RuntimeError)."""
    try:
        return cls.recipe_from_kernel_args(
            list(block), fp8_dtype, bool(pow2), float(eps), bool(columnwise), str(scale_rule)
        )
    except (CkptqError, TypeError, ValueError) as e:  # the recipe's own validation
        msg = f"ckptq: {e}"
        torch._check(False, lambda: msg)


def logical_shape(
    src: Sequence[torch.Tensor], src_format: str, src_block: Sequence[int] = ()
) -> tuple[tuple, object, object]:
    """``(batch, M, K)`` of the logical tensor whose ``src_format`` components are ``src``.

    ``src[0]`` is the element data (..., M, K / d), where ``d`` is the divisor of the format's
    ``data`` component along K (2 for nvfp4's and mxfp4's packed E2M1, 1 otherwise).
    """
    data = src[0]
    torch._check(data.dim() >= 2, lambda: f"ckptq: source data must have rank >= 2, got {tuple(data.shape)}")
    *batch, m, k = data.shape
    cls = FORMATS.get(src_format)
    if cls is not None:
        rec = _recipe(cls, src_block, data.dtype)
        spec = next(s for s in cls.component_specs(tuple(data.shape), rec) if s.name == "data")
        k = k * spec.block_of(data.dim() - 1)
    return tuple(batch), m, k


def output_specs(
    batch: tuple,
    m,
    k,
    dst_format: str,
    dst_block: Sequence[int],
    fp8_dtype: torch.dtype | None,
    columnwise: bool,
    pow2: bool = False,
    eps: float = 0.0,
    scale_rule: str = "",
) -> list[tuple[tuple, torch.dtype]]:
    """Shapes and dtypes of the target components, canonical order (the format's ``component_specs``)."""
    shape = tuple(batch) + (m, k)
    if dst_format in _HP_DTYPES:
        return [(shape, _HP_DTYPES[dst_format])]
    cls = FORMATS.get(dst_format)
    if cls is None:
        raise ValueError(f"ckptq: unknown target format {dst_format!r}")
    rec = _recipe(cls, dst_block, fp8_dtype, pow2, eps, columnwise, scale_rule)
    return [(s.shape(shape), s.dtype) for s in cls.component_specs(shape, rec)]


_lib = torch.library.Library("ckptq", "DEF")  # referenced to keep the registration alive
_lib.define(REQUANTIZE_SCHEMA)
_lib.define(AMAX_SCHEMA)
_lib.define(CRC32C_SCHEMA)


@torch.library.register_fake("ckptq::requantize")
def _requantize_fake(
    src,
    src_format,
    src_block,
    dst_format,
    dst_block,
    fp8_dtype=None,
    pow2=False,
    eps=0.0,
    columnwise=False,
    amax=None,
    scale=None,
    scale_rule="",
):
    batch, m, k = logical_shape(src, src_format, src_block)
    dev = src[0].device
    return [
        src[0].new_empty(shape, dtype=dt, device=dev)
        for shape, dt in output_specs(batch, m, k, dst_format, dst_block, fp8_dtype, columnwise, pow2, eps, scale_rule)
    ]


@torch.library.register_fake("ckptq::amax")
def _amax_fake(src, src_format, src_block):
    batch, _, _ = logical_shape(src, src_format, src_block)
    return src[0].new_empty(batch, dtype=torch.float32)


@torch.library.register_fake("ckptq::crc32c")
def _crc32c_fake(data, value=0, segment=0):
    return data.new_empty((), dtype=torch.int64)

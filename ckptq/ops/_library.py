"""Schemas and fake (meta) kernels of the ``ckptq`` custom ops.

The schemas are defined here, in Python, so that they exist whether or not a compiled backend
loaded; the C++ extensions (``ckptq._C`` for CPU, ``ckptq._C_cuda`` for CUDA) register only their
implementations (``TORCH_LIBRARY_IMPL(ckptq, CPU|CUDA, m)``). The fake kernels give output shapes
and dtypes for FakeTensor / ``torch.compile`` / meta tensors.

Ops:

``ckptq::requantize(Tensor[] src, str src_format, int[] src_block, str dst_format, int[] dst_block,
ScalarType? fp8_dtype=None, bool pow2=False, float eps=0.0, bool columnwise=False, Tensor? amax=None,
Tensor? scale=None) -> Tensor[]``
    Decode ``src`` (the components of ``src_format``, canonical order) and encode it as
    ``dst_format`` in one pass; returns the target's components in canonical order. Formats:
    ``fp32``, ``bf16``, ``fp16`` (one plain tensor), ``fp8_tensor`` (data, scale_inv),
    ``fp8_block`` (data, scale_inv; block ``[bm, bk]``), ``mxfp8`` (data, scale; plus
    columnwise_data, columnwise_scale as a target with ``columnwise``; block ``[1, 32]``),
    ``nvfp4`` (data, scale, amax; block ``[1, 16]`` or ``[16, 16]``). ``fp8_dtype`` is the element
    dtype of an fp8 target; ``pow2`` and ``eps`` its scale options; ``amax`` (nvfp4, fp8_tensor)
    and ``scale`` (fp8_tensor) override the per-matrix value (fp32, one value per matrix).

``ckptq::amax(Tensor[] src, str src_format, int[] src_block) -> Tensor``
    The amax of each matrix of the decoded source (fp32, batch shape; NaN propagates as the
    canonical NaN), i.e. what an nvfp4 / fp8_tensor target would use.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["REQUANTIZE_SCHEMA", "AMAX_SCHEMA", "HP_FORMATS", "logical_shape", "output_specs"]

REQUANTIZE_SCHEMA = (
    "requantize(Tensor[] src, str src_format, int[] src_block, str dst_format, int[] dst_block, "
    "ScalarType? fp8_dtype=None, bool pow2=False, float eps=0.0, bool columnwise=False, "
    "Tensor? amax=None, Tensor? scale=None) -> Tensor[]"
)
AMAX_SCHEMA = "amax(Tensor[] src, str src_format, int[] src_block) -> Tensor"

#: high-precision dtype -> format name used by the ops
HP_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_HP_DTYPES = {v: k for k, v in HP_FORMATS.items()}


def _cdiv(a, b):
    return -(-a // b)


def logical_shape(src: Sequence[torch.Tensor], src_format: str) -> tuple[tuple, object, object]:
    """``(batch, M, K)`` of the logical tensor whose ``src_format`` components are ``src``.

    ``src[0]`` is the element data: (..., M, K), or (..., M, K/2) packed for nvfp4.
    """
    data = src[0]
    torch._check(data.dim() >= 2, lambda: f"ckptq: source data must have rank >= 2, got {tuple(data.shape)}")
    *batch, m, k = data.shape
    if src_format == "nvfp4":
        k = 2 * k
    return tuple(batch), m, k


def output_specs(
    batch: tuple, m, k, dst_format: str, dst_block: Sequence[int], fp8_dtype: Optional[torch.dtype], columnwise: bool
) -> list[tuple[tuple, torch.dtype]]:
    """Shapes and dtypes of the target components, canonical order (DESIGN.md section 2)."""
    b = tuple(batch)
    if dst_format in _HP_DTYPES:
        return [(b + (m, k), _HP_DTYPES[dst_format])]
    if dst_format == "fp8_tensor":
        return [(b + (m, k), fp8_dtype), (b, torch.float32)]
    if dst_format == "fp8_block":
        bm, bk = dst_block
        return [(b + (m, k), fp8_dtype), (b + (_cdiv(m, bm), _cdiv(k, bk)), torch.float32)]
    if dst_format == "mxfp8":
        out = [(b + (m, k), torch.float8_e4m3fn), (b + (m, _cdiv(k, 32)), torch.uint8)]
        if columnwise:
            out += [(b + (m, k), torch.float8_e4m3fn), (b + (_cdiv(m, 32), k), torch.uint8)]
        return out
    if dst_format == "nvfp4":
        bm = dst_block[0] if len(dst_block) else 1
        return [
            (b + (m, k // 2), torch.uint8),
            (b + (_cdiv(m, bm), _cdiv(k, 16)), torch.float8_e4m3fn),
            (b, torch.float32),
        ]
    raise ValueError(f"ckptq: unknown target format {dst_format!r}")


_lib = torch.library.Library("ckptq", "DEF")  # noqa: referenced to keep the registration alive
_lib.define(REQUANTIZE_SCHEMA)
_lib.define(AMAX_SCHEMA)


@torch.library.register_fake("ckptq::requantize")
def _requantize_fake(
    src, src_format, src_block, dst_format, dst_block, fp8_dtype=None, pow2=False, eps=0.0,
    columnwise=False, amax=None, scale=None,
):
    batch, m, k = logical_shape(src, src_format)
    if dst_format in ("fp8_tensor", "fp8_block"):
        torch._check(
            fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2),
            lambda: f"ckptq: target {dst_format} needs fp8_dtype e4m3fn or e5m2, got {fp8_dtype}",
        )
    dev = src[0].device
    return [src[0].new_empty(shape, dtype=dt, device=dev) for shape, dt in
            output_specs(batch, m, k, dst_format, dst_block, fp8_dtype, columnwise)]


@torch.library.register_fake("ckptq::amax")
def _amax_fake(src, src_format, src_block):
    batch, _, _ = logical_shape(src, src_format)
    return src[0].new_empty(batch, dtype=torch.float32)

"""The GEMM scale swizzle that TransformerEngine and torchao both use for MXFP8 / NVFP4 block scales.

The (R, C) scale matrix is zero-padded to (cdiv(R, 128) * 128, cdiv(C, 4) * 4) and stored as
128x4 tiles in cuBLAS's order: tile (row tile, column tile), then ``i % 32``, ``(i % 128) // 32``,
``j % 4`` -- the view/permute ``S.view(Rp/128, 4, 32, Cp/4, 4).permute(0, 3, 2, 1, 4)``
(TransformerEngine's ``_with_gemm_swizzled_scales``, torchao's ``to_blocked`` / ``from_blocked``).
"""

from __future__ import annotations

import torch

from ..chunks import cdiv

__all__ = ["swizzle", "unswizzle", "swizzled_numel"]


def swizzled_numel(rows: int, cols: int) -> int:
    """Elements of the swizzled buffer of a (rows, cols) scale matrix (the padded size)."""
    return cdiv(rows, 128) * cdiv(cols, 4) * 512


def unswizzle(buf: torch.Tensor, rows: int, cols: int, *, transposed: bool = False) -> torch.Tensor:
    """Compact (rows, cols) scales from a buffer of :func:`swizzled_numel` elements (any shape,
    ``buf``'s dtype) holding the swizzle of the padded matrix; the inverse of :func:`swizzle`.
    ``transposed``: the (cols, rows) transpose of that matrix instead, laid out row-major (one
    gather, not an unswizzle and then a transposing copy).

    One-byte scales (E8M0, E4M3, uint8) are moved four at a time: the swizzle keeps ``j % 4``
    innermost, so each 4-byte group of the buffer is one row's 4 adjacent columns."""
    rb, cb = cdiv(rows, 128), cdiv(cols, 4)
    if buf.device.type == "meta":  # a record's skeleton: the result's shape and strides, without meta kernels
        return (
            buf.new_empty((cb * 4, rb * 128))[:cols, :rows]
            if transposed
            else buf.new_empty((rb * 128, cb * 4))[:rows, :cols]
        )
    tiles = buf.reshape(rb, cb, 32, 4, 4)  # (row tile, col tile, i % 32, (i % 128) // 32, j % 4)
    if transposed:
        return tiles.permute(1, 4, 0, 3, 2).reshape(cb * 4, rb * 128)[:cols, :rows]
    if buf.element_size() == 1 and tiles.is_contiguous() and tiles.data_ptr() % 4 == 0:
        words = tiles.view(torch.int32).squeeze(-1)  # (row tile, col tile, i % 32, (i % 128) // 32)
        return words.permute(0, 3, 2, 1).reshape(rb * 128, cb).view(buf.dtype)[:rows, :cols]
    return tiles.permute(0, 3, 2, 1, 4).reshape(rb * 128, cb * 4)[:rows, :cols]


def swizzle(compact: torch.Tensor) -> torch.Tensor:
    """The swizzled buffer (flat, ``compact``'s dtype, padding zeroed) of the (R, C) matrix ``compact``."""
    r, c = compact.shape
    rb, cb = cdiv(r, 128), cdiv(c, 4)
    padded = compact.new_zeros(rb * 128, cb * 4)
    padded[:r, :c] = compact
    return padded.view(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4).reshape(-1)

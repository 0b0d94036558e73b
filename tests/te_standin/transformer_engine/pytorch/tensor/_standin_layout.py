"""Layout helpers of the stand-in (not a TE module): padded scale shapes, the GEMM swizzle written
as TE's index map, and element decoders used by the stand-in's TE-order ``dequantize``.

Swizzle (docs/producers.md 1.3, ``common/cast/mxfp8/swizzle.cuh::gemm_swizzled_scale_idx``): for a
compact scale matrix S[i, j] padded to (rup(rows, 128), rup(cols, 4)), the byte of S[i, j] lives at
``tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)`` with
``tile = (i // 128) * num_tiles_x + j // 4`` and ``num_tiles_x = padded_cols / 4``.
"""

from __future__ import annotations

import torch


def rup(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def gemm_swizzled_scale_idx(i: torch.Tensor, j: torch.Tensor, num_tiles_x: int) -> torch.Tensor:
    """Linear index of compact scale ``S[i, j]`` in the swizzled buffer (int64 tensors in/out)."""
    tile = (i // 128) * num_tiles_x + j // 4
    offset = (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)
    return tile * 512 + offset


def swizzle_index_map(rows_padded: int, cols_padded: int) -> torch.Tensor:
    """(rows_padded, cols_padded) int64: the swizzled linear position of every padded element."""
    assert rows_padded % 128 == 0 and cols_padded % 4 == 0
    i = torch.arange(rows_padded, dtype=torch.int64)[:, None]
    j = torch.arange(cols_padded, dtype=torch.int64)[None, :]
    return gemm_swizzled_scale_idx(i, j, cols_padded // 4)


def swizzle(padded: torch.Tensor) -> torch.Tensor:
    """Flat swizzled copy of a padded compact matrix (same dtype and numel)."""
    idx = swizzle_index_map(*padded.shape).reshape(-1)
    out = torch.empty(padded.numel(), dtype=padded.dtype)
    out[idx] = padded.reshape(-1)
    return out


def read_scale(
    buf: torch.Tensor, i: torch.Tensor, j: torch.Tensor, *, swizzled: bool, padded_shape: tuple[int, int]
) -> torch.Tensor:
    """``S[i, j]`` read from a (compact-padded or swizzled) buffer whose padded matrix orientation
    is ``padded_shape`` (rows, cols)."""
    if swizzled:
        return buf.reshape(-1)[gemm_swizzled_scale_idx(i, j, padded_shape[1] // 4)]
    return buf.reshape(padded_shape)[i, j]


def random_bytes(shape, generator: torch.Generator, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Nonzero random bytes viewed as ``dtype`` (TE's padding is undefined: never zero here)."""
    shape = tuple(shape)
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        1, 256, shape[:-1] + (shape[-1] * nbytes,) if shape else (nbytes,), dtype=torch.uint8, generator=generator
    )
    return raw.view(dtype).reshape(shape)


# E2M1 values by 4-bit code (docs/producers.md 1.1, sign bit is bit 3).
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)

# 1 / (6 * 448) rounded once to fp32, as ``constexpr float factor_inv = 1.0f / (6.0f * E4M3_MAX)``
# in ``common/cast/nvfp4/dequantize_nvfp4.cuh`` (E4M3_MAX = 448; 6 * 448 is exact in fp32).
NVFP4_FACTOR_INV = torch.tensor(1.0 / (6.0 * 448.0), dtype=torch.float32)


def e8m0_scale(byte: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32 (``ptx::exp2f``): e=0 is 2^-127 (subnormal), e=255 is NaN."""
    e = byte.to(torch.int32)
    normal = (e.clamp(1, 254) << 23).view(torch.float32)
    out = torch.where(e == 0, torch.tensor(2.0**-127, dtype=torch.float32), normal)
    return torch.where(e == 255, torch.tensor(float("nan"), dtype=torch.float32), out)

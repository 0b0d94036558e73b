"""Stand-in for ``transformer_engine/pytorch/tensor/mxfp8_tensor.py`` (docs/producers.md 1.3, 2.3, 2.7).

Buffers (logical (M, K), M % 32 == K % 32 == 0 in TE):
``_rowwise_data`` uint8 (M, K); ``_rowwise_scale_inv`` uint8 E8M0 (rup(M,128), rup(K/32,4)) indexed
[row, kblock]; ``_columnwise_data`` uint8 (M, K) (not transposed); ``_columnwise_scale_inv`` uint8
(rup(M/32,4), rup(K,128)) indexed [mblock, col]. With ``_with_gemm_swizzled_scales`` the rowwise
buffer holds the swizzle of its padded matrix and the columnwise buffer the swizzle of the
*transposed* padded matrix (rup(K,128), rup(M/32,4)); buffer shapes stay the same.
"""

from __future__ import annotations

import torch

from ..constants import DType
from ..quantized_tensor import QuantizedTensor, Quantizer
from ._standin_layout import cdiv, e8m0_scale, read_scale, rup

_TORCH_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}


class MXFP8Quantizer(Quantizer):
    def __init__(
        self, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True, with_2d_quantization: bool = False
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.cast(fp8_dtype)
        self.with_2d_quantization = with_2d_quantization


class MXFP8Tensor(QuantizedTensor):
    _BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")
    _LAYOUT_FLAGS = ("_fp8_dtype", "_with_gemm_swizzled_scales")

    def __new__(
        cls,
        *,
        shape,
        dtype: torch.dtype,
        rowwise_data: torch.Tensor | None,
        rowwise_scale_inv: torch.Tensor | None,
        fp8_dtype,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
        quantizer: Quantizer | None = None,
        with_gemm_swizzled_scales: bool = False,
        requires_grad: bool = False,
        device=None,
    ):
        if device is None:
            device = (rowwise_data if rowwise_data is not None else columnwise_data).device
        self = cls._wrap(shape, dtype, device, requires_grad)
        self._rowwise_data = rowwise_data
        self._columnwise_data = columnwise_data
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_scale_inv = columnwise_scale_inv
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._fp8_dtype = DType.cast(fp8_dtype)
        self._with_gemm_swizzled_scales = with_gemm_swizzled_scales
        return self

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (
            _make_mxfp8_tensor_in_reduce_ex,
            (
                self._rowwise_data,
                self._rowwise_scale_inv,
                self._columnwise_data,
                self._columnwise_scale_inv,
                self._fp8_dtype,
                self.dtype,
                self.shape,
                self._quantizer,
                self._with_gemm_swizzled_scales,
            ),
        )

    @classmethod
    def _make_in_reduce_ex(
        cls,
        rowwise_data,
        rowwise_scale_inv,
        columnwise_data,
        columnwise_scale_inv,
        fp8_dtype,
        dtype,
        shape,
        quantizer=None,
        with_gemm_swizzled_scales=False,
    ):
        return _make_mxfp8_tensor_in_reduce_ex(
            rowwise_data,
            rowwise_scale_inv,
            columnwise_data,
            columnwise_scale_inv,
            fp8_dtype,
            dtype,
            shape,
            quantizer,
            with_gemm_swizzled_scales,
        )

    def dequantize(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rowwise ``code * 2^(e - 127)`` with e read by index from the (padded/swizzled) scale
        buffer (``dequantize_mxfp8.cuh`` reads either layout)."""
        m, k = self.shape
        i = torch.arange(m)[:, None].expand(m, k)
        j = torch.arange(k)[None, :].expand(m, k)
        e = read_scale(
            self._rowwise_scale_inv,
            i,
            j // 32,
            swizzled=self._with_gemm_swizzled_scales,
            padded_shape=(rup(m, 128), rup(cdiv(k, 32), 4)),
        )
        codes = self._rowwise_data.view(_TORCH_FP8[int(self._fp8_dtype)]).float()
        return (codes * e8m0_scale(e)).to(dtype)


def _make_mxfp8_tensor_in_reduce_ex(
    rowwise_data,
    rowwise_scale_inv,
    columnwise_data,
    columnwise_scale_inv,
    fp8_dtype,
    dtype,
    shape,
    quantizer=None,
    with_gemm_swizzled_scales=False,
):
    return MXFP8Tensor(
        rowwise_data=rowwise_data,
        rowwise_scale_inv=rowwise_scale_inv,
        fp8_dtype=fp8_dtype,
        columnwise_data=columnwise_data,
        columnwise_scale_inv=columnwise_scale_inv,
        dtype=dtype,
        shape=shape,
        quantizer=quantizer,
        with_gemm_swizzled_scales=with_gemm_swizzled_scales,
    )

"""Stand-in for ``transformer_engine/pytorch/tensor/float8_blockwise_tensor.py`` (docs/producers.md 2.5, 2.7).

Buffers (logical (M, K), any M, K): ``_rowwise_data`` uint8 (M, K); ``_columnwise_data`` uint8 (K, M);
fp32 scales, never swizzled (C++ ``Float8BlockQuantizer::get_scale_shape``):
* 2-D (128x128, ``_is_2D_scaled``): rowwise (cdiv(M,128), rup(cdiv(K,128),4)) indexed [mb, kb];
  columnwise (cdiv(K,128), rup(cdiv(M,128),4)) indexed [kb, mb] -- the exact transpose.
* 1-D (1x128): rowwise (cdiv(K,128), rup(M,4)) indexed [kb, row] ("GEMM_READY", transposed);
  columnwise (the transpose quantized with 1x128 blocks along M) (cdiv(M,128), rup(K,4)) indexed [mb, k].
"""

from __future__ import annotations

from typing import Any

import torch

from ..constants import DType
from ..quantized_tensor import QuantizedTensor, Quantizer

_TORCH_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}


class Float8BlockQuantizer(Quantizer):
    def __init__(
        self,
        fp8_dtype,
        *,
        rowwise: bool,
        columnwise: bool,
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = True,
        block_scaling_dim: int = 2,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.cast(fp8_dtype)
        self.block_len = 128
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_epsilon = amax_epsilon
        self.block_scaling_dim = block_scaling_dim


class Float8BlockwiseQTensor(QuantizedTensor):
    _BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")
    _LAYOUT_FLAGS = ("_fp8_dtype", "_is_2D_scaled")

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
        is_2D_scaled: bool = True,
        requires_grad: bool = False,
        device=None,
    ):
        if device is None:
            device = (rowwise_data if rowwise_data is not None else columnwise_data).device
        self = cls._wrap(shape, dtype, device, requires_grad)
        self._rowwise_data = rowwise_data
        self._columnwise_data = columnwise_data
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._fp8_dtype = DType.cast(fp8_dtype)
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_scale_inv = columnwise_scale_inv
        self._is_2D_scaled = is_2D_scaled
        return self

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (
            _make_float8_blockwise_tensor_in_reduce_ex,
            (
                self.shape,
                self._rowwise_data,
                self._rowwise_scale_inv,
                self._columnwise_data,
                self._columnwise_scale_inv,
                self._fp8_dtype,
                self.dtype,
                self._quantizer,
                self._is_2D_scaled,
                None,
            ),  # trailing data_format slot (removed field, always None)
        )

    @classmethod
    def _make_in_reduce_ex(
        cls,
        shape,
        rowwise_data,
        rowwise_scale_inv,
        columnwise_data,
        columnwise_scale_inv,
        fp8_dtype,
        dtype,
        quantizer,
        is_2D_scaled,
        data_format: Any = None,
    ):
        return _make_float8_blockwise_tensor_in_reduce_ex(
            shape,
            rowwise_data,
            rowwise_scale_inv,
            columnwise_data,
            columnwise_scale_inv,
            fp8_dtype,
            dtype,
            quantizer,
            is_2D_scaled,
            data_format,
        )

    def dequantize(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rowwise ``q * scale_inv[block]`` (``_FromFloat8BlockwiseFunc``), scales by index; from the
        columnwise buffers when no rowwise data is held, as TE does."""
        if self._rowwise_data is None:
            return self.dequantize_columnwise(dtype=dtype)
        m, k = self.shape
        i = torch.arange(m)[:, None].expand(m, k)
        j = torch.arange(k)[None, :].expand(m, k)
        if self._is_2D_scaled:
            s = self._rowwise_scale_inv[i // 128, j // 128]
        else:
            s = self._rowwise_scale_inv[j // 128, i]
        codes = self._rowwise_data.view(_TORCH_FP8[int(self._fp8_dtype)]).float()
        return (codes * s).to(dtype)

    def dequantize_columnwise(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The columnwise copy's values, (M, K): TE's columnwise dequantize (``_FromFloat8BlockwiseFunc``
        / ``_dequantize_vectorwise`` on ``_columnwise_data`` (K, M), output transposed back), scales
        by index: 2-D ``[k // 128, m // 128]``, 1-D ``[m // 128, k]``."""
        m, k = self.shape
        r = torch.arange(k)[:, None].expand(k, m)  # row of the (K, M) columnwise data
        c = torch.arange(m)[None, :].expand(k, m)
        if self._is_2D_scaled:
            s = self._columnwise_scale_inv[r // 128, c // 128]
        else:
            s = self._columnwise_scale_inv[c // 128, r]
        codes = self._columnwise_data.view(_TORCH_FP8[int(self._fp8_dtype)]).float()
        return (codes * s).t().to(dtype)


def _make_float8_blockwise_tensor_in_reduce_ex(
    shape,
    rowwise_data,
    rowwise_scale_inv,
    columnwise_data,
    columnwise_scale_inv,
    fp8_dtype,
    dtype,
    quantizer,
    is_2D_scaled,
    data_format: Any = None,
):
    del data_format  # ignored, as in TE
    return Float8BlockwiseQTensor(
        shape=shape,
        rowwise_data=rowwise_data,
        rowwise_scale_inv=rowwise_scale_inv,
        fp8_dtype=fp8_dtype,
        columnwise_data=columnwise_data,
        columnwise_scale_inv=columnwise_scale_inv,
        dtype=dtype,
        quantizer=quantizer,
        is_2D_scaled=is_2D_scaled,
    )

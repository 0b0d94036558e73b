"""Stand-in for ``transformer_engine/pytorch/tensor/nvfp4_tensor.py`` (docs/producers.md 2.4, 2.7).

Buffers (logical (M, K), M % 16 == K % 16 == 0 in TE):
``_rowwise_data`` uint8 (M, K/2), element 2i in the low nibble; ``_rowwise_scale_inv`` uint8 E4M3
(rup(M,128), rup(K/16,4)) indexed [row, kblock] (2-D mode: each 16x16 tile's scale repeated on its
16 rows); ``_columnwise_data`` uint8 (K, M/2) (transposed, packed along M);
``_columnwise_scale_inv`` uint8 (rup(K,128), rup(M/16,4)); ``_amax_rowwise``/``_amax_columnwise``
fp32 (1,). Swizzled scales: both buffers hold the swizzle of their padded matrix (producers.md 1.3).
"""

from __future__ import annotations

import torch

from ..constants import DType
from ..quantized_tensor import QuantizedTensor, Quantizer
from ._standin_layout import E2M1, NVFP4_FACTOR_INV, cdiv, read_scale, rup

# Sign pattern of the stand-in's 16-point RHT (bit b set -> column b negated); a stand-in value.
_STANDIN_SIGN_MASK = 0b1010011011001001


def _hadamard16() -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _rht_matrix(sign_mask: int) -> torch.Tensor:
    signs = torch.tensor([-1.0 if (sign_mask >> b) & 1 else 1.0 for b in range(16)])
    return (torch.diag(signs) @ _hadamard16() / 4.0).to(torch.bfloat16)


class NVFP4Quantizer(Quantizer):
    def __init__(
        self,
        fp4_dtype=DType.kFloat4E2M1,
        rowwise: bool = True,
        columnwise: bool = True,
        with_amax_reduction: bool = False,
        amax_reduction_group=None,
        with_rht: bool = False,
        with_post_rht_amax: bool = False,
        with_2d_quantization: bool = False,
        stochastic_rounding: bool = False,
        row_scaled_nvfp4: bool = False,
        nvfp4_use_4over6: bool = False,
        nvfp4_e4m3_max: int = 448,
        nvfp4_4over6_err_mode: str = "MAE",
        with_random_sign_mask: bool = True,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.cast(fp4_dtype)
        self.with_rht = with_rht
        self.with_post_rht_amax = with_post_rht_amax
        self.with_amax_reduction = with_amax_reduction
        self.amax_reduction_group = amax_reduction_group
        self.with_2d_quantization = with_2d_quantization
        self.stochastic_rounding = stochastic_rounding
        self.row_scaled_nvfp4 = row_scaled_nvfp4
        self.nvfp4_use_4over6 = nvfp4_use_4over6
        self.nvfp4_e4m3_max = nvfp4_e4m3_max if nvfp4_use_4over6 else 448
        self.nvfp4_4over6_err_mode = nvfp4_4over6_err_mode.upper()
        self.rht_matrix_random_sign_mask_t = _STANDIN_SIGN_MASK if with_random_sign_mask else 0
        self.rht_matrix = _rht_matrix(self.rht_matrix_random_sign_mask_t)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["amax_reduction_group"] = None
        return state


class NVFP4Tensor(QuantizedTensor):
    _BUFFERS = (
        "_rowwise_data",
        "_rowwise_scale_inv",
        "_columnwise_data",
        "_columnwise_scale_inv",
        "_amax_rowwise",
        "_amax_columnwise",
    )
    _LAYOUT_FLAGS = ("_with_gemm_swizzled_scales", "_row_scaled_nvfp4", "_nvfp4_use_4over6")

    def __new__(
        cls,
        *,
        shape,
        dtype: torch.dtype,
        fp4_dtype,
        rowwise_data: torch.Tensor | None,
        rowwise_scale_inv: torch.Tensor | None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
        amax_rowwise: torch.Tensor | None = None,
        amax_columnwise: torch.Tensor | None = None,
        quantizer: Quantizer | None = None,
        requires_grad: bool = False,
        with_gemm_swizzled_scales: bool = False,
        device=None,
        row_scaled_nvfp4: bool = False,
        nvfp4_use_4over6: bool = False,
        nvfp4_e4m3_max: int = 448,
    ):
        if device is None:
            device = (rowwise_data if rowwise_data is not None else columnwise_data).device
        self = cls._wrap(shape, dtype, device, requires_grad)
        self._rowwise_data = rowwise_data
        self._columnwise_data = columnwise_data
        self._fp4_dtype = DType.cast(fp4_dtype)
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_scale_inv = columnwise_scale_inv
        self._amax_rowwise = amax_rowwise
        self._amax_columnwise = amax_columnwise
        self._with_gemm_swizzled_scales = with_gemm_swizzled_scales
        self._row_scaled_nvfp4 = row_scaled_nvfp4
        self._nvfp4_use_4over6 = nvfp4_use_4over6
        self._nvfp4_e4m3_max = nvfp4_e4m3_max if nvfp4_use_4over6 else 448
        return self

    def __reduce_ex__(self, protocol: int) -> tuple:
        payload = (
            self.shape,
            self._rowwise_data,
            self._rowwise_scale_inv,
            self._columnwise_data,
            self._columnwise_scale_inv,
            self._amax_rowwise,
            self._amax_columnwise,
            self._fp4_dtype,
            self.dtype,
            self._quantizer,
            self._with_gemm_swizzled_scales,
        )
        if getattr(self, "_standin_flavor", "main") != "2974":  # row-scaled / 4over6 came later
            payload += (self._row_scaled_nvfp4, self._nvfp4_use_4over6, self._nvfp4_e4m3_max)
        return (_make_nvfp4_tensor_in_reduce_ex, payload)

    @classmethod
    def _make_in_reduce_ex(
        cls,
        shape,
        rowwise_data,
        rowwise_scale_inv,
        columnwise_data,
        columnwise_scale_inv,
        amax_rowwise,
        amax_columnwise,
        fp4_dtype,
        dtype,
        quantizer,
        with_gemm_swizzled_scales=False,
    ):
        return _make_nvfp4_tensor_in_reduce_ex(
            shape,
            rowwise_data,
            rowwise_scale_inv,
            columnwise_data,
            columnwise_scale_inv,
            amax_rowwise,
            amax_columnwise,
            fp4_dtype,
            dtype,
            quantizer,
            with_gemm_swizzled_scales,
        )

    def dequantize(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rowwise only, kernel order of ``dequantize_nvfp4.cuh``:
        ``final_scale = float(s) * amax * factor_inv`` (left to right), ``x = e2m1 * final_scale``,
        with s read by index from the (padded/swizzled) buffer."""
        m, k = self.shape
        i = torch.arange(m)[:, None].expand(m, k)
        j = torch.arange(k)[None, :].expand(m, k)
        byte = self._rowwise_data[i, j // 2].to(torch.int64)
        code = (byte >> (4 * (j % 2))) & 0xF
        s = read_scale(
            self._rowwise_scale_inv,
            i,
            j // 16,
            swizzled=self._with_gemm_swizzled_scales,
            padded_shape=(rup(m, 128), rup(cdiv(k, 16), 4)),
        )
        amax = self._amax_rowwise.float().reshape(())
        final_scale = (s.view(torch.float8_e4m3fn).float() * amax) * NVFP4_FACTOR_INV
        return (E2M1[code] * final_scale).to(dtype)

    def dequantize_columnwise(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The columnwise copy's values, (M, K). TE has no columnwise NVFP4 dequantize
        (``_FromNVFP4Func`` raises NotImplementedError); its quantizer writes the copy as the rowwise
        encoding of x^T (a (K, M) tensor, ``_amax_columnwise``), so this is the dequantize kernel's
        order on that tensor, read by index from ``_columnwise_*``, transposed back."""
        m, k = self.shape
        r = torch.arange(k)[:, None].expand(k, m)  # row of x^T = column of x
        c = torch.arange(m)[None, :].expand(k, m)
        byte = self._columnwise_data[r, c // 2].to(torch.int64)
        code = (byte >> (4 * (c % 2))) & 0xF
        s = read_scale(
            self._columnwise_scale_inv,
            r,
            c // 16,
            swizzled=self._with_gemm_swizzled_scales,
            padded_shape=(rup(k, 128), rup(cdiv(m, 16), 4)),
        )
        amax = self._amax_columnwise.float().reshape(())
        final_scale = (s.view(torch.float8_e4m3fn).float() * amax) * NVFP4_FACTOR_INV
        return (E2M1[code] * final_scale).t().to(dtype)


def _make_nvfp4_tensor_in_reduce_ex(
    shape,
    rowwise_data,
    rowwise_scale_inv,
    columnwise_data,
    columnwise_scale_inv,
    amax_rowwise,
    amax_columnwise,
    fp4_dtype,
    dtype,
    quantizer,
    with_gemm_swizzled_scales,
    row_scaled_nvfp4=False,
    nvfp4_use_4over6=False,
    nvfp4_e4m3_max=448,
):
    return NVFP4Tensor(
        shape=shape,
        dtype=dtype,
        fp4_dtype=fp4_dtype,
        rowwise_data=rowwise_data,
        rowwise_scale_inv=rowwise_scale_inv,
        columnwise_data=columnwise_data,
        columnwise_scale_inv=columnwise_scale_inv,
        amax_rowwise=amax_rowwise,
        amax_columnwise=amax_columnwise,
        quantizer=quantizer,
        requires_grad=False,
        with_gemm_swizzled_scales=with_gemm_swizzled_scales,
        row_scaled_nvfp4=row_scaled_nvfp4,
        nvfp4_use_4over6=nvfp4_use_4over6,
        nvfp4_e4m3_max=nvfp4_e4m3_max,
    )

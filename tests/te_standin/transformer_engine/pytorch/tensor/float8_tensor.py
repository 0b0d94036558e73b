"""Stand-in for ``transformer_engine/pytorch/tensor/float8_tensor.py`` (docs/producers.md 2.2, 2.7).

Buffers: ``_data`` uint8 (M, K) rowwise FP8 codes (None when only columnwise is held),
``_transpose`` uint8 (K, M) (Hopper's columnwise copy, ``_transpose_invalid``), ``_scale_inv``
fp32 (1,). ``_fp8_dtype`` is a ``DType``. The pickle drops the quantizer and the transpose cache.
"""

from __future__ import annotations

import torch

from ..constants import DType
from ..quantized_tensor import QuantizedTensor, Quantizer

_TORCH_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}


class Float8Quantizer(Quantizer):
    """Delayed scaling: ``scale``/``amax`` tensors are views into the module's fp8_meta in TE."""

    def __init__(
        self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.scale = scale
        self.amax = amax
        self.dtype = DType.cast(fp8_dtype)


class Float8CurrentScalingQuantizer(Quantizer):
    def __init__(
        self,
        fp8_dtype,
        device=None,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        use_existing_amax: bool = False,
        with_amax_reduction: bool = False,
        amax_reduction_group=None,
        force_pow_2_scales: bool = False,
        amax_epsilon: float = 0.0,
        scale=None,
        amax=None,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        del device, use_existing_amax, scale, amax  # deprecated no-ops in TE
        self.dtype = DType.cast(fp8_dtype)
        self.with_amax_reduction = with_amax_reduction
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_epsilon = amax_epsilon

    def __getstate__(self):
        state = self.__dict__.copy()
        state["amax_reduction_group"] = None
        return state


class Float8Tensor(QuantizedTensor):
    _BUFFERS = ("_data", "_transpose", "_scale_inv")
    _LAYOUT_FLAGS = ("_fp8_dtype",)

    def __new__(
        cls,
        *,
        shape,
        dtype: torch.dtype,
        data: torch.Tensor | None,
        fp8_scale_inv: torch.Tensor,
        fp8_dtype,
        data_transpose: torch.Tensor | None = None,
        quantizer: Quantizer | None = None,
        requires_grad: bool = False,
        device=None,
    ):
        if device is None:
            device = (data if data is not None else data_transpose).device
        self = cls._wrap(shape, dtype, device, requires_grad)
        self._data = data
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._fp8_dtype = DType.cast(fp8_dtype)
        self._scale_inv = fp8_scale_inv
        self._transpose = data_transpose
        self._transpose_invalid = data_transpose is None
        return self

    def __reduce_ex__(self, protocol: int) -> tuple:
        transpose = None
        if self._data is None and self._transpose is not None and not self._transpose_invalid:
            transpose = self._transpose
        payload = (self._data, self._fp8_dtype, self._scale_inv, self.dtype, self.shape, transpose)
        if getattr(self, "_standin_flavor", "main") == "2974":
            payload = payload[:5]  # #2974-era payload: no data_transpose slot
        return (_make_float8_tensor_in_reduce_ex, payload)

    @classmethod
    def _make_in_reduce_ex(cls, data, fp8_dtype, fp8_scale_inv, dtype, shape):
        """Legacy reconstructor (pickles reference it as ``getattr(Float8Tensor, ...)``)."""
        return _make_float8_tensor_in_reduce_ex(data, fp8_dtype, fp8_scale_inv, dtype, shape)

    def dequantize(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """TE CPU fallback order: ``_data.view(fp8).float() * _scale_inv`` (docs/producers.md 2.2)."""
        fp8 = _TORCH_FP8[int(self._fp8_dtype)]
        codes = self._data if self._data is not None else self._transpose.t()
        return (codes.view(fp8).float() * self._scale_inv.float()).to(dtype)


def _make_float8_tensor_in_reduce_ex(data, fp8_dtype, fp8_scale_inv, dtype, shape, data_transpose=None):
    return Float8Tensor(
        data=data,
        fp8_dtype=fp8_dtype,
        fp8_scale_inv=fp8_scale_inv,
        dtype=dtype,
        shape=shape,
        data_transpose=data_transpose,
        device=(data if data is not None else data_transpose).device,
    )

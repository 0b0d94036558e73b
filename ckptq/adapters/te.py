"""TransformerEngine (TE) adapter: TE's quantized tensors <-> ckptq canonical tensors, without TE.

TE is never imported. Objects are recognized by their class's module and qualified name
(:data:`TE_CLASSES`) or, for records rebuilt from TE pickles, as :class:`TEPayload`. Every function
works on anything that carries TE's attribute names (``_data``, ``_rowwise_scale_inv``, ...), so a
live TE tensor, a DTensor holding one, and a payload from a TE DCP record are handled alike.

Layout facts: docs/producers.md, "2. TransformerEngine" (TE ``main`` at d0067d0; TE paths below are
relative to ``transformer_engine/pytorch/`` in its repo). Logical shape (M, K): TE flattens leading
dims, ckptq needs rank 2. Scale padding contents are undefined in TE (docs/producers.md, 2.1): they
are stripped on read and zeroed on write.

=====================  ==========================================================  ==========
TE class               buffers (uint8 unless noted) -> ckptq components             format
=====================  ==========================================================  ==========
Float8Tensor           ``_data`` (M, K) -> data; ``_transpose`` (K, M) (Hopper       fp8_tensor
                       columnwise copy, derived); ``_scale_inv`` fp32 (1,) ->
                       scale_inv (). producers.md 2.2, ``tensor/float8_tensor.py``.
MXFP8Tensor            ``_rowwise_data`` (M, K) -> data; ``_rowwise_scale_inv``     mxfp8
                       (rup(M,128), rup(K/32,4)) -> scale (M, K/32);
                       ``_columnwise_data`` (M, K) -> columnwise_data;
                       ``_columnwise_scale_inv`` (rup(M/32,4), rup(K,128)) ->
                       columnwise_scale (M/32, K). producers.md 2.3.
NVFP4Tensor            ``_rowwise_data`` (M, K/2) -> data; ``_rowwise_scale_inv``   nvfp4
                       E4M3 (rup(M,128), rup(K/16,4)) -> scale (M, K/16), or every
                       16th row (M/16, K/16) for 16x16 tiles; ``_amax_rowwise`` fp32
                       (1,) -> amax (). Columnwise ``_columnwise_data`` (K, M/2) ->
                       columnwise_data (M/2, K) and ``_columnwise_scale_inv``
                       (rup(K,128), rup(M/16,4)) -> columnwise_scale (M/16, K), both
                       transposed (1x16 only; 16x16: derived on insert).
                       producers.md 2.4, ``tensor/storage/nvfp4_tensor_storage.py``.
Float8BlockwiseQTensor ``_rowwise_data`` (M, K) -> data; ``_rowwise_scale_inv`` fp32  fp8_block
                       2-D: (cdiv(M,128), rup(cdiv(K,128),4)) -> (M/128, K/128);
                       1-D: (cdiv(K,128), rup(M,4)) transposed -> (M, K/128).
                       1-D columnwise: ``_columnwise_data`` (K, M) transposed ->
                       columnwise_data; ``_columnwise_scale_inv`` (cdiv(M,128),
                       rup(K,4)) -> columnwise_scale_inv (M/128, K). 2-D: derived on
                       insert. producers.md 2.5, C++ ``Float8BlockQuantizer::get_scale_shape``.
=====================  ==========================================================  ==========

GEMM swizzle (MXFP8/NVFP4 ``_with_gemm_swizzled_scales``, docs/producers.md 1.3): 128x4 tiles in cuBLAS order,
the view/permute ``S.view(Mp/128, 4, 32, Kp/4, 4).permute(0, 3, 2, 1, 4)`` and its inverse, shared
with torchao in :mod:`ckptq.adapters._swizzle`; MXFP8 columnwise buffers hold the swizzle of the
*transposed* (K, M/32) scale matrix.

Pickles (docs/producers.md 2.7): :data:`PICKLE_GLOBALS` maps every global a TE DCP record references to
the stand-ins below (reconstructors -> :class:`TEPayload`, quantizer classes -> :class:`QuantizerState`,
both ``DType`` enums -> :func:`te_dtype`), for ckptq's restricted unpickler.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..chunks import cdiv
from ..errors import CheckpointFormatError, ShardingError, UnsafeCheckpointError, UnsupportedFormatError
from ..formats import Float8BlockTensor, Float8Tensor, MXFP8Tensor, NVFP4Tensor, QuantizedTensor, quantize
from ..metrics import sqnr_db
from ._swizzle import swizzle, unswizzle
from .base import check_fits, refuse

__all__ = [
    "TE_CLASSES",
    "PICKLE_GLOBALS",
    "TEPayload",
    "TEDType",
    "QuantizerState",
    "te_dtype",
    "te_class_of",
    "make_float8",
    "make_mxfp8",
    "make_nvfp4",
    "make_float8_blockwise",
    "to_canonical",
    "empty_canonical",
    "insert",
]

PRODUCER = "transformer_engine"
_TENSOR_MOD = "transformer_engine.pytorch.tensor."

#: ``(module, qualname)`` of TE's four quantized wrapper classes -> the class name.
TE_CLASSES: dict[tuple[str, str], str] = {
    (_TENSOR_MOD + "float8_tensor", "Float8Tensor"): "Float8Tensor",
    (_TENSOR_MOD + "mxfp8_tensor", "MXFP8Tensor"): "MXFP8Tensor",
    (_TENSOR_MOD + "nvfp4_tensor", "NVFP4Tensor"): "NVFP4Tensor",
    (_TENSOR_MOD + "float8_blockwise_tensor", "Float8BlockwiseQTensor"): "Float8BlockwiseQTensor",
}


# ============================================================================ TE enums and records
class TEDType(enum.IntEnum):
    """TE's ``DType`` values (``transformer_engine/common/include/transformer_engine/transformer_engine.h``)."""

    kByte = 0
    kInt16 = 1
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat8E8M0 = 9
    kFloat4E2M1 = 10


def te_dtype(value: Any) -> TEDType:
    """The pickle stand-in for both ``transformer_engine.pytorch.constants.DType(v)`` (IntEnum) and
    ``transformer_engine_torch.DType(v)`` (pybind11, pickled as ``(tex.DType, (int,))``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointFormatError(f"TransformerEngine DType payload {value!r} is not an int")
    try:
        return TEDType(int(value))
    except ValueError:
        raise CheckpointFormatError(f"unknown TransformerEngine DType value {value}") from None


_DTYPE_NAMES = {7: "E4M3", 8: "E5M2", 10: "E2M1"}
_TORCH_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}
_FP8_CODE = {torch.float8_e4m3fn: 7, torch.float8_e5m2: 8}


def _code(value: Any) -> int | None:
    """int of a TE DType (IntEnum, pybind enum, TEDType); None when absent or not int-like."""
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


class TEPayload:
    """A TE quantized tensor rebuilt from its pickle payload: plain attributes named as on the live
    tensor (``_data``, ``_rowwise_data``, ..., ``_quantizer``), plus ``dtype`` (the fake
    high-precision torch dtype), ``shape`` (``torch.Size``) and ``te_class`` (e.g. ``"MXFP8Tensor"``)."""

    def __init__(self, te_class: str, shape: Any, dtype: Any, **fields: Any):
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(f"TransformerEngine {te_class} payload: dtype {dtype!r} is not a torch dtype")
        try:
            shape = torch.Size([int(s) for s in shape])
        except (TypeError, ValueError):
            raise CheckpointFormatError(f"TransformerEngine {te_class} payload: bad shape {shape!r}") from None
        for name, v in fields.items():
            if name.endswith(("_data", "_scale_inv", "_transpose")) or name.startswith("_amax"):
                if v is not None and not isinstance(v, torch.Tensor):
                    raise CheckpointFormatError(
                        f"TransformerEngine {te_class} payload: {name} is {type(v).__name__}, expected a tensor"
                    )
        self.te_class = te_class
        self.shape = shape
        self.dtype = dtype
        self.__dict__.update(fields)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        held = [k for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)]
        return f"TEPayload({self.te_class}, shape={tuple(self.shape)}, dtype={self.dtype}, buffers={held})"


class QuantizerState:
    """A TE quantizer rebuilt from its pickle (``NEWOBJ`` then ``BUILD`` with its ``__dict__``):
    the state's keys become attributes, in order; ``type_name`` is TE's class name."""

    type_name: ClassVar[str] = "Quantizer"

    def __new__(cls, *args: Any, **kwargs: Any):
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointFormatError(f"TransformerEngine {self.type_name} state is not a dict of str keys")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not isinstance(v, torch.Tensor))
        return f"{self.type_name}State({fields})"


class Float8QuantizerState(QuantizerState):
    type_name = "Float8Quantizer"


class Float8CurrentScalingQuantizerState(QuantizerState):
    type_name = "Float8CurrentScalingQuantizer"


class MXFP8QuantizerState(QuantizerState):
    type_name = "MXFP8Quantizer"


class NVFP4QuantizerState(QuantizerState):
    type_name = "NVFP4Quantizer"


class Float8BlockQuantizerState(QuantizerState):
    type_name = "Float8BlockQuantizer"


# ------------------------------------------------ reconstructors (payloads: docs/producers.md 2.7)
def make_float8(data, fp8_dtype, fp8_scale_inv, dtype, shape, data_transpose=None) -> TEPayload:
    """``float8_tensor._make_float8_tensor_in_reduce_ex``: (data, fp8_dtype, scale_inv, dtype, shape
    [, data_transpose]); the transpose is pickled only when ``_data`` is None; no quantizer."""
    return TEPayload(
        "Float8Tensor",
        shape,
        dtype,
        _data=data,
        _fp8_dtype=fp8_dtype,
        _scale_inv=fp8_scale_inv,
        _transpose=data_transpose,
        _transpose_invalid=data_transpose is None,
        _quantizer=None,
    )


def make_mxfp8(
    rowwise_data,
    rowwise_scale_inv,
    columnwise_data,
    columnwise_scale_inv,
    fp8_dtype,
    dtype,
    shape,
    quantizer=None,
    with_gemm_swizzled_scales=False,
) -> TEPayload:
    """``mxfp8_tensor._make_mxfp8_tensor_in_reduce_ex`` (9 positional fields)."""
    return TEPayload(
        "MXFP8Tensor",
        shape,
        dtype,
        _rowwise_data=rowwise_data,
        _columnwise_data=columnwise_data,
        _rowwise_scale_inv=rowwise_scale_inv,
        _columnwise_scale_inv=columnwise_scale_inv,
        _quantizer=quantizer,
        _fp8_dtype=fp8_dtype,
        _with_gemm_swizzled_scales=bool(with_gemm_swizzled_scales),
    )


def make_nvfp4(
    shape,
    rowwise_data,
    rowwise_scale_inv,
    columnwise_data,
    columnwise_scale_inv,
    amax_rowwise,
    amax_columnwise,
    fp4_dtype,
    dtype,
    quantizer=None,
    with_gemm_swizzled_scales=False,
    row_scaled_nvfp4=False,
    nvfp4_use_4over6=False,
    nvfp4_e4m3_max=448,
) -> TEPayload:
    """``nvfp4_tensor._make_nvfp4_tensor_in_reduce_ex`` (14 fields on main, 11 in #2974-era pickles)."""
    return TEPayload(
        "NVFP4Tensor",
        shape,
        dtype,
        _rowwise_data=rowwise_data,
        _columnwise_data=columnwise_data,
        _fp4_dtype=fp4_dtype,
        _quantizer=quantizer,
        _rowwise_scale_inv=rowwise_scale_inv,
        _columnwise_scale_inv=columnwise_scale_inv,
        _amax_rowwise=amax_rowwise,
        _amax_columnwise=amax_columnwise,
        _with_gemm_swizzled_scales=bool(with_gemm_swizzled_scales),
        _row_scaled_nvfp4=bool(row_scaled_nvfp4),
        _nvfp4_use_4over6=bool(nvfp4_use_4over6),
        _nvfp4_e4m3_max=nvfp4_e4m3_max,
    )


def make_float8_blockwise(
    shape,
    rowwise_data,
    rowwise_scale_inv,
    columnwise_data,
    columnwise_scale_inv,
    fp8_dtype,
    dtype,
    quantizer=None,
    is_2D_scaled=True,
    data_format=None,
) -> TEPayload:
    """``float8_blockwise_tensor._make_float8_blockwise_tensor_in_reduce_ex``; the trailing
    ``data_format`` (removed field, always None since #2486) is ignored."""
    del data_format
    return TEPayload(
        "Float8BlockwiseQTensor",
        shape,
        dtype,
        _rowwise_data=rowwise_data,
        _columnwise_data=columnwise_data,
        _quantizer=quantizer,
        _fp8_dtype=fp8_dtype,
        _rowwise_scale_inv=rowwise_scale_inv,
        _columnwise_scale_inv=columnwise_scale_inv,
        _is_2D_scaled=bool(is_2D_scaled),
    )


class _LegacyClass:
    """Stand-in for a TE tensor class in legacy pickles, which reference the classmethod
    ``<Class>._make_in_reduce_ex`` as ``getattr(<Class>, "_make_in_reduce_ex")``."""

    _make_in_reduce_ex: ClassVar[Callable[..., TEPayload]]


class _LegacyFloat8Tensor(_LegacyClass):
    _make_in_reduce_ex = staticmethod(make_float8)


class _LegacyMXFP8Tensor(_LegacyClass):
    _make_in_reduce_ex = staticmethod(make_mxfp8)


class _LegacyNVFP4Tensor(_LegacyClass):
    _make_in_reduce_ex = staticmethod(make_nvfp4)


class _LegacyFloat8BlockwiseQTensor(_LegacyClass):
    _make_in_reduce_ex = staticmethod(make_float8_blockwise)


def legacy_getattr(obj: Any, name: Any) -> Callable[..., TEPayload]:
    """Restricted ``builtins.getattr`` for legacy pickles: only ``<TE class>._make_in_reduce_ex``."""
    if isinstance(obj, type) and issubclass(obj, _LegacyClass) and name == "_make_in_reduce_ex":
        return obj._make_in_reduce_ex
    raise UnsafeCheckpointError(
        f"a pickle calls getattr({getattr(obj, '__name__', type(obj).__name__)}, {name!r}); ckptq allows getattr "
        f"only for TransformerEngine's legacy <Class>._make_in_reduce_ex reconstructors. Nothing was run."
    )


#: Every global a TE DCP record references -> ckptq's stand-in (never TE's code).
PICKLE_GLOBALS: dict[tuple[str, str], Any] = {
    (_TENSOR_MOD + "float8_tensor", "_make_float8_tensor_in_reduce_ex"): make_float8,
    (_TENSOR_MOD + "mxfp8_tensor", "_make_mxfp8_tensor_in_reduce_ex"): make_mxfp8,
    (_TENSOR_MOD + "nvfp4_tensor", "_make_nvfp4_tensor_in_reduce_ex"): make_nvfp4,
    (_TENSOR_MOD + "float8_blockwise_tensor", "_make_float8_blockwise_tensor_in_reduce_ex"): make_float8_blockwise,
    (_TENSOR_MOD + "float8_tensor", "Float8Quantizer"): Float8QuantizerState,
    (_TENSOR_MOD + "float8_tensor", "Float8CurrentScalingQuantizer"): Float8CurrentScalingQuantizerState,
    (_TENSOR_MOD + "mxfp8_tensor", "MXFP8Quantizer"): MXFP8QuantizerState,
    (_TENSOR_MOD + "nvfp4_tensor", "NVFP4Quantizer"): NVFP4QuantizerState,
    (_TENSOR_MOD + "float8_blockwise_tensor", "Float8BlockQuantizer"): Float8BlockQuantizerState,
    ("transformer_engine.pytorch.constants", "DType"): te_dtype,
    ("transformer_engine_torch", "DType"): te_dtype,
    # Legacy payloads: GLOBAL builtins.getattr + GLOBAL <module>.<Class>, REDUCE.
    (_TENSOR_MOD + "float8_tensor", "Float8Tensor"): _LegacyFloat8Tensor,
    (_TENSOR_MOD + "mxfp8_tensor", "MXFP8Tensor"): _LegacyMXFP8Tensor,
    (_TENSOR_MOD + "nvfp4_tensor", "NVFP4Tensor"): _LegacyNVFP4Tensor,
    (_TENSOR_MOD + "float8_blockwise_tensor", "Float8BlockwiseQTensor"): _LegacyFloat8BlockwiseQTensor,
    ("builtins", "getattr"): legacy_getattr,
    ("__builtin__", "getattr"): legacy_getattr,  # protocol-2 spelling (torch.save's default protocol)
}


# ============================================================================ buffer helpers
def _rup(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def _read_scales(buf: torch.Tensor, rows: int, cols: int, swizzled: bool, *, transposed: bool = False) -> torch.Tensor:
    """Compact (rows, cols) scales of a TE scale buffer; a view of ``buf`` unless swizzled.
    ``transposed``: a swizzled buffer holds the (cols, rows) matrix (MXFP8 columnwise), unswizzled
    and transposed in one gather."""
    if not swizzled:
        return buf[:rows, :cols]
    return unswizzle(buf, cols, rows, transposed=True) if transposed else unswizzle(buf, rows, cols)


def _write_scales(buf: torch.Tensor, compact: torch.Tensor, swizzled: bool, *, transposed: bool = False) -> None:
    """Write compact scales (``buf``'s dtype) into ``buf`` in place, padding zeroed."""
    if swizzled:
        buf.copy_(swizzle(compact.t() if transposed else compact).view(buf.shape))
    else:
        buf.zero_()
        buf[: compact.shape[0], : compact.shape[1]].copy_(compact)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/2) uint8 -> (R, C) E2M1 codes; element 2i is the low nibble (docs/producers.md 1.1)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


# ============================================================================ per-class records
@dataclasses.dataclass
class _TEContents:
    """What a TE object holds, in ckptq terms: its TE class, ckptq format, logical shape and dtype,
    recipe, and whether its block scales are GEMM-swizzled."""

    te_class: str
    fmt: str
    shape: tuple[int, int]
    dtype: torch.dtype
    recipe: dict
    swizzled: bool = False


_U8, _F32 = torch.uint8, torch.float32


def _where(fqn: str, te_class: str) -> str:
    return f"tensor '{fqn}' ({te_class})"


def _refuse(fqn: str, te_class: str, field: str, why: str) -> None:
    refuse(_where(fqn, te_class), fqn, field, why)


def _held(obj: Any, desc: _TEContents, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], fqn: str) -> dict:
    """The held buffers among ``specs`` (attr -> (shape, dtype)), each checked against its spec."""
    out = {}
    for attr, (shape, dtype) in specs.items():
        t = getattr(obj, attr, None)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointFormatError(
                f"{_where(fqn, desc.te_class)}: buffer {attr} is {got}, expected {dtype} {tuple(shape)} for "
                f"logical shape {desc.shape} in TransformerEngine's layout of this class (TE main, 2026-08). The "
                f"tensor or record does not match it: it comes from a TE version ckptq does not map, or is damaged."
            )
        out[attr] = t
    return out


def _prelude(obj: Any, fqn: str, te_class: str, fmt: str) -> _TEContents:
    shape = tuple(int(s) for s in obj.shape)
    if len(shape) != 2:
        _refuse(
            fqn,
            te_class,
            f"logical shape {shape}",
            "is not 2-D (TE flattens leading dims; ckptq's TE adapter maps (M, K) tensors only)",
        )
    return _TEContents(te_class, fmt, shape, obj.dtype, {}, bool(getattr(obj, "_with_gemm_swizzled_scales", False)))


def _fp8_code(obj: Any, fqn: str, te_class: str, allowed=(7, 8)) -> int:
    code = _code(getattr(obj, "_fp8_dtype", None))
    if code not in allowed:
        name = _DTYPE_NAMES.get(code, code)
        _refuse(
            fqn,
            te_class,
            f"_fp8_dtype={name}",
            f"is not an element type of ckptq's format for this class ({'/'.join(_DTYPE_NAMES[c] for c in allowed)})",
        )
    return code


def _requantized(values: torch.Tensor, fmt: str, **recipe: Any) -> tuple[dict, float]:
    """Quantize ``values.T`` rowwise (= the columnwise copy of ``values``); its components and the
    SQNR of its values against ``values``."""
    q = quantize(values.t().contiguous(), fmt, **recipe)
    return q.components(), sqnr_db(values, q.dequantize(torch.float32).t())


# ---------------------------------------------------------------- Float8Tensor -> fp8_tensor
def _float8_specs(d: _TEContents):
    m, k = d.shape
    return {"_data": ((m, k), _U8), "_transpose": ((k, m), _U8), "_scale_inv": ((1,), _F32)}


def _float8_describe(obj, fqn):
    d = _prelude(obj, fqn, "Float8Tensor", "fp8_tensor")
    code = _fp8_code(obj, fqn, d.te_class)
    if getattr(obj, "_data", None) is None and (
        getattr(obj, "_transpose", None) is None or getattr(obj, "_transpose_invalid", False)
    ):
        _refuse(fqn, d.te_class, "_data", "is None and no valid _transpose is held (no FP8 data)")
    q = getattr(obj, "_quantizer", None)
    d.recipe = dict(
        fp8_dtype=_TORCH_FP8[code],
        pow2=bool(getattr(q, "force_pow_2_scales", False)),
        eps=float(getattr(q, "amax_epsilon", 0.0)),
    )
    return d


def _float8_extract(obj, d, fqn):
    b = _held(obj, d, _float8_specs(d), fqn)
    fp8 = d.recipe["fp8_dtype"]
    data = b["_data"].view(fp8) if "_data" in b else b["_transpose"].view(fp8).t().contiguous()
    return {"data": data, "scale_inv": b["_scale_inv"].reshape(())}


def _float8_insert(obj, qt, d, fqn):
    b = _held(obj, d, _float8_specs(d), fqn)
    c = qt.components()
    data = _u8(c["data"])
    b["_scale_inv"].copy_(c["scale_inv"].reshape(1))
    if "_data" in b:
        b["_data"].copy_(data)
    if "_transpose" in b:  # exact: the transpose cache is a byte transpose of _data
        b["_transpose"].copy_(data.t())
        if hasattr(obj, "_transpose_invalid"):
            obj._transpose_invalid = False
    return None


# ---------------------------------------------------------------- MXFP8Tensor -> mxfp8
def _mxfp8_specs(d: _TEContents):
    m, k = d.shape
    return {
        "_rowwise_data": ((m, k), _U8),
        "_rowwise_scale_inv": ((_rup(m, 128), _rup(cdiv(k, 32), 4)), _U8),
        "_columnwise_data": ((m, k), _U8),
        "_columnwise_scale_inv": ((_rup(cdiv(m, 32), 4), _rup(k, 128)), _U8),
    }


def _mxfp8_describe(obj, fqn):
    d = _prelude(obj, fqn, "MXFP8Tensor", "mxfp8")
    _fp8_code(obj, fqn, d.te_class, allowed=(7,))
    if getattr(obj, "_rowwise_data", None) is None:
        _refuse(fqn, d.te_class, "_rowwise_data", "is None (columnwise-only MXFP8)")
    d.recipe = dict(columnwise=getattr(obj, "_columnwise_data", None) is not None)
    return d


def _mxfp8_extract(obj, d, fqn):
    b = _held(obj, d, _mxfp8_specs(d), fqn)
    m, k = d.shape
    out = {
        "data": b["_rowwise_data"].view(torch.float8_e4m3fn),
        "scale": _read_scales(b["_rowwise_scale_inv"], m, cdiv(k, 32), d.swizzled),
    }
    if d.recipe["columnwise"]:
        out["columnwise_data"] = b["_columnwise_data"].view(torch.float8_e4m3fn)
        out["columnwise_scale"] = _read_scales(b["_columnwise_scale_inv"], cdiv(m, 32), k, d.swizzled, transposed=True)
    return out


def _mxfp8_insert(obj, qt, d, fqn):
    _check_holdable(d, fqn)
    b = _held(obj, d, _mxfp8_specs(d), fqn)
    c = qt.components()
    b["_rowwise_data"].copy_(_u8(c["data"]))
    _write_scales(b["_rowwise_scale_inv"], c["scale"], d.swizzled)
    if "_columnwise_data" not in b:
        return None
    sqnr = None
    if "columnwise_data" in c:
        cdata, cscale = c["columnwise_data"], c["columnwise_scale"]
    else:  # 1-D columnwise is quantized independently from HP values: requantize (producers.md 2.3)
        cc, sqnr = _requantized(qt.dequantize(torch.float32), "mxfp8")
        cdata, cscale = cc["data"].t(), cc["scale"].t()
    b["_columnwise_data"].copy_(_u8(cdata))
    _write_scales(b["_columnwise_scale_inv"], cscale, d.swizzled, transposed=True)
    return sqnr


# ---------------------------------------------------------------- NVFP4Tensor -> nvfp4
def _nvfp4_specs(d: _TEContents):
    m, k = d.shape
    return {
        "_rowwise_data": ((m, k // 2), _U8),
        "_rowwise_scale_inv": ((_rup(m, 128), _rup(cdiv(k, 16), 4)), _U8),
        "_columnwise_data": ((k, m // 2), _U8),
        "_columnwise_scale_inv": ((_rup(k, 128), _rup(cdiv(m, 16), 4)), _U8),
        "_amax_rowwise": ((1,), _F32),
        "_amax_columnwise": ((1,), _F32),
    }


def _nvfp4_describe(obj, fqn):
    d = _prelude(obj, fqn, "NVFP4Tensor", "nvfp4")
    te = d.te_class
    code = _code(getattr(obj, "_fp4_dtype", None))
    if code != 10:
        _refuse(fqn, te, f"_fp4_dtype={code}", "is not kFloat4E2M1")
    q = getattr(obj, "_quantizer", None)
    if getattr(obj, "_row_scaled_nvfp4", False):
        _refuse(fqn, te, "_row_scaled_nvfp4=True", "(one fp32 amax per row)")
    if getattr(obj, "_nvfp4_use_4over6", False) or int(getattr(obj, "_nvfp4_e4m3_max", 448)) != 448:
        _refuse(
            fqn,
            te,
            f"_nvfp4_use_4over6/_nvfp4_e4m3_max={getattr(obj, '_nvfp4_e4m3_max', 448)}",
            "(4over6 block selection, E4M3 bound other than 448)",
        )
    if getattr(obj, "_rowwise_data", None) is None:
        _refuse(fqn, te, "_rowwise_data", "is None (columnwise-only NVFP4)")
    if getattr(q, "with_rht", False) and getattr(obj, "_columnwise_data", None) is not None:
        _refuse(
            fqn, te, "_columnwise_data (quantizer.with_rht=True)", "holds Random-Hadamard-transformed columnwise data"
        )
    if d.shape[1] % 2:
        raise CheckpointFormatError(f"{_where(fqn, te)}: K={d.shape[1]} is odd; NVFP4 packs two values per byte")
    two_d = bool(getattr(q, "with_2d_quantization", False))
    # 1x16: TE's columnwise copy is x^T quantized separately (docs/producers.md 2.4): stored natively.
    d.recipe = dict(two_d=two_d, columnwise=not two_d and getattr(obj, "_columnwise_data", None) is not None)
    return d


def _nvfp4_extract(obj, d, fqn):
    b = _held(obj, d, _nvfp4_specs(d), fqn)
    m, k = d.shape
    scale = _read_scales(b["_rowwise_scale_inv"], m, cdiv(k, 16), d.swizzled)
    if d.recipe["two_d"]:  # 2-D mode: each 16x16 tile's scale repeated on its 16 rows (docs/producers.md 2.4)
        tiles = scale[::16]
        if not torch.equal(tiles.repeat_interleave(16, 0)[:m], scale):
            d.recipe["two_d"] = False  # not tile-constant: keep it exact as 1x16 scales
        else:
            scale = tiles
    out = {
        "data": b["_rowwise_data"],
        "scale": scale.view(torch.float8_e4m3fn),
        "amax": b["_amax_rowwise"].reshape(()),
    }
    amax_col = b.get("_amax_columnwise")
    if d.recipe["columnwise"] and (amax_col is None or not torch.equal(_u8(amax_col), _u8(b["_amax_rowwise"]))):
        # ckptq's columnwise copy shares the tensor's amax (as TE's quantizer without a Hadamard
        # transform); a different _amax_columnwise is kept in the producer record, the copy is not stored.
        d.recipe["columnwise"] = False
    if d.recipe["columnwise"]:  # TE: (K, M/2) packed along M and (K, M/16) scales; ckptq: untransposed
        out["columnwise_data"] = b["_columnwise_data"].t()
        cscale = _read_scales(b["_columnwise_scale_inv"], k, cdiv(m, 16), d.swizzled)
        out["columnwise_scale"] = cscale.t().view(torch.float8_e4m3fn)
    return out


def _nvfp4_insert(obj, qt, d, fqn):
    m, k = d.shape
    _check_holdable(d, fqn)
    b = _held(obj, d, _nvfp4_specs(d), fqn)
    qt, _ = qt.with_per_tensor("amax")  # TE stores amax; another producer's global scale: the closest amax
    c = qt.components()
    two_d = qt.recipe.two_d
    scale = _u8(c["scale"])
    b["_rowwise_data"].copy_(c["data"])
    _write_scales(b["_rowwise_scale_inv"], scale.repeat_interleave(16, 0)[:m] if two_d else scale, d.swizzled)
    b["_amax_rowwise"].copy_(c["amax"].reshape(1))
    if "_amax_columnwise" in b:
        b["_amax_columnwise"].copy_(c["amax"].reshape(1))
    if "_columnwise_data" not in b:
        return None
    sqnr = None
    if two_d:  # exact: nvfp4_data_transpose + nvfp4_2d_scale_transpose (producers.md 2.4)
        cdata = _pack_fp4(_unpack_fp4(c["data"]).t())
        cscale = scale.t().repeat_interleave(16, 0)[:k]
    elif "columnwise_data" in c:  # stored: TE's own bytes
        cdata, cscale = c["columnwise_data"].t(), _u8(c["columnwise_scale"]).t()
    else:  # 1-D columnwise is quantized from HP values with the same amax: requantize
        cc, sqnr = _requantized(qt.dequantize(torch.float32), "nvfp4", amax=c["amax"])
        cdata, cscale = cc["data"], _u8(cc["scale"])
    b["_columnwise_data"].copy_(cdata)
    _write_scales(b["_columnwise_scale_inv"], cscale, d.swizzled)
    return sqnr


# ---------------------------------------------------------------- Float8BlockwiseQTensor -> fp8_block
def _float8_block_specs(d: _TEContents):
    m, k = d.shape
    mb, kb = cdiv(m, 128), cdiv(k, 128)
    two_d = d.recipe["block"] == (128, 128)
    return {
        "_rowwise_data": ((m, k), _U8),
        "_rowwise_scale_inv": ((mb, _rup(kb, 4)) if two_d else (kb, _rup(m, 4)), _F32),
        "_columnwise_data": ((k, m), _U8),
        "_columnwise_scale_inv": ((kb, _rup(mb, 4)) if two_d else (mb, _rup(k, 4)), _F32),
    }


def _float8_block_describe(obj, fqn):
    d = _prelude(obj, fqn, "Float8BlockwiseQTensor", "fp8_block")
    code = _fp8_code(obj, fqn, d.te_class)
    if getattr(obj, "_rowwise_data", None) is None:
        _refuse(fqn, d.te_class, "_rowwise_data", "is None (columnwise-only FP8 block tensor)")
    q = getattr(obj, "_quantizer", None)
    one_d = not getattr(obj, "_is_2D_scaled", True)
    d.recipe = dict(
        block=(1, 128) if one_d else (128, 128),
        fp8_dtype=_TORCH_FP8[code],
        pow2=bool(getattr(q, "force_pow_2_scales", True)),
        eps=float(getattr(q, "amax_epsilon", 0.0)),
        # 1-D: the columnwise copy is x^T quantized separately (docs/producers.md 2.5): stored natively
        columnwise=one_d and getattr(obj, "_columnwise_data", None) is not None,
    )
    return d


def _float8_block_extract(obj, d, fqn):
    b = _held(obj, d, _float8_block_specs(d), fqn)
    m, k = d.shape
    kb = cdiv(k, 128)
    s = b["_rowwise_scale_inv"]
    scale = s[:, :kb] if d.recipe["block"] == (128, 128) else s[:, :m].t()  # 1-D: stored (K/128, M)
    out = {"data": b["_rowwise_data"].view(d.recipe["fp8_dtype"]), "scale_inv": scale}
    if d.recipe["columnwise"]:  # TE: data (K, M), scales (M/128, rup(K, 4)) [m_block, k]; ckptq: untransposed
        out["columnwise_data"] = b["_columnwise_data"].t().view(d.recipe["fp8_dtype"])
        out["columnwise_scale_inv"] = b["_columnwise_scale_inv"][:, :k]
    return out


def _float8_block_insert(obj, qt, d, fqn):
    b = _held(obj, d, _float8_block_specs(d), fqn)
    c = qt.components()
    two_d = d.recipe["block"] == (128, 128)
    data, scale = _u8(c["data"]), c["scale_inv"]
    b["_rowwise_data"].copy_(data)
    _write_scales(b["_rowwise_scale_inv"], scale if two_d else scale.t(), False)
    if "_columnwise_data" not in b:
        return None
    sqnr = None
    if two_d:  # exact: fp8_transpose + scale transpose (producers.md 2.5)
        cdata, cscale = data.t(), scale.t()
    elif "columnwise_data" in c:  # stored: TE's own bytes
        cdata, cscale = _u8(c["columnwise_data"]).t(), c["columnwise_scale_inv"]
    else:  # 1-D columnwise: x.T quantized with 1x128 blocks along M; requantize
        cc, sqnr = _requantized(
            qt.dequantize(torch.float32),
            "fp8_block",
            block=(1, 128),
            fp8_dtype=d.recipe["fp8_dtype"],
            pow2=d.recipe["pow2"],
            eps=d.recipe["eps"],
        )
        cdata, cscale = _u8(cc["data"]), cc["scale_inv"].t()  # stored (M/128, K)
    b["_columnwise_data"].copy_(cdata)
    _write_scales(b["_columnwise_scale_inv"], cscale, False)
    return sqnr


@dataclasses.dataclass(frozen=True)
class _ClassHandler:
    """How ckptq handles one TE tensor class: its ckptq format's class and the class's functions."""

    qt_class: type
    describe: Callable[[Any, str], _TEContents]
    extract: Callable[[Any, _TEContents, str], dict]
    insert: Callable[[Any, QuantizedTensor, _TEContents, str], float | None]
    columnwise_buffers: str  # named in the requantization warning


_HANDLERS: dict[str, _ClassHandler] = {
    "Float8Tensor": _ClassHandler(Float8Tensor, _float8_describe, _float8_extract, _float8_insert, "_transpose"),
    "MXFP8Tensor": _ClassHandler(
        MXFP8Tensor, _mxfp8_describe, _mxfp8_extract, _mxfp8_insert, "_columnwise_data/_columnwise_scale_inv"
    ),
    "NVFP4Tensor": _ClassHandler(
        NVFP4Tensor, _nvfp4_describe, _nvfp4_extract, _nvfp4_insert, "_columnwise_data/_columnwise_scale_inv"
    ),
    "Float8BlockwiseQTensor": _ClassHandler(
        Float8BlockTensor,
        _float8_block_describe,
        _float8_block_extract,
        _float8_block_insert,
        "_columnwise_data/_columnwise_scale_inv",
    ),
}


# ============================================================================ public functions
def te_class_of(obj: Any) -> str | None:
    """TE's class name for a live TE tensor (class or base matched by module + qualname), a DTensor
    holding one, or a :class:`TEPayload`; None for anything else. Never imports TE."""
    obj = getattr(obj, "_local_tensor", obj)
    if isinstance(obj, TEPayload):
        return obj.te_class
    for cls in type(obj).__mro__:
        name = TE_CLASSES.get((cls.__module__, cls.__qualname__))
        if name is not None:
            return name
    return None


def _resolve(obj: Any, fqn: str) -> tuple[Any, _ClassHandler, _TEContents]:
    local = getattr(obj, "_local_tensor", obj)
    name = te_class_of(local)
    if name is None:
        raise UnsupportedFormatError(
            f"tensor '{fqn}': {type(local).__name__} is not a TransformerEngine "
            f"quantized tensor ({', '.join(TE_CLASSES.values())})"
        )
    handler = _HANDLERS[name]
    return local, handler, handler.describe(local, fqn)


def _te_version() -> str | None:
    v = getattr(sys.modules.get("transformer_engine"), "__version__", None)
    return None if v is None else str(v)


_QUANTIZER_FIELDS = (
    "rowwise_usage",
    "columnwise_usage",
    "dtype",
    "with_amax_reduction",
    "force_pow_2_scales",
    "amax_epsilon",
    "block_len",
    "block_scaling_dim",
    "with_2d_quantization",
    "with_rht",
    "with_post_rht_amax",
    "stochastic_rounding",
    "row_scaled_nvfp4",
    "nvfp4_use_4over6",
    "nvfp4_e4m3_max",
    "nvfp4_4over6_err_mode",
    "rht_matrix_random_sign_mask_t",
)


def _quantizer_record(q: Any) -> dict | None:
    """The builtin-valued quantizer fields needed to rebuild it (process groups, tensors dropped)."""
    if q is None:
        return None
    out: dict[str, Any] = {"type": q.type_name if isinstance(q, QuantizerState) else type(q).__name__}
    for f in _QUANTIZER_FIELDS:
        if not hasattr(q, f):
            continue
        v = getattr(q, f)
        if f == "dtype":
            v = _DTYPE_NAMES.get(_code(v), _code(v))
        elif isinstance(v, bool):
            v = bool(v)
        elif isinstance(v, int):
            v = int(v)
        elif isinstance(v, float):
            v = float(v)
        elif not isinstance(v, str):
            continue
        out[f] = v
    return out


def _producer(obj: Any, d: _TEContents) -> dict:
    rec: dict[str, Any] = {"name": PRODUCER, "version": _te_version(), "class": d.te_class}
    if d.te_class == "NVFP4Tensor":
        rec["fp4_dtype"] = "E2M1"
    else:
        rec["fp8_dtype"] = _DTYPE_NAMES[_code(obj._fp8_dtype)]
    rec["quantizer"] = _quantizer_record(getattr(obj, "_quantizer", None))
    rec["swizzled"] = d.swizzled
    if d.te_class == "Float8Tensor":
        rec["usages"] = {
            "rowwise": getattr(obj, "_data", None) is not None,
            "columnwise": getattr(obj, "_transpose", None) is not None,
        }
    else:
        rec["usages"] = {
            "rowwise": getattr(obj, "_rowwise_data", None) is not None,
            "columnwise": getattr(obj, "_columnwise_data", None) is not None,
        }
    if d.te_class == "Float8BlockwiseQTensor":
        rec["is_2D_scaled"] = d.recipe["block"] == (128, 128)
    amax_col = getattr(obj, "_amax_columnwise", None)
    if d.te_class == "NVFP4Tensor" and isinstance(amax_col, torch.Tensor) and amax_col.numel() == 1:
        rec["amax_columnwise"] = float(amax_col.float().item()).hex()
    return rec


def _wrap(handler: _ClassHandler, d: _TEContents, comps: dict, fqn: str) -> QuantizedTensor:
    cls = handler.qt_class
    return cls.from_components(comps, d.shape, d.dtype, cls.Recipe(**d.recipe), fqn=fqn)


def to_canonical(obj: Any, fqn: str) -> tuple[QuantizedTensor, dict]:
    """The canonical ckptq tensor of a TE tensor (or DTensor of one, or :class:`TEPayload`) and a
    ``producer`` record of builtins.

    Components are compact and unswizzled, of the object's local logical shape (M, K); they are
    views of TE's buffers where the layout allows (data, unswizzled scales, amax), copies where it
    must be rearranged (swizzled scales, a Float8 transpose-only tensor).
    ``producer`` = ``{"name": "transformer_engine", "version", "class", "fp8_dtype"|"fp4_dtype",
    "quantizer": {type, usages, dtype, pow2/eps, block_scaling_dim, with_2d_quantization, ...} | None,
    "swizzled", "usages": {"rowwise", "columnwise"} (buffers held), ["is_2D_scaled"],
    ["amax_columnwise": float.hex()]}``.

    Raises:
        UnsupportedFormatError: what ckptq cannot hold exactly (names FQN, class and field).
        CheckpointFormatError: a buffer whose shape or dtype contradicts TE's layout.
    """
    local, handler, d = _resolve(obj, fqn)
    comps = handler.extract(local, d, fqn)
    return _wrap(handler, d, comps, fqn), _producer(local, d)


def empty_canonical(obj: Any, fqn: str) -> QuantizedTensor:
    """A canonical tensor with fresh uninitialized components of ``obj``'s format, recipe, local
    shape and device (what a load reads into before :func:`insert`). NVFP4 is 16x16 (``two_d``)
    when the quantizer says ``with_2d_quantization``; MXFP8, NVFP4 1x16 and FP8-block 1x128 have
    columnwise components when ``obj`` holds columnwise data."""
    local, handler, d = _resolve(obj, fqn)
    _check_holdable(d, fqn)
    cls = handler.qt_class
    rec = cls.Recipe(**d.recipe)
    dev = (
        next(v.device for v in vars(local).values() if isinstance(v, torch.Tensor))
        if isinstance(local, TEPayload)
        else local.device
    )
    comps = {
        s.name: torch.empty(s.shape(d.shape), dtype=s.dtype, device=dev) for s in cls.component_specs(d.shape, rec)
    }
    return cls.from_components(comps, d.shape, d.dtype, rec, fqn=fqn)


#: TE's own shape requirements of a local tensor (``quantizer.cpp``: MXFP8 and NVFP4 create_tensor).
_HOLDABLE = {"MXFP8Tensor": 32, "NVFP4Tensor": 16}


def _check_holdable(d: _TEContents, fqn: str) -> None:
    """A shard TE itself could not hold (MXFP8 rows/cols not multiples of 32, NVFP4 of 16) is a
    sharding problem: raise ShardingError naming the FQN, class, shape and multiple."""
    mult = _HOLDABLE.get(d.te_class)
    if mult and any(n % mult for n in d.shape):
        raise ShardingError(
            f"{_where(fqn, d.te_class)}: local shape {d.shape} is not a multiple of {mult} in both dims, which "
            f"TE's {d.te_class} requires (quantizer.cpp); choose a placement whose shards are multiples of {mult}."
        )


def insert(obj: Any, qt: QuantizedTensor, fqn: str) -> float | None:
    """Write canonical ``qt`` into the TE object's buffers in place, in TE's layout.

    Padding is zeroed, scales are swizzled when the target's are, amaxes are set, and derived
    copies made consistent: exact where TE derives them (FP8 transpose, NVFP4 16x16 and FP8-block
    128x128 columnwise: byte/nibble transposes), from ``qt``'s columnwise components (MXFP8, NVFP4
    1x16, FP8-block 1x128) when present, else requantized from ``qt``'s values.

    Returns:
        The SQNR (dB) of the requantized columnwise values against ``qt``'s values, also reported
        in a warning naming the FQN; None when every byte written was exact.

    Raises:
        CheckpointFormatError: ``qt``'s format, element dtype, block or shape does not fit the target,
            or the target's buffers contradict TE's layout.
        UnsupportedFormatError: the target is of a kind ckptq refuses (see :func:`to_canonical`).
    """
    local, handler, d = _resolve(obj, fqn)
    check_fits(qt, d.fmt, d.shape, d.recipe, _where(fqn, d.te_class))
    sqnr = handler.insert(local, qt, d, fqn)
    if sqnr is not None:
        warnings.warn(
            f"{_where(fqn, d.te_class)}: the columnwise copy ({handler.columnwise_buffers}) was requantized "
            f"from the loaded rowwise values (SQNR {sqnr:.1f} dB against them): TE quantizes it from the "
            f"original high-precision weights, so it is close to, not bit-identical with, TE's own bytes.",
            stacklevel=2,
        )
    return sqnr

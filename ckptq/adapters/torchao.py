"""torchao adapter: torchao 0.18's quantized tensor subclasses <-> ckptq canonical tensors, without torchao.

torchao is never imported. Live objects are recognized by their class's module and qualified name
(:data:`AO_CLASSES`); records rebuilt from torchao pickles (``torch.save`` files, DCP records written
by DCP's default planner) are :class:`TorchAOPayload` subclasses carrying the same attribute names
(``qdata``, ``scale``, ``per_tensor_scale``, ``is_swizzled_scales``, ...), so both are handled alike.
Facts: docs/producers.md, "3. torchao" (torchao 0.18.0, read from the wheel).

=================  ===============================================================  ===========
torchao class      fields -> ckptq components                                       ckptq format
=================  ===============================================================  ===========
NVFP4Tensor        ``qdata`` uint8 (..., M, K/2) -> data (view; same nibble order:   nvfp4 (1x16)
                   element 2i low); ``scale`` e4m3 (..., M, K/16), or swizzled
                   (ceil(M/128)*32, ceil(K/64)*16) -> scale (..., M, K/16);
                   ``per_tensor_scale`` fp32 () or (E, 1, 1) -> global_scale_inv
                   (...) byte for byte (recipe ``per_tensor="global_scale_inv"``);
                   None -> 1.0. ``prototype/mx_formats/nvfp4_tensor.py``
                   (``dequantize``, ``get_hp_scales``).
MXTensor           ``qdata`` e4m3 (..., M, K) -> data (view); ``scale`` e8m0fnu     mxfp8
                   (..., M, K/32) or swizzled (ceil(M/128)*32, ceil(K/128)*16) ->
                   scale uint8 (..., M, K/32) (``.view(uint8)``: the biased
                   exponent). ``elem_dtype=float8_e4m3fn``, ``block_size=32``.
                   ``prototype/mx_formats/mx_tensor.py`` (``to_dtype``,
                   ``get_fp_scale``).
MXTensor (FP4)     ``elem_dtype=float4_e2m1fn_x2``: ``qdata`` uint8 (..., M, K/2),   mxfp4
                   element 2i in the low nibble (``kernels.py`` ``pack_uint4``) ->
                   data (view; ckptq's order); ``scale`` as above -> scale.
Float8Tensor       ``qdata`` e4m3/e5m2 (..., M, K) -> data (view); ``scale`` fp32   fp8_tensor /
                   decode multiplier: one element (PerTensor, shape (1, 1)) ->      fp8_block
                   fp8_tensor ``scale_inv`` (); (M/bm, K/bk) (PerRow (M, 1),
                   PerBlock) -> fp8_block ``scale_inv`` with block (bm, bk)
                   (per-row = (1, K)). ``quantization/quantize_/workflows/float8/
                   float8_tensor.py``, ``quantization/quant_primitives.py``
                   (``_dequantize_affine_float8``: ``q.float() * scale``, the block
                   inferred as ``shape // scale.shape``).
=================  ===============================================================  ===========

Swizzle (``prototype/mx_formats/utils.py`` ``to_blocked``/``from_blocked``): the (R, C) scale matrix,
zero-padded to (ceil(R/128)*128, ceil(C/4)*4), is stored tile by tile: 128x4 tiles in row-block-major
order, inside a tile entry (32i + j, c) at [j, 4i + c] of a 32x16 block (cuBLAS block-scaling
layout). For 3-D tensors torchao swizzles the flattened (prod(leading) * M, C) matrix. Padding is
dropped on read and zeroed on write.

Exactness (ckptq dequantize vs torchao ``dequantize()``, both computing in fp32):

* MXTensor (E4M3 and FP4) and Float8Tensor: components equal byte for byte, values bit-exact in
  both directions (the same formulas: ``float(q) * 2^(e-127)``, ``e2m1(q) * 2^(e-127)`` and
  ``float(q) * scale``).
* NVFP4Tensor: torchao decodes ``e2m1 * fl32(per_tensor_scale * float(s))`` (``get_hp_scales``), which
  is ckptq's ``global_scale_inv`` convention (docs/formats.md): ``per_tensor_scale`` is stored as it
  is and the values are bit-exact in both directions. Without a global scale (``per_tensor_scale=None``,
  decode ``e2m1 * float(s)``) the tensor is stored with ``global_scale_inv = 1``, which decodes to the
  same values; a target without per_tensor_scale accepts only such tensors (else
  CheckpointFormatError). A tensor in another convention (ckptq's own ``amax``) is written into a
  torchao target with the ``per_tensor_scale`` whose decode is closest to its own
  (:meth:`ckptq.formats.NVFP4Tensor.with_per_tensor`, <= 2 fp32 ulps in the tests); nothing is
  requantized.

Not in the canonical tensor: NVFP4's ``act_per_tensor_scale`` (a static activation calibration value,
no part of the weight's values) and the attributes (``act_quant_kwargs``, ``mm_config``,
``kernel_preference``, ...): they are recorded in ``producer`` (float hex / builtins); :func:`insert`
leaves them as the target holds them (adapters receive only the canonical tensor).

Refused (UnsupportedFormatError naming FQN, class, field): MXTensor with another element dtype
(E5M2, FP6) or block size, NVFP4 with block_size != 16, transposed (column-major) qdata, non-fp32
Float8 scales, block grids that do not divide the shape.

Pickles: torch pickles a torchao tensor as ``torch._tensor._rebuild_from_type_v2(
torch._utils._rebuild_wrapper_subclass, <class>, (<class>, dtype, size, stride, offset, layout,
device, requires_grad), <__dict__>)``; the globals it references beyond torch's (found with
``pickletools`` on torchao 0.18.0 pickles) are the three classes, the enums ``KernelPreference`` and
``ScaleCalculationMode``, the kwargs dataclasses, the granularities and ``Float8MMConfig``.
:data:`PICKLE_GLOBALS` maps exactly those to the stand-ins below.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from typing import Any, ClassVar

import torch

from ..errors import CheckpointFormatError, UnsupportedFormatError
from ..formats import Float8BlockTensor, Float8Tensor, MXFP8Tensor, NVFP4Tensor, QuantizedTensor, format_class
from ._swizzle import swizzle, swizzled_numel, unswizzle
from .base import FlatTensor, check_fits, refuse

__all__ = [
    "AO_CLASSES",
    "PICKLE_GLOBALS",
    "PAYLOAD_TYPES",
    "TorchAOPayload",
    "ao_class_of",
    "to_canonical",
    "empty_canonical",
    "insert",
    "safetensors_groups",
    "safetensors_to_canonical",
    "safetensors_flatten",
]

PRODUCER = "torchao"
_NVFP4_MODULE = "torchao.prototype.mx_formats.nvfp4_tensor"
_MX_MODULE = "torchao.prototype.mx_formats.mx_tensor"
_FLOAT8_MODULE = "torchao.quantization.quantize_.workflows.float8.float8_tensor"

#: ``(module, qualname)`` of torchao's tensor classes -> the class name. ``Float8Tensor`` sets its
#: ``__module__`` to ``torchao.quantization`` (end of float8_tensor.py); both spellings are listed.
AO_CLASSES: dict[tuple[str, str], str] = {
    (_NVFP4_MODULE, "NVFP4Tensor"): "NVFP4Tensor",
    (_MX_MODULE, "MXTensor"): "MXTensor",
    ("torchao.quantization", "Float8Tensor"): "Float8Tensor",
    (_FLOAT8_MODULE, "Float8Tensor"): "Float8Tensor",
}

_E4M3, _E5M2, _U8, _F32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.float32


# ============================================================================ pickle stand-ins
class TorchAOPayload(torch.Tensor):
    """A torchao tensor rebuilt from its pickle: an inert wrapper tensor (logical shape and dtype,
    no storage, every op refused) whose attributes are the pickled ``__dict__`` (``qdata``,
    ``scale``, ...). ``ao_class`` names the torchao class."""

    ao_class: ClassVar[str] = ""
    _TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("qdata", "scale")
    _OPTIONAL_TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise CheckpointFormatError(
            f"a torchao {cls.ao_class} read from a pickle is a record of its fields, not a live tensor "
            f"({func} is not available); read it through ckptq (CheckpointView / open_checkpoint)"
        )

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointFormatError(f"torchao {self.ao_class} pickle: its state is not a dict of str keys")
        for name in self._TENSOR_FIELDS + self._OPTIONAL_TENSOR_FIELDS:
            v = state.get(name)
            if not isinstance(v, torch.Tensor) and (v is not None or name in self._TENSOR_FIELDS):
                raise CheckpointFormatError(
                    f"torchao {self.ao_class} pickle: field {name} is {type(v).__name__}, expected a tensor"
                )
        for k, v in state.items():
            if k.startswith("_") or not k.isidentifier() or hasattr(torch.Tensor, k):
                continue  # never shadow tensor attributes (e.g. Float8Tensor's 'dtype' is the wrapper's)
            self.__dict__[k] = v

    def __repr__(self) -> str:
        return f"TorchAOPayload({self.ao_class}, shape={tuple(self.shape)}, dtype={self.dtype})"


class NVFP4Payload(TorchAOPayload):
    ao_class = "NVFP4Tensor"
    _OPTIONAL_TENSOR_FIELDS = ("per_tensor_scale", "act_per_tensor_scale")


class MXPayload(TorchAOPayload):
    ao_class = "MXTensor"


class Float8Payload(TorchAOPayload):
    ao_class = "Float8Tensor"


PAYLOAD_TYPES: tuple[type, ...] = (NVFP4Payload, MXPayload, Float8Payload)


def _enum_value(value: Any) -> str:
    """Stand-in for torchao's str enums (``KernelPreference``, ``ScaleCalculationMode``), pickled as
    ``REDUCE(Enum, (value,))``: the value string."""
    if not isinstance(value, str):
        raise CheckpointFormatError(f"torchao enum payload {value!r} is not a str")
    return value


class _RebuiltObject:
    """A torchao dataclass or NamedTuple rebuilt from its pickle (``NEWOBJ`` [+ ``BUILD`` with its
    ``__dict__``): fields become attributes; ``type_name`` is torchao's class name."""

    type_name: ClassVar[str] = ""
    _fields: ClassVar[tuple[str, ...]] = ()  # NamedTuple field order (positional NEWOBJ args)

    def __new__(cls, *args: Any) -> _RebuiltObject:
        self = object.__new__(cls)
        if len(args) > len(cls._fields):
            raise CheckpointFormatError(f"torchao {cls.type_name} pickle: {len(args)} positional fields")
        self.__dict__.update(zip(cls._fields, args, strict=False))
        return self

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) and not k.startswith("__") for k in state):
            raise CheckpointFormatError(f"torchao {self.type_name} state is not a dict of field names")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{self.type_name}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def _record_type(name: str, fields: tuple[str, ...] = ()) -> type:
    return type(f"{name}Record", (_RebuiltObject,), {"type_name": name, "_fields": fields, "__module__": __name__})


_KWARG_RECORDS = {
    n: _record_type(n)
    for n in (
        "QuantizeTensorToNVFP4Kwargs",
        "QuantizeTensorToMXKwargs",
        "QuantizeTensorToFloat8Kwargs",
        "PerTensor",
        "PerRow",
        "PerBlock",
    )
}
_MM_CONFIG = _record_type("Float8MMConfig", ("emulate", "use_fast_accum", "pad_inner_dim"))

#: Every torchao global a pickled torchao 0.18 tensor references -> ckptq's stand-in.
PICKLE_GLOBALS: dict[tuple[str, str], Any] = {
    (_NVFP4_MODULE, "NVFP4Tensor"): NVFP4Payload,
    (_MX_MODULE, "MXTensor"): MXPayload,
    ("torchao.quantization", "Float8Tensor"): Float8Payload,
    (_FLOAT8_MODULE, "Float8Tensor"): Float8Payload,
    ("torchao.quantization.quantize_.common.kernel_preference", "KernelPreference"): _enum_value,
    ("torchao.prototype.mx_formats.config", "ScaleCalculationMode"): _enum_value,
    (_NVFP4_MODULE, "QuantizeTensorToNVFP4Kwargs"): _KWARG_RECORDS["QuantizeTensorToNVFP4Kwargs"],
    (_MX_MODULE, "QuantizeTensorToMXKwargs"): _KWARG_RECORDS["QuantizeTensorToMXKwargs"],
    (_FLOAT8_MODULE, "QuantizeTensorToFloat8Kwargs"): _KWARG_RECORDS["QuantizeTensorToFloat8Kwargs"],
    ("torchao.quantization.granularity", "PerTensor"): _KWARG_RECORDS["PerTensor"],
    ("torchao.quantization.granularity", "PerRow"): _KWARG_RECORDS["PerRow"],
    ("torchao.quantization.granularity", "PerBlock"): _KWARG_RECORDS["PerBlock"],
    ("torchao.float8.inference", "Float8MMConfig"): _MM_CONFIG,
}


def _plain(v: Any, depth: int = 0) -> Any:
    """A JSON-able record of a torchao attribute value (live object or stand-in): enums -> value,
    dataclasses / NamedTuples / records -> ``{"type", fields...}``, dtypes -> name."""
    if depth > 8:
        return repr(v)
    if isinstance(v, enum.Enum):  # before str: torchao's enums are str enums
        return _plain(v.value, depth + 1)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, _RebuiltObject):
        return {"type": v.type_name, **{k: _plain(x, depth + 1) for k, x in v.__dict__.items()}}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {
            "type": type(v).__name__,
            **{f.name: _plain(getattr(v, f.name, None), depth + 1) for f in dataclasses.fields(v)},
        }
    if isinstance(v, tuple) and hasattr(v, "_asdict"):
        return {"type": type(v).__name__, **{k: _plain(x, depth + 1) for k, x in v._asdict().items()}}
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, torch.Tensor):
        return [float(x).hex() for x in v.detach().to("cpu", _F32).reshape(-1).tolist()]
    return repr(v)


# ============================================================================ buffer helpers
@dataclasses.dataclass
class _AOContents:
    """What a torchao object holds, in ckptq terms: its torchao class, ckptq format, logical shape
    and dtype, recipe, and whether its block scales are swizzled."""

    ao_class: str
    fmt: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    recipe: dict
    swizzled: bool = False


def _where(fqn: str, ao_class: str) -> str:
    return f"tensor '{fqn}' (torchao {ao_class})"


def _refuse(fqn: str, ao_class: str, field: str, why: str) -> None:
    refuse(_where(fqn, ao_class), fqn, field, why)


def _tensor(obj: Any, name: str, d_class: str, fqn: str, *, optional: bool = False) -> torch.Tensor | None:
    t = getattr(obj, name, None)
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor):
        raise CheckpointFormatError(f"{_where(fqn, d_class)}: field {name} is {type(t).__name__}, not a tensor")
    return t


def _check(t: torch.Tensor, shape: tuple, dtype: torch.dtype, name: str, d: _AOContents, fqn: str) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise CheckpointFormatError(
            f"{_where(fqn, d.ao_class)}: field {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} "
            f"{tuple(shape)} for logical shape {d.shape} (torchao 0.18 layout)"
        )


def _row_major(obj: Any, d: _AOContents, fqn: str) -> torch.Tensor:
    q = _tensor(obj, "qdata", d.ao_class, fqn)
    if q.dim() < 2 or (q.dim() >= 2 and q.stride(-2) < q.stride(-1) and q.shape[-2] > 1 and q.shape[-1] > 1):
        _refuse(fqn, d.ao_class, f"qdata of strides {tuple(q.stride())}", "is transposed (column-major)")
    return q


def _read_block_scales(obj: Any, d: _AOContents, cols: int, dtype: torch.dtype, fqn: str) -> torch.Tensor:
    """Compact (..., M, cols) scales of an NVFP4/MX tensor (a view unless swizzled)."""
    *lead, m = d.shape[:-1]
    s = _tensor(obj, "scale", d.ao_class, fqn)
    if s.dtype != dtype:
        _check(s, s.shape, dtype, "scale", d, fqn)
    if not d.swizzled:
        _check(s, (*lead, m, cols), dtype, "scale", d, fqn)
        return s
    rows = math.prod(lead) * m
    if s.numel() != swizzled_numel(rows, cols):
        raise CheckpointFormatError(
            f"{_where(fqn, d.ao_class)}: swizzled scale has {s.numel()} elements, expected "
            f"{swizzled_numel(rows, cols)} for logical shape {d.shape} (torchao to_blocked)"
        )
    return unswizzle(s.reshape(-1), rows, cols).reshape(*lead, m, cols)


def _write_block_scales(obj: Any, compact: torch.Tensor, swizzled: bool) -> None:
    """Write compact (..., M, C) scales into ``obj.scale`` in place (its dtype, bytes unchanged)."""
    target = obj.scale.view(_U8)
    src = compact.view(_U8)
    if swizzled:
        target.copy_(swizzle(src.reshape(-1, src.shape[-1])).view(target.shape))
    else:
        target.copy_(src)


# ============================================================================ per-class logic
def _version() -> str | None:
    v = getattr(sys.modules.get("torchao"), "__version__", None)
    return None if v is None else str(v)


def _swizzled(obj: Any) -> bool:
    return bool(getattr(obj, "is_swizzled_scales", False))


def _nvfp4_describe(obj: Any, fqn: str) -> _AOContents:
    d = _AOContents("NVFP4Tensor", "nvfp4", tuple(int(s) for s in obj.shape), obj.dtype, {}, _swizzled(obj))
    if len(d.shape) not in (2, 3):
        _refuse(fqn, d.ao_class, f"logical shape {d.shape}", "is not 2-D or 3-D")
    if int(getattr(obj, "block_size", 16)) != 16:
        _refuse(fqn, d.ao_class, f"block_size={obj.block_size}", "is not 16")
    q = _row_major(obj, d, fqn)
    _check(q, (*d.shape[:-1], d.shape[-1] // 2), _U8, "qdata", d, fqn)
    if d.shape[-1] % 16:
        _refuse(fqn, d.ao_class, f"K={d.shape[-1]}", "is not a multiple of 16")
    d.recipe = dict(two_d=False, per_tensor="global_scale_inv")
    return d


def _nvfp4_global_scale_inv(obj: Any, d: _AOContents, fqn: str) -> torch.Tensor:
    """``per_tensor_scale`` as the batch-shaped fp32 ``global_scale_inv`` (bytes kept; 1 where None)."""
    lead = d.shape[:-2]
    pts = _tensor(obj, "per_tensor_scale", d.ao_class, fqn, optional=True)
    if pts is None:
        return torch.ones(lead, dtype=_F32, device=obj.qdata.device)
    if pts.dtype != _F32 or pts.numel() not in (1, math.prod(lead)):
        _refuse(
            fqn,
            d.ao_class,
            f"per_tensor_scale {pts.dtype} {tuple(pts.shape)}",
            f"is not fp32 with one value (or one per expert of {lead})",
        )
    if pts.numel() == 1:  # one global scale (also for a 3-D tensor): the same value for every matrix
        return pts.detach().reshape(()).expand(lead).contiguous()
    return pts.detach().reshape(lead)


def _nvfp4_extract(obj: Any, d: _AOContents, fqn: str) -> tuple[dict, dict]:
    k = d.shape[-1]
    scale = _read_block_scales(obj, d, k // 16, _E4M3, fqn)
    pts = getattr(obj, "per_tensor_scale", None)
    extra = {
        "per_tensor_scale": None if pts is None else ("per_expert" if pts.dim() == 3 else "scalar"),
        "use_triton_kernel": bool(getattr(obj, "use_triton_kernel", False)),
        "act_per_tensor_scale": _plain(getattr(obj, "act_per_tensor_scale", None)),
        "act_quant_kwargs": _plain(getattr(obj, "act_quant_kwargs", None)),
    }
    return {"data": obj.qdata, "scale": scale, "global_scale_inv": _nvfp4_global_scale_inv(obj, d, fqn)}, extra


def _nvfp4_insert(obj: Any, qt: QuantizedTensor, d: _AOContents, fqn: str) -> None:
    qt, _ = qt.with_per_tensor("global_scale_inv")  # no copy when it already is torchao's convention
    c = qt.components()
    scale = c["scale"]
    if qt.recipe.two_d:  # 16x16 tiles: each tile's scale on its 16 rows is the same 1x16 value
        scale = scale.repeat_interleave(16, dim=-2)[..., : d.shape[-2], :]
    new = c["global_scale_inv"]
    pts = getattr(obj, "per_tensor_scale", None)
    if pts is None:
        if not bool((new == 1.0).all()):
            raise CheckpointFormatError(
                f"{_where(fqn, d.ao_class)}: the target has no per_tensor_scale, but the loaded tensor's global "
                f"scale ({new.reshape(-1)[:4].tolist()}) is not 1 (the single-level encoding); build the target "
                f"with a per_tensor_scale (NVFP4Tensor.to_nvfp4(..., per_tensor_scale=...))"
            )
    else:
        if pts.numel() == 1 and new.numel() > 1:
            if not bool((new == new.reshape(-1)[0]).all()):
                raise CheckpointFormatError(
                    f"{_where(fqn, d.ao_class)}: the target holds one per_tensor_scale, "
                    f"the loaded tensor one global scale per expert"
                )
            new = new.reshape(-1)[:1]
        pts.copy_(new.reshape(pts.shape))
    obj.qdata.copy_(c["data"])
    _write_block_scales(obj, scale, d.swizzled)


_FP4X2 = torch.float4_e2m1fn_x2  # torchao's FP4 elem_dtype; its qdata is uint8, two codes per byte


def _mxfp8_describe(obj: Any, fqn: str) -> _AOContents:
    elem = getattr(obj, "elem_dtype", None)
    fp4 = elem == _FP4X2
    d = _AOContents("MXTensor", "mxfp4" if fp4 else "mxfp8", tuple(int(s) for s in obj.shape), obj.dtype, {})
    d.swizzled = _swizzled(obj)
    if elem not in (_E4M3, _FP4X2):
        _refuse(
            fqn,
            d.ao_class,
            f"elem_dtype={_plain(elem)}",
            "is neither float8_e4m3fn (ckptq's mxfp8) nor float4_e2m1fn_x2 (ckptq's mxfp4)",
        )
    if int(getattr(obj, "block_size", 32)) != 32:
        _refuse(fqn, d.ao_class, f"block_size={obj.block_size}", "is not 32")
    if len(d.shape) < 2:
        _refuse(fqn, d.ao_class, f"logical shape {d.shape}", "has fewer than 2 dims")
    q = _row_major(obj, d, fqn)
    if d.shape[-1] % 32:
        _refuse(fqn, d.ao_class, f"K={d.shape[-1]}", "is not a multiple of 32")
    if fp4:
        _check(q, (*d.shape[:-1], d.shape[-1] // 2), _U8, "qdata", d, fqn)
        d.recipe = {}
    else:
        _check(q, d.shape, _E4M3, "qdata", d, fqn)
        d.recipe = dict(columnwise=False)
    return d


def _mxfp8_extract(obj: Any, d: _AOContents, fqn: str) -> tuple[dict, dict]:
    scale = _read_block_scales(obj, d, d.shape[-1] // 32, torch.float8_e8m0fnu, fqn).view(_U8)
    extra = {
        "elem_dtype": "float4_e2m1fn_x2" if d.fmt == "mxfp4" else "float8_e4m3fn",
        "block_size": 32,
        "kernel_preference": _plain(getattr(obj, "kernel_preference", None)),
        "act_quant_kwargs": _plain(getattr(obj, "act_quant_kwargs", None)),
    }
    return {"data": obj.qdata, "scale": scale}, extra


def _mxfp8_insert(obj: Any, qt: QuantizedTensor, d: _AOContents, fqn: str) -> None:
    c = qt.components()
    obj.qdata.view(_U8).copy_(c["data"].view(_U8))
    _write_block_scales(obj, c["scale"], d.swizzled)


def _float8_describe(obj: Any, fqn: str) -> _AOContents:
    d = _AOContents("Float8Tensor", "", tuple(int(s) for s in obj.shape), obj.dtype, {})
    if len(d.shape) < 2:
        _refuse(fqn, d.ao_class, f"logical shape {d.shape}", "has fewer than 2 dims")
    q = _row_major(obj, d, fqn)
    if q.dtype not in (_E4M3, _E5M2):
        _refuse(fqn, d.ao_class, f"qdata dtype {q.dtype}", "is not float8_e4m3fn / float8_e5m2")
    _check(q, d.shape, q.dtype, "qdata", d, fqn)
    s = _tensor(obj, "scale", d.ao_class, fqn)
    if s.dtype != _F32:
        _refuse(fqn, d.ao_class, f"scale dtype {s.dtype}", "is not float32")
    if s.numel() == 1:
        d.fmt, d.recipe = "fp8_tensor", dict(fp8_dtype=q.dtype, pow2=False, eps=0.0)
        return d
    # torchao infers the block as shape // scale.shape (_maybe_expand_scale_to_tensor_shape)
    lead = d.shape[:-2]
    if (
        s.dim() != len(d.shape)
        or tuple(s.shape[:-2]) != lead
        or any(n % b for n, b in zip(d.shape[-2:], s.shape[-2:], strict=False))
    ):
        _refuse(
            fqn,
            d.ao_class,
            f"scale {tuple(s.shape)}",
            f"is not a block grid dividing the shape {d.shape} with one grid per leading index",
        )
    block = (d.shape[-2] // s.shape[-2], d.shape[-1] // s.shape[-1])
    d.fmt, d.recipe = "fp8_block", dict(block=block, fp8_dtype=q.dtype, pow2=False, eps=0.0)
    return d


def _float8_extract(obj: Any, d: _AOContents, fqn: str) -> tuple[dict, dict]:
    s = obj.scale
    lead = d.shape[:-2]
    if d.fmt == "fp8_tensor":
        scale_inv = s.reshape(()) if not lead else s.reshape(1).expand(math.prod(lead)).reshape(lead).contiguous()
    else:
        scale_inv = s
    bs = getattr(obj, "block_size", None)
    gran = (
        "per_tensor" if d.fmt == "fp8_tensor" else "per_row" if d.recipe["block"] == (1, d.shape[-1]) else "per_block"
    )
    extra = {
        "granularity": gran,
        "block_size": _plain(bs),
        "fp8_dtype": str(obj.qdata.dtype).replace("torch.", ""),
        "kernel_preference": _plain(getattr(obj, "kernel_preference", None)),
        "mm_config": _plain(getattr(obj, "mm_config", None)),
        "act_quant_kwargs": _plain(getattr(obj, "act_quant_kwargs", None)),
    }
    return {"data": obj.qdata, "scale_inv": scale_inv}, extra


def _float8_insert(obj: Any, qt: QuantizedTensor, d: _AOContents, fqn: str) -> None:
    c = qt.components()
    s = c["scale_inv"]
    if d.fmt == "fp8_tensor" and s.numel() > 1:
        if not bool((s == s.reshape(-1)[0]).all()):
            raise CheckpointFormatError(
                f"{_where(fqn, d.ao_class)}: the target holds one scale, the loaded tensor one per leading index"
            )
        s = s.reshape(-1)[:1]
    obj.scale.copy_(s.reshape(obj.scale.shape))
    obj.qdata.view(_U8).copy_(c["data"].view(_U8))


_HANDLERS = {
    "NVFP4Tensor": (_nvfp4_describe, _nvfp4_extract, _nvfp4_insert),
    "MXTensor": (_mxfp8_describe, _mxfp8_extract, _mxfp8_insert),
    "Float8Tensor": (_float8_describe, _float8_extract, _float8_insert),
}
_QT = {"nvfp4": NVFP4Tensor, "mxfp8": MXFP8Tensor, "fp8_tensor": Float8Tensor, "fp8_block": Float8BlockTensor}


def _qt_class(fmt: str) -> type:
    return _QT.get(fmt) or format_class(fmt)


# ============================================================================ public functions
def ao_class_of(obj: Any) -> str | None:
    """torchao's class name of a live torchao tensor (matched by module + qualname, bases too), a
    DTensor holding one, or a :class:`TorchAOPayload`; None otherwise. Never imports torchao."""
    obj = getattr(obj, "_local_tensor", obj)
    if isinstance(obj, TorchAOPayload):
        return obj.ao_class
    for cls in type(obj).__mro__:
        name = AO_CLASSES.get((cls.__module__, cls.__qualname__))
        if name is not None:
            return name
    return None


def _resolve(obj: Any, fqn: str):
    local = getattr(obj, "_local_tensor", obj)
    name = ao_class_of(local)
    if name is None:
        raise UnsupportedFormatError(
            f"tensor '{fqn}': {type(local).__name__} is not a torchao quantized tensor "
            f"(NVFP4Tensor, MXTensor, Float8Tensor)"
        )
    describe, extract, ins = _HANDLERS[name]
    return local, describe(local, fqn), extract, ins


def to_canonical(obj: Any, fqn: str) -> tuple[QuantizedTensor, dict]:
    """The canonical ckptq tensor of a torchao tensor (live, a DTensor's local one, or a pickle
    payload) and a ``producer`` record of builtins.

    Components are compact and unswizzled, of the object's logical shape; ``data`` (and unswizzled
    scales, Float8 scales) are views of torchao's buffers, swizzled scales and NVFP4 ``global_scale_inv``
    (``per_tensor_scale``'s bytes) copies.
    ``producer`` = ``{"name": "torchao", "version" (of the live library; None for a pickle payload),
    "class", "orig_dtype", "swizzled", ...}`` plus, for
    NVFP4Tensor, ``per_tensor_scale`` (None / "scalar" / "per_expert"),
    ``use_triton_kernel``, ``act_per_tensor_scale`` (float hex list), ``act_quant_kwargs``; MXTensor
    ``elem_dtype``, ``block_size``, ``kernel_preference``, ``act_quant_kwargs``; Float8Tensor
    ``granularity`` (per_tensor / per_row / per_block), ``block_size``, ``fp8_dtype``,
    ``kernel_preference``, ``mm_config``, ``act_quant_kwargs``.

    Raises:
        UnsupportedFormatError: what ckptq cannot hold exactly (names FQN, class and field).
        CheckpointFormatError: a field whose shape or dtype contradicts torchao's layout.
    """
    local, d, extract, _ = _resolve(obj, fqn)
    comps, extra = extract(local, d, fqn)
    cls = _qt_class(d.fmt)
    qt = cls.from_components(comps, d.shape, d.dtype, cls.Recipe(**d.recipe), fqn=fqn)
    version = None if isinstance(local, TorchAOPayload) else _version()  # a pickle's writer version is unknown
    producer = {
        "name": PRODUCER,
        "version": version,
        "class": d.ao_class,
        "orig_dtype": str(d.dtype).replace("torch.", ""),
        "swizzled": d.swizzled,
        **extra,
    }
    return qt, producer


def empty_canonical(obj: Any, fqn: str) -> QuantizedTensor:
    """Fresh uninitialized canonical components of ``obj``'s format, recipe, logical shape and device
    (what a load reads into before :func:`insert`)."""
    local, d, _, _ = _resolve(obj, fqn)
    cls = _qt_class(d.fmt)
    rec = cls.Recipe(**d.recipe)
    dev = local.qdata.device
    comps = {
        s.name: torch.empty(s.shape(d.shape), dtype=s.dtype, device=dev) for s in cls.component_specs(d.shape, rec)
    }
    return cls.from_components(comps, d.shape, d.dtype, rec, fqn=fqn)


def insert(obj: Any, qt: QuantizedTensor, fqn: str) -> float | None:
    """Write canonical ``qt`` into the torchao tensor's buffers in place: ``qdata``, ``scale``
    (swizzled, padding zeroed, when the target's are) and NVFP4 ``per_tensor_scale`` (``qt``'s
    ``global_scale_inv``, or the closest one for another convention:
    :meth:`ckptq.formats.NVFP4Tensor.with_per_tensor`). Nothing is requantized: returns None.

    Raises:
        CheckpointFormatError: ``qt``'s format, element dtype, block or shape does not fit the target
            (including an NVFP4 target without per_tensor_scale for a tensor whose global scale is not 1).
        UnsupportedFormatError: the target is of a kind ckptq refuses (see :func:`to_canonical`).
    """
    local, d, _, ins = _resolve(obj, fqn)
    check_fits(qt, d.fmt, d.shape, d.recipe, _where(fqn, d.ao_class))
    ins(local, qt, d, fqn)
    return None


# ============================================================================ safetensors files
# torchao 0.18 ``prototype/safetensors/safetensors_support.py`` (``flatten_tensor_state_dict`` /
# ``unflatten_tensor_state_dict``, what transformers' torchao integration saves with
# ``safe_serialization=True``): a tensor ``<module>.<name>`` of a torchao class is stored as the plain
# tensors ``<module>._<name>_<field>`` (one per tensor-data field that is not None), and the file's
# ``__metadata__`` maps ``<module>.<name>`` to the JSON ``{"_type": class, "_data": {attribute:
# encoded value}, "_tensor_data_names": [fields]}`` and ``"tensor_names"`` to the JSON list of every
# tensor name (plain ones have ``{"_type": "Tensor"}``). Encoded values (``safetensors_utils.py``,
# ``TensorSubclassAttributeJSONEncoder``): ``{"_type": "torch.dtype", "_data": "bfloat16"}``, enums
# ``{"_type": enum class, "_data": member name}``, dataclasses / NamedTuples ``{"_type", "_data": {field:
# value}}``, lists as lists.
_ST_PAYLOADS = {"NVFP4Tensor": NVFP4Payload, "MXTensor": MXPayload, "Float8Tensor": Float8Payload}
#: canonical component -> torchao field, per class
_ST_COMPONENTS = {
    "NVFP4Tensor": {"data": "qdata", "scale": "scale", "global_scale_inv": "per_tensor_scale"},
    "MXTensor": {"data": "qdata", "scale": "scale"},
    "Float8Tensor": {"data": "qdata", "scale_inv": "scale"},
}
#: the logical dtype's attribute per class
_ST_DTYPE_ATTR = {"NVFP4Tensor": "orig_dtype", "MXTensor": "orig_dtype", "Float8Tensor": "dtype"}
#: torchao's str enums the metadata names by member (``KernelPreference``, ``ScaleCalculationMode``)
_ST_ENUMS = ("KernelPreference", "ScaleCalculationMode")
#: torchao's other safetensors classes (``ALLOWED_TENSORS_SUBCLASSES``), refused by name
_ST_OTHER = ("Int4Tensor", "Int4TilePackedTo4dTensor", "IntxUnpackedToInt8Tensor", "Int8Tensor", "Int4PlainInt32Tensor")


def _st_decode(v: Any, depth: int = 0) -> Any:
    """An encoded attribute value as the pickle stand-ins hold it: dtypes -> torch.dtype, enums ->
    the member name (torchao's str enums pickle as their value; both are upper-case names here),
    dataclasses / NamedTuples -> records, lists kept."""
    if depth > 8:
        raise CheckpointFormatError("torchao safetensors metadata nests deeper than 8 levels")
    if isinstance(v, list):
        return [_st_decode(x, depth + 1) for x in v]
    if not isinstance(v, dict):
        return v
    kind, data = v.get("_type"), v.get("_data")
    if kind == "torch.dtype":
        dt = getattr(torch, str(data), None)
        if not isinstance(dt, torch.dtype):
            raise CheckpointFormatError(f"torchao safetensors metadata: unknown dtype {data!r}")
        return dt
    if kind in _ST_ENUMS and isinstance(data, str):
        return data.lower()  # torchao 0.18: each member's value is its name in lower case ("AUTO" -> "auto")
    if isinstance(data, dict):
        rec = _KWARG_RECORDS.get(kind) or (_MM_CONFIG if kind == "Float8MMConfig" else _record_type(str(kind)))
        obj = object.__new__(rec)
        obj.__dict__.update({k: _st_decode(x, depth + 1) for k, x in data.items()})
        return obj
    return data  # an enum member name


def safetensors_groups(metadata: dict, names: Any, where: str) -> dict[str, FlatTensor]:
    """The torchao tensors a safetensors file's ``__metadata__`` describes, by name; ``{}`` when the
    metadata is not torchao's (no ``tensor_names``, or records of types torchao does not write).
    ``names``: the tensor names stored (in any file of the folder).

    Raises:
        CheckpointFormatError: malformed torchao metadata, or a member tensor missing (names it).
        UnsupportedFormatError: a torchao class ckptq does not hold (names the tensor and class).
    """
    import json

    text = (metadata or {}).get("tensor_names")
    if not isinstance(text, str):
        return {}
    try:
        tensor_names = json.loads(text)
        records = {n: json.loads(metadata[n]) for n in tensor_names}
    except (ValueError, KeyError, TypeError):
        return {}  # some other tool's "tensor_names" (torchao's is_metadata_torchao is as lenient)
    known = ("Tensor", *_ST_PAYLOADS, *_ST_OTHER)
    if not all(isinstance(r, dict) and r.get("_type") in known for r in records.values()):
        return {}
    out = {}
    for name, rec in records.items():
        kind = rec["_type"]
        if kind == "Tensor":
            continue
        if kind in _ST_OTHER:
            raise UnsupportedFormatError(
                f"{where}: tensor '{name}' is a torchao {kind}, which ckptq does not hold (it holds "
                f"{sorted(_ST_PAYLOADS)}); dequantize it with torchao first"
            )
        if not isinstance(rec.get("_data"), dict):
            raise CheckpointFormatError(f"{where}: torchao {kind} '{name}' has no attribute record ('_data')")
        module, _, leaf = name.rpartition(".")
        members = {f: f"{module}._{leaf}_{f}" if module else f"_{leaf}_{f}" for f in rec.get("_tensor_data_names", [])}
        missing = [m for m in members.values() if m not in names]
        if missing:
            raise CheckpointFormatError(
                f"{where}: torchao {kind} '{name}' lists {sorted(members)}, but {missing} are not in the "
                f"folder; a shard is missing or the file was changed"
            )
        attrs = {k: _st_decode(v) for k, v in rec["_data"].items()}
        small = tuple(f for f in members if f not in ("qdata", "scale"))  # global scales: read when opened
        out[name] = FlatTensor(name, kind, attrs, members, small, dict(_ST_COMPONENTS[kind]))
    return out


def safetensors_to_canonical(flat: FlatTensor, tensors: dict) -> tuple[QuantizedTensor, dict]:
    """The canonical tensor and producer record of a flattened torchao tensor (``tensors``: stored
    name -> tensor; meta tensors for ``qdata`` and ``scale`` give the descriptor without reading
    them), through the same checks as a live or pickled one (:func:`to_canonical`)."""
    fields = {f: tensors[n] for f, n in flat.members.items()}
    q = fields.get("qdata")
    if q is None:
        raise CheckpointFormatError(f"tensor '{flat.fqn}' (torchao {flat.kind}): no qdata")
    packed = flat.kind == "NVFP4Tensor" or flat.attributes.get("elem_dtype") == _FP4X2  # two codes per byte
    shape = tuple(q.shape[:-1]) + ((q.shape[-1] * 2,) if packed else (q.shape[-1],))
    dtype = flat.attributes.get(_ST_DTYPE_ATTR[flat.kind])
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"tensor '{flat.fqn}' (torchao {flat.kind}): no logical dtype in its metadata")
    payload = torch.Tensor._make_wrapper_subclass(_ST_PAYLOADS[flat.kind], shape, dtype=dtype, device=q.device)
    payload.__setstate__({**{k: v for k, v in flat.attributes.items() if k != "dtype"}, **fields})
    return to_canonical(payload, flat.fqn)


def _st_dtype(dt: torch.dtype) -> dict:
    return {"_type": "torch.dtype", "_data": str(dt).replace("torch.", "")}


def _st_enum(kind: str, value: Any, default: str) -> dict:
    v = value if isinstance(value, str) and value else default
    return {"_type": kind, "_data": v.upper()}  # member name (see _st_decode)


def safetensors_flatten(name: str, qt: QuantizedTensor, producer: dict | None) -> tuple[dict, str, dict]:
    """torchao's flattened form of canonical ``qt`` stored as ``name`` (what torchao's
    ``flatten_tensor_state_dict`` writes for the torchao tensor :func:`insert` would fill):
    ``({stored name: tensor}, metadata JSON, numerics)``; ``numerics`` ``{"max_ulps": n}`` when an
    NVFP4 global scale changed convention (:meth:`~ckptq.formats.NVFP4Tensor.with_per_tensor`).

    Scales are written compact (``is_swizzled_scales`` false); attributes torchao keeps beside the
    values (``kernel_preference``, ``use_triton_kernel``) come from a torchao ``producer`` record,
    else torchao's defaults; ``act_quant_kwargs``, ``mm_config`` and ``act_per_tensor_scale`` are not
    written (null / absent: the weight's values do not depend on them).

    MXFP8 with a columnwise copy is written rowwise (torchao's MXTensor has none).

    Raises:
        UnsupportedFormatError: a tensor torchao's classes cannot hold (fp8_block blocks that do not
            divide the shape; ranks other than 2 and 3), naming it.
    """
    import json

    prod = producer if isinstance(producer, dict) and producer.get("name") == PRODUCER else {}
    c, shape, info = qt.components(), tuple(qt.shape), {}
    module, _, leaf = name.rpartition(".")
    prefix = f"{module}._{leaf}_" if module else f"_{leaf}_"
    where = f"tensor '{name}' ({qt.FORMAT})"
    if qt.FORMAT == "nvfp4":
        qt, u = qt.with_per_tensor("global_scale_inv")
        if u:
            info["max_ulps"] = u
        c = qt.components()
        scale = c["scale"].repeat_interleave(16, dim=-2)[..., : shape[-2], :] if qt.recipe.two_d else c["scale"]
        g = c["global_scale_inv"].to(_F32)
        fields = {"qdata": c["data"], "scale": scale}
        uniform = bool((g == g.reshape(-1)[0]).all()) if g.numel() else True
        if not (prod and prod.get("per_tensor_scale") is None and bool((g == 1.0).all())):
            one = uniform and (len(shape) == 2 or prod.get("per_tensor_scale") != "per_expert")
            fields = {"per_tensor_scale": g.reshape(-1)[:1].reshape(()) if one else g.reshape(-1, 1, 1), **fields}
        kind = "NVFP4Tensor"
        data = {
            "is_swizzled_scales": False,
            "use_triton_kernel": bool(prod.get("use_triton_kernel", False)),
            "act_quant_kwargs": None,
            "block_size": 16,
            "orig_dtype": _st_dtype(qt.dtype),
        }
    elif qt.FORMAT in ("mxfp8", "mxfp4"):
        kind = "MXTensor"
        fields = {"qdata": c["data"], "scale": c["scale"].view(torch.float8_e8m0fnu)}
        data = {
            "elem_dtype": _st_dtype(_FP4X2 if qt.FORMAT == "mxfp4" else _E4M3),
            "block_size": 32,
            "orig_dtype": _st_dtype(qt.dtype),
            "kernel_preference": _st_enum("KernelPreference", prod.get("kernel_preference"), "emulated"),
            "act_quant_kwargs": None,
            "is_swizzled_scales": False,
        }
    elif qt.FORMAT in ("fp8_tensor", "fp8_block"):
        kind = "Float8Tensor"
        nd = len(shape)
        if qt.FORMAT == "fp8_tensor":  # one scale (torchao's PerTensor), else one per matrix: block (1, M, K)
            si = c["scale_inv"].reshape(-1)
            if bool((si == si[0]).all()):
                scale, block = si[:1].reshape((1,) * nd), list(shape)
            else:
                scale, block = si.reshape(tuple(shape[:-2]) + (1, 1)), [1] * (nd - 2) + list(shape[-2:])
        else:
            bm, bk = qt.recipe.block
            if shape[-2] % bm or shape[-1] % bk:
                raise UnsupportedFormatError(
                    f"{where}: torchao's Float8Tensor infers the block as shape // scale shape, so block "
                    f"{(bm, bk)} must divide the shape {shape}; convert it with --to fp8_block --block of a "
                    f"divisor first, or export another layout"
                )
            scale, block = c["scale_inv"], [1] * (nd - 2) + [bm, bk]
        fields = {"qdata": c["data"], "scale": scale.to(_F32)}
        data = {
            "block_size": block,
            "mm_config": None,
            "act_quant_kwargs": None,
            "kernel_preference": _st_enum("KernelPreference", prod.get("kernel_preference"), "auto"),
            "dtype": _st_dtype(qt.dtype),
        }
    else:
        raise UnsupportedFormatError(f"{where}: torchao has no tensor class for {qt.FORMAT}")
    if len(shape) not in (2, 3):
        refuse(where, name, f"logical shape {shape}", "is not 2-D or 3-D")
    record = {"_type": kind, "_data": data, "_tensor_data_names": list(fields)}
    return {prefix + f: t.contiguous() for f, t in fields.items()}, json.dumps(record), info

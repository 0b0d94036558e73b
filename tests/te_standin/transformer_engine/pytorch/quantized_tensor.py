"""Stand-in for ``transformer_engine/pytorch/quantized_tensor.py``: ``Quantizer`` and the wrapper
base ``QuantizedTensor`` (docs/producers.md, 2.1).

The wrapper is a ``torch.Tensor._make_wrapper_subclass`` with the *logical* shape and a fake
high-precision dtype; bytes live in inner buffers named as in TE. Dispatch implements only what
DTensor wrapping and DCP's save/stage path need (as TE does, natively): detach/alias, identity
view/slice, ``_to_copy`` keeping the subclass, clone, raw ``copy_`` between equal layouts,
``new_empty``/``new_zeros``/``empty_like``/``zeros_like`` of the same shape, ``is_pinned`` and
``_pin_memory``. Anything else raises ``NotImplementedError`` (TE would dequantize; the tests must
not depend on that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

aten = torch.ops.aten


class Quantizer:
    """Base quantizer; ``__dict__`` starts with these four keys in this order (TE main)."""

    def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False
        self.optimize_for_gemm = False

    def copy(self) -> Quantizer:
        """Shallow copy with the same ``__dict__`` (key order kept)."""
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        return out

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not isinstance(v, torch.Tensor))
        return f"{type(self).__name__}({fields})"


class QuantizedTensor(torch.Tensor):
    """Wrapper base. Subclasses list their inner tensor attributes in ``_BUFFERS`` and the flags
    that must agree for a raw ``copy_`` in ``_LAYOUT_FLAGS``."""

    _BUFFERS: ClassVar[tuple[str, ...]] = ()
    _LAYOUT_FLAGS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _wrap(cls, shape, dtype, device, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )

    def __init__(self, *args, **kwargs):  # state is set in __new__
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---------------------------------------------------------------- helpers
    def _buffers(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in self._BUFFERS}

    def _rebuild(self, fn: Callable[[torch.Tensor], torch.Tensor], shape=None) -> QuantizedTensor:
        """Same metadata (quantizer copied), every held buffer replaced by ``fn(buffer)``."""
        new = {k: (None if v is None else fn(v)) for k, v in self._buffers().items()}
        device = next((v.device for v in new.values() if v is not None), self.device)
        out = type(self)._wrap(self.shape if shape is None else shape, self.dtype, device)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(new)
        q = self.__dict__.get("_quantizer")
        out._quantizer = q.copy() if q is not None else None
        return out

    def _same_layout(self, other) -> bool:
        if type(self) is not type(other) or tuple(self.shape) != tuple(other.shape):
            return False
        for k in self._BUFFERS:
            a, b = getattr(self, k), getattr(other, k)
            if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or a.dtype != b.dtype)):
                return False
        return all(getattr(self, f, None) == getattr(other, f, None) for f in self._LAYOUT_FLAGS)

    def untyped_storage(self) -> torch.UntypedStorage:
        # As TE (#2974): an empty storage, so DCP/FSDP2 staging code that inspects storages works.
        return torch.UntypedStorage(0, device=self.device)

    def dequantize(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    # ---------------------------------------------------------------- dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket
        self = args[0]
        if op in (aten.detach, aten.alias):
            return self._rebuild(func)
        if op in (aten.view, aten._unsafe_view):
            size = list(args[1])
            if -1 in size:
                size[size.index(-1)] = self.numel() // max(1, -_prod(size))
            if tuple(size) != tuple(self.shape):
                raise NotImplementedError(f"{cls.__name__} stand-in: only identity views")
            return self._rebuild(lambda t: t.view(t.shape))
        if op is aten._to_copy:
            dtype = kwargs.get("dtype")
            if dtype is not None and dtype != self.dtype:
                raise NotImplementedError(f"{cls.__name__} stand-in: _to_copy to {dtype} would dequantize")
            dev = kwargs.get("device")
            pin = bool(kwargs.get("pin_memory"))

            def move(t):
                out = t.to(device=dev, copy=True) if dev is not None else t.clone()
                return out.pin_memory() if pin else out

            return self._rebuild(move)
        if op is aten.clone:
            return self._rebuild(lambda t: t.clone())
        if op is aten.copy_:
            dst, src = args[0], args[1]
            if not (isinstance(dst, QuantizedTensor) and dst._same_layout(src)):
                raise NotImplementedError(f"{cls.__name__} stand-in: copy_ only between equal layouts")
            for k in dst._BUFFERS:
                d, s = getattr(dst, k), getattr(src, k)
                if d is not None:
                    d.copy_(s)
            return dst
        if op in (aten.new_empty, aten.new_zeros, aten.empty_like, aten.zeros_like):
            size = tuple(args[1]) if op in (aten.new_empty, aten.new_zeros) else tuple(self.shape)
            if size != tuple(self.shape) or kwargs.get("dtype") not in (None, self.dtype):
                raise NotImplementedError(f"{cls.__name__} stand-in: {op} only with the same shape/dtype")
            dev = kwargs.get("device") or self.device
            zero = op in (aten.new_zeros, aten.zeros_like)
            pin = bool(kwargs.get("pin_memory"))
            new = torch.zeros if zero else torch.empty
            return self._rebuild(lambda t: new(t.shape, dtype=t.dtype, device=dev, pin_memory=pin))
        if op is aten.is_pinned:
            return all(t.is_pinned() for t in self._buffers().values() if t is not None)
        if op is aten._pin_memory:
            return self._rebuild(lambda t: t.pin_memory())
        if op is aten.slice:
            full = list(args[1:5]) + [0, None, None, 1][len(args) - 1 :]
            dim, start, end, step = full[0], full[1], full[2], full[3]
            n = self.shape[dim]
            if (start or 0) == 0 and (end is None or end >= n) and step == 1:
                return self._rebuild(lambda t: t)
            raise NotImplementedError(f"{cls.__name__} stand-in: only identity slices")
        raise NotImplementedError(f"{cls.__name__} stand-in does not implement {func}")


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out

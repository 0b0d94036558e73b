"""Stand-in for TE's compiled extension ``transformer_engine_torch`` (``tex``): only ``DType``.

TE binds ``DType`` with pybind11 (``common/util/pybind_helper.h``): not an ``int`` subclass, and it
pickles as ``(transformer_engine_torch.DType, (int,))``. #2974-era TE stored this enum in
``_fp8_dtype`` / quantizer ``dtype``; TE main normalizes to ``constants.DType``.
"""

from __future__ import annotations

_NAMES = {
    0: "kByte",
    2: "kInt32",
    4: "kFloat32",
    5: "kFloat16",
    6: "kBFloat16",
    7: "kFloat8E4M3",
    8: "kFloat8E5M2",
    10: "kFloat4E2M1",
}


class DType:
    """pybind11-like enum value: ``int(d)``, ``d.name``, equality with ints and other enums."""

    __slots__ = ("_value",)

    def __init__(self, value: int):
        value = int(value)
        if value not in _NAMES:
            raise ValueError(f"{value} is not a valid transformer_engine_torch.DType")
        object.__setattr__(self, "_value", value)

    @property
    def name(self) -> str:
        return _NAMES[self._value]

    @property
    def value(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    __index__ = __int__

    def __eq__(self, other) -> bool:
        try:
            return self._value == int(other)
        except (TypeError, ValueError):
            return NotImplemented

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return f"<DType.{self.name}: {self._value}>"

    def __reduce__(self):
        return (DType, (self._value,))

    def __reduce_ex__(self, protocol):
        return (DType, (self._value,))


for _v, _n in _NAMES.items():
    setattr(DType, _n, DType(_v))
del _v, _n

"""Stand-in for ``transformer_engine/pytorch/constants.py``: the ``DType`` IntEnum and block sizes.

Values from ``transformer_engine/common/include/transformer_engine/transformer_engine.h``. An
IntEnum pickles as ``(transformer_engine.pytorch.constants.DType, (value,))``.
"""

from __future__ import annotations

import enum

MXFP8_BLOCK_SCALING_SIZE = 32
NVFP4_BLOCK_SCALING_SIZE = 16


class DType(enum.IntEnum):
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

    @classmethod
    def cast(cls, dtype) -> DType:
        """Normalize a ``DType`` or ``transformer_engine_torch.DType`` (anything with ``int()``)."""
        return dtype if isinstance(dtype, cls) else cls(int(dtype))

    def __eq__(self, other):
        try:
            return int(self) == int(other)
        except (TypeError, ValueError):
            return NotImplemented

    def __ne__(self, other):
        r = self.__eq__(other)
        return r if r is NotImplemented else not r

    def __hash__(self):
        return int.__hash__(self)

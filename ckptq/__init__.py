"""ckptq: checkpoints of low-precision quantized tensors (FP8, FP8 blockwise, MXFP8, NVFP4) for
PyTorch Distributed Checkpoint (DCP): native bit-exact saves, high-precision export, inspection.

The names below are imported on first use (PEP 562), so that ``import ckptq`` (and the ``ckptq``
command's ``--help``, ``--version`` and usage errors) does not import torch.
"""

from __future__ import annotations

import importlib

from ._version import __version__ as __version__
from .errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    CkptqError,
    InconsistentScaleError,
    QuantizationError,
    ShardingError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    UsageError,
)

__all__ = [
    "quantize",
    "requantize",
    "from_components",
    "QuantizedTensor",
    "Float8Tensor",
    "Float8BlockTensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "QuantizedSavePlanner",
    "QuantizedLoadPlanner",
    "quantize_state_dict",
    "reshard_checkpoint",
    "ReshardOptions",
    "CkptqError",
    "CheckpointFormatError",
    "ChecksumMismatchError",
    "ShardingError",
    "InconsistentScaleError",
    "UnsupportedFormatError",
    "QuantizationError",
    "UnsafeCheckpointError",
    "UsageError",
]

#: Public name -> the submodule that defines it (imported when the name is first read).
_LAZY = {
    **dict.fromkeys(
        (
            "quantize",
            "requantize",
            "from_components",
            "QuantizedTensor",
            "Float8Tensor",
            "Float8BlockTensor",
            "MXFP8Tensor",
            "NVFP4Tensor",
        ),
        ".formats",
    ),
    **dict.fromkeys(("QuantizedSavePlanner", "QuantizedLoadPlanner", "quantize_state_dict"), ".planners"),
    **dict.fromkeys(("reshard_checkpoint", "ReshardOptions"), ".reshard"),
}


def __getattr__(name: str):
    """A public name of :data:`__all__` from its submodule, or a submodule (``ckptq.io``,
    ``ckptq.formats``, ...) after a plain ``import ckptq``."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later reads skip this function
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""ckptq: checkpoints of low-precision quantized tensors (FP8, FP8 blockwise, MXFP8, NVFP4, MXFP4) for
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
    MissingKeyError,
    QuantizationError,
    ShardingError,
    UnsafeCheckpointError,
    UnsafePickledObjectError,
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
    "MXFP4Tensor",
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
    "UnsafePickledObjectError",
    "MissingKeyError",
    "UsageError",
]

_FORMATS = (
    "quantize",
    "requantize",
    "from_components",
    "QuantizedTensor",
    "Float8Tensor",
    "Float8BlockTensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "MXFP4Tensor",
)
_PLANNERS = ("QuantizedSavePlanner", "QuantizedLoadPlanner", "quantize_state_dict")
_RESHARD = ("reshard_checkpoint", "ReshardOptions")


def __getattr__(name: str):
    """A public name of :data:`__all__` from its submodule (imported on first use), or a submodule
    (``ckptq.io``, ``ckptq.formats``, ...) after a plain ``import ckptq``."""
    if name in _FORMATS:
        from . import formats as module
    elif name in _PLANNERS:
        from . import planners as module
    elif name in _RESHARD:
        from . import reshard as module
    elif name == "io":  # ckptq.io.SafeFileSystemReader after a plain `import ckptq`
        return importlib.import_module(".io", __name__)
    elif not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""ckptq: checkpoints of low-precision quantized tensors (FP8, FP8 blockwise, MXFP8, NVFP4) for
PyTorch Distributed Checkpoint (DCP): native bit-exact saves, high-precision export, inspection."""

from __future__ import annotations

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
from .formats import (
    Float8BlockTensor,
    Float8Tensor,
    MXFP8Tensor,
    NVFP4Tensor,
    QuantizedTensor,
    from_components,
    quantize,
    requantize,
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


def __getattr__(name):  # planners and reshard import torch.distributed.checkpoint lazily
    if name in ("QuantizedSavePlanner", "QuantizedLoadPlanner", "quantize_state_dict"):
        from . import planners

        return getattr(planners, name)
    if name in ("reshard_checkpoint", "ReshardOptions"):
        from . import reshard

        return getattr(reshard, name)
    if name == "io":  # ckptq.io.SafeFileSystemReader after a plain `import ckptq`
        import importlib

        return importlib.import_module(".io", __name__)
    raise AttributeError(f"module 'ckptq' has no attribute {name!r}")

"""The ckptq error hierarchy.

Every error a user can trigger is a :class:`CkptqError`. Messages name the tensor (FQN), its shape,
dtype and block where they apply, and say what to do. ``assert`` is used only for internal invariants.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CkptqError",
    "CheckpointFormatError",
    "ShardingError",
    "InconsistentScaleError",
    "UnsupportedFormatError",
    "QuantizationError",
    "UnsafeCheckpointError",
    "UnsafePickledObjectError",
    "MissingKeyError",
    "ChecksumMismatchError",
    "UsageError",
]


class CkptqError(Exception):
    """Base class of every error raised by ckptq."""


class CheckpointFormatError(CkptqError, ValueError):
    """A checkpoint or component set is malformed: missing or truncated entries, wrong shapes or
    dtypes, an unknown descriptor version."""


class ShardingError(CkptqError, ValueError):
    """A shard boundary falls inside a quantization block, a shard is not one contiguous box, or the
    saved chunks do not cover what a load asks for."""


class InconsistentScaleError(ShardingError):
    """The shards of one tensor carry different per-tensor values (FP8 ``scale_inv``, NVFP4 ``amax``)."""


class UnsupportedFormatError(CkptqError, ValueError):
    """An unknown format name, recipe option or an operation a quantized tensor does not support."""


class QuantizationError(CkptqError, ValueError):
    """Input that cannot be quantized as asked (wrong rank, odd last dim for NVFP4, non-float input)."""


class UnsafeCheckpointError(CheckpointFormatError):
    """A pickle in a checkpoint references a global outside the allow-list; nothing from it was run."""


class UnsafePickledObjectError(UnsafeCheckpointError, pickle.UnpicklingError):
    """A non-tensor (bytes) entry of a checkpoint pickles a global outside the allow-list of trainer
    state types (:func:`ckptq.io.safe_pickle.load_pickled_object`); nothing from it was run. Also a
    ``pickle.UnpicklingError``, which is what ``torch.load(weights_only=True)`` raises for it."""


class MissingKeyError(CheckpointFormatError, RuntimeError):
    """State-dict entries to load are not in the checkpoint (and ``allow_partial_load`` is off).
    Also a ``RuntimeError`` with DCP's phrase "Missing key in checkpoint", as DCP's default load
    planner raises it (torch 2.11 and 2.13 ``default_planner.py``)."""


class ChecksumMismatchError(CheckpointFormatError):
    """A record's bytes do not match the checksum its checkpoint recorded for them (a corrupt or
    replaced data file); the message names the file, byte range and entry."""


class UsageError(CkptqError, ValueError):
    """Bad user-supplied option text (a mesh, placement, plan, ``--to`` target, dtype or choice
    that does not parse); the CLI exits 2, as for its own usage errors."""

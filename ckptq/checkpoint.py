"""Offline, read-only access to DCP checkpoints as *logical* tensors.

:class:`CheckpointView` reads any ``FileSystemWriter`` checkpoint (ckptq or plain) without a process
group or executing pickled code: each logical entry (:class:`ckptq.contract.Entry`, folded and
validated by :func:`ckptq.contract.fold_entries`) is a natively saved quantized tensor (its
components folded together), a high-precision entry of a quantized tensor, a plain tensor, or a
non-tensor (bytes) entry. The writer of checkpoint directories is :mod:`ckptq.io.writer`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from .contract import Entry, fold_entries, read_record, saved_world_size
from .errors import CheckpointFormatError
from .formats import from_components
from .formats.base import QuantizedTensor
from .io.reader import SafeFileSystemReader, load_entries, read_metadata

__all__ = ["Entry", "CheckpointView"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointView:
    """Read-only logical view of a DCP checkpoint directory.

    Args:
        path: the checkpoint directory.
        metadata: use this already-read ``Metadata`` (planning from metadata alone; reads of
            tensor data still go to ``path``).

    Raises:
        CheckpointFormatError / UnsafeCheckpointError: from :func:`ckptq.io.read_metadata`.
    """

    def __init__(self, path: PathLike, *, metadata: Optional[Metadata] = None):
        self.path = Path(path)
        self.metadata: Metadata = read_metadata(self.path) if metadata is None else metadata
        self.record = read_record(self.metadata.planner_data)
        self.reader = SafeFileSystemReader(self.path, metadata=self.metadata)
        self._entries = fold_entries(self.metadata, where=str(self.path))

    def entries(self) -> list[Entry]:
        """Logical entries in a stable order (sorted by FQN)."""
        return [self._entries[k] for k in sorted(self._entries)]

    def __contains__(self, fqn: str) -> bool:
        return fqn in self._entries

    def entry(self, fqn: str) -> Entry:
        try:
            return self._entries[fqn]
        except KeyError:
            raise CheckpointFormatError(f"{self.path}: no entry '{fqn}'") from None

    @property
    def world_size(self) -> Optional[int]:
        """Ranks that saved it (:func:`ckptq.contract.saved_world_size`)."""
        return saved_world_size(self.metadata)[0]

    def read(self, fqn: str) -> Union[QuantizedTensor, torch.Tensor]:
        """The whole logical tensor: a QuantizedTensor for native entries, else a plain tensor.

        Memory: the tensor plus one saved chunk at a time (DCP reads chunk by chunk).
        """
        e = self.entry(fqn)
        if e.kind == "bytes":
            raise CheckpointFormatError(f"{self.path}: '{fqn}' is a non-tensor entry")
        data = load_entries(self.reader, self.metadata, list(e.keys.values()))
        if e.kind == "tensor":
            return data[fqn]
        return from_components(e.descriptor, {name: data[key] for name, key in e.keys.items()})

    def read_raw_bytes(self, fqn: str) -> tuple[bytes, Any]:
        """The stored record of a non-tensor entry, verbatim (never unpickled), and its transform
        descriptors (DCP stream extensions), for copying into another checkpoint."""
        info = (self.metadata.storage_data or {}).get(MetadataIndex(fqn))
        if info is None or not hasattr(info, "relative_path"):
            raise CheckpointFormatError(f"{self.path}: no storage location for '{fqn}'")
        with open(self.path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return f.read(info.length), getattr(info, "transform_descriptors", None)

    def mapping(self, key: str) -> Optional[tuple]:
        """DCP's flatten mapping (path tuple) of an entry, if the checkpoint has one."""
        pd = self.metadata.planner_data
        if isinstance(pd, dict) and isinstance(pd.get(key), tuple):
            return pd[key]
        return None

"""Offline, read-only access to DCP checkpoints as *logical* tensors.

:class:`CheckpointView` reads any ``FileSystemWriter`` checkpoint (ckptq or plain) without a process
group or executing pickled code: each logical entry (:class:`ckptq.contract.Entry`, folded and
validated by :func:`ckptq.contract.fold_entries`) is a natively saved quantized tensor (its
components folded together), a high-precision entry of a quantized tensor, a plain tensor, or a
non-tensor (bytes) entry. The writer of checkpoint directories is :mod:`ckptq.io.writer`.

:func:`open_checkpoint` opens any checkpoint ckptq reads (a DCP directory, or a source another
library wrote that a registered opener recognizes, e.g. a Hugging Face safetensors folder or a
``torch.save`` file) as an object with the :class:`CheckpointView` interface, so reshard, convert,
inspect and verify work on all of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from .contract import Entry, EntryTable, fold_entries, read_record, saved_world_size
from .errors import CheckpointFormatError
from .formats import from_components
from .formats.base import QuantizedTensor
from .io.reader import SafeFileSystemReader, load_entries, read_metadata

__all__ = ["Entry", "CheckpointView", "open_checkpoint", "register_source"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointView(EntryTable):
    """Read-only logical view of a DCP checkpoint directory.

    Args:
        path: the checkpoint directory.
        metadata: use this already-read ``Metadata`` (planning from metadata alone; reads of
            tensor data still go to ``path``). It must be one :func:`ckptq.io.read_metadata` or
            ``SafeFileSystemReader`` returned: those checked it (:func:`ckptq.io.check_storage`)
            before anything is allocated from its sizes.

    Raises:
        CheckpointFormatError / UnsafeCheckpointError: from :func:`ckptq.io.read_metadata`.
    """

    def __init__(self, path: PathLike, *, metadata: Optional[Metadata] = None):
        self.path = Path(path)
        self.metadata: Metadata = read_metadata(self.path) if metadata is None else metadata
        self.record = read_record(self.metadata.planner_data)
        self.reader = SafeFileSystemReader(self.path, metadata=self.metadata)
        self._entries = fold_entries(self.metadata, where=str(self.path))

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
            blob = f.read(info.length)
        descriptors = getattr(info, "transform_descriptors", None)
        if not descriptors:
            _check_archive(blob, f"{self.path}: '{fqn}', record '{info.relative_path}' bytes "
                                 f"{info.offset}..{info.offset + info.length}")
        return blob, descriptors

    def mapping(self, key: str) -> Optional[tuple]:
        """DCP's flatten mapping (path tuple) of an entry, if the checkpoint has one."""
        pd = self.metadata.planner_data
        if isinstance(pd, dict) and isinstance(pd.get(key), tuple):
            return pd[key]
        return None


def _check_archive(blob: bytes, where: str) -> None:
    """A non-tensor record copied verbatim must be a whole ``torch.save`` archive (a zip whose members'
    CRC-32s match); it is never unpickled here."""
    import io
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            bad = z.testzip()
    except Exception as e:  # not a zip, truncated, damaged directory
        raise CheckpointFormatError(f"{where}: the record is truncated or corrupt ({type(e).__name__}: {e}); "
                                    f"restore the file or re-save the checkpoint") from None
    if bad is not None:
        raise CheckpointFormatError(f"{where}: member '{bad}' of the record fails its CRC-32 check; the file "
                                    f"is corrupt: restore it or re-save the checkpoint")


#: ``(name, detect, open)`` of the non-DCP sources, tried in order (see :func:`register_source`).
_SOURCES: list[tuple[str, Callable[[Path], bool], Callable[[Path], Any]]] = []


def register_source(name: str, detect: Callable[[Path], bool], opener: Callable[[Path], Any]) -> None:
    """Teach :func:`open_checkpoint` another kind of checkpoint.

    Args:
        name: what it is, for messages (``"Hugging Face safetensors"``).
        detect: ``path -> bool``, cheap (file names, a config file), never raising for paths of
            other kinds.
        opener: ``path -> view``: an object with :class:`CheckpointView`'s interface (``path``,
            ``entries``, ``entry``, ``__contains__``, ``read``, ``read_raw_bytes``, ``mapping``)
            whose entries are :class:`ckptq.contract.Entry` s with ckptq descriptors.
    """
    _SOURCES.append((name, detect, opener))


def open_checkpoint(path: PathLike) -> Any:
    """A read-only logical view of the checkpoint at ``path``: :class:`CheckpointView` for a DCP
    directory (or its ``.metadata``), else the view of the first registered source that
    recognizes it.

    Raises:
        CheckpointFormatError: nothing recognizes ``path`` (names what was tried), or it is
            malformed; UnsafeCheckpointError: it would run code.
    """
    p = Path(path)
    if p.is_dir() and (p / ".metadata").is_file() or p.name == ".metadata":
        return CheckpointView(p.parent if p.name == ".metadata" else p)
    _load_builtin_sources()
    for _, detect, opener in _SOURCES:
        if detect(p):
            return opener(p)
    return CheckpointView(p)  # raises the DCP reader's precise error (missing, not DCP, ...)


def _load_builtin_sources() -> None:
    """Register ckptq's own non-DCP sources (once): each module's ``SOURCE`` (name, detect, opener)."""
    import importlib

    while _BUILTIN_SOURCE_MODULES:
        register_source(*importlib.import_module(_BUILTIN_SOURCE_MODULES.pop(0)).SOURCE)


#: Modules (below this one) whose ``SOURCE`` tuple is registered on the first non-DCP open.
_BUILTIN_SOURCE_MODULES: list[str] = ["ckptq.io.torchsave", "ckptq.io.safetensors"]

"""The interface every checkpoint source implements, and what registers one with ``open_checkpoint``.

A *source* is a read-only logical view of one saved checkpoint: a DCP directory
(:class:`ckptq.checkpoint.CheckpointView`), a ``torch.save`` file (:class:`ckptq.io.torchsave.TorchSaveView`)
or a Hugging Face safetensors file or folder (:class:`ckptq.io.safetensors.SafetensorsView`). The
offline tools (reshard, convert, export, inspect, verify) use only :class:`CheckpointSource`; each
source module declares one :class:`SourceKind` (``SOURCE``) that :func:`ckptq.checkpoint.open_checkpoint`
lists. This module imports no source, so the sources and ``checkpoint`` import it, never each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..contract import Entry
from ..formats.base import QuantizedTensor

__all__ = ["CheckpointSource", "SourceKind"]


@runtime_checkable
class CheckpointSource(Protocol):
    """What the offline tools use of an opened checkpoint.

    Attributes:
        path: the checkpoint (directory or file) as opened.
        source: what it is, for reports (``"dcp"``, ``"torch.save file"``, ``"safetensors (modelopt)"``).
        files: its data files (paths).
        world_size: the ranks that saved it, when the source records them, else None.
    """

    path: Path
    source: str

    @property
    def files(self) -> Sequence[Path]: ...

    @property
    def world_size(self) -> int | None: ...

    def entries(self) -> list[Entry]:
        """The logical entries (:class:`ckptq.contract.Entry`, with ckptq descriptors), sorted by FQN."""
        ...

    def __contains__(self, fqn: str) -> bool: ...

    def entry(self, fqn: str) -> Entry:
        """The entry ``fqn``. Raises CheckpointFormatError naming the checkpoint if there is none."""
        ...

    def read(self, fqn: str) -> QuantizedTensor | torch.Tensor:
        """The whole logical tensor ``fqn``: a QuantizedTensor for ``"quantized"`` entries, else a
        plain CPU tensor (its stored dtype and logical shape). Raises CheckpointFormatError for a
        ``"bytes"`` entry or a damaged record."""
        ...

    def read_raw_bytes(self, fqn: str) -> tuple[bytes, Any]:
        """The stored record of non-tensor entry ``fqn``, verbatim (never unpickled), and its DCP
        stream transform descriptors. Raises CheckpointFormatError where the source has none."""
        ...

    def mapping(self, key: str) -> tuple | None:
        """DCP's flatten mapping (path tuple) of an entry, or None."""
        ...

    def saved_chunks(self, key: str) -> list | None:
        """The saved chunks of tensor entry ``key`` as byte ranges of the data files
        (:class:`ckptq.checkpoint.SavedChunk`), or None when they cannot be read by byte range
        (then the tools use :meth:`read`)."""
        ...

    def close(self) -> None:
        """Release open files and buffers (the source stays usable: it reopens them)."""
        ...


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """One kind of checkpoint :func:`ckptq.checkpoint.open_checkpoint` opens.

    Attributes:
        name: what it is, for messages (``"Hugging Face safetensors"``).
        detect: ``path -> bool``, cheap (file names, a config file), never raising for paths of other kinds.
        open: ``path -> CheckpointSource``.
    """

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], CheckpointSource]

"""``torch.save`` files as ckptq checkpoints (a source for :func:`ckptq.open_checkpoint`).

A ``torch.save`` file of a dict of tensors (a model's ``state_dict()``, nested dicts flattened with
``'.'``) is presented as a :class:`ckptq.io.source.CheckpointSource`: plain tensors
are ``"tensor"`` entries, foreign quantized tensors that a registered adapter knows (torchao's
``NVFP4Tensor`` / ``MXTensor`` / ``Float8Tensor``, TransformerEngine's) are ``"quantized"`` entries
with ckptq descriptors (:func:`ckptq.contract.native_descriptor`, the adapter's ``producer``), read as
canonical ckptq tensors. So ``ckptq inspect model.pt`` and ``ckptq convert model.pt out --to native``
work on such files.

The file is unpickled once, when the view is opened, by :func:`ckptq.io.foreign.load_record`:
torch's ``weights_only`` unpickler plus the adapters' declared globals mapped to ckptq stand-ins;
nothing else is resolved and no code from the file runs. The whole file is read into memory.
Non-tensor values (ints, strings, optimizer hyper-parameters) are not entries; their keys are listed
in :attr:`TorchSaveView.skipped`.

Format (torch/serialization.py, ``_save``): a zip archive ``<name>/data.pkl`` (the pickle),
``<name>/data/<key>`` (storages), ``<name>/version`` ...; :func:`detect` looks for ``*/data.pkl``.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import adapters
from ..contract import Entry, EntryTable, component_fqn, native_descriptor
from ..errors import CheckpointFormatError
from ..formats.base import QuantizedTensor
from .foreign import load_record
from .source import SourceKind

__all__ = ["TorchSaveView", "detect", "check_torchsave_records"]

NAME = "torch.save file"


def detect(path: Path) -> bool:
    """True for a file that is a zip archive holding a ``<dir>/data.pkl`` (``torch.save``'s
    format since torch 1.6); never raises."""
    try:
        p = Path(path)
        if not p.is_file() or not zipfile.is_zipfile(p):
            return False
        with zipfile.ZipFile(p) as z:
            return any(n.count("/") == 1 and n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def check_torchsave_records(path: Path, progress: Any = None) -> tuple[list, int, int]:
    """Read every member of a ``torch.save`` archive once and check its CRC-32 (``ckptq verify PATH``).

    ``torch.save`` stores each storage as a zip member with the CRC-32 of its bytes (torch's
    ``serialization.config.save.compute_crc32``, on by default); members stored with CRC 0 (that
    option off) count as unverified.

    Returns:
        ``(problems, verified, unverified)`` as :meth:`ckptq.io.SafeFileSystemReader.check_records`,
        with ``problems`` as ``(member, file, start, end, message)``.

    Raises:
        CheckpointFormatError: the file is not a readable zip archive.
    """
    problems, verified, unverified = [], 0, 0
    try:
        z = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointFormatError(f"{path}: not a readable torch.save archive ({e}); restore the file") from e
    with z:
        for info in z.infolist():
            start, end = info.header_offset, info.header_offset + info.compress_size
            if progress is not None:
                progress(info.compress_size)
            if info.CRC == 0 and info.file_size:
                unverified += 1
                continue
            try:
                with z.open(info) as f:
                    while f.read(1 << 24):
                        pass
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
                problems.append((info.filename, Path(path).name, start, end, f"{e}: the file is corrupt; restore it"))
                continue
            verified += 1
    return problems, verified, unverified


def _flatten(obj: Any, prefix: str, out: dict, skipped: list, where: str) -> None:
    for k, v in obj.items():
        if not isinstance(k, str):
            raise CheckpointFormatError(f"{where}: key {k!r} under '{prefix}' is not a str")
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            _flatten(v, name, out, skipped, where)
        elif isinstance(v, torch.Tensor) or adapters.adapter_for(v) is not None:  # TE payloads are not tensors
            if name in out:
                raise CheckpointFormatError(f"{where}: two values flatten to the key '{name}'")
            out[name] = v
        else:
            skipped.append(name)


class TorchSaveView(EntryTable):
    """Read-only logical view of a ``torch.save`` file of a (nested) dict of tensors.

    Args:
        path: the file.

    Implements :class:`ckptq.io.source.CheckpointSource`.

    Attributes:
        path: the file; ``files``: ``[path]``; ``source``: ``"torch.save file"``;
        skipped: the keys of non-tensor values (not entries); ``world_size``: None (not recorded).

    Raises:
        UnsafeCheckpointError: the pickle references a global nobody maps (nothing is run).
        CheckpointFormatError: the file is corrupt or not a dict of tensors.
        UnsupportedFormatError: an adapter refuses a foreign tensor (names FQN, class and field).
    """

    world_size = None

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.files = [self.path]
        self.source = NAME
        where = str(self.path)
        try:
            blob = self.path.read_bytes()
        except OSError as e:
            raise CheckpointFormatError(f"{where}: cannot read it ({e})") from None
        obj = load_record(blob, source=where)
        if not isinstance(obj, Mapping):
            raise CheckpointFormatError(
                f"{where}: holds a {type(obj).__name__}, not a dict of tensors (save a state_dict())"
            )
        flat: dict[str, Any] = {}
        self.skipped: list[str] = []
        _flatten(obj, "", flat, self.skipped, where)
        self._values: dict[str, torch.Tensor | QuantizedTensor] = {}
        self._entries: dict[str, Entry] = {}
        for fqn, v in flat.items():
            adapter = adapters.adapter_for(v)
            if adapter is not None or isinstance(v, QuantizedTensor):
                qt, producer = adapter.to_canonical(v, fqn) if adapter is not None else (v, None)
                desc = native_descriptor(qt, fqn, tuple(qt.shape), producer)
                keys = {s.name: component_fqn(fqn, s.name) for s in qt.specs}
                self._entries[fqn] = Entry(fqn, "quantized", tuple(qt.shape), qt.dtype, desc, keys)
                self._values[fqn] = qt
            elif type(v) is torch.Tensor or type(v) is torch.nn.Parameter:
                t = v.detach()
                self._entries[fqn] = Entry(fqn, "tensor", tuple(t.shape), t.dtype, None, {fqn: fqn})
                self._values[fqn] = t
            else:
                raise CheckpointFormatError(
                    f"{where}: '{fqn}' is a {type(v).__module__}.{type(v).__qualname__}, a tensor subclass no "
                    f"registered adapter reads"
                )

    def read(self, fqn: str) -> QuantizedTensor | torch.Tensor:
        """The whole logical tensor: the canonical QuantizedTensor of a quantized entry (views of the
        loaded buffers where the layout allows), else the plain tensor."""
        self.entry(fqn)
        return self._values[fqn]

    def read_raw_bytes(self, fqn: str) -> tuple[bytes, Any]:
        """Not available: a torch.save file's entries are all tensors (non-tensor values are skipped)."""
        raise CheckpointFormatError(f"{self.path}: '{fqn}' is not a non-tensor record ({NAME}s have none)")

    def mapping(self, key: str) -> tuple | None:
        """None: a torch.save file has no DCP flatten mapping."""
        return None

    def saved_chunks(self, key: str) -> list | None:
        """None: the entries are read whole (the file was loaded when the view was opened)."""
        return None

    def close(self) -> None:
        """Nothing to release (the file is closed once loaded)."""


#: The kind :func:`ckptq.checkpoint.open_checkpoint` lists.
SOURCE = SourceKind(NAME, detect, TorchSaveView)

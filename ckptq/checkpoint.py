"""Offline access to DCP checkpoints as *logical* tensors, and a streaming writer of DCP directories.

:class:`CheckpointView` reads any ``FileSystemWriter`` checkpoint (ckptq or plain) without a process
group or executing pickled code: each logical entry is a natively saved quantized tensor (its
components folded together), a high-precision entry of a quantized tensor, a plain tensor, or a
non-tensor (bytes) entry. :class:`CheckpointDirWriter` writes DCP's own on-disk format (one
``torch.save`` record per chunk, ``.metadata`` last) with one storage file per target rank, which
``FileSystemWriter`` cannot do from one process; it is what ``ckptq reshard`` and ``ckptq convert``
stream into.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .errors import CheckpointFormatError
from .formats import from_components
from .formats.base import QuantizedTensor
from .io.reader import SafeFileSystemReader, load_entries, read_metadata
from .planners._common import CKPTQ_KEY, CONTRACT_VERSION, ckptq_planner_data

__all__ = ["Entry", "CheckpointView", "CheckpointDirWriter"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One logical entry of a checkpoint.

    Attributes:
        fqn: the logical name (a quantized tensor's FQN, not its component keys).
        kind: ``"quantized"`` (native components), ``"tensor"`` (plain or high precision) or ``"bytes"``.
        shape: logical shape (``()`` for bytes).
        dtype: stored dtype of a tensor entry; the logical dtype of a quantized one.
        descriptor: the ckptq descriptor (quantized and high-precision entries), else None.
        keys: the DCP entries that hold it (components, or the fqn itself).
    """

    fqn: str
    kind: str
    shape: tuple[int, ...]
    dtype: Optional[torch.dtype]
    descriptor: Optional[dict]
    keys: tuple[str, ...]

    @property
    def format(self) -> Optional[str]:
        return self.descriptor["format"] if self.descriptor else None


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
        self.record = ckptq_planner_data(self.metadata.planner_data)
        self.reader = SafeFileSystemReader(self.path, metadata=self.metadata)
        self._entries = self._build_entries()

    def _build_entries(self) -> dict[str, Entry]:
        sdm = self.metadata.state_dict_metadata
        out: dict[str, Entry] = {}
        owned: set[str] = set()
        from .formats.base import str_to_dtype

        for fqn, desc in self.record["tensors"].items():
            if desc.get("mode") == "native":
                keys = tuple(c.get("fqn", f"{fqn}.{n}") for n, c in desc["components"].items())
                missing = [k for k in keys if k not in sdm]
                if missing:
                    raise CheckpointFormatError(
                        f"{self.path}: tensor '{fqn}' lacks component entries {missing}; the "
                        f"checkpoint is incomplete"
                    )
                out[fqn] = Entry(fqn, "quantized", tuple(desc["shape"]), str_to_dtype(desc["dtype"]),
                                 desc, keys)
                owned.update(keys)
            elif fqn in sdm:
                md = sdm[fqn]
                out[fqn] = Entry(fqn, "tensor", tuple(md.size), md.properties.dtype, desc, (fqn,))
                owned.add(fqn)
        for key, md in sdm.items():
            if key in owned:
                continue
            if isinstance(md, TensorStorageMetadata):
                out[key] = Entry(key, "tensor", tuple(md.size), md.properties.dtype, None, (key,))
            else:
                out[key] = Entry(key, "bytes", (), None, None, (key,))
        return out

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
        """Ranks that saved it (from the ckptq record, else the number of distinct storage files)."""
        if self.record.get("world_size"):
            return int(self.record["world_size"])
        storage = self.metadata.storage_data or {}
        files = {getattr(v, "relative_path", None) for v in storage.values()}
        ranks = {f.split("_")[2] for f in files if isinstance(f, str) and f.startswith("__")}
        return len(ranks) or None

    def read(self, fqn: str) -> Union[QuantizedTensor, torch.Tensor]:
        """The whole logical tensor: a QuantizedTensor for native entries, else a plain tensor.

        Memory: the tensor plus one saved chunk at a time (DCP reads chunk by chunk).
        """
        e = self.entry(fqn)
        if e.kind == "bytes":
            raise CheckpointFormatError(f"{self.path}: '{fqn}' is a non-tensor entry")
        data = load_entries(self.reader, self.metadata, list(e.keys))
        if e.kind == "tensor":
            return data[fqn]
        comps = {name: data[c.get("fqn", f"{fqn}.{name}")] for name, c in e.descriptor["components"].items()}
        return from_components(e.descriptor, comps)

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


class CheckpointDirWriter:
    """Writes a DCP ``FileSystemWriter``-compatible checkpoint into ``path``, streaming.

    Each chunk is one ``torch.save`` record appended to ``__{rank}_0.distcp`` of the rank it is
    assigned to, so a rank's chunks are contiguous in one file. :meth:`finish` writes ``.metadata``
    (a pickle of DCP's ``Metadata``, as ``FileSystemWriter.finish`` does). ``path`` must be empty.
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._files: dict[int, Any] = {}
        self._md: dict[str, Any] = {}
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self.bytes_per_rank: dict[int, int] = {}

    def _file(self, rank: int):
        if rank not in self._files:
            self._files[rank] = open(self.path / f"__{rank}_0.distcp", "wb")
        return self._files[rank]

    def add_chunk(self, rank: int, key: str, global_size, offsets, tensor: torch.Tensor) -> None:
        """Append ``tensor`` as the chunk at ``offsets`` of entry ``key`` (global ``global_size``)."""
        md = self._md.get(key)
        if md is None:
            md = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), torch.Size(global_size), [])
            self._md[key] = md
        assert md.properties.dtype == tensor.dtype and tuple(md.size) == tuple(global_size), key
        offsets = torch.Size(offsets)
        md.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape))
        f = self._file(rank)
        start = f.tell()
        t = tensor.detach().cpu()
        if t.untyped_storage().nbytes() != t.nbytes or not t.is_contiguous():
            t = t.clone()  # torch.save writes whole storages: never a view's parent
        torch.save(t, f)
        self._storage[MetadataIndex(key, offsets)] = _StorageInfo(f"__{rank}_0.distcp", start, f.tell() - start)
        self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + t.nbytes

    def add_bytes(self, rank: int, key: str, record: bytes, transform_descriptors=None) -> None:
        """Append a verbatim non-tensor record (as read by :meth:`CheckpointView.read_raw_bytes`)."""
        f = self._file(rank)
        start = f.tell()
        f.write(record)
        self._md[key] = BytesStorageMetadata()
        info = _StorageInfo(f"__{rank}_0.distcp", start, len(record))
        if transform_descriptors:
            info.transform_descriptors = transform_descriptors
        self._storage[MetadataIndex(key)] = info

    def finish(self, planner_data: dict, *, ckptq_tensors: dict, world_size: int, extra: Optional[dict] = None) -> Metadata:
        """Close the data files (fsync) and write ``.metadata``; returns the Metadata."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._files.clear()
        pd = dict(planner_data)
        pd[CKPTQ_KEY] = {"version": CONTRACT_VERSION, "world_size": world_size, "tensors": ckptq_tensors,
                         **(extra or {})}
        metadata = Metadata(state_dict_metadata=self._md, planner_data=pd, storage_data=self._storage,
                            storage_meta=StorageMeta())
        metadata.version = "1.0.0"
        tmp = self.path / ".metadata.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / ".metadata")
        return metadata

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

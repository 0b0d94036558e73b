"""A streaming writer of DCP ``FileSystemWriter`` checkpoint directories, from one process.

DCP's ``FileSystemWriter`` writes the files of the ranks of a running process group; ``ckptq reshard``
and ``ckptq convert`` need one storage file per *target* rank written from one process, so
:class:`CheckpointDirWriter` writes DCP's own on-disk format directly: one ``torch.save`` record per
chunk appended to ``__{rank}_0.distcp``, ``_StorageInfo`` locations, and ``.metadata`` (a pickle of
DCP's ``Metadata``, as ``FileSystemWriter.finish`` writes it) last. The output is read by stock
``dcp.load``.

This is the only module that uses DCP internals to write (``_StorageInfo`` and the metadata version);
:func:`check_dcp_version` guards them: an unknown DCP version fails loudly instead of writing files
that a future ``dcp.load`` might misread.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CkptqError

__all__ = ["CheckpointDirWriter", "check_dcp_version", "KNOWN_DCP_VERSIONS"]

PathLike = Union[str, "os.PathLike[str]"]

#: DCP on-disk versions whose layout this writer reproduces (torch 2.11 and 2.13 write "1.0.0").
KNOWN_DCP_VERSIONS = ("1.0.0",)


def check_dcp_version() -> tuple[type, str]:
    """DCP's ``_StorageInfo`` class and on-disk version, after checking that this torch's DCP writes
    a version this writer knows and that ``_StorageInfo`` has the fields it fills.

    Raises:
        CkptqError: an unknown DCP version or ``_StorageInfo`` layout (upgrade ckptq, or run the
            offline tools with a torch whose DCP version is one of :data:`KNOWN_DCP_VERSIONS`).
    """
    import dataclasses

    from torch.distributed.checkpoint import filesystem as fs

    version = getattr(fs, "CURRENT_DCP_VERSION", None)
    info = getattr(fs, "_StorageInfo", None)
    fields = [f.name for f in dataclasses.fields(info)] if dataclasses.is_dataclass(info) else None
    if version not in KNOWN_DCP_VERSIONS or fields is None or fields[:3] != ["relative_path", "offset", "length"]:
        raise CkptqError(
            f"torch {torch.__version__} writes DCP version {version!r} with storage fields {fields}; "
            f"ckptq's offline writer knows DCP versions {list(KNOWN_DCP_VERSIONS)} with "
            f"_StorageInfo(relative_path, offset, length, ...). Upgrade ckptq, or run reshard/convert "
            f"with a torch of a known DCP version."
        )
    return info, version


class CheckpointDirWriter:
    """Writes a DCP ``FileSystemWriter``-compatible checkpoint into ``path``, streaming.

    Each chunk is one ``torch.save`` record appended to ``__{rank}_0.distcp`` of the rank it is
    assigned to, so a rank's chunks are contiguous in one file. :meth:`finish` writes ``.metadata``.
    ``path`` should be a new, empty directory.

    Raises:
        CkptqError: this torch's DCP version is unknown (:func:`check_dcp_version`).
    """

    def __init__(self, path: PathLike):
        self._storage_info, self._version = check_dcp_version()
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._files: dict[int, Any] = {}
        self._md: dict[str, Any] = {}
        self._storage: dict[MetadataIndex, Any] = {}
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
        self._storage[MetadataIndex(key, offsets)] = self._storage_info(f"__{rank}_0.distcp", start, f.tell() - start)
        self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + t.nbytes

    def add_bytes(self, rank: int, key: str, record: bytes, transform_descriptors=None) -> None:
        """Append a verbatim non-tensor record (as read by ``CheckpointView.read_raw_bytes``)."""
        f = self._file(rank)
        start = f.tell()
        f.write(record)
        self._md[key] = BytesStorageMetadata()
        info = self._storage_info(f"__{rank}_0.distcp", start, len(record))
        if transform_descriptors:
            info.transform_descriptors = transform_descriptors
        self._storage[MetadataIndex(key)] = info

    def finish(self, planner_data: dict) -> Metadata:
        """Close the data files (fsync) and write ``.metadata`` with ``planner_data``; returns it."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._files.clear()
        metadata = Metadata(state_dict_metadata=self._md, planner_data=dict(planner_data),
                            storage_data=self._storage, storage_meta=StorageMeta())
        metadata.version = self._version
        tmp = self.path / ".metadata.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / ".metadata")
        return metadata

    def abort(self) -> None:
        """Close the data files without writing ``.metadata`` (the directory is then incomplete)."""
        for f in self._files.values():
            f.close()
        self._files.clear()

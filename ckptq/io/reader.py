"""Safe reading of DCP ``FileSystemWriter`` checkpoints: metadata without running pickled code.

- :class:`SafeFileSystemReader` is a drop-in ``FileSystemReader`` for ``dcp.load``: its
  ``read_metadata`` uses :mod:`ckptq.io.safe_pickle`, and its ``read_data`` checks every non-tensor
  (BYTE_IO) item with ``torch.load(weights_only=True)`` before DCP's planner loads it (DCP's
  ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``). Tensor items are
  already read by DCP with ``weights_only=True``. Checkpoints that other libraries wrote with
  pickled quantized tensors (TransformerEngine) are presented through the ckptq contract
  (:mod:`ckptq.io.foreign`), their records unpickled with the adapters' stand-ins only.
- :func:`read_metadata` opens a checkpoint directory for tools (``ckptq inspect``) with clear
  :class:`~ckptq.errors.CheckpointFormatError` s for missing, truncated and non-DCP paths.

This module is ckptq's error boundary for reading: every malformed checkpoint a reader
path meets (``read_metadata``, ``CheckpointView``, ``inspect``, ``verify``, ``load_entries``,
``dcp.load`` with :class:`SafeFileSystemReader`) becomes a ``CheckpointFormatError`` naming the
file, the entry and what to do, before anything large is allocated. Metadata-level checks live in
:func:`check_storage` (geometry, locations, record sizes, files) and
:func:`ckptq.contract.fold_entries` (ckptq descriptors); record-level ones in
``SafeFileSystemReader.read_data`` (each record's dtype and shape) and
:func:`ckptq.io.foreign.load_record`. ``dcp.load`` wraps them in ``CheckpointException``:
:func:`dcp_failure` gets them back.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import re
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..checksums import check, checksum_key
from ..errors import CheckpointFormatError, CkptqError, UnsafeCheckpointError
from .safe_pickle import safe_load

__all__ = [
    "SafeFileSystemReader",
    "read_metadata",
    "check_storage",
    "load_entries",
    "dcp_failure",
    "check_record_header",
    "METADATA_FILE",
]

#: The last error :meth:`SafeFileSystemReader.read_metadata` raised in this thread (for :func:`dcp_failure`).
_LAST_METADATA_ERROR = threading.local()

#: The name of the global metadata file DCP's ``FileSystemWriter`` writes.
METADATA_FILE = ".metadata"

PathLike = Union[str, "os.PathLike[str]"]


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never executes code from the checkpoint and checks what it reads.

    Use it wherever DCP takes a storage reader:
    ``dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=...)``.

    It is ckptq's one error boundary for reading: every malformation of a checkpoint becomes a
    :class:`~ckptq.errors.CheckpointFormatError` (or a subclass) naming the file, the entry and
    what to do, before anything large is allocated:

    * :meth:`read_metadata` unpickles ``.metadata`` through the allow-list, then runs
      :func:`check_storage` (entry and chunk geometry, storage locations, record sizes, data files)
      on it: a metadata that claims more elements than its records hold bytes is refused there;
    * :meth:`read_data` checks each record as it is read: it must unpickle with
      ``weights_only=True``, lie inside its file, hold a tensor of the dtype and chunk size the
      metadata gives (DCP itself would cast a wrong dtype silently), and, where the checkpoint
      records checksums (:class:`~ckptq.io.ChecksumFileSystemWriter`, the offline tools), match
      its checksum: a flipped bit in a data file is a :class:`~ckptq.errors.ChecksumMismatchError`
      naming the file, byte range and entry.

    ``dcp.load`` wraps these errors in ``CheckpointException``: see :func:`dcp_failure`.

    Args:
        path: the checkpoint directory.
        metadata: already-read metadata of ``path`` (e.g. from :func:`read_metadata`); when given,
            :meth:`read_metadata` returns it instead of unpickling the file again (for tools that
            call ``dcp.load`` once per tensor). ``reset`` to another path drops it.
        verify_storage: also check that the data files exist and are long enough when reading the
            metadata (the geometry and record-size checks always run).
        verify_checksums: compare each record's checksum (:mod:`ckptq.checksums`) with the one the
            metadata records, where it records one (on by default; a planner with
            ``verify_checksums=False``, e.g. ``QuantizedLoadPlanner(verify_checksums=False)``, turns
            it off too). Costs one crc32c pass over the bytes read (about 10 GB/s on one core).
        **kwargs: passed to ``FileSystemReader``.

    Raises (from :meth:`read_metadata`):
        CheckpointFormatError: the metadata file is missing, truncated, or not DCP ``Metadata``, or
            it fails :func:`check_storage`.
        UnsafeCheckpointError: the metadata pickle references a global outside the allow-list, or
            a storage location is absolute or leaves the checkpoint directory.
    Raises (from :meth:`read_data`):
        CheckpointFormatError: a record is truncated, corrupt, or not the tensor the metadata says.
        UnsafeCheckpointError: an item cannot be loaded with ``weights_only=True``.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        metadata: Metadata | None = None,
        verify_storage: bool = True,
        verify_checksums: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        self._cached_metadata = metadata
        self._verify_storage = verify_storage
        self.verify_checksums = verify_checksums
        self._verifying = verify_checksums
        self._checksums: dict | None = None
        self._md: Mapping = {}
        self._chunk_sizes: dict | None = None

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
        if checkpoint_id and Path(checkpoint_id) != Path(self.path):
            self._cached_metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self._cached_metadata is not None and rank is None:
            metadata = self._cached_metadata
            if metadata.storage_meta is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata
        path = self._get_metadata_path(rank)
        previous = getattr(_LAST_METADATA_ERROR, "error", None)
        if rank is None:
            _LAST_METADATA_ERROR.error = None
        elif previous is not None and not os.path.exists(str(path)):
            raise previous  # dcp.load's fallback to per-rank metadata after a failed global read
        try:
            return self._read_checked(path, rank)
        except CkptqError as e:
            if rank is None:
                _LAST_METADATA_ERROR.error = e  # dcp.load hides it in an AssertionError: see dcp_failure
            raise

    def _read_checked(self, path: Any, rank: int | None) -> Metadata:
        try:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
            _check_pickle_memo(data, str(path))
            metadata = safe_load(io.BytesIO(data), source=str(path))
        except CkptqError:
            raise
        except FileNotFoundError as e:
            raise CheckpointFormatError(
                f"{path}: no DCP metadata file; is '{self.path}' a complete DCP checkpoint "
                f"directory? (DCP writes '{METADATA_FILE}' last, so an interrupted save has none)"
            ) from e
        except OSError as e:
            raise CheckpointFormatError(f"{path}: cannot read the DCP metadata file: {e}") from e
        except Exception as e:  # any malformed pickle: EOFError, UnpicklingError, ValueError, ...
            raise CheckpointFormatError(
                f"{path}: the DCP metadata file is truncated or corrupt "
                f"({type(e).__name__}: {e}); re-save the checkpoint or restore the file"
            ) from e
        if not isinstance(metadata, Metadata):
            raise CheckpointFormatError(
                f"{path}: holds a pickled {type(metadata).__name__}, not DCP Metadata; this is not a DCP checkpoint"
            )
        # per-rank metadata (use_collectives=False) lists only that rank's chunks: no coverage check
        complete = rank is None
        try:
            _check_fields(metadata)
            _check_locations_inside(metadata, self.path, str(path))
            _check_layout(metadata, Path(self.path), files=self._verify_storage, complete=complete)
        except CkptqError:
            raise
        except Exception as e:  # a value of a type no DCP writes, met before a check named it
            raise CheckpointFormatError(
                f"{path}: the DCP metadata is malformed ({type(e).__name__}: {e}); restore the file or "
                f"re-save the checkpoint"
            ) from e
        from .foreign import virtualize

        try:
            metadata = virtualize(metadata, Path(self.path))
        except CkptqError:
            raise
        except Exception as e:  # a foreign record the adapters cannot make sense of
            raise CheckpointFormatError(
                f"{self.path}: a record of another library's tensor cannot be read "
                f"({type(e).__name__}: {e}); the data file is corrupt: restore it or re-save"
            ) from e
        _check_record_sizes(metadata, Path(self.path))
        from ..contract import fold_entries

        fold_entries(metadata, where=str(self.path))  # the ckptq descriptors against the entries
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        from ..contract import read_checksums

        self._checksums = read_checksums(metadata.planner_data, where=str(self.path))
        self._md = metadata.state_dict_metadata
        self._chunk_sizes = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    self._chunk_sizes[(fqn, tuple(c.offsets))] = (md.properties.dtype, tuple(c.sizes))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        from .foreign import ForeignLocation, read_foreign_items

        foreign = [it for it in plan.items if isinstance(self.storage_data.get(it.storage_index), ForeignLocation)]
        if foreign:  # entries of a checkpoint another library wrote (see ckptq.io.foreign)
            try:
                read_foreign_items(Path(self.path), self.storage_data, foreign, planner)
            except CkptqError:
                raise
            except Exception as e:
                raise CheckpointFormatError(
                    f"{self.path}: reading another library's records failed ({type(e).__name__}: {e}); "
                    f"the data files are corrupt: restore them or re-save"
                ) from e
            served = {id(it) for it in foreign}
            plan = dataclasses.replace(plan, items=[it for it in plan.items if id(it) not in served])
        self._verifying = bool(self.verify_checksums and getattr(planner, "verify_checksums", True))
        if hasattr(planner, "checksums_verified_by_reader"):
            planner.checksums_verified_by_reader = self._verifying
        self._read_items(plan.items, _WeightsOnlyBytes(planner, str(self.path)))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, items: list, planner: Any) -> None:
        """DCP's ``FileSystemReader.read_data`` loop, with every record checked (see the class
        docstring) and every failure named by file, byte range and entry."""
        per_file: dict[str, list] = {}
        for it in items:
            info = self.storage_data.get(it.storage_index)
            if info is None or not hasattr(info, "relative_path"):
                raise CheckpointFormatError(
                    f"{self.path}: '{it.storage_index.fqn}' has no storage location in the metadata; "
                    f"the checkpoint is incomplete"
                )
            per_file.setdefault(str(info.relative_path), []).append(it)
        for rel, reqs in per_file.items():
            file = self.fs.concat_path(self.path, rel)
            try:
                size = os.path.getsize(file)
                stream_cm = self.fs.create_stream(file, "rb")
            except OSError as e:
                raise CheckpointFormatError(
                    f"{self.path}: data file '{rel}' cannot be opened ({e}); copy the whole checkpoint directory"
                ) from e
            with stream_cm as stream:
                for req in reqs:
                    self._read_item(stream, rel, size, req, planner)

    def _read_item(self, stream: Any, rel: str, size: int, req: Any, planner: Any) -> None:
        where = self._where(req.storage_index, rel)
        value = self._load_record(
            stream, rel, size, req.storage_index, req.type == LoadItemType.BYTE_IO, verify=self._verifying
        )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, value)
            return
        try:
            tensor = narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
        except Exception as e:
            raise CheckpointFormatError(
                f"{where}: the read request does not fit the record ({e}); the metadata is inconsistent"
            ) from e
        try:
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointFormatError(
                    f"{where}: read {list(tensor.size())} elements for a destination of "
                    f"{list(target.size())}; the metadata is inconsistent"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        except CkptqError:
            raise
        except Exception as e:  # the planner could not use what the record holds
            raise CheckpointFormatError(
                f"{where}: the load planner failed on this record ({type(e).__name__}: {e}); the record "
                f"read intact, so the checkpoint and the target state_dict disagree"
            ) from e

    def _where(self, index: MetadataIndex, rel: str) -> str:
        info = self.storage_data[index]
        start, end = int(info.offset), int(info.offset) + int(info.length)
        return (
            f"{self.path}: '{index.fqn}'"
            + (f" (chunk at offsets {list(index.offset)})" if index.offset is not None else "")
            + f", record '{rel}' bytes {start}..{end}"
        )

    def _load_record(self, stream: Any, rel: str, size: int, index: MetadataIndex, is_bytes: bool, verify: bool) -> Any:
        """One whole record, checked: a CPU tensor of the chunk's dtype and size, or the
        ``io.BytesIO`` of a bytes entry; its checksum compared with the metadata's when ``verify``
        and the checkpoint has one for it.

        Raises:
            CheckpointFormatError: the record is truncated, corrupt, not what the metadata says, or
                its checksum differs (naming the file, the byte range and the entry).
            UnsafeCheckpointError: the record cannot be loaded with ``weights_only=True``.
        """
        info = self.storage_data[index]
        start, end = int(info.offset), int(info.offset) + int(info.length)
        where = self._where(index, rel)
        if end > size:
            raise CheckpointFormatError(
                f"{where}: the file has only {size} bytes; it is truncated: restore it or re-save"
            )
        try:
            if not getattr(info, "transform_descriptors", None) and not is_bytes:
                check_record_header(_Window(stream, start, end - start), where)
            if hasattr(self, "_slice_file"):
                file_slice = self._slice_file(stream, info)
            else:  # a torch without DCP's file views
                stream.seek(start)
                file_slice = io.BytesIO(stream.read(end - start))
            descriptors = getattr(info, "transform_descriptors", None) or ()
            transforms = getattr(self, "transforms", None)
            if transforms is not None:
                file_slice = transforms.transform_load_stream(_ReadIndex(index), descriptors, file_slice)
            elif descriptors:
                raise CheckpointFormatError(
                    f"{where}: stored with stream transforms {descriptors} this torch cannot undo"
                )
            if is_bytes:
                value = io.BytesIO(file_slice.read(-1))
                if verify:
                    self._check_sum(index, value.getbuffer(), where)
                value.seek(0)
                return value
            seekable = file_slice if file_slice.seekable() else io.BytesIO(file_slice.read(-1))
            tensor = load_weights_only(seekable, where, "cpu")
            want = (self._chunk_sizes or {}).get((index.fqn, tuple(index.offset or ())))
            check_chunk_tensor(tensor, want, where)
            if verify:
                self._check_sum(index, tensor, where)
            return tensor
        except CkptqError:
            raise
        except Exception as e:  # zip / EOF / shape errors of a damaged record
            raise CheckpointFormatError(
                f"{where}: the record is truncated or corrupt ({type(e).__name__}: {e}); restore the "
                f"file or re-save the checkpoint"
            ) from e

    def _check_sum(self, index: MetadataIndex, payload: Any, where: str) -> None:
        check(payload, (self._checksums or {}).get(checksum_key(index)), where)

    def check_records(
        self, progress: Any | None = None
    ) -> tuple[list[tuple[MetadataIndex, str, int, int, str]], int, int]:
        """Read every record of the checkpoint once and compare its checksum (``ckptq verify PATH``).

        Call after :meth:`read_metadata` and :meth:`set_up_storage_reader`. Records are read one at
        a time (peak memory: the largest record); ``progress`` is called with each record's length.

        Returns:
            ``(problems, checked, unchecked)``: ``problems`` lists ``(index, file, start, end,
            message)`` of each record that failed (a checksum mismatch or any malformation), in file
            order; ``checked`` counts records whose checksum matched, ``unchecked`` records read
            intact that have no checksum (older or foreign checkpoints, or records another library
            wrote, which are checked by :func:`ckptq.io.foreign.load_record` when read).
        """
        from .foreign import ForeignLocation

        problems, checked, unchecked = [], 0, 0
        per_file: dict[str, list] = {}
        for index, info in self.storage_data.items():
            if isinstance(info, ForeignLocation):
                unchecked += 1
                continue
            per_file.setdefault(str(info.relative_path), []).append(index)
        for rel in sorted(per_file):
            indices = sorted(per_file[rel], key=lambda i: int(self.storage_data[i].offset))
            file = self.fs.concat_path(self.path, rel)
            try:
                size = os.path.getsize(file)
                stream_cm = self.fs.create_stream(file, "rb")
            except OSError as e:
                for index in indices:
                    info = self.storage_data[index]
                    problems.append(
                        (
                            index,
                            rel,
                            int(info.offset),
                            int(info.offset) + int(info.length),
                            f"cannot open the data file ({e})",
                        )
                    )
                continue
            with stream_cm as stream:
                for index in indices:
                    info = self.storage_data[index]
                    if progress is not None:
                        progress(int(info.length))
                    is_bytes = not isinstance(self._md.get(index.fqn), TensorStorageMetadata)
                    try:
                        self._load_record(stream, rel, size, index, is_bytes, verify=True)
                    except CkptqError as e:
                        where = self._where(index, rel) + ": "
                        problems.append(
                            (
                                index,
                                rel,
                                int(info.offset),
                                int(info.offset) + int(info.length),
                                str(e)[len(where) :] if str(e).startswith(where) else str(e),
                            )
                        )
                        continue
                    if self._checksums and checksum_key(index) in self._checksums:
                        checked += 1
                    else:
                        unchecked += 1
        return problems, checked, unchecked


@dataclasses.dataclass(frozen=True)
class _ReadIndex:
    """What DCP's stream transforms read from a read item: its storage index."""

    storage_index: MetadataIndex


class _WeightsOnlyBytes:
    """Planner proxy: BYTE_IO values must pass ``torch.load(weights_only=True)`` before the real
    planner's ``load_bytes`` (DCP's default uses ``weights_only=False``) sees them."""

    def __init__(self, planner: LoadPlanner, source: str) -> None:
        self._planner = planner
        self._source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            torch.load(io.BytesIO(value.getvalue()), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{self._source}: refusing to load non-tensor entry '{fqn}': it cannot be read "
                f"with torch.load(weights_only=True), so loading it could run code ({e}). Register "
                f"its classes with torch.serialization.add_safe_globals if you trust them."
            ) from e
        except Exception as e:
            raise CheckpointFormatError(
                f"{self._source}: non-tensor entry '{fqn}' is corrupt ({type(e).__name__}: {e})"
            ) from e
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def dcp_failure(exc: BaseException, where: str) -> Exception:
    """The ckptq error to raise for a failed ``dcp.load``/``dcp.save``.

    ``dcp.load`` runs the storage reader and the planner inside its own error collection: any
    exception they raise (a :class:`~ckptq.errors.CheckpointFormatError` from
    :class:`SafeFileSystemReader`, a :class:`~ckptq.errors.ShardingError` from
    ``QuantizedLoadPlanner``, ...) reaches the caller wrapped in
    ``torch.distributed.checkpoint.api.CheckpointException``, which derives from
    ``BaseException``: ``except Exception`` and ``except ckptq.CkptqError`` both miss it. Its
    ``failures`` maps each failing rank to ``(exception, traceback)``. This returns the first
    wrapped :class:`~ckptq.errors.CkptqError` as is; any other failure becomes a
    :class:`~ckptq.errors.CheckpointFormatError` naming ``where`` and the original error. Use::

        from torch.distributed.checkpoint.api import CheckpointException
        from ckptq.io import SafeFileSystemReader, dcp_failure

        try:
            dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=QuantizedLoadPlanner())
        except CheckpointException as e:
            raise dcp_failure(e, path) from None   # a CkptqError naming file, entry and remedy

    Args:
        exc: the ``CheckpointException`` (any other exception is treated as its own cause).
        where: how the message names the checkpoint (its path).
    """
    failures = getattr(exc, "failures", None)
    causes = (
        [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, Mapping) else [exc]
    )
    for cause in causes:
        if isinstance(cause, CkptqError):
            return cause
    # DCP turns a failed metadata read into AssertionError("metadata is None; global metadata read
    # failed: <message>") (torch 2.13; torch 2.11 says only "metadata is None"): the reader kept
    # the error it raised
    last = getattr(_LAST_METADATA_ERROR, "error", None)
    if last is not None and any(str(last) in str(c) or str(c).startswith("metadata is None") for c in causes):
        return last
    cause = causes[0] if causes else exc
    return CheckpointFormatError(
        f"{where}: reading the checkpoint failed ({type(cause).__name__}: {cause}); the data files may be corrupt"
    )


class ReadView(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes; subclasses read from ``pos`` in ``readinto``
    (and advance it). Seeks are clamped to ``[0, size]``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = min(max(base + offset, 0), self.size)
        return self.pos


class _Window(ReadView):
    """Bytes ``[start, start + length)`` of a seekable binary file, as a file (for ``zipfile``)."""

    def __init__(self, base: Any, start: int, length: int) -> None:
        super().__init__(length)
        self._base, self._start = base, start

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        self._base.seek(self._start + self.pos)
        data = self._base.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def load_weights_only(stream: Any, where: str, map_location: Any) -> Any:
    """``torch.load(stream, weights_only=True)`` of one record; a pickle it refuses (a global outside
    the allow-list) becomes :class:`~ckptq.errors.UnsafeCheckpointError` naming ``where``. Other
    unpickling errors (a damaged record) propagate for the caller to report as corruption."""
    try:
        return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "GLOBAL" not in str(e) and "global" not in str(e):
            raise  # a damaged record, not a refused one
        raise UnsafeCheckpointError(
            f"{where}: the record cannot be read with torch.load(weights_only=True), so loading it could "
            f"run code ({str(e).strip().splitlines()[-1]}); nothing from it was run. Restore the file or "
            f"re-save the checkpoint"
        ) from None


def check_chunk_tensor(t: Any, want: tuple | None, where: str) -> None:
    """What a record holds must be a plain tensor of the chunk's ``(dtype, sizes)`` from the metadata
    (``want``; None: only that it is a tensor).

    Raises:
        CheckpointFormatError: it is not (``where`` names the file, byte range and entry).
    """
    if type(t) is not torch.Tensor:
        raise CheckpointFormatError(
            f"{where}: the record holds a {type(t).__name__}, not a tensor; the data file and the metadata "
            f"disagree: restore the file or re-save"
        )
    if want is not None and (t.dtype, tuple(t.shape)) != (want[0], tuple(want[1])):
        raise CheckpointFormatError(
            f"{where}: the record holds a {str(t.dtype).removeprefix('torch.')} tensor of shape "
            f"{list(t.shape)}, but the metadata gives this chunk {str(want[0]).removeprefix('torch.')} "
            f"{list(want[1])}; the data file and the metadata disagree: restore them or re-save"
        )


def check_record_header(stream: Any, where: str) -> None:
    """Check the pickle of one ``torch.save`` record (its ``data.pkl`` member) against the CRC-32
    its zip directory stores, before ``torch.load`` (which does not check CRCs) trusts the dtype,
    shape, strides and storage offsets it describes. Reads only the record's directory and that
    member (hundreds of bytes); the tensor bytes are checked against the checkpoint's checksums
    (:mod:`ckptq.checksums`), not here. ``stream`` is left at the record's start.

    Raises:
        CheckpointFormatError: the record is not a zip archive, lacks its pickle, or the pickle's
            bytes do not match their CRC-32 (``where`` names file, byte range and entry).
    """
    import zipfile

    try:
        with zipfile.ZipFile(stream) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            if len(names) != 1:
                raise zipfile.BadZipFile(f"{len(names)} pickles in the archive")
            z.read(names[0])  # zipfile checks the CRC-32 at the member's end
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
        raise CheckpointFormatError(
            f"{where}: the record is truncated or corrupt ({type(e).__name__}: {e}); restore the file "
            f"or re-save the checkpoint"
        ) from None
    finally:
        stream.seek(0)


def _pickle_arg_lengths() -> dict[int, int]:
    import pickletools

    return {ord(op.code): 0 if op.arg is None else op.arg.n for op in pickletools.opcodes}


_PICKLE_ARGS = _pickle_arg_lengths()


def _check_pickle_memo(data: bytes, source: str) -> None:
    """Refuse a pickle whose memo indices exceed its length before the C unpickler sees it.

    The C unpickler grows its memo array to twice a ``LONG_BINPUT``/``PUT`` index and zero-fills
    it: one flipped byte in ``.metadata`` can ask for gigabytes (a hang, then an allocation
    failure). A real pickle stores at most one memo entry per opcode, so an index >= its length
    is corrupt. Walks the opcodes without building anything; stops at the first unknown opcode
    or STOP (the unpickler then reports what it finds).
    """
    n, i, args = len(data), 0, _PICKLE_ARGS
    frm = int.from_bytes
    while i < n:
        code = data[i]
        i += 1
        k = args.get(code)
        if k is None or code == 0x2E:  # unknown opcode, or STOP
            return
        if k >= 0:
            if code == 0x72 and frm(data[i : i + 4], "little") >= n:  # LONG_BINPUT
                raise CheckpointFormatError(
                    f"{source}: the DCP metadata file is corrupt (a pickle memo index "
                    f"{frm(data[i : i + 4], 'little')} in a {n}-byte file); restore the file or re-save the checkpoint"
                )
            i += k
        elif k == -1:  # up to a newline; GLOBAL and INST take two lines
            end = data.find(b"\n", i)
            if end < 0:
                return
            if code == 0x70:  # PUT
                try:
                    idx = int(data[i:end])
                except ValueError:
                    return
                if idx >= n:
                    raise CheckpointFormatError(
                        f"{source}: the DCP metadata file is corrupt (a pickle memo index {idx} in a "
                        f"{n}-byte file); restore the file or re-save the checkpoint"
                    )
            if code in (0x63, 0x69):
                end = data.find(b"\n", end + 1)
                if end < 0:
                    return
            i = end + 1
        elif k == -2:  # one length byte
            i += 1 + (data[i] if i < n else 0)
        elif k in (-3, -4):  # four length bytes
            length = frm(data[i : i + 4], "little", signed=(k == -3))
            if length < 0:
                return
            i += 4 + length
        elif k == -5:  # eight length bytes
            i += 8 + frm(data[i : i + 8], "little")
        else:
            return


def _check_locations_inside(metadata: Metadata, root: Any, source: str) -> None:
    """Refuse storage locations that are absolute or leave the checkpoint directory ('..')."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        rel = str(rel)
        parts = Path(rel).parts
        if os.path.isabs(rel) or ".." in parts or "\\" in rel:
            raise UnsafeCheckpointError(
                f"{source}: the metadata points '{getattr(index, 'fqn', '?')}' at '{rel}', outside "
                f"the checkpoint directory '{root}'; refusing to read it"
            )


def _describe_non_dcp(p: Path) -> str:
    if list(p.glob("__*.metadata")):
        return (
            f"{p}: has only per-rank metadata files (__<rank>.metadata, written with "
            f"use_collectives=False) and no global '{METADATA_FILE}'; such checkpoints can only be "
            f"loaded into the same topology and are not supported here"
        )
    if list(p.glob("*.safetensors")):
        return f"{p}: is a safetensors directory, not a DCP FileSystemWriter checkpoint (no '{METADATA_FILE}')"
    if list(p.glob("*.distcp")):
        return (
            f"{p}: has .distcp data files but no '{METADATA_FILE}'; the save was probably "
            f"interrupted (DCP writes the metadata last). Re-save the checkpoint"
        )
    return f"{p}: not a DCP checkpoint directory (no '{METADATA_FILE}' file)"


def read_metadata(path: PathLike, *, verify_storage: bool = True) -> Metadata:
    """Read the DCP ``Metadata`` of a checkpoint directory safely (no process group needed).

    Args:
        path: the checkpoint directory (a ``FileSystemWriter`` output), or its ``.metadata`` file.
        verify_storage: also check that every referenced data file exists and is long enough
            (:func:`check_storage` with ``files=True``); the metadata-only checks always run.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        CheckpointFormatError: the path is missing, is not a DCP checkpoint, or its metadata or
            data files are truncated or inconsistent (see :func:`check_storage`).
        UnsafeCheckpointError: the metadata pickle references a global outside the allow-list, or a
            storage location points outside the checkpoint directory.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or directory")
    if p.is_file():
        if p.name != METADATA_FILE:
            raise CheckpointFormatError(
                f"{p}: is a file; expected a DCP checkpoint directory (the folder that holds "
                f"'{METADATA_FILE}' and the .distcp files)"
            )
        p = p.parent
    if not (p / METADATA_FILE).is_file():
        raise CheckpointFormatError(_describe_non_dcp(p))
    return SafeFileSystemReader(p, verify_storage=verify_storage).read_metadata()


def check_storage(metadata: Metadata, path: PathLike, *, files: bool = True, complete: bool = True) -> None:
    """The one place where a checkpoint's metadata is checked against itself and its files.

    :class:`SafeFileSystemReader` runs it on every metadata it reads (so :func:`read_metadata`,
    :class:`~ckptq.checkpoint.CheckpointView`, inspect, verify and ``dcp.load`` all get it), before
    any tensor is allocated. Checks, in order:

    1. structure: every DCP dataclass has its fields; entries are ``TensorStorageMetadata`` (a
       ``torch.dtype``, a size of ints >= 0, a list of chunks) or ``BytesStorageMetadata``;
       ``planner_data`` a dict or None, ``storage_data`` a dict, ``version`` a version number;
    2. chunk geometry, per tensor entry: each chunk has the entry's rank, offsets and sizes >= 0,
       ``offset + size`` within the entry's size; no two chunks overlap; with ``complete``, the
       chunks cover the entry exactly (their volumes sum to its numel);
    3. storage: every chunk and non-tensor entry has a location with ``offset, length >= 0`` in a
       data file (not ``.metadata``), and every location belongs to a chunk or entry (a removed
       entry leaves its locations behind); in each data file, the byte ranges of distinct records
       do not overlap;
    4. record sizes: a chunk of N elements of dtype D needs at least ``N * D.itemsize`` bytes in
       its record (a foreign record, :mod:`ckptq.io.foreign`: its component's bytes, or 4 bits per
       element for high-precision values), so an absurd size claim (a 2^40-element tensor) is
       refused here rather than by trying to allocate it;
    5. with ``files``: every data file exists under ``path`` and holds ``offset + length`` bytes.

    Storage layers other than DCP's file system one (no ``relative_path`` in ``storage_data``) get
    checks 1 and 2 only.

    Args:
        metadata: the checkpoint's ``Metadata`` (as :class:`SafeFileSystemReader` returns it).
        path: the checkpoint directory (names it in messages; holds the data files).
        files: run check 5.
        complete: run the coverage part of check 2 (False for per-rank metadata).

    Raises:
        CheckpointFormatError: what failed, naming the checkpoint, the entry (FQN) and the file.
    """
    root = Path(path)
    _check_fields(metadata)
    _check_layout(metadata, root, files=files, complete=complete)
    _check_record_sizes(metadata, root)


def _fail(root: Path, msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{root}: {msg}; the metadata is corrupt or does not belong to these "
        f"files: restore '{METADATA_FILE}' or re-save the checkpoint"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x: Any) -> tuple[int, ...] | None:
    if not isinstance(x, (tuple, list)) or not all(_is_int(v) for v in x):
        return None
    return tuple(x)


def _check_layout(metadata: Metadata, root: Path, *, files: bool, complete: bool) -> None:
    """Checks 1-3 and 5 of :func:`check_storage` (metadata only, plus file sizes)."""
    sdm = metadata.state_dict_metadata
    if not isinstance(sdm, Mapping):
        raise _fail(root, f"state_dict_metadata is a {type(sdm).__name__}, not a dict")
    pd = metadata.planner_data
    if pd is not None and not isinstance(pd, Mapping):
        raise _fail(root, f"planner_data is a {type(pd).__name__}, not a dict")
    sm = getattr(metadata, "storage_meta", None)
    if sm is not None and not isinstance(sm, StorageMeta):
        raise _fail(root, f"storage_meta is a {type(sm).__name__}, not StorageMeta")
    version = getattr(metadata, "version", None)
    if version is not None and not (isinstance(version, str) and re.fullmatch(r"\d+(\.\d+)*", version)):
        raise _fail(root, f"DCP metadata version {version!r} is not a version number")
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):  # DCP's readers need one (FileSystemReader asserts it)
        raise _fail(root, f"storage_data is a {type(storage).__name__}, not a dict")
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise _fail(root, f"entry name {fqn!r} is not a string")
        if isinstance(md, TensorStorageMetadata):
            _check_chunks(root, fqn, md, complete)
        elif not isinstance(md, BytesStorageMetadata):
            raise _fail(root, f"entry '{fqn}' is described by a {type(md).__name__}")
    with_path = [hasattr(v, "relative_path") for v in storage.values()]
    if not any(with_path):
        return  # another storage layer: its reader checks its own locations
    if not all(with_path):
        raise _fail(root, "some storage locations have no file")
    for fqn, md in sdm.items():
        keys = (
            [MetadataIndex(fqn, c.offsets) for c in md.chunks]
            if isinstance(md, TensorStorageMetadata)
            else [MetadataIndex(fqn)]
        )
        for key in keys:
            if key not in storage:
                where = f" chunk at offsets {list(key.offset)}" if key.offset is not None else ""
                raise CheckpointFormatError(
                    f"{root}: entry '{fqn}'{where} has no storage location in the metadata; "
                    f"the checkpoint is incomplete"
                )
    ranges: dict[str, list] = {}
    chunk_keys = {
        (fqn, tuple(c.offsets)) for fqn, md in sdm.items() if isinstance(md, TensorStorageMetadata) for c in md.chunks
    }
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str):
            raise _fail(root, f"storage key {index!r} is not a MetadataIndex")
        if index.offset is None:
            known = isinstance(sdm.get(fqn), BytesStorageMetadata)
        else:
            known = (fqn, tuple(index.offset)) in chunk_keys
        if not known:  # DCP writes a location for each chunk of its entries, nothing else
            where = f" at offsets {list(index.offset)}" if index.offset is not None else ""
            raise _fail(
                root,
                f"the storage location of '{fqn}'{where} belongs to no entry or chunk of the "
                f"metadata (an entry or chunk was removed)",
            )
        rel, off, length = info.relative_path, getattr(info, "offset", None), getattr(info, "length", None)
        if (
            not isinstance(rel, (str, os.PathLike))
            or not str(rel)
            or Path(str(rel)).name.endswith(METADATA_FILE)
            or not _is_int(off)
            or not _is_int(length)
            or off < 0
            or length < 0
        ):
            raise _fail(
                root, f"'{fqn}' has a malformed storage location (file {rel!r}, offset {off!r}, length {length!r})"
            )
        ranges.setdefault(str(rel), []).append((off, off + length, fqn, info))
    for rel, spans in sorted(ranges.items()):
        spans.sort(key=lambda s: (s[0], s[1]))
        prev = None
        for span in spans:
            if span[1] == span[0]:
                continue
            if prev is not None and span[0] < prev[1]:
                shared = (span[0], span[1]) == (prev[0], prev[1]) and _shares_record(span[3], prev[3])
                if not shared:
                    raise _fail(
                        root,
                        f"in data file '{rel}', the records of '{prev[2]}' (bytes "
                        f"{prev[0]}..{prev[1]}) and '{span[2]}' (bytes {span[0]}..{span[1]}) "
                        f"overlap",
                    )
            if prev is None or span[1] > prev[1]:
                prev = span
        if not files:
            continue
        end, fqn = max((s[1], s[2]) for s in spans)
        target = root / rel
        if not target.is_file():
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' (holding '{fqn}') is missing; copy the whole checkpoint directory"
            )
        size = target.stat().st_size
        if size < end:
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' is truncated: {size} bytes, but the metadata places "
                f"'{fqn}' up to byte {end}; restore the file or re-save the checkpoint"
            )


def _check_fields(metadata: Metadata) -> None:
    """Every DCP dataclass in ``metadata`` has all its fields (a damaged pickle can rename one)."""
    seen: list = [metadata]
    sdm = getattr(metadata, "state_dict_metadata", None)
    if isinstance(sdm, Mapping):
        for md in sdm.values():
            seen.append(md)
            seen.append(getattr(md, "properties", None))
            chunks = getattr(md, "chunks", None)
            if isinstance(chunks, (list, tuple)):
                seen.extend(chunks)
    storage = getattr(metadata, "storage_data", None)
    if isinstance(storage, Mapping):
        for index, info in storage.items():
            seen += [index, info]
    for obj in seen:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            missing = [f.name for f in dataclasses.fields(obj) if not hasattr(obj, f.name)]
            if missing:
                raise CheckpointFormatError(
                    f"the DCP metadata holds a {type(obj).__name__} without {missing}; the file is "
                    f"corrupt: restore it or re-save the checkpoint"
                )


def _shares_record(a: Any, b: Any) -> bool:
    """Virtual chunks of one foreign record (components of one saved shard) share its bytes."""
    from .foreign import ForeignLocation

    return isinstance(a, ForeignLocation) and isinstance(b, ForeignLocation)


def _check_chunks(root: Path, fqn: str, md: TensorStorageMetadata, complete: bool) -> None:
    """Check 2 of :func:`check_storage` for one tensor entry."""
    props = md.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _fail(root, f"tensor '{fqn}' has no valid dtype ({getattr(props, 'dtype', props)!r})")
    size = _ints(md.size)
    if size is None or any(s < 0 for s in size):
        raise _fail(root, f"tensor '{fqn}' has a malformed size {md.size!r}")
    if not isinstance(md.chunks, (list, tuple)):
        raise _fail(root, f"tensor '{fqn}' has chunks {type(md.chunks).__name__}, not a list")
    boxes = []
    for c in md.chunks:
        off = _ints(getattr(c, "offsets", None)) if isinstance(c, ChunkStorageMetadata) else None
        sz = _ints(getattr(c, "sizes", None)) if isinstance(c, ChunkStorageMetadata) else None
        if off is None or sz is None or len(off) != len(size) or len(sz) != len(size):
            raise _fail(root, f"tensor '{fqn}' of size {list(size)} has a malformed chunk {c!r}")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size, strict=False)):
            raise _fail(
                root,
                f"tensor '{fqn}' of size {list(size)} has a chunk at offsets {list(off)} of "
                f"sizes {list(sz)}, outside the tensor",
            )
        if math.prod(sz):
            boxes.append((off, sz))
    _check_disjoint(root, fqn, size, boxes)
    covered = sum(math.prod(s) for _, s in boxes)
    if complete and covered != math.prod(size):
        raise _fail(
            root, f"the chunks of tensor '{fqn}' (size {list(size)}) cover {covered} of its {math.prod(size)} elements"
        )


def _check_disjoint(root: Path, fqn: str, size: tuple, boxes: list) -> None:
    """No two boxes overlap: a sweep along the dim with the most distinct offsets."""
    if len(boxes) < 2:
        return
    dim = max(range(len(size)), key=lambda d: len({b[0][d] for b in boxes})) if size else 0
    if not size:  # 0-d: two non-empty chunks of one element overlap
        raise _fail(root, f"scalar tensor '{fqn}' has {len(boxes)} chunks")
    boxes = sorted(boxes, key=lambda b: b[0][dim])
    active: list = []
    for off, sz in boxes:
        active = [a for a in active if a[0][dim] + a[1][dim] > off[dim]]
        for aoff, asz in active:
            if all(o < ao + asz_ and ao < o + s for o, s, ao, asz_ in zip(off, sz, aoff, asz, strict=False)):
                raise _fail(
                    root,
                    f"tensor '{fqn}': chunks at offsets {list(aoff)} (sizes {list(asz)}) and "
                    f"{list(off)} (sizes {list(sz)}) overlap",
                )
        active.append((off, sz))


def _record_bytes_needed(md: TensorStorageMetadata, sizes: tuple, info: Any) -> int:
    """Bytes a record must hold for a chunk of ``sizes`` of ``md`` (check 4 of :func:`check_storage`)."""
    from .foreign import ForeignLocation

    numel = math.prod(sizes)
    if isinstance(info, ForeignLocation) and info.component is None:
        return (numel + 1) // 2  # high-precision values decoded from >= 4-bit codes
    return numel * md.properties.dtype.itemsize


def _check_record_sizes(metadata: Metadata, root: Path) -> None:
    """Check 4 of :func:`check_storage`."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        for c in md.chunks:
            info = storage.get(MetadataIndex(fqn, c.offsets))
            if info is None or not hasattr(info, "length"):
                continue
            need = _record_bytes_needed(md, tuple(c.sizes), info)
            if int(info.length) < need:
                raise _fail(
                    root,
                    f"tensor '{fqn}' ({str(md.properties.dtype).removeprefix('torch.')} "
                    f"{list(md.size)}): its chunk at offsets {list(c.offsets)} of sizes "
                    f"{list(c.sizes)} needs at least {need} bytes, but its record in "
                    f"'{info.relative_path}' has {int(info.length)}",
                )


def load_entries(reader: SafeFileSystemReader, metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """Read whole tensor entries of a checkpoint into fresh full-size CPU tensors (no process group).

    Args:
        reader: a :class:`~ckptq.io.SafeFileSystemReader` on the checkpoint (built with
            ``metadata=`` so the metadata is not re-read per call).
        metadata: the checkpoint's metadata.
        keys: tensor entry names (``TensorStorageMetadata`` keys), e.g. ``["w.data", "w.scale"]``.

    Returns:
        ``{key: tensor}`` with each entry's global size and stored dtype, assembled by DCP from all
        of its chunks.

    ``metadata`` must be one :class:`SafeFileSystemReader` returned (checked by
    :func:`check_storage`, so the sizes allocated here are backed by record bytes on disk).

    Raises:
        CheckpointFormatError: a key is not a tensor entry of the checkpoint, or its data cannot be
            read (corrupt data file).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    sd = {}
    for key in keys:
        entry = metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointFormatError(f"{reader.path}: '{key}' is not a tensor entry of the checkpoint")
        sd[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            raise dcp_failure(e, f"{reader.path}: entries {keys}") from None
    return sd

"""A streaming writer of DCP ``FileSystemWriter`` checkpoint directories, from one process.

DCP's ``FileSystemWriter`` writes the files of the ranks of a running process group; ``ckptq reshard``
and ``ckptq convert`` need one storage file per *target* rank written from one process, so
:class:`CheckpointDirWriter` writes DCP's own on-disk format directly: one ``torch.save``-format record
per chunk (framed by :mod:`ckptq.io.records`, no pickling per record) appended to
``__{rank}_0.distcp``, ``_StorageInfo`` locations, and ``.metadata`` (a pickle of
DCP's ``Metadata``, as ``FileSystemWriter.finish`` writes it) last. The output is read by stock
``dcp.load``.

:class:`AtomicFileSystemWriter` is the storage writer for ``dcp.save`` that makes a checkpoint
appear complete or not at all (staging directory + rename), so saving over an existing checkpoint
never leaves its old ``.metadata`` pointing into new, partial data files.

This is the only module that uses DCP internals to write (``_StorageInfo`` and the metadata version);
:func:`check_dcp_version` guards them: an unknown DCP version fails loudly instead of writing files
that a future ``dcp.load`` might misread.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._gc import gc_paused
from ..checksums import Hasher, checksum, checksum_key
from ..contract import sidecar_ranks, with_checksums, with_digest
from ..errors import CkptqError
from ..ops import crc32c_available
from . import storage
from .index import write_index
from .metadata import METADATA_FILE

__all__ = [
    "CheckpointDirWriter",
    "EncodedChunk",
    "encode_chunk",
    "ChecksumFileSystemWriter",
    "AtomicFileSystemWriter",
    "check_dcp_version",
    "KNOWN_DCP_VERSIONS",
    "check_destination",
    "staging_dir",
    "commit_dir",
    "replace_dir",
    "check_writable",
    "write_error",
]

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


_COPY_BYTES = 64 << 20


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> int:
    """Copy up to ``n`` bytes between files at the given offsets; returns how many were copied."""
    n = min(n, _COPY_BYTES)
    try:
        return os.copy_file_range(src_fd, dst_fd, n, src_off, dst_off)
    except OSError as e:
        import errno

        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    data = os.pread(src_fd, min(n, 8 << 20), src_off)  # no copy_file_range between these files
    return os.pwrite(dst_fd, data, dst_off) if data else 0


@dataclasses.dataclass(frozen=True)
class EncodedChunk:
    """A chunk ready to append (:func:`encode_chunk`): its record framing, payload bytes (a view
    of the tensor's memory: keep it unchanged until appended), zip CRC-32 and checksum."""

    dtype: torch.dtype
    shape: tuple
    record: Any
    data: memoryview
    crc32: int
    checksum: int


def encode_chunk(tensor: torch.Tensor, *, known: tuple[int, int] | None = None) -> EncodedChunk:
    """Everything :meth:`CheckpointDirWriter.add_encoded` needs to append ``tensor`` as a
    ``torch.save``-format record: the framing for its dtype and shape
    (:func:`ckptq.io.records.tensor_record`), its bytes (copied to row-major CPU memory only if
    not so already), their zip CRC-32 and their checksum (:func:`ckptq.checksums.checksum`).
    Thread-safe; the hashing releases the GIL.

    Args:
        known: ``(checksum, crc32)`` of these exact bytes when the caller has them already (a whole
            saved chunk copied verbatim, its recorded checksum verified on reading:
            ``CheckpointView.read_box``'s return value); they are not hashed again.
    """
    from ..checksums import checksum, payload
    from .records import payload_crc32, tensor_record

    t = tensor.detach()
    data = payload(t)
    sums = known if known is not None else (checksum(data), payload_crc32(data))
    return EncodedChunk(t.dtype, tuple(t.shape), tensor_record(t.dtype, tuple(t.shape)), data, sums[1], sums[0])


class CheckpointDirWriter:
    """Writes a DCP ``FileSystemWriter``-compatible checkpoint into ``path``, streaming.

    Each chunk is one ``torch.save``-format record appended to ``__{rank}_0.distcp`` of the rank
    it is assigned to, so a rank's chunks are contiguous in one file. Records are framed by
    :func:`ckptq.io.records.tensor_record` (``torch.save``'s own framing, made once per dtype and
    shape) around the chunk's bytes, with no pickling per record; the zip CRC-32 and the checksum
    (:mod:`ckptq.checksums`) of each chunk are computed by :meth:`add_chunk` itself, so the caller
    may reuse the tensor's memory as soon as it returns (:func:`encode_chunk` and
    :meth:`add_encoded` split that work, e.g. hashing on one thread, appending on another).
    Once ``sync_every`` bytes were appended to a file, its data is flushed to disk (``fdatasync``)
    on a background thread while writing goes on. :meth:`finish` stores the checksums in the ckptq
    record of ``.metadata``, which it writes last. ``path`` should be a new, empty directory.

    Several processes may write the files of one checkpoint into one directory: each its own
    ranks' files, or records of any file at byte offsets fixed in advance (the ``at`` of the
    ``add_*`` methods; ranges that do not overlap). Each calls :meth:`close_local` and sends what
    it returns to one process, which passes them to :meth:`merge_local` and then calls :meth:`finish`.

    ``path`` may be an fsspec URL (``s3://bucket/prefix``; :mod:`ckptq.io.storage`): each data
    file is then one object uploaded as it is written (multipart), records appended in the order
    they come (``at`` is not used: objects cannot be written at offsets), and the writer of
    process ``part`` (of several writing one checkpoint) names its files ``__{rank}_{part}.distcp``
    (DCP's own naming of a rank's several files), so no two processes write one object. The
    objects appear when :meth:`close_local` completes their uploads; ``.metadata`` (one PUT) last.

    Not thread-safe: call it from one thread at a time.

    Raises:
        CkptqError: this torch's DCP version is unknown (:func:`check_dcp_version`).
    """

    def __init__(self, path: PathLike, *, sync_every: int = 256 << 20, part: int = 0):
        self._storage_info, self._version = check_dcp_version()
        self.remote = storage.is_url(path)
        self._part = part if self.remote else 0
        self.path: Any = storage.location(path) if self.remote else Path(path)
        if not self.remote:
            self.path.mkdir(parents=True, exist_ok=True)
        self._files: dict[int, Any] = {}
        self._fds: dict[int, int] = {}
        self._pos: dict[int, int] = {}
        self._unsynced: dict[int, int] = {}
        self._sync_every = sync_every
        self._syncer: Any = None
        self._syncs: list = []
        self._md: dict[str, Any] = {}
        self._storage: dict[MetadataIndex, Any] = {}
        self._sums: dict[tuple, int] = {}
        self._closed = False
        self.bytes_per_rank: dict[int, int] = {}

    def _name(self, rank: int) -> str:
        return f"__{rank}_{self._part}.distcp"

    def _fd(self, rank: int) -> int:
        if rank not in self._fds:
            # no O_TRUNC: with positions (``at``), several processes write one file
            self._fds[rank] = os.open(self.path / f"__{rank}_0.distcp", os.O_WRONLY | os.O_CREAT, 0o644)
            self._pos[rank] = 0
            self._unsynced[rank] = 0
        return self._fds[rank]

    def _append(self, rank: int, parts: list, at: int | None = None) -> tuple[int, int]:
        """Write ``parts`` (bytes-like) into ``rank``'s file at byte ``at`` (None: after the last
        write); returns (start, length)."""
        if self.remote:
            return self._append_remote(rank, parts)
        fd = self._fd(rank)
        start = self._pos[rank] if at is None else at
        from .fileio import pwrite_all

        total = pwrite_all(fd, parts, start)
        self._pos[rank] = start + total
        self._unsynced[rank] += total
        if self._unsynced[rank] >= self._sync_every:
            self._unsynced[rank] = 0
            if self._syncer is None:
                import concurrent.futures as cf

                self._syncer = cf.ThreadPoolExecutor(1, thread_name_prefix="ckptq-fdatasync")
            self._syncs = [f for f in self._syncs if not f.done()] + [self._syncer.submit(os.fdatasync, fd)]
        return start, total

    def _append_remote(self, rank: int, parts: list) -> tuple[int, int]:
        f = self._files.get(rank)
        if f is None:
            f = self._files[rank] = storage.open_file(storage.join(self.path, self._name(rank)), "wb")
            self._pos[rank] = 0
        start = self._pos[rank]
        for p in parts:
            if len(p):
                f.write(memoryview(p).cast("B"))
        self._pos[rank] = f.tell()
        return start, self._pos[rank] - start

    def _add_entry_chunk(self, key: str, global_size, offsets, dtype: torch.dtype, shape) -> torch.Size:
        """Record a chunk of ``shape`` at ``offsets`` in tensor entry ``key`` (created on first use);
        returns the offsets as DCP stores them."""
        md = self._md.get(key)
        if md is None:
            md = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(global_size), [])
            self._md[key] = md
        assert md.properties.dtype == dtype and tuple(md.size) == tuple(global_size), key
        offsets = torch.Size(offsets)
        md.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(shape)))
        return offsets

    def add_chunk(
        self, rank: int, key: str, global_size, offsets, tensor: torch.Tensor, *, at: int | None = None
    ) -> None:
        """Append ``tensor`` (any layout; CPU or not) as the chunk at ``offsets`` of entry ``key``
        (global ``global_size``), with its checksum; with ``at``, write its record at that byte of
        the file instead (record offsets fixed in advance). ``tensor`` is not referenced after this returns."""
        self.add_encoded(rank, key, global_size, offsets, encode_chunk(tensor), at=at)

    def add_encoded(
        self, rank: int, key: str, global_size, offsets, chunk: EncodedChunk, *, at: int | None = None
    ) -> None:
        """Append a chunk :func:`encode_chunk` prepared (possibly on another thread) as the chunk
        at ``offsets`` of entry ``key`` (global ``global_size``), with its checksum (``at``: as
        :meth:`add_chunk`)."""
        offsets = self._add_entry_chunk(key, global_size, offsets, chunk.dtype, chunk.shape)
        self._sums[(key, tuple(offsets))] = chunk.checksum
        start, length = self._append(rank, [chunk.record.header, chunk.data, chunk.record.trailer_for(chunk.crc32)], at)
        self._storage[MetadataIndex(key, offsets)] = self._storage_info(self._name(rank), start, length)
        self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + len(chunk.data)

    def add_copy(
        self,
        rank: int,
        key: str,
        global_size,
        offsets,
        dtype: torch.dtype,
        shape,
        src_fd: int,
        src_offset: int,
        checksum: int,
        crc32: int,
        *,
        at: int | None = None,
    ) -> None:
        """Append the chunk at ``offsets`` of entry ``key`` (global ``global_size``) whose payload,
        a contiguous ``dtype`` tensor of ``shape``, is bytes ``src_offset ..`` of the open file
        ``src_fd``: copied in the kernel (``os.copy_file_range``; a read/write loop where the
        file systems do not support it), never through this process's memory. ``checksum`` and
        ``crc32`` are the payload's (the caller hashed it, e.g. ``CheckpointView.hash_chunk``);
        ``at``: as :meth:`add_chunk`."""
        from .records import tensor_record

        if self.remote:
            raise CkptqError(f"internal error: {self.path}: file-to-file copies go to local directories only")
        offsets = self._add_entry_chunk(key, global_size, offsets, dtype, shape)
        record = tensor_record(dtype, tuple(shape))
        start, head = self._append(rank, [record.header], at)
        fd, pos, done = self._fd(rank), start + head, 0
        while done < record.nbytes:
            n = _copy_range(src_fd, src_offset + done, fd, pos + done, record.nbytes - done)
            if n <= 0:
                raise CkptqError(
                    f"{self.path}: copying '{key}' ({record.nbytes} bytes at {src_offset}) stopped "
                    f"after {done} bytes: the source file is shorter than its metadata says"
                )
            done += n
        self._unsynced[rank] += done
        self._append(rank, [record.trailer_for(crc32)], pos + done)
        self._sums[(key, tuple(offsets))] = checksum
        self._storage[MetadataIndex(key, offsets)] = self._storage_info(self._name(rank), start, record.length)
        self.bytes_per_rank[rank] = self.bytes_per_rank.get(rank, 0) + record.nbytes

    def add_bytes(
        self, rank: int, key: str, record: bytes, transform_descriptors=None, *, at: int | None = None
    ) -> None:
        """Append a verbatim non-tensor record (as read by ``CheckpointView.read_raw_bytes``;
        ``at``: as :meth:`add_chunk`)."""
        start, length = self._append(rank, [record], at)
        if not transform_descriptors:  # else the payload is the un-transformed bytes: not hashed
            self._sums[(key, None)] = checksum(record)
        self._md[key] = BytesStorageMetadata()
        info = self._storage_info(self._name(rank), start, length)
        if transform_descriptors:
            info.transform_descriptors = transform_descriptors
        self._storage[MetadataIndex(key)] = info

    def close_local(self) -> tuple:
        """Close this writer's data files (fsync) and return what :meth:`merge_local` of the
        writer that calls :meth:`finish` needs (picklable): entries, locations, checksums, bytes."""
        if not self._closed:
            for f in self._syncs:
                f.result()
            if self._syncer is not None:
                self._syncer.shutdown(wait=True)
                self._syncer = None
            for fd in self._fds.values():
                os.fsync(fd)
                os.close(fd)
            self._fds.clear()
            for f in self._files.values():
                f.close()  # completes the upload: the object appears
            self._files.clear()
            self._closed = True
        return self._md, self._storage, self._sums, dict(self.bytes_per_rank)

    def merge_local(self, shard: tuple) -> None:
        """Add what another process's writer returned from :meth:`close_local` (its files are in
        this writer's directory, for ranks this one did not write)."""
        md, storage, sums, per_rank = shard
        for key, m in md.items():
            mine = self._md.get(key)
            if mine is None:
                self._md[key] = m
            elif isinstance(m, TensorStorageMetadata):
                assert (
                    isinstance(mine, TensorStorageMetadata)
                    and mine.properties.dtype == m.properties.dtype
                    and tuple(mine.size) == tuple(m.size)
                ), key
                mine.chunks.extend(m.chunks)
        self._storage.update(storage)
        self._sums.update(sums)
        for r, b in per_rank.items():
            self.bytes_per_rank[r] = self.bytes_per_rank.get(r, 0) + b

    def finish(self, planner_data: dict) -> Metadata:
        """Close the data files (fsync) and write ``.metadata`` with ``planner_data`` and the
        records' checksums; returns it."""
        self.close_local()
        self._check_files()
        # One order and one string object per name, whatever the processes that wrote the records
        # (merge_local): pickle shares objects by identity, so .metadata is then the same bytes.
        with gc_paused():  # ~1M small objects: the cyclic GC's passes over them would cost more
            sums = {(sys.intern(f), o): v for (f, o), v in sorted(self._sums.items(), key=_order)}
            planner_data = with_checksums(_canonical(planner_data), sums)
            for md in self._md.values():
                if isinstance(md, TensorStorageMetadata):
                    md.chunks.sort(key=lambda c: tuple(c.offsets))
            entries = {sys.intern(k): self._md[k] for k in sorted(self._md)}
            located = {}  # in file order (records never overlap: a unique key)
            for index, info in sorted(self._storage.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
                object.__setattr__(index, "fqn", sys.intern(index.fqn))  # an equal value: its hash is unchanged
                info.relative_path = sys.intern(info.relative_path)
                located[index] = info
        metadata = with_digest(
            Metadata(
                state_dict_metadata=entries,
                planner_data=planner_data,
                storage_data=located,
                storage_meta=StorageMeta(),
            )
        )
        metadata.version = self._version
        if not self.remote:  # the chunk index (local checkpoints), before .metadata, which names it
            write_index(self.path, metadata)
        if self.remote:  # one PUT: the checkpoint appears whole, or not at all
            with storage.open_file(storage.join(self.path, METADATA_FILE), "wb") as f:
                pickle.dump(metadata, f)
            return metadata
        tmp = self.path / ".metadata.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / ".metadata")
        return metadata

    def _check_files(self) -> None:
        """Every record's file is in the directory and holds its records (by size: nothing is read).
        Records other processes wrote (:meth:`merge_local`) are only here when the directory is one
        file system every process sees; a host that wrote into a local folder of the same name
        leaves its files out.

        Raises:
            CkptqError: a file is missing or shorter than its records (names it; nothing is committed).
        """
        if not isinstance(self.path, Path):  # only a directory of a file system can be checked by stat
            return
        ends: dict[str, int] = {}
        for info in self._storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            try:
                size = os.stat(self.path / name).st_size
            except FileNotFoundError:
                size = -1
            if size < end:
                found = "is missing" if size < 0 else f"has {size} bytes"
                raise CkptqError(
                    f"{self.path / name} {found}, its records end at byte {end}: the processes that wrote it "
                    f"did not write into this directory. With several hosts, the output must be on a file "
                    f"system every host sees at the same path (docs/design.md, offline tools); nothing was "
                    f"committed"
                )

    def abort(self) -> None:
        """Close the data files without writing ``.metadata`` (the directory is then incomplete)."""
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for f in self._files.values():
            storage.discard(f)  # an unfinished upload is aborted, never completed
        self._files.clear()


def _order(item: tuple) -> tuple:
    """Sort key of a checksum ``((fqn, offsets), value)``: the chunk's ``(fqn, offsets)`` (offsets
    None for a bytes entry)."""
    return item[0][0], item[0][1] or ()


def _canonical(value: Any) -> Any:
    """``value`` (builtins: dicts, lists, tuples, strings, numbers) rebuilt with no container shared
    and one (interned) object per distinct string: its pickle then depends only on its contents."""
    if isinstance(value, str):
        return sys.intern(value)
    if isinstance(value, dict):
        return {_canonical(k): _canonical(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_canonical(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A ``WriteResult.storage_data`` on its way to the coordinator: DCP's location + checksum."""

    info: Any
    checksum: int | None


class _HashingPlanner:
    """Save-planner proxy for :class:`ChecksumFileSystemWriter`: every value the storage writer
    resolves is handed to a :class:`~ckptq.checksums.Hasher` as it is returned. A CUDA tensor is
    hashed on its GPU and returned as is (DCP's loader copies it to the host, overlapped with the
    writes); where the GPU kernel is not built it is copied to the host here and that copy is
    hashed and returned (one copy, not two)."""

    def __init__(self, planner: Any, hasher: Hasher) -> None:
        self._planner, self._hasher = planner, hasher

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, item: Any) -> Any:
        data = self._planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            data = data.detach()
            if data.device.type != "cpu" and not crc32c_available(data.device):
                data = data.cpu()
            self._hasher.submit(checksum_key(item.index), data)
        else:  # io.BytesIO of a bytes entry
            self._hasher.submit(checksum_key(item.index), bytes(data.getbuffer()))
        return data


class ChecksumFileSystemWriter(FileSystemWriter):
    """A DCP ``FileSystemWriter`` that records a checksum of every chunk it writes, and writes at
    the disk's speed.

    ``dcp.save(sd, storage_writer=ChecksumFileSystemWriter(path), planner=...)`` (or
    ``dcp.async_save``) writes DCP's usual files; each rank hashes the payload of every tensor
    chunk and bytes entry it writes (:mod:`ckptq.checksums`: crc32c of the elements' bytes), and
    the coordinator stores the table in the ckptq record of ``.metadata``
    (:func:`ckptq.contract.with_checksums`), with any planner. Readers that do not know checksums
    (stock ``dcp.load``) read the checkpoint as usual; ckptq's loads verify them
    (:class:`ckptq.io.SafeFileSystemReader`, :class:`ckptq.QuantizedLoadPlanner`, ``ckptq verify``).

    How it writes (``torch.save`` records, the files and ``.metadata`` of DCP's own format): the
    chunks of a rank are spread over ``thread_count`` files (DCP's ``FileSystemWriter`` bins: the
    largest chunks first, each to the least-filled file), each written by its own thread with
    large ``pwritev`` calls: the record framing of :func:`ckptq.io.records.tensor_record` around
    the chunk's bytes (no ``torch.save`` per chunk), the chunk's checksum and zip CRC-32 computed
    piece by piece on the same thread (both release the GIL), CUDA chunks copied out of the GPU
    through two pinned buffers of ``buffer_bytes`` per thread (:class:`ckptq.io.fileio.Staging`),
    and each file's write-back started every ``sync_every`` bytes (:class:`ckptq.io.fileio.Flusher`).
    ``dcp.async_save`` stages the state dict into pinned host memory kept for the next save of
    the same tensors (``cache_staging``; one non-blocking copy per tensor, one wait). For a URL
    path (:class:`AtomicFileSystemWriter`) the same records make each data object, joined once in
    memory from the tensors' bytes and uploaded whole (:func:`ckptq.io.storage.put_object`), a
    rank's records spread over objects of at most about :data:`ckptq.io.storage.OBJECT_BYTES`,
    ``thread_count`` of them built and uploaded at once; ``.metadata`` is one PUT. With DCP's
    stream transforms (``_extensions``), another ``serialization_format`` or
    ``single_file_per_rank=False`` it writes through ``FileSystemWriter`` itself (with checksums).

    Args:
        path: the checkpoint directory.
        thread_count: files (and writer threads) per rank (default
            :data:`ckptq.io.fileio.DEFAULT_THREADS`; DCP's default is 1).
        buffer_bytes: bytes of each pinned staging buffer (default
            :data:`ckptq.io.fileio.DEFAULT_BUFFER_BYTES`).
        sync_every: bytes written to a file between two starts of its write-back (default
            :data:`ckptq.io.fileio.DEFAULT_SYNC_EVERY`; 0: only the final fsync). Only with
            ``sync_files=True`` (the default).
        cache_staging: ``dcp.async_save`` keeps the staged (pinned) copy of the state dict for
            the next save of tensors of the same shapes, dtypes and devices (host memory the size
            of the rank's state dict; ``False`` frees it after each save).
        **kwargs: passed to ``FileSystemWriter`` (``sync_files``, ``single_file_per_rank``, ...).
    """

    def __init__(
        self,
        path: PathLike,
        *args: Any,
        thread_count: int | None = None,
        buffer_bytes: int | None = None,
        sync_every: int | None = None,
        cache_staging: bool = True,
        **kwargs: Any,
    ) -> None:
        from .fileio import DEFAULT_BUFFER_BYTES, DEFAULT_SYNC_EVERY, DEFAULT_THREADS

        if len(args) < 3:  # FileSystemWriter's positional (single_file_per_rank, sync_files, thread_count)
            kwargs["thread_count"] = DEFAULT_THREADS if thread_count is None else int(thread_count)
        super().__init__(path, *args, **kwargs)
        self.buffer_bytes = DEFAULT_BUFFER_BYTES if buffer_bytes is None else int(buffer_bytes)
        self.sync_every = DEFAULT_SYNC_EVERY if sync_every is None else int(sync_every)
        self.cache_staging = cache_staging
        self._staged_key: Any = None

    def _streams_records(self) -> bool:
        """Whether this writer writes the records itself (else through ``FileSystemWriter``)."""
        fmt = getattr(self, "serialization_format", None)
        return (
            self.single_file_per_rank
            and not getattr(getattr(self, "transforms", None), "extensions", ())
            and (fmt is None or getattr(fmt, "value", None) == "torch_save")
        )

    def stage(self, state_dict: Any) -> Any:
        """``dcp.async_save``'s staging: a CPU copy of ``state_dict`` (pinned when it holds CUDA
        tensors; one non-blocking copy per tensor, then one wait), kept for the next save of the
        same tensors when ``cache_staging`` (see :func:`_stage_cached`)."""
        self.per_thread_copy_ahead = 0
        staged, self._staged_key = _stage_cached(state_dict)
        return staged

    def storage_meta(self) -> Any:
        if self._staged_key is not None:  # dcp.save's first call on the saving thread (see _STAGED_BUSY)
            _STAGED_BUSY[self._staged_key] = threading.current_thread()
        return super().storage_meta()

    def write_data(self, plan: Any, planner: Any) -> Future:
        if hasattr(planner, "checksums_by_writer"):  # ckptq's planner: no checksum files of its own
            planner.checksums_by_writer()
        try:
            if self._streams_records():
                results = self._write_records(plan, planner)
            else:
                results = self._write_through_dcp(plan, planner)
        finally:
            if self._staged_key is not None:
                _release_staged(self._staged_key, keep=self.cache_staging)
                self._staged_key = None
        out: Future = Future()
        out.set_result(results)
        return out

    def _write_through_dcp(self, plan: Any, planner: Any) -> list:
        hasher = Hasher()
        try:
            results = super().write_data(plan, _HashingPlanner(planner, hasher)).wait()
            sums = hasher.results()
        finally:
            hasher.close()
        return [
            dataclasses.replace(r, storage_data=_Checked(r.storage_data, sums.get(checksum_key(r.index))))
            for r in results
        ]

    def _write_records(self, plan: Any, planner: Any) -> list:
        import concurrent.futures as cf

        prefix = plan.storage_data.prefix
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        files, workers = max(1, self.thread_count), max(1, self.thread_count)
        write = self._write_file
        if storage.is_url(str(self.path)):  # objects of at most about OBJECT_BYTES, thread_count uploads at once
            files = max(files, -(-sum(_item_bytes(it, chunk=True) for it in plan.items) // storage.OBJECT_BYTES))
            write = self._write_object
        jobs = [(f"{prefix}{i}.distcp", items) for i, items in enumerate(_bins(files, plan.items))]
        if write is self._write_object:
            jobs = [job for job in jobs if job[1]]  # no empty objects
        if len(jobs) == 1 or workers == 1:
            return [r for name, items in jobs for r in write(name, items, planner, None)]
        with cf.ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="ckptq-write") as pool:
            futures = [pool.submit(write, name, items, planner, device) for name, items in jobs]
            return [r for f in futures for r in f.result()]

    def _write_file(self, name: str, items: list, planner: Any, device: int | None) -> list:
        """Write ``items`` (bytes entries first, as DCP does) as the records of data file ``name``
        (on a thread of its own: ``device`` is the calling thread's current CUDA device)."""
        from .fileio import Flusher, pwrite_all

        fd = os.open(self.fs.concat_path(self.path, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        flusher, ok = Flusher(fd, self.sync_every if self.sync_files else 0), False

        def put(parts: list, pos: int) -> int:
            n = pwrite_all(fd, parts, pos)
            flusher.wrote(n)
            return n

        try:
            out = self._encode(name, items, planner, device, put)
            ok = True
        finally:
            try:
                flusher.close(fsync=ok and self.sync_files)
            finally:
                os.close(fd)
        return out

    def _write_object(self, name: str, items: list, planner: Any, device: int | None) -> list:
        """Make the records of ``items`` (as :meth:`_write_file`) and upload them as the data
        object ``name`` (:func:`ckptq.io.storage.put_object`: it appears whole when its upload
        completes, or not at all). The object's bytes are joined once in memory, from the
        tensors' own memory (a CUDA tensor's through one copy to the host)."""
        parts: list = []

        def put(pieces: list, pos: int) -> int:
            pieces = [memoryview(p).cast("B") for p in pieces]
            parts.extend(pieces)
            return sum(len(p) for p in pieces)

        out = self._encode(name, items, planner, device, put, _Whole())
        data = b"".join(parts)
        parts.clear()  # the tensors are no longer held
        storage.put_object(str(self.fs.concat_path(self.path, name)), data)
        return out

    def _encode(self, name: str, items: list, planner: Any, device: int | None, put: Any, staging: Any = None) -> list:
        """Write the records of ``items`` (bytes entries first, as DCP does) one after another from
        byte 0 with ``put(parts, pos)`` (bytes-like ``parts`` at byte ``pos`` of file ``name``;
        returns the bytes written), each hashed; returns their write results. ``staging``: what
        gives a tensor's bytes (default :class:`ckptq.io.fileio.Staging`); ``device``: as for
        :meth:`_write_file`."""
        if device is not None:
            torch.cuda.set_device(device)  # resolve_data may run kernels (high precision) on it
        import zlib

        from torch.distributed.checkpoint.planner import WriteItemType

        from .fileio import Staging
        from .records import tensor_record

        storage_info, _ = check_dcp_version()
        staging, pos, out = staging or Staging(self.buffer_bytes), 0, []
        for item in _bytes_first(items):
            data, start = planner.resolve_data(item), pos
            if item.type == WriteItemType.BYTE_IO:
                buf = data.getbuffer()
                pos += put([buf], pos)
                sum_ = checksum(buf)
            else:
                t = data.detach()
                record = tensor_record(t.dtype, tuple(t.shape))
                pending, sum_, crc = [record.header], 0, 0
                for piece in staging.pieces(t):
                    sum_, crc = checksum(piece, sum_), zlib.crc32(piece, crc)
                    pos, pending = pos + put(pending + [piece], pos), []
                pos += put(pending + [record.trailer_for(crc)], pos)
            info = storage_info(name, start, pos - start)
            out.append(WriteResult(index=item.index, size_in_bytes=pos - start, storage_data=_Checked(info, sum_)))
        return out

    def finish(self, metadata: Metadata, results: list) -> None:
        sums: dict[tuple, int] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                info = r.storage_data
                if isinstance(info, _Checked):
                    if info.checksum is not None:
                        sums[checksum_key(r.index)] = info.checksum
                    info = info.info
                plain[-1].append(dataclasses.replace(r, storage_data=info))
        if sums or sidecar_ranks(metadata.planner_data) is not None:  # the table replaces the planner's files
            metadata.planner_data = with_checksums(metadata.planner_data, sums)
            with_digest(metadata)  # the record now has a checksum table: the digest covers that
        if not getattr(self, "remote", False) and not storage.is_url(str(self.path)):
            # The chunk index (local checkpoints), before FileSystemWriter.finish writes .metadata (which
            # names it) with these same locations: the union of the ranks' write results, as it sets them.
            metadata.storage_data = {r.index: r.storage_data for rank_results in plain for r in rank_results}
            write_index(Path(self.path), metadata)
        if storage.is_url(str(self.path)) and getattr(self, "use_collectives", True):
            # One PUT of .metadata (DCP's finish PUTs .metadata.tmp and "renames" it: on an object store
            # a copy and deletes, six requests more): the checkpoint appears whole, last, or not at all.
            # What FileSystemWriter.finish (torch 2.13) sets before it pickles the metadata:
            metadata.version = check_dcp_version()[1]
            metadata.storage_data = {r.index: r.storage_data for rank_results in plain for r in rank_results}
            metadata.storage_meta = self.storage_meta()
            storage.put_object(str(storage.join(str(self.path), METADATA_FILE)), pickle.dumps(metadata))
            return
        super().finish(metadata, plain)


class _Whole:
    """A tensor's bytes in one piece that stays valid (a CPU tensor's own memory; a CUDA tensor
    copied to the host): for records kept until an object is uploaded."""

    @staticmethod
    def pieces(tensor: torch.Tensor) -> Any:
        from ..checksums import payload

        return iter([payload(tensor)])


def _item_bytes(item: Any, *, chunk: bool = False) -> int:
    """Payload bytes of a write item's tensor (0 for a bytes entry): of the whole tensor, as DCP's
    ``_split_by_size_and_type`` weighs items (torch 2.13 ``filesystem._item_size``), or with
    ``chunk`` of the chunk the item writes."""
    td = item.tensor_data
    if td is None:
        return 0
    return math.prod(td.chunk.sizes if chunk else td.size) * torch.empty((), dtype=td.properties.dtype).element_size()


def _bytes_first(items: list) -> list:
    """``items`` with the bytes entries first, as DCP's writer orders a file's records."""
    from torch.distributed.checkpoint.planner import WriteItemType

    return [it for it in items if it.type == WriteItemType.BYTE_IO] + [
        it for it in items if it.type != WriteItemType.BYTE_IO
    ]


def _bins(count: int, items: list) -> list[list]:
    """The items of a rank's plan in ``count`` files, as DCP's ``FileSystemWriter`` splits them
    (torch 2.13 ``filesystem._split_by_size_and_type``): bytes entries round-robin, tensor chunks
    largest first, each into the file with the fewest tensor bytes so far."""
    from torch.distributed.checkpoint.planner import WriteItemType

    if count == 1:
        return [list(items)]
    out: list[list] = [[] for _ in range(count)]
    sizes = [0] * count
    byte_items = [it for it in items if it.type == WriteItemType.BYTE_IO]
    for i, it in enumerate(byte_items):
        out[i % count].append(it)

    for it in sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True):
        i = sizes.index(min(sizes))
        out[i].append(it)
        sizes[i] += _item_bytes(it)
    return out


#: ``dcp.async_save`` staging copies kept for the next save: signature -> staged state dict.
_STAGED: dict[Any, Any] = {}
#: keys of kept copies a save still writes from -> the thread running that save (None until the
#: save thread's first call, :meth:`ChecksumFileSystemWriter.storage_meta`). ``dcp.async_save``
#: runs each save on a thread of its own, which ends with the save, so the copy of a thread that
#: ended is free again even when the save failed before ``write_data`` released it (a read-only
#: destination, another rank's failed plan).
_STAGED_BUSY: dict[Any, Any] = {}


def _signature(state_dict: Any) -> tuple[Any, bool]:
    """What a staged copy of ``state_dict`` depends on (every leaf's path, type, shape, dtype,
    device, strides and DTensor placements; non-tensor leaves by type), and whether it holds
    CUDA tensors."""
    from torch.distributed.tensor import DTensor

    cuda = []

    def walk(obj: Any, path: tuple) -> Any:
        if isinstance(obj, dict):
            return tuple(walk(v, path + (k,)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return tuple(walk(v, path + (i,)) for i, v in enumerate(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cuda":
                cuda.append(path)
            extra = (tuple(obj.placements), tuple(obj._local_tensor.shape)) if isinstance(obj, DTensor) else ()
            return (path, type(obj), tuple(obj.shape), obj.dtype, str(obj.device), tuple(obj.stride()), extra)
        return (path, type(obj))  # staged as is: the value of each save

    return walk(state_dict, ()), bool(cuda)


def _staging_copy(state_dict: Any, pin: bool) -> Any:
    """Empty CPU tensors (page-locked when ``pin``) of ``state_dict``'s structure: a DTensor's
    local tensor (a DTensor of the same mesh and placements around it), a quantized tensor's
    components (its ``empty_like``), plain tensors; other values as they are."""
    from torch.distributed.tensor import DTensor

    def alloc(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: alloc(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(alloc(v) for v in obj)
        if isinstance(obj, DTensor):
            return DTensor.from_local(
                empty(obj._local_tensor),
                obj.device_mesh,
                obj.placements,
                run_check=False,
                shape=obj.shape,
                stride=obj.stride(),
            )
        if isinstance(obj, torch.Tensor):
            return empty(obj)
        return obj

    def empty(t: torch.Tensor) -> torch.Tensor:  # nothing to page-lock in an empty tensor
        return torch.empty_like(t.detach(), device="cpu", pin_memory=pin and t.numel() > 0)

    return alloc(state_dict)


def _copy_into(src: Any, dst: Any, non_blocking: bool) -> Any:
    """Copy every tensor of ``src`` into the same place of ``dst`` (from :func:`_staging_copy`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(src, dict):
        return {k: _copy_into(v, dst[k], non_blocking) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        return type(src)(_copy_into(v, d, non_blocking) for v, d in zip(src, dst, strict=True))
    if isinstance(src, DTensor):
        dst._local_tensor.copy_(src._local_tensor, non_blocking=non_blocking)
    elif isinstance(src, torch.Tensor):
        dst.copy_(src.detach(), non_blocking=non_blocking)
    else:
        return src
    return dst


def _stage_cached(state_dict: Any) -> tuple[Any, Any]:
    """A CPU copy of ``state_dict`` for ``dcp.async_save`` and the key to release it with
    (:func:`_release_staged`; None: not kept): the kept copy of the same signature is reused
    (copied into, nothing allocated) unless a save still writes from it, else a new one is made
    (page-locked when the state dict holds CUDA tensors). The copies are non-blocking, followed by
    one ``torch.cuda.synchronize``."""
    key, cuda = _signature(state_dict)
    owner = _STAGED_BUSY.get(key)
    busy = key in _STAGED_BUSY and (owner is None or owner.is_alive())
    staged = None if busy else _STAGED.get(key)
    if staged is None:
        staged = _staging_copy(state_dict, pin=cuda and torch.cuda.is_available())
    if not busy:
        _STAGED[key] = staged
        _STAGED_BUSY[key] = None
    staged = _copy_into(state_dict, staged, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return staged, None if busy else key


def _release_staged(key: Any, *, keep: bool) -> None:
    _STAGED_BUSY.pop(key, None)
    if not keep:
        _STAGED.pop(key, None)


def reserve_staging(state_dict: Any) -> int:
    """Allocate now the host memory that ``dcp.async_save`` with ckptq's storage writer
    (:class:`ChecksumFileSystemWriter`, :class:`AtomicFileSystemWriter`, ``cache_staging=True``)
    stages ``state_dict`` into, so that even the first such save blocks only for the copy out of
    the GPU. Call it once at setup (after the model is built and sharded, with the state dict a
    save will pass, or one of the same structure: every tensor's path, type, shape, dtype,
    device, strides and DTensor placements), not per save.

    Without it the first async save of a process allocates and page-locks that memory while the
    caller waits: 22-35x the D2H copy for 2.7 GB in fresh processes on one H100 machine, 2.8-4.1x
    on 2 H200 (``docs/benchmarks.md``, "async_save's staging memory"). The memory is page-locked
    when the state dict holds CUDA tensors (torch's pinned host allocator, per tensor; torch's
    ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8``
    made that 3x faster there) and is touched now otherwise; it is kept until
    :func:`release_staging`. A second save started while one still writes from the copy stages
    into new memory, as without a reservation.

    Args:
        state_dict: the state dict ``dcp.async_save`` will be given (DTensors, ckptq quantized
            tensors, plain tensors; other values are not staged).

    Returns:
        Bytes of host memory held for it (the same reservation is not made twice).
    """
    key, cuda = _signature(state_dict)
    staged = _STAGED.get(key)
    if staged is None:
        staged = _staging_copy(state_dict, pin=cuda and torch.cuda.is_available())
        for t in _staged_tensors(staged):
            if not t.is_pinned():  # fault its pages in now, not during the save (any dtype or strides)
                torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).zero_()
        _STAGED[key] = staged
    return sum(t.untyped_storage().nbytes() for t in _staged_tensors(staged))


def release_staging(state_dict: Any = None) -> None:
    """Free the host memory kept for ``dcp.async_save`` (:func:`reserve_staging`, or kept by a save
    with ``cache_staging=True``): for the state dicts of ``state_dict``'s structure, or all when
    None. A save still writing from it keeps it until that save ends."""
    if state_dict is None:
        _STAGED.clear()
    else:
        _STAGED.pop(_signature(state_dict)[0], None)


def _staged_tensors(staged: Any) -> list[torch.Tensor]:
    """The CPU tensors that hold a staged copy's bytes (DTensor locals, quantized components)."""
    from torch.distributed.tensor import DTensor

    if isinstance(staged, dict):
        return [t for v in staged.values() for t in _staged_tensors(v)]
    if isinstance(staged, (list, tuple)):
        return [t for v in staged for t in _staged_tensors(v)]
    if isinstance(staged, DTensor):
        return _staged_tensors(staged._local_tensor)
    if isinstance(staged, torch.Tensor):
        comps = getattr(staged, "components", None)  # a ckptq quantized tensor's component tensors
        return list(comps().values()) if callable(comps) else [staged]
    return []


class AtomicFileSystemWriter(ChecksumFileSystemWriter):
    """A DCP ``FileSystemWriter`` whose checkpoint appears complete or not at all (and carries
    checksums, as :class:`ChecksumFileSystemWriter`).

    ``dcp.save(sd, storage_writer=AtomicFileSystemWriter(path), planner=...)`` writes every rank's
    files into the sibling staging directory ``.{name}.ckptq-saving`` (emptied by the coordinator
    before any rank writes), and the coordinator, after every rank reported success and
    ``.metadata`` is written, swaps it into place (:func:`replace_dir`: one atomic exchange of the
    two directories where the file system supports it, so ``path`` names the old or the new
    checkpoint at every instant) and removes the old one. So a save that fails or is killed midway
    leaves an existing checkpoint at ``path`` untouched (plain DCP would leave its old
    ``.metadata`` pointing into new, partial data files). A save that fails (a rank's write raised,
    e.g. the disk is full, or ``.metadata`` or the swap failed) removes the staging directory and
    raises a :class:`~ckptq.errors.CkptqError` naming ``path``, the ranks and their errors (DCP
    wraps it in its ``CheckpointException``); a killed save leaves the staging directory, which
    the next save into ``path`` empties. The directory must be on a file system every rank shares
    (as for ``FileSystemWriter``).

    ``path`` may be an fsspec URL (``s3://bucket/prefix``), with DCP's own fsspec file system (as
    ``FsspecWriter``) as its ``fs``: object stores cannot rename, so the data objects are uploaded
    whole under the final prefix and ``.metadata`` last, in one PUT (readers see no checkpoint
    before it exists; a save killed midway leaves none). An existing checkpoint there is refused (a CkptqError, wrapped
    in DCP's ``CheckpointException``: :func:`ckptq.io.dcp_failure`) unless ``overwrite=True``, which deletes
    its ``.metadata`` first and its other objects next, before any rank writes: from then until the
    new ``.metadata`` is written there is no checkpoint at that prefix (save versions under new
    prefixes to keep the old one meanwhile). Objects left by an interrupted save are removed then
    too. See :mod:`ckptq.io.storage`.

    Args:
        path: the checkpoint directory, or an fsspec URL.
        **kwargs: passed to :class:`ChecksumFileSystemWriter` (``thread_count``, ``sync_files``,
            ...; for URLs ``overwrite`` defaults to False, ``sync_files`` to False (an upload is
            durable once it completes) and ``thread_count`` (objects built and uploaded at once,
            each holding its bytes in memory) to 1).

    Raises:
        CkptqError: ``use_collectives=False`` saves (one metadata file per rank) are not supported;
            the staging directory cannot be made, or an existing ``path`` is not writable (nothing
            is written); a rank's write or the commit failed (the staging directory is removed,
            ``path`` unchanged).
    """

    def __init__(self, path: PathLike, **kwargs: Any) -> None:
        self.remote = storage.is_url(path)
        if self.remote:
            self.target: Any = storage.location(path)
            kwargs.setdefault("overwrite", False)
            kwargs.setdefault("sync_files", False)
            kwargs.setdefault("thread_count", 1)  # objects in memory at once (see ChecksumFileSystemWriter)
            super().__init__(self.target, **kwargs)
            self.fs, self.path = storage.dcp_filesystem(self.target)
            return
        self.target = Path(path)
        super().__init__(_staging(self.target), **kwargs)

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
        if self.remote:
            super().reset(None)
            if checkpoint_id:
                self.target = storage.location(checkpoint_id)
                self.fs, self.path = storage.dcp_filesystem(self.target)
            return
        if checkpoint_id:
            self.target = Path(checkpoint_id)
        super().reset(_staging(self.target))

    @property
    def checkpoint_id(self) -> PathLike:  # what DCP records in StorageMeta: the final path
        return self.target

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not kwargs.get("use_collectives", True):
            raise CkptqError(
                f"{self.target}: AtomicFileSystemWriter needs dcp.save's collectives (one global "
                f".metadata written last); use FileSystemWriter for use_collectives=False saves"
            )

    def prepare_local_plan(self, plan: Any) -> Any:
        if self.remote:
            if not self.overwrite and self._metadata_exists():
                raise CkptqError(
                    f"{self.target}: holds a checkpoint, and an object store cannot replace one atomically; "
                    f"save under a new prefix, or pass overwrite=True (deletes the old checkpoint before writing "
                    f"the new one)"
                )
            return super().prepare_local_plan(plan)
        check_writable(self.target)
        try:
            return super().prepare_local_plan(plan)  # makes the staging directory
        except OSError as e:
            raise CkptqError(
                f"{self.target}: cannot make the staging directory {self.path} ({e}); the folder "
                f"{self.target.parent} must be writable by every rank; nothing was written"
            ) from e

    def write_data(self, plan: Any, planner: Any) -> Future:
        if self.remote:  # a failed upload raises (DCP's finish does not run: no .metadata, no checkpoint)
            return super().write_data(plan, planner)
        # A failed write (ChecksumFileSystemWriter's write threads, or DCP's loop) is returned as a
        # result, not raised, so that the coordinator's finish runs and removes the staging
        # directory (DCP calls finish only when every rank succeeded).
        try:
            return super().write_data(plan, planner)
        except Exception as e:  # noqa: BLE001 - reported by the coordinator's finish
            out: Future = Future()
            out.set_result([_WriteFailed(getattr(self, "rank", None), describe_failure(e))])
            return out

    def prepare_global_plan(self, plans: list) -> list:
        # Coordinator only, after every rank made its local plan and before any rank writes: files
        # left in the staging directory by an interrupted save are stale.
        if self.remote:  # DCP's prepare_local_plan refused an existing checkpoint unless overwrite
            storage.remove_tree(self.target, first=(METADATA_FILE,))
            return super().prepare_global_plan(plans)
        staging = Path(self.path)
        for stale in staging.iterdir() if staging.is_dir() else ():
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        return super().prepare_global_plan(plans)

    def finish(self, metadata: Metadata, results: list) -> None:
        if self.remote:  # the PUT of .metadata (ChecksumFileSystemWriter.finish) is the commit
            super().finish(metadata, results)
            return
        staging, target = Path(self.path), self.target
        failed = [f for rank_results in results for f in rank_results if isinstance(f, _WriteFailed)]
        try:
            if failed:
                raise CkptqError(
                    f"{target}: the save failed on {len(failed)} rank(s), nothing was committed (the "
                    f"checkpoint there, if any, is unchanged; the staging directory is removed):\n  "
                    + "\n  ".join(f"rank {f.rank}: {f.error}" for f in failed)
                )
            super().finish(metadata, results)  # .metadata written (and fsynced) in the staging directory
            previous = replace_dir(staging, target, aside=target.parent / f".{target.name}.ckptq-old")
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, CkptqError):
                raise
            raise CkptqError(
                f"{target}: committing the save failed ({type(e).__name__}: {e}); the checkpoint there, "
                f"if any, is unchanged and the staging directory is removed"
            ) from e
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _WriteFailed:
    """A rank's failed ``write_data``, on its way to the coordinator's ``finish``."""

    rank: int | None
    error: str


def _staging(target: Path) -> Path:
    return target.parent / f".{target.name}.ckptq-saving"


def check_writable(dst: Path) -> None:
    """Refuse a destination this process cannot replace: its folder, or an existing ``dst``
    itself (its files could not be removed after the swap), is not writable.

    Raises:
        CkptqError: naming the read-only directory (nothing is written).
    """
    dst = Path(dst)
    for d in (dst.parent, dst) if dst.is_dir() else (dst.parent,):
        if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
            raise CkptqError(f"destination {dst}: {d} is not writable (read-only); nothing was written")


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``,
    kernel 3.15+, glibc 2.28+); False where that is unavailable (another OS, an old libc, a file
    system without it).

    Raises:
        OSError: the exchange failed otherwise (e.g. ``b`` does not exist).
    """
    import ctypes
    import errno

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_dir(new: Path, dst: Path, *, aside: Path) -> Path | None:
    """Put the complete directory ``new`` in place as ``dst``; returns where the previous ``dst``
    now is (for the caller to remove), or None when there was none.

    An existing ``dst`` is swapped with ``new`` in one atomic exchange (:func:`_rename_exchange`),
    so a process opening ``dst`` at any instant finds the old or the new directory, and a crash
    leaves both whole (the old one under ``new``'s name). Where the exchange is unavailable
    ``dst`` is renamed to ``aside`` first (a crash between the two renames leaves ``dst`` missing
    and the old directory whole at ``aside``; a failed second rename puts it back). Both are made
    durable (``fsync`` of the folder).
    """
    previous = None
    if dst.exists():
        try:
            if _rename_exchange(new, dst):
                previous = new
        except FileNotFoundError:
            pass  # dst went away meanwhile: a plain rename below
        if previous is None and dst.exists():
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(dst, aside)
            previous = aside
    if previous is not new:
        try:
            os.replace(new, dst)
        except BaseException:
            if previous is not None:  # put the old directory back
                os.replace(previous, dst)
            raise
    _fsync_dir(dst.parent)
    return previous


def _fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- outputs of the offline tools
def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """The offline tools' output ``dst`` must not overlap their input ``src`` (either inside the
    other, or the same) and must not exist unless ``overwrite``.

    A URL ``dst`` (:mod:`ckptq.io.storage`) exists when any object has its prefix (a checkpoint,
    an export, or what an interrupted run left): ``overwrite`` lets :func:`staging_dir` delete them.

    Raises:
        CkptqError: it overlaps the source, exists without ``overwrite``, or is read-only
            (:func:`check_writable`); nothing is written.
    """
    if storage.is_url(src) or storage.is_url(dst):
        s, d = str(storage.location(src)) + "/", str(storage.location(dst)) + "/"
        if s.startswith(d) or d.startswith(s):
            raise CkptqError(f"destination {dst} overlaps the source {src}; choose a separate prefix")
        if not storage.is_url(dst):
            if Path(dst).exists() and not overwrite:
                raise CkptqError(f"destination {dst} exists; pass --overwrite to replace it")
            check_writable(dst)
            return
        if overwrite:
            return
        names = storage.list_names(dst)
        if names:
            what = "a checkpoint" if METADATA_FILE in names else f"{len(names)} object(s) (an interrupted run's?)"
            raise CkptqError(f"destination {dst} holds {what}; pass --overwrite to replace it")
        return
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst == src or src in dst.parents or dst in src.parents:
        raise CkptqError(f"destination {dst} overlaps the source {src}; choose a separate directory")
    if dst.exists() and not overwrite:
        raise CkptqError(f"destination {dst} exists; pass --overwrite to replace it")
    check_writable(dst)


def describe_failure(e: BaseException) -> str:
    """``Type: message`` of a failed write, with the ``OSError`` it arose from where a library's
    error hides it (``torch.save`` into a full file reports ``unexpected pos``), and what to do
    when that is a full disk or a file-size limit (ENOSPC, EFBIG, EDQUOT)."""
    import errno

    text, cause = f"{type(e).__name__}: {e}", e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None and cause is not e:
        text += f" (from {type(cause).__name__}: {cause})"
    if cause is not None and cause.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        text += " -- the disk is full or a file-size limit was reached: free space or raise the limit (ulimit -f)"
    return text


def write_error(dst: Path, e: OSError) -> CkptqError:
    """The error of an offline tool whose writing of output ``dst`` failed with ``e`` (whose own
    message may not name a file: a full disk, a file-size limit). The caller has removed, or
    removes, its staging folder; ``dst`` is unchanged."""
    return CkptqError(
        f"writing {dst} failed: {describe_failure(e)}; nothing was committed, {dst} is unchanged and the "
        f"staging folder is removed"
    )


def staging_dir(dst: Path) -> Path:
    """A fresh, empty temporary sibling of output directory ``dst`` (``.DST.ckptq-tmp-PID``) for
    the offline tools (reshard, convert, export) to write into, after removing such folders (and
    ``.DST.ckptq-old-PID`` ones, :func:`commit_dir`'s) of ``dst`` left by killed runs (their PID
    is gone; logged on the ``ckptq`` logger). Folders of live
    processes (another run into the same destination) are left alone.

    For a URL ``dst`` (an object store cannot rename a folder) it is ``dst`` itself, after deleting
    what the prefix holds (``.metadata`` or ``config.json`` first: an existing checkpoint or export
    stops being one before its data goes; :func:`check_destination` allowed that); the tool's
    ``.metadata`` (an export's ``config.json``), written last, is the commit."""
    if storage.is_url(dst):
        dst = storage.location(dst)
        storage.remove_tree(dst, first=(METADATA_FILE, "config.json"))
        return dst
    import glob
    import logging

    prefixes = (f".{dst.name}.ckptq-tmp-", f".{dst.name}.ckptq-old-")
    for p in [p for pre in prefixes for p in dst.parent.glob(glob.escape(pre) + "*")]:
        pid = p.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (maybe another run into the same destination)
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue  # alive under another user, or not a PID: not ours to judge
        shutil.rmtree(p, ignore_errors=True)
        logging.getLogger("ckptq").warning("removed %s, left by a killed ckptq run (process %s is gone)", p, pid)
    tmp = dst.parent / f"{prefixes[0]}{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, dst: Path) -> None:
    """Move the completed ``tmp`` into place as ``dst`` (:func:`replace_dir`: an existing ``dst``
    is swapped out atomically and removed after), so ``dst`` is never a partial output. Nothing to
    do for a URL (``tmp`` is ``dst``; writing ``.metadata`` committed it)."""
    if storage.is_url(dst):
        return
    previous = replace_dir(tmp, dst, aside=dst.parent / f".{dst.name}.ckptq-old-{os.getpid()}")
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)

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
import os
import pickle
import shutil
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

from ..checksums import Hasher, checksum, checksum_key
from ..contract import sidecar_ranks, with_checksums, with_digest
from ..errors import CkptqError

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

    Not thread-safe: call it from one thread at a time.

    Raises:
        CkptqError: this torch's DCP version is unknown (:func:`check_dcp_version`).
    """

    def __init__(self, path: PathLike, *, sync_every: int = 256 << 20):
        self._storage_info, self._version = check_dcp_version()
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
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
        fd = self._fd(rank)
        start = self._pos[rank] if at is None else at
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(len(v) for v in views)
        done = 0
        while views:
            n = os.pwritev(fd, views, start + done)
            done += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        self._pos[rank] = start + total
        self._unsynced[rank] += total
        if self._unsynced[rank] >= self._sync_every:
            self._unsynced[rank] = 0
            if self._syncer is None:
                import concurrent.futures as cf

                self._syncer = cf.ThreadPoolExecutor(1, thread_name_prefix="ckptq-fdatasync")
            self._syncs = [f for f in self._syncs if not f.done()] + [self._syncer.submit(os.fdatasync, fd)]
        return start, total

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
        self._storage[MetadataIndex(key, offsets)] = self._storage_info(f"__{rank}_0.distcp", start, length)
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
        self._storage[MetadataIndex(key, offsets)] = self._storage_info(f"__{rank}_0.distcp", start, record.length)
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
        info = self._storage_info(f"__{rank}_0.distcp", start, length)
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
        planner_data = with_checksums(planner_data, self._sums)
        for md in self._md.values():
            if isinstance(md, TensorStorageMetadata):
                md.chunks.sort(key=lambda c: tuple(c.offsets))
        metadata = with_digest(
            Metadata(
                state_dict_metadata=self._md,
                planner_data=planner_data,
                storage_data=self._storage,
                storage_meta=StorageMeta(),
            )
        )
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
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A ``WriteResult.storage_data`` on its way to the coordinator: DCP's location + checksum."""

    info: Any
    checksum: int | None


class _HashingPlanner:
    """Save-planner proxy for :class:`ChecksumFileSystemWriter`: every value the storage writer
    resolves is handed to a :class:`~ckptq.checksums.Hasher` as it is returned (CUDA tensors are
    copied to the CPU here, as DCP's loader would)."""

    def __init__(self, planner: Any, hasher: Hasher) -> None:
        self._planner, self._hasher = planner, hasher

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, item: Any) -> Any:
        data = self._planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            data = data.detach()
            if data.device.type != "cpu":
                data = data.cpu()
            self._hasher.submit(checksum_key(item.index), data)
        else:  # io.BytesIO of a bytes entry
            self._hasher.submit(checksum_key(item.index), bytes(data.getbuffer()))
        return data


class ChecksumFileSystemWriter(FileSystemWriter):
    """A DCP ``FileSystemWriter`` that records a checksum of every chunk it writes.

    ``dcp.save(sd, storage_writer=ChecksumFileSystemWriter(path), planner=...)`` (or
    ``dcp.async_save``) writes DCP's usual files; each rank hashes the payload of every tensor
    chunk and bytes entry it writes (:mod:`ckptq.checksums`: crc32c of the elements' bytes, on a
    background thread while DCP writes), and the coordinator stores the table in the ckptq record
    of ``.metadata`` (:func:`ckptq.contract.with_checksums`), with any planner. Readers that do not
    know checksums (stock ``dcp.load``) read the checkpoint as usual; ckptq's loads verify them
    (:class:`ckptq.io.SafeFileSystemReader`, :class:`ckptq.QuantizedLoadPlanner`, ``ckptq verify``).

    Args:
        path: the checkpoint directory.
        **kwargs: passed to ``FileSystemWriter``.
    """

    def write_data(self, plan: Any, planner: Any) -> Future:
        if hasattr(planner, "checksums_by_writer"):  # ckptq's planner: no checksum files of its own
            planner.checksums_by_writer()
        hasher = Hasher()
        try:
            results = super().write_data(plan, _HashingPlanner(planner, hasher)).wait()
            sums = hasher.results()
        finally:
            hasher.close()
        out: Future = Future()
        out.set_result(
            [
                dataclasses.replace(r, storage_data=_Checked(r.storage_data, sums.get(checksum_key(r.index))))
                for r in results
            ]
        )
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
        super().finish(metadata, plain)


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

    Args:
        path: the checkpoint directory.
        **kwargs: passed to ``FileSystemWriter`` (``thread_count``, ``sync_files``, ...).

    Raises:
        CkptqError: ``use_collectives=False`` saves (one metadata file per rank) are not supported;
            the staging directory cannot be made, or an existing ``path`` is not writable (nothing
            is written); a rank's write or the commit failed (the staging directory is removed,
            ``path`` unchanged).
    """

    def __init__(self, path: PathLike, **kwargs: Any) -> None:
        self.target = Path(path)
        super().__init__(_staging(self.target), **kwargs)

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
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
        check_writable(self.target)
        try:
            return super().prepare_local_plan(plan)  # makes the staging directory
        except OSError as e:
            raise CkptqError(
                f"{self.target}: cannot make the staging directory {self.path} ({e}); the folder "
                f"{self.target.parent} must be writable by every rank; nothing was written"
            ) from e

    def write_data(self, plan: Any, planner: Any) -> Future:
        # A failed write is returned as a result, not raised, so that the coordinator's finish
        # runs and removes the staging directory (DCP calls finish only when every rank succeeded).
        try:
            return super().write_data(plan, planner)
        except Exception as e:  # noqa: BLE001 - reported by the coordinator's finish
            out: Future = Future()
            out.set_result([_WriteFailed(getattr(self, "rank", None), describe_failure(e))])
            return out

    def prepare_global_plan(self, plans: list) -> list:
        # Coordinator only, after every rank made its local plan and before any rank writes: files
        # left in the staging directory by an interrupted save are stale.
        staging = Path(self.path)
        for stale in staging.iterdir() if staging.is_dir() else ():
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        return super().prepare_global_plan(plans)

    def finish(self, metadata: Metadata, results: list) -> None:
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

    Raises:
        CkptqError: it overlaps the source, exists without ``overwrite``, or is read-only
            (:func:`check_writable`); nothing is written.
    """
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
    processes (another run into the same destination) are left alone."""
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
    is swapped out atomically and removed after), so ``dst`` is never a partial output."""
    previous = replace_dir(tmp, dst, aside=dst.parent / f".{dst.name}.ckptq-old-{os.getpid()}")
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)

"""The DCP storage reader of ckptq: metadata without running pickled code, every record checked.

- :class:`SafeFileSystemReader` is a drop-in ``FileSystemReader`` for ``dcp.load``: its
  ``read_metadata`` uses :mod:`ckptq.io.safe_pickle` and :func:`ckptq.io.metadata.validate_metadata`,
  and its ``read_data`` checks every record (:mod:`ckptq.io.record_check`) and every non-tensor
  (BYTE_IO) item with :func:`~ckptq.io.safe_pickle.load_pickled_object` (``weights_only`` plus the
  trainer state types) before DCP's planner loads it (DCP's ``DefaultLoadPlanner.load_bytes`` calls
  ``torch.load(weights_only=False)``). Checkpoints that
  other libraries wrote with pickled quantized tensors (TransformerEngine) are presented through
  the ckptq contract (:mod:`ckptq.io.foreign`), their records unpickled with the adapters' stand-ins only.
- :func:`read_metadata` opens a checkpoint directory for tools (``ckptq inspect``) with clear
  :class:`~ckptq.errors.CheckpointFormatError` s for missing, truncated and non-DCP paths;
  :func:`load_entries` reads whole tensor entries without a process group.

Together with :mod:`ckptq.io.metadata` and :mod:`ckptq.io.record_check` this is ckptq's error
boundary for reading: every malformed checkpoint a reader path meets (``read_metadata``,
``CheckpointView``, ``inspect``, ``verify``, ``load_entries``, ``dcp.load`` with
:class:`SafeFileSystemReader`) becomes a ``CheckpointFormatError`` naming the file, the entry and
what to do, before anything large is allocated. Metadata-level checks live in
:func:`ckptq.io.metadata.check_storage` (geometry, locations, record sizes, files) and
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
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .._gc import gc_paused
from ..checksums import check, checksum_key
from ..contract import DATA_FILE_NAME, Entry, read_checksums, verified_facts
from ..errors import CheckpointFormatError, CkptqError, UnsafeCheckpointError
from .fileio import advise_later, default_read_threads
from .foreign import ForeignLocation, read_foreign_items
from .metadata import METADATA_FILE, describe_non_dcp, validate_metadata
from .read_buffers import empty_for_read, reading
from .record_check import Window, check_chunk_tensor, check_record_header, load_weights_only
from .safe_pickle import load_pickled_object, safe_loads
from .storage import (
    RangePrefetcher,
    dcp_filesystem,
    file_size,
    is_url,
    join,
    list_names,
    location,
    name_of,
    parent_of,
    read_range,
)

__all__ = ["SafeFileSystemReader", "read_metadata", "read_metadata_and_entries", "load_entries", "dcp_failure"]

#: The last error :meth:`SafeFileSystemReader.read_metadata` raised in this thread (for :func:`dcp_failure`).
_LAST_METADATA_ERROR = threading.local()

PathLike = Union[str, "os.PathLike[str]"]


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never executes code from the checkpoint and checks what it reads.

    Use it wherever DCP takes a storage reader:
    ``dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=...)``.

    It is ckptq's one error boundary for reading: every malformation of a checkpoint becomes a
    :class:`~ckptq.errors.CheckpointFormatError` (or a subclass) naming the file, the entry and
    what to do, before anything large is allocated:

    * :meth:`read_metadata` unpickles ``.metadata`` through the allow-list, then runs
      :func:`~ckptq.io.metadata.check_storage` (entry and chunk geometry, storage locations,
      record sizes, data files) on it: a metadata that claims more elements than its records hold
      bytes is refused there;
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
        thread_count: data files read at once, each by its own thread (default
            :func:`ckptq.io.fileio.default_read_threads`: 4 in a process that uses CUDA, else 8).
        buffer_bytes: bytes of each read request, and of each of the
            :data:`ckptq.io.fileio.READ_AHEAD_BUFFERS` pinned buffers per file that CUDA
            destinations are filled through (so their copies do not wait) (default
            :data:`ckptq.io.fileio.DEFAULT_BUFFER_BYTES`).
        read_ahead_bytes: bytes of records a file's thread reads ahead of the records the caller
            has committed (at least one record); a load whose records are converted holds
            temporaries of up to this much per file read at once (default
            :data:`ckptq.io.fileio.READ_AHEAD_BYTES`, 1 GiB).
        fadvise: tell the kernel each data file is read sequentially (``POSIX_FADV_SEQUENTIAL``).
        early_read_ahead: bytes of this rank's own data files (``__<rank>_*.distcp``, as DCP's and
            ckptq's writers name them) the kernel is asked to fetch as soon as ``.metadata`` is
            read, while it is checked and DCP plans the load (``POSIX_FADV_WILLNEED`` on a
            background thread), when the checkpoint's data files are of as many ranks as load it
            (a load into the layout it was saved from reads its own files); 0 turns it off
            (default :data:`ckptq.io.fileio.EARLY_READ_AHEAD`).
        **kwargs: passed to ``FileSystemReader``.

    How it reads: the records of each local data file are read in file order by a background thread
    of their own (up to ``thread_count`` files at once), ahead of their use
    (:class:`ckptq.io.fileio.RecordReader`). A record whose framing is byte for byte the one this
    torch writes for the chunk's dtype and shape (:func:`ckptq.io.records.tensor_record`: every
    record DCP's ``FileSystemWriter`` and ckptq's writers write with this torch) is checked by
    comparing that framing, so its pickle is never run; that thread then resolves the record's
    destinations with the planner (under a lock) and reads its payload with ``preadv`` straight
    into a CPU destination that takes the whole chunk (else into one buffer of the chunk, narrowed
    afterwards; CUDA destinations through pinned buffers), hashing each piece as it arrives. The
    calling thread compares each record's checksum and commits it (a record whose checksum then
    fails has been copied by that time; the load fails as usual). Any other record (another
    torch's framing, stream transforms, bytes entries) is read and checked through
    ``torch.load(weights_only=True)`` as described above. The records of a URL's data object are
    read the same two ways, their bytes fetched ahead in file order, records next to each other in
    one ranged GET of up to :data:`ckptq.io.storage.READ_WINDOW` bytes
    (:class:`ckptq.io.storage.RangePrefetcher`; a record read the second way is fetched by itself).

    Raises (from :meth:`read_metadata`):
        CheckpointFormatError: the metadata file is missing, truncated, or not DCP ``Metadata``, or
            it fails :func:`~ckptq.io.metadata.check_storage`.
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
        thread_count: int | None = None,
        buffer_bytes: int | None = None,
        read_ahead_bytes: int | None = None,
        fadvise: bool = True,
        early_read_ahead: int | None = None,
        **kwargs: Any,
    ) -> None:
        from .fileio import DEFAULT_BUFFER_BYTES, EARLY_READ_AHEAD, READ_AHEAD_BYTES

        super().__init__(path, **kwargs)
        if is_url(path):  # DCP's own fsspec file system (as FsspecReader), with ckptq's options
            self.fs, self.path = dcp_filesystem(str(path))
        self.thread_count = None if thread_count is None else max(1, int(thread_count))
        self.buffer_bytes = DEFAULT_BUFFER_BYTES if buffer_bytes is None else int(buffer_bytes)
        self.read_ahead_bytes = READ_AHEAD_BYTES if read_ahead_bytes is None else max(0, int(read_ahead_bytes))
        self.fadvise = fadvise
        self.early_read_ahead = EARLY_READ_AHEAD if early_read_ahead is None else max(0, int(early_read_ahead))
        self._cached_metadata = metadata
        self._verify_storage = verify_storage
        self.verify_checksums = verify_checksums
        self._verifying = verify_checksums
        self._checksums: dict | None = None
        self._md: Mapping = {}
        self._chunk_sizes: dict | None = None
        #: The logical entries of the metadata last read from the file (checkpoint order), as
        #: :func:`ckptq.contract.fold_entries` validated them (None before the first read).
        self.entries: dict[str, Entry] | None = None
        self._pinned = _PinnedFiles()

    def reset(self, checkpoint_id: PathLike | None = None) -> None:
        if checkpoint_id and location(checkpoint_id) != location(self.path):
            self._cached_metadata = None
        self._unpin()
        super().reset(checkpoint_id)
        if checkpoint_id and is_url(checkpoint_id):
            self.fs, self.path = dcp_filesystem(str(checkpoint_id))

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
        elif previous is not None and file_size(path) is None:
            raise previous  # dcp.load's fallback to per-rank metadata after a failed global read
        try:
            if rank is None:
                return self._read_pinned(path)
            return self._read_checked(path, rank)
        except CkptqError as e:
            if rank is None:
                _LAST_METADATA_ERROR.error = e  # dcp.load hides it in an AssertionError: see dcp_failure
            raise

    def _read_pinned(self, path: Any) -> Metadata:
        """Read ``.metadata`` and open every data file it names, all of one checkpoint: the
        directory at ``self.path`` must be the same one (device and inode) before and after,
        else (a writer swapped a new checkpoint in meanwhile: :func:`ckptq.io.writer.replace_dir`)
        it is tried again. The open files are what :meth:`read_data` reads, so a checkpoint
        replaced (and its old files removed) while it is read is still read whole: a load gives
        the old checkpoint or the new one, never records of both. Checkpoints of more than
        :data:`PIN_MAX_FILES` data files are read by path (not pinned)."""
        self._unpin()
        if is_url(str(self.path)):  # objects are not opened ahead (nor renamed: see AtomicFileSystemWriter)
            return self._read_checked(path, None)
        for _ in range(PIN_TRIES):
            before = _identity(self.path)
            try:
                metadata = self._read_checked(path, None)
                files = self._open_files(metadata)
            except CkptqError:
                if before is not None and _identity(self.path) != before:
                    continue  # replaced while reading: the metadata or files were of two checkpoints
                raise
            if before is not None and _identity(self.path) == before:
                self._pinned = files
                return metadata
            files.close()
        raise CheckpointFormatError(
            f"{self.path}: the checkpoint was replaced {PIN_TRIES} times while being opened; load it "
            f"again once the saves into this directory pause"
        )

    def _open_files(self, metadata: Metadata) -> _PinnedFiles:
        rels = {str(i.relative_path) for i in metadata.storage_data.values() if hasattr(i, "relative_path")}
        files = _PinnedFiles()
        if len(rels) > PIN_MAX_FILES or is_url(str(self.path)):
            return files
        try:
            for rel in sorted(rels):
                files[rel] = os.open(self.fs.concat_path(self.path, rel), os.O_RDONLY)
        except OSError as e:
            files.close()
            raise CheckpointFormatError(
                f"{self.path}: data file '{rel}' cannot be opened ({e}); copy the whole checkpoint directory"
            ) from e
        return files

    def _data_size(self, rel: str) -> int:
        """The size of data file ``rel``: of the file opened with the metadata (:meth:`_read_pinned`),
        else of the file or object by its path now.

        Raises:
            OSError: it cannot be found or opened.
        """
        fd = self._pinned.get(rel)
        if fd is not None:
            return os.fstat(fd).st_size
        size = file_size(self.fs.concat_path(self.path, rel))
        if size is None:
            raise FileNotFoundError(f"no file {rel}")
        return size

    def _unpin(self) -> None:
        if getattr(self, "_pinned", None):
            self._pinned.close()
        self._pinned = _PinnedFiles()

    @gc_paused()  # the metadata's many small objects: the GC's full passes over them cost ~30% more
    def _read_checked(self, path: Any, rank: int | None) -> Metadata:
        try:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
            if rank is None:
                self._read_own_files_ahead()
            metadata = safe_loads(data, source=str(path), what="the DCP metadata file")
            del data  # the file's bytes: not kept while the metadata is checked
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
        metadata, self.entries = validate_metadata(
            metadata, self._root(), source=str(path), files=self._verify_storage, complete=rank is None
        )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_own_files_ahead(self) -> None:
        """Ask the kernel for the first :attr:`early_read_ahead` bytes of this rank's own data files
        (split evenly over them; see the class docstring). Local checkpoints only; advice only."""
        if not self.early_read_ahead or is_url(str(self.path)) or not self.fadvise:
            return
        dist = torch.distributed
        rank, world = (0, 1)
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        by_rank: dict[int, list[str]] = {}
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    m = DATA_FILE_NAME.fullmatch(e.name)
                    if m:
                        by_rank.setdefault(int(m.group(1)), []).append(e.path)
        except OSError:
            return
        if by_rank and max(by_rank) + 1 == world and rank in by_rank:  # saved by as many ranks as load it
            files = sorted(by_rank[rank])
            share = self.early_read_ahead // len(files)
            if share:  # (a length of 0 would mean "to the end of the file")
                advise_later([(f, 0, share) for f in files])

    def _root(self) -> str | Path:
        """The checkpoint's folder: a URL string or a ``Path``."""
        return str(self.path) if is_url(str(self.path)) else Path(self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        facts = verified_facts(metadata)  # the table validate_metadata read, else read here
        self._checksums = facts["checksums"] if facts else read_checksums(metadata.planner_data, where=str(self.path))
        self._md = metadata.state_dict_metadata
        self._chunk_sizes = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    self._chunk_sizes[(fqn, tuple(c.offsets))] = (md.properties.dtype, tuple(c.sizes))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        with reading():  # the CPU buffers freed by one read are reused by the next (ckptq.io.read_buffers)
            self._read_data(plan, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        foreign = [it for it in plan.items if isinstance(self.storage_data.get(it.storage_index), ForeignLocation)]
        if foreign:  # entries of a checkpoint another library wrote (see ckptq.io.foreign)
            try:
                read_foreign_items(self._root(), self.storage_data, foreign, planner)
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
        try:
            self._read_items(plan.items, _WeightsOnlyBytes(planner, str(self.path)))
        finally:
            self._unpin()

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
        opened = []
        for rel, reqs in per_file.items():
            try:
                opened.append((rel, self.fs.concat_path(self.path, rel), self._data_size(rel), reqs))
            except OSError as e:
                raise CheckpointFormatError(
                    f"{self.path}: data file '{rel}' cannot be opened ({e}); copy the whole checkpoint directory"
                ) from e
        # the read-ahead of the next thread_count - 1 files runs while the records of one are used;
        # their threads resolve destinations, so every planner call holds this lock
        self._planner_lock = threading.RLock()
        starts = [self._plan_file(rel, file, size, reqs, planner) for rel, file, size, reqs in opened]
        started: dict[int, tuple] = {}
        threads = self.thread_count or default_read_threads()
        try:
            for i, (rel, file, size, reqs) in enumerate(opened):
                for j in range(i, min(len(starts), i + threads)):
                    if j not in started:
                        started[j] = starts[j]()
                self._read_file(rel, file, size, reqs, planner, started.pop(i))
        finally:
            for _, reader, _ in started.values():
                if reader is not None:
                    reader.close()

    def _plan_file(self, rel: str, file: Any, size: int, reqs: list, planner: Any) -> Any:
        """A function that starts the reading of the records of ``reqs`` that are read fast (see
        the class docstring) and returns ``(fast records, RecordReader or None, destinations)``.
        A URL's records are fetched ahead, together, in ranged GETs (:class:`~ckptq.io.storage.RangePrefetcher`)."""
        from .fileio import READ_AHEAD_BUFFERS, RecordReader
        from .records import tensor_record

        fast: dict[MetadataIndex, Any] = {}
        by_index: dict[MetadataIndex, list] = {}
        for req in reqs:
            index = req.storage_index
            by_index.setdefault(index, []).append(req)
            info = self.storage_data[index]
            want = (self._chunk_sizes or {}).get((index.fqn, tuple(index.offset or ())))
            if (
                index in fast
                or req.type == LoadItemType.BYTE_IO
                or want is None
                or getattr(info, "transform_descriptors", None)
                or int(info.offset) + int(info.length) > size
            ):
                continue
            try:
                record = tensor_record(want[0], tuple(want[1]))
            except CkptqError:
                continue
            if record.length == int(info.length):
                fast[index] = record
        order = sorted(fast, key=lambda i: int(self.storage_data[i].offset))
        fast = {i: fast[i] for i in order}
        records = [
            (int(self.storage_data[i].offset), int(self.storage_data[i].length), fast[i].header, fast[i].nbytes)
            for i in order
        ]
        pin = torch.cuda.is_available() and torch.cuda.is_initialized()
        state: dict[MetadataIndex, tuple] = {}  # index -> (targets, CPU buffer of the whole chunk or None)

        def prepare(i: int) -> list:
            """The destinations of record ``i`` (on the reading thread): each read item's target that
            takes the whole chunk as is, else one CPU buffer of the chunk for :meth:`_read_fast` to narrow."""
            index = order[i]
            dtype, sizes = (self._chunk_sizes or {})[(index.fqn, tuple(index.offset or ()))]
            with self._planner_lock:
                targets = [(req, planner.resolve_tensor(req).detach()) for req in by_index[index]]
            dsts, whole = [], None
            for req, target in targets:
                if _takes_whole_chunk(req, target, dtype, sizes):
                    dsts.append(target.reshape(-1).view(torch.uint8))
                elif whole is None:
                    whole = empty_for_read((fast[index].nbytes,), torch.uint8)
                    dsts.append(whole)
            state[index] = (targets, whole)
            return dsts

        def start() -> tuple:
            if not records:
                return fast, None, state
            source = self._pinned.get(rel)  # the file opened with the metadata (read through a duplicate)
            if is_url(str(file)):
                source = RangePrefetcher(str(file), [(r[0], r[0] + r[1]) for r in records])
            reader = RecordReader(
                file if source is None else source,
                records,
                prepare,
                hashed=self._verifying,
                buffer_bytes=self.buffer_bytes,
                depth=READ_AHEAD_BUFFERS,
                ahead=self.read_ahead_bytes,
                pin=pin,
                fadvise=self.fadvise,
            )
            return fast, reader.start(), state

        return start

    def _read_file(self, rel: str, file: Any, size: int, reqs: list, planner: Any, started: tuple) -> None:
        fast, reader, state = started
        by_index: dict[MetadataIndex, list] = {}
        for req in reqs:
            by_index.setdefault(req.storage_index, []).append(req)
        slow = [req for req in reqs if req.storage_index not in fast]
        try:
            with self._open_data(rel) as stream:
                results = reader.results() if reader is not None else iter(())
                for index in fast:
                    try:
                        result = next(results)
                    except CkptqError:
                        raise
                    except Exception as e:
                        raise CheckpointFormatError(
                            f"{self._where(index, rel)}: the record cannot be read ({type(e).__name__}: {e}); "
                            f"restore the file or re-save"
                        ) from e
                    if not self._read_fast(rel, index, result, state, planner):
                        slow += by_index[index]  # another framing: read through torch.load
                for req in sorted(slow, key=lambda r: int(self.storage_data[r.storage_index].offset)):
                    with self._planner_lock:
                        self._read_item(stream(req.storage_index), rel, size, req, planner)
        finally:
            if reader is not None:
                reader.close()

    def _read_fast(self, rel: str, index: MetadataIndex, result: tuple, state: dict, planner: Any) -> bool:
        """Finish one record that the reading thread read into its destinations (``result``:
        ``(framed, payload bytes read, checksum)``): check its length and checksum, narrow it into
        the targets that take part of it, commit; False (nothing written) if its framing differs."""
        framed, got, value = result
        if not framed:
            return False
        where = self._where(index, rel)
        dtype, sizes = (self._chunk_sizes or {})[(index.fqn, tuple(index.offset or ()))]
        targets, whole = state.pop(index)
        nbytes = math.prod(sizes) * dtype.itemsize
        if got != nbytes:
            raise CheckpointFormatError(
                f"{where}: the file ends inside the record; it is truncated: restore it or re-save"
            )
        if self._verifying:
            self._check_sum(index, None, where, got=value)
        with self._planner_lock:
            for req, target in targets:
                if whole is not None and not _takes_whole_chunk(req, target, dtype, sizes):
                    chunk = whole.view(dtype).reshape(sizes) if nbytes else torch.empty(sizes, dtype=dtype)
                    tensor = _narrow(chunk, req, where)
                    if target.size() != tensor.size():
                        raise CheckpointFormatError(
                            f"{where}: read {list(tensor.size())} elements for a destination of "
                            f"{list(target.size())}; the metadata is inconsistent"
                        )
                    target.copy_(tensor)
                try:
                    planner.commit_tensor(req, target)
                except CkptqError:
                    raise
                except Exception as e:
                    raise CheckpointFormatError(
                        f"{where}: the load planner failed on this record ({type(e).__name__}: {e}); the record "
                        f"read intact, so the checkpoint and the target state_dict disagree"
                    ) from e
        return True

    def _open_data(self, rel: str) -> Any:
        """A context manager giving ``index -> stream`` of data file ``rel``: one open stream for
        every record of a local file (the file opened with the metadata, :meth:`_read_pinned`, else
        opened by path now); for a URL, each record's byte range fetched by itself (one ranged
        GET: fsspec's read-ahead cache would fetch again on each backward seek)."""
        import contextlib

        fd = self._pinned.get(rel)
        if fd is not None:
            return contextlib.closing(_SameStream(os.fdopen(os.dup(fd), "rb")))
        file = self.fs.concat_path(self.path, rel)
        if not is_url(str(file)):
            return contextlib.closing(_SameStream(self.fs.create_stream(file, "rb")))

        def fetch(index: MetadataIndex) -> Any:
            info = self.storage_data[index]
            return read_range(file, int(info.offset), int(info.offset) + int(info.length))

        return contextlib.nullcontext(fetch)

    def _read_item(self, stream: Any, rel: str, size: int, req: Any, planner: Any) -> None:
        where = self._where(req.storage_index, rel)
        value = self._load_record(
            stream, rel, size, req.storage_index, req.type == LoadItemType.BYTE_IO, verify=self._verifying
        )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, value)
            return
        tensor = _narrow(value, req, where)
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
                check_record_header(Window(stream, start, end - start), where)
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
                    # its bytes (no copy, no buffer export that a raised mismatch's traceback would keep
                    # alive past the BytesIO: a BytesIO collected with an export cannot close)
                    self._check_sum(index, value.getvalue(), where)
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

    def _check_sum(self, index: MetadataIndex, payload: Any, where: str, got: int | None = None) -> None:
        check(payload, (self._checksums or {}).get(checksum_key(index)), where, got=got)

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
        try:
            return self._check_records(progress)
        finally:
            self._unpin()

    def _check_records(self, progress: Any | None) -> tuple[list, int, int]:
        problems, checked, unchecked = [], 0, 0
        per_file: dict[str, list] = {}
        for index, info in self.storage_data.items():
            if isinstance(info, ForeignLocation):
                unchecked += 1
                continue
            per_file.setdefault(str(info.relative_path), []).append(index)
        for rel in sorted(per_file):
            indices = sorted(per_file[rel], key=lambda i: int(self.storage_data[i].offset))
            try:
                size = self._data_size(rel)
                stream_cm = self._open_data(rel)
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
                        self._load_record(stream(index), rel, size, index, is_bytes, verify=True)
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


class _SameStream:
    """``index -> stream`` giving one open stream for every record (closed by :meth:`close`)."""

    def __init__(self, cm: Any) -> None:
        self._cm = cm
        self._stream = cm.__enter__()

    def __call__(self, index: Any) -> Any:
        return self._stream

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


#: How often :meth:`SafeFileSystemReader.read_metadata` tries again when the checkpoint is replaced meanwhile.
PIN_TRIES = 5
#: Checkpoints of more data files than this are read by path (each pinned file is an open descriptor).
PIN_MAX_FILES = 256


def _identity(path: Any) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class _PinnedFiles(dict):
    """``{relative path: open file descriptor}`` of one checkpoint's data files; closed with it."""

    def close(self) -> None:
        for fd in self.values():
            os.close(fd)
        self.clear()

    def __del__(self) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class _ReadIndex:
    """What DCP's stream transforms read from a read item: its storage index."""

    storage_index: MetadataIndex


class _WeightsOnlyBytes:
    """Planner proxy: BYTE_IO values must pass :func:`ckptq.io.safe_pickle.load_pickled_object`
    (``weights_only`` plus the trainer state types) before the real planner's ``load_bytes`` (DCP's
    default uses ``weights_only=False``) sees them; skipped for a planner that trusts pickled
    objects (``QuantizedLoadPlanner(trust_pickled_objects=True)``)."""

    def __init__(self, planner: LoadPlanner, source: str) -> None:
        self._planner = planner
        self._source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if not getattr(self._planner, "trust_pickled_objects", False):
            try:
                load_pickled_object(io.BytesIO(value.getvalue()), where=f"{self._source}: non-tensor entry '{fqn}'")
            except UnsafeCheckpointError:
                raise
            except Exception as e:
                raise CheckpointFormatError(
                    f"{self._source}: non-tensor entry '{fqn}' is corrupt ({type(e).__name__}: {e})"
                ) from e
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def _takes_whole_chunk(req: Any, target: torch.Tensor, dtype: torch.dtype, sizes: tuple) -> bool:
    """Whether read item ``req`` wants the whole stored chunk, as is, in ``target`` (contiguous,
    of the stored dtype and size): its bytes are then copied straight in."""
    return (
        all(int(o) == 0 for o in req.storage_offsets)
        and tuple(int(n) for n in req.lengths) == tuple(sizes)
        and tuple(target.shape) == tuple(sizes)
        and target.dtype == dtype
        and target.is_contiguous()
        and type(target) is torch.Tensor
    )


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


def read_metadata(path: PathLike, *, verify_storage: bool = True) -> Metadata:
    """Read the DCP ``Metadata`` of a checkpoint directory safely (no process group needed).

    Args:
        path: the checkpoint directory (a ``FileSystemWriter`` output), or its ``.metadata`` file.
        verify_storage: also check that every referenced data file exists and is long enough
            (:func:`~ckptq.io.metadata.check_storage` with ``files=True``); the metadata-only
            checks always run.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        As :func:`read_metadata_and_entries`.
    """
    return read_metadata_and_entries(path, verify_storage=verify_storage)[0]


def read_metadata_and_entries(path: PathLike, *, verify_storage: bool = True) -> tuple[Metadata, dict[str, Entry]]:
    """Read the DCP ``Metadata`` of a checkpoint directory safely (no process group needed), with
    its logical entries (validated once, as :class:`SafeFileSystemReader` reads it).

    Args:
        path: the checkpoint directory (a ``FileSystemWriter`` output), or its ``.metadata`` file.
        verify_storage: also check that every referenced data file exists and is long enough
            (:func:`~ckptq.io.metadata.check_storage` with ``files=True``); the metadata-only
            checks always run.

    Returns:
        ``(metadata, entries)``: the ``torch.distributed.checkpoint.metadata.Metadata`` and its
        logical entries in the checkpoint's entry order (:func:`ckptq.contract.fold_entries`).

    Raises:
        CheckpointFormatError: the path is missing, is not a DCP checkpoint, or its metadata or
            data files are truncated or inconsistent (see :func:`~ckptq.io.metadata.check_storage`).
        UnsafeCheckpointError: the metadata pickle references a global outside the allow-list, or a
            storage location points outside the checkpoint directory.
    """
    if is_url(path):
        url = str(path).rstrip("/")
        if name_of(url) == METADATA_FILE:
            url = str(parent_of(url))
        if file_size(join(url, METADATA_FILE)) is None:
            names = list_names(url)
            raise CheckpointFormatError(
                f"{url}: no '{METADATA_FILE}' object"
                + (
                    f" but {len(names)} other object(s): the save was probably interrupted (ckptq and DCP "
                    f"write '{METADATA_FILE}' last); re-save the checkpoint"
                    if names
                    else "; nothing is stored under this prefix"
                )
            )
        reader = SafeFileSystemReader(url, verify_storage=verify_storage)
        return reader.read_metadata(), reader.entries
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
        raise CheckpointFormatError(describe_non_dcp(p))
    # the callers (inspect, the offline tools' views) read what they need in their own order: no
    # early read-ahead of rank 0's files
    reader = SafeFileSystemReader(p, verify_storage=verify_storage, early_read_ahead=0)
    metadata = reader.read_metadata()
    return metadata, reader.entries


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
    :func:`~ckptq.io.metadata.check_storage`, so the sizes allocated here are backed by record bytes on disk).

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
        sd[key] = empty_for_read(tuple(entry.size), entry.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            raise dcp_failure(e, f"{reader.path}: entries {keys}") from None
    return sd


def _narrow(value: torch.Tensor, req: Any, where: str) -> torch.Tensor:
    """The part of a record's tensor ``value`` that read request ``req`` asks for.

    Raises:
        CheckpointFormatError: the request does not fit the record (inconsistent metadata)."""
    try:
        return narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
    except Exception as e:
        raise CheckpointFormatError(
            f"{where}: the read request does not fit the record ({e}); the metadata is inconsistent"
        ) from e

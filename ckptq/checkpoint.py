"""Offline, read-only access to DCP checkpoints as *logical* tensors.

:class:`CheckpointView` reads any ``FileSystemWriter`` checkpoint (ckptq or plain) without a process
group or executing pickled code: each logical entry (:class:`ckptq.contract.Entry`, folded and
validated by :func:`ckptq.contract.fold_entries`) is a natively saved quantized tensor (its
components folded together), a high-precision entry of a quantized tensor, a plain tensor, or a
non-tensor (bytes) entry. The writer of checkpoint directories is :mod:`ckptq.io.writer`.

:func:`open_checkpoint` opens any checkpoint ckptq reads (a DCP directory, or a source another
library wrote that a listed source recognizes, e.g. a Hugging Face safetensors folder or a
``torch.save`` file) as a :class:`ckptq.io.source.CheckpointSource`, so reshard, convert, export,
inspect and verify work on all of them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from . import chunks
from ._gc import gc_paused
from .checksums import check as check_checksum
from .checksums import checksum
from .checksums import combine as combine_checksums
from .contract import CKPTQ_KEY, Entry, EntryTable, fold_entries, read_checksums, read_record, saved_world_size
from .errors import CheckpointFormatError, CkptqError
from .formats import from_components
from .formats.base import QuantizedTensor
from .io import fileio, safetensors, storage, torchsave
from .io.fileio import advise_later
from .io.foreign import ForeignLocation
from .io.index import INDEX_FILE, ChunkIndex
from .io.metadata import METADATA_FILE, check_file_name, check_storage
from .io.read_buffers import Reading, empty_for_read
from .io.reader import SafeFileSystemReader, load_entries, read_metadata_and_entries
from .io.source import CheckpointSource, SourceKind

__all__ = [
    "Entry",
    "CheckpointView",
    "IndexedCheckpointView",
    "CheckpointSource",
    "SavedChunk",
    "open_checkpoint",
    "open_indexed",
    "register_source",
]

#: Bytes of the buffer that partial (strided) reads of a saved chunk go through, a band of rows at a time.
STAGING_BYTES = 1 << 20

#: Bytes past a read that the kernel is asked to fetch meanwhile (``posix_fadvise(WILLNEED)``, a
#: window moved along as the reads go): the disk has requests queued while the bytes before are
#: copied and hashed, and the next records' small framing reads find their pages in the cache.
#: 128 MiB rather than 64 once the advice fetched the whole window (:func:`ckptq.io.fileio.willneed`):
#: on two H100 hosts the TransformerEngine source of ``scripts/bench_offline.py`` read at 0.94 / 0.84
#: of the disk with it against 0.89 / 0.80, the native source at 1.10 / 0.96 against 1.04 / 0.97
#: (docs/benchmarks.md, "WILLNEED fetches one read-ahead window per call").
READ_AHEAD = 128 << 20

#: A box that reads part of a saved chunk not checked yet reads the chunk whole when it is at most
#: this long (checked from those bytes, and its other parts served from them: one read of the chunk
#: instead of the part, then the chunk again to check it); longer chunks are read part by part.
HOLD_BYTES = 64 << 20

#: Foreign records (one shard of another library's tensor) loaded ahead of a view's reads, in the
#: order :meth:`CheckpointView.will_read` gave, each on a background thread: two, so that one's
#: bytes come from the disk while the other is unpickled and converted (``docs/benchmarks.md``).
FOREIGN_AHEAD = 2
#: The most record bytes loaded ahead at once (:data:`FOREIGN_AHEAD`); a record that would pass it
#: is loaded by its own read.
FOREIGN_AHEAD_BYTES = 256 << 20


@dataclasses.dataclass
class SavedChunk:
    """Where the payload of one saved chunk of a tensor entry lies (see :meth:`CheckpointView.saved_chunks`).

    Attributes:
        box: ``(offsets, sizes)`` of the chunk in the entry.
        dtype: the entry's stored dtype.
        file: the data file's path relative to the checkpoint.
        start, length: the record's byte range in ``file``.
        payload: offset in ``file`` of the chunk's elements (row-major, little-endian).
        checksum: the crc32c the checkpoint records for it (None: it records none).
        crc32: the zip CRC-32 its record's directory gives its payload (None: not one member).
        where: how messages name it (checkpoint, entry, chunk, file and byte range).
    """

    box: chunks.Box
    dtype: torch.dtype
    file: str
    start: int
    length: int
    payload: int
    checksum: int | None
    where: str
    crc32: int | None = None
    verified: bool = False


PathLike = Union[str, "os.PathLike[str]"]


class CheckpointView(EntryTable):
    """Read-only logical view of a DCP checkpoint directory (a :class:`ckptq.io.source.CheckpointSource`).

    Args:
        path: the checkpoint directory, or an fsspec URL of one (``s3://bucket/prefix``; records
            are then read by byte range, never the whole object: :mod:`ckptq.io.storage`).
        metadata: use this already-read ``Metadata`` (planning from metadata alone; reads of
            tensor data still go to ``path``). It must be one :func:`ckptq.io.read_metadata` or
            ``SafeFileSystemReader`` returned: those checked it (:func:`ckptq.io.check_storage`)
            before anything is allocated from its sizes.

    Raises:
        CheckpointFormatError / UnsafeCheckpointError: from :func:`ckptq.io.read_metadata`.
    """

    source = "dcp"

    def __init__(self, path: PathLike, *, metadata: Metadata | None = None):
        self.path: Any = storage.location(path) if storage.is_url(path) else Path(path)
        if metadata is None:  # the reader validated the entries as it read the metadata
            self.metadata, self._entries = read_metadata_and_entries(self.path)
        else:
            self.metadata, self._entries = metadata, fold_entries(metadata, where=str(self.path))
        self._init_reads()

    def _init_reads(self) -> None:
        """The state of reads (``self.path``, ``self.metadata`` and ``self._entries`` set)."""
        self.record = read_record(self.metadata.planner_data)
        self.reader = SafeFileSystemReader(self.path, metadata=self.metadata)
        self._saved: dict[str, list[SavedChunk] | None] = {}
        self._ranges = storage.RangeReader(self.path)
        self._advised: dict[str, int] = {}  # local data file -> end of the range asked for (READ_AHEAD)
        self._order: dict[str, int] | None = None  # FQN -> place in the order reads come (will_read)
        self._sequence: list[str] = []  # the FQNs in that order
        self._ahead: dict[str, int] = {}  # FQN -> bytes of its records asked for (_advise_entries), in order
        self._staging: Any = None
        self._held: tuple[SavedChunk | None, Any] = (None, None)  # a chunk read whole for parts of it (_hold)
        self._checksums: Any = False  # read on first use
        self._foreign_ahead: dict[str, tuple[cf.Future, int]] = {}  # FQN -> (its canonical tensor, record bytes)
        self._reading = Reading()  # the blocks of tensors read and freed are reused until close()

    def _checksum_table(self) -> dict:
        """``{(key, offsets or None): crc32c}`` of the records the checkpoint records checksums for."""
        if self._checksums is False:
            self._checksums = read_checksums(self.metadata.planner_data, where=str(self.path)) or {}
        return self._checksums

    @property
    def world_size(self) -> int | None:
        """Ranks that saved it (:func:`ckptq.contract.saved_world_size`)."""
        return saved_world_size(self.metadata)[0]

    @property
    def files(self) -> list[Any]:
        """The data files the metadata names (sorted; ``Path`` s, or URL strings)."""
        locations = self.metadata.storage_data if isinstance(self.metadata.storage_data, Mapping) else {}
        rels = {str(getattr(i, "relative_path", "")) for i in locations.values()} - {""}
        return [storage.join(self.path, rel) for rel in sorted(rels)]

    def entries_in_order(self) -> dict[str, Entry]:
        """The logical entries in the checkpoint's entry order (FQN -> entry), as
        :func:`ckptq.contract.fold_entries` gives them (:meth:`entries` sorts them by FQN)."""
        return dict(self._entries)

    def read(self, fqn: str) -> QuantizedTensor | torch.Tensor:
        """The whole logical tensor: a QuantizedTensor for native entries, else a plain tensor.

        Entries whose saved chunks can be read by byte range (:meth:`saved_chunks`; each chunk's
        checksum checked, :meth:`read_box`) are read straight into the result; others (records
        another library wrote, stream transforms) through DCP's reader, chunk by chunk.

        The records of an entry are read at once (several requests in flight), and each read asks
        the kernel to fetch the records of the entries after it meanwhile (in the order
        :meth:`will_read` gave).

        Memory: the tensor plus at most one saved chunk (or a 1 MiB buffer); for records another
        library wrote, read in the order :meth:`will_read` gave, also the next ones loaded ahead
        (at most :data:`FOREIGN_AHEAD_BYTES`).
        """
        e = self.entry(fqn)
        if e.kind == "bytes":
            raise CheckpointFormatError(f"{self.path}: '{fqn}' is a non-tensor entry")
        keys = list(e.keys.values())
        if self.local:  # the kernel fetches this entry's records and the next ones' meanwhile
            self._advise_entries(fqn)
        if all(self.saved_chunks(k) is not None for k in keys):  # 4x faster than DCP's load per tensor
            data, runs = {}, []
            for k in keys:
                md = self.metadata.state_dict_metadata[k]
                size = tuple(md.size)
                data[k] = empty_for_read(size, md.properties.dtype)
                saved = self.saved_chunks(k)
                if len(saved) == 1 and saved[0].box == ((0,) * len(size), size):  # one run: read with the others
                    c = saved[0]
                    runs.append((c, _bytes_of(data[k]), 0, c.checksum is not None and not c.verified))
                else:
                    self.read_box(k, ((0,) * len(size), size), data[k])
            for (c, _, _, check), running in zip(runs, self._read_runs(runs), strict=True):
                if check:
                    self._verify(c, running)
        else:
            data = self._one_foreign_shard(fqn) or load_entries(self.reader, self.metadata, keys)
        if e.kind == "tensor":
            return data[fqn]
        return from_components(e.descriptor, {name: data[key] for name, key in e.keys.items()})

    def _one_foreign_shard(self, fqn: str) -> dict[str, torch.Tensor] | None:
        """The entries of ``fqn``, a foreign tensor saved as one shard (one record another library
        wrote, :mod:`ckptq.io.foreign`), as its adapter's canonical tensor gives them (no copy into
        new tensors); None for any other layout (read through DCP's reader).

        Where :meth:`will_read` gave the order, the records of the next :data:`FOREIGN_AHEAD` such
        entries in it (at most :data:`FOREIGN_AHEAD_BYTES` of them) are loaded and converted on
        background threads meanwhile, so the disk reads them while this one is converted and the
        caller works on it; an entry's errors are raised when it is read."""
        locs = self._foreign_shard(fqn)
        if locs is None:
            return None
        future = self._foreign_ahead.pop(fqn, (None, 0))[0]
        place = self._order.get(fqn) if self._order else None
        wanted = self._sequence[place + 1 : place + 1 + FOREIGN_AHEAD] if place is not None else []
        for name in [n for n in self._foreign_ahead if n not in wanted]:  # reads left the order
            fileio.settle([self._foreign_ahead.pop(name)[0]])
        held = sum(nbytes for _, nbytes in self._foreign_ahead.values())
        for name in wanted:
            ahead = self._foreign_shard(name) if name not in self._foreign_ahead else None
            if ahead is None:
                continue
            loc = next(iter(ahead.values()))
            if held + loc.length > FOREIGN_AHEAD_BYTES:
                break
            held += loc.length
            pool = fileio.shared_pool("ahead", FOREIGN_AHEAD)
            self._foreign_ahead[name] = (pool.submit(self._canonical, loc), loc.length)
        qt = future.result() if future is not None else self._canonical(next(iter(locs.values())))
        sdm, data = self.metadata.state_dict_metadata, {}
        for k, loc in locs.items():
            t = qt._components[loc.component] if loc.component is not None else qt.dequantize(torch.float32)
            if tuple(t.shape) != tuple(sdm[k].size) or t.dtype != sdm[k].properties.dtype:
                return None
            data[k] = t.contiguous()
        return data

    def _foreign_shard(self, fqn: str) -> dict[str, ForeignLocation] | None:
        """``{key: location}`` of entry ``fqn``'s keys when all of them are one foreign record's
        whole components (one shard of another library's tensor), else None."""
        e = self.entry(fqn)
        if e.kind == "bytes":
            return None
        storage, sdm, locs = self.metadata.storage_data or {}, self.metadata.state_dict_metadata, {}
        for k in e.keys.values():
            md = sdm[k]
            loc = storage.get(MetadataIndex(k, md.chunks[0].offsets)) if len(md.chunks) == 1 else None
            if not isinstance(loc, ForeignLocation) or tuple(md.chunks[0].sizes) != tuple(md.size):
                return None
            locs[k] = loc
        if len({(str(v.relative_path), int(v.offset)) for v in locs.values()}) != 1:
            return None
        return locs

    def _canonical(self, loc: ForeignLocation) -> QuantizedTensor:
        """:func:`ckptq.io.foreign.shard_canonical` of ``loc``, other errors than ckptq's reported as
        corrupt data files."""
        from .io.foreign import shard_canonical

        try:
            return shard_canonical(self.path, loc)
        except CkptqError:
            raise
        except Exception as e:
            raise CheckpointFormatError(
                f"{self.path}: reading another library's record of '{loc.expect.fqn}' failed "
                f"({type(e).__name__}: {e}); the data files are corrupt: restore them or re-save"
            ) from e

    def read_raw_bytes(self, fqn: str) -> tuple[bytes, Any]:
        """The stored record of a non-tensor entry, verbatim (never unpickled), and its transform
        descriptors (DCP stream extensions), for copying into another checkpoint."""
        info = (self.metadata.storage_data or {}).get(MetadataIndex(fqn))
        if info is None or not hasattr(info, "relative_path"):
            raise CheckpointFormatError(f"{self.path}: no storage location for '{fqn}'")
        with self._record_file(str(info.relative_path)) as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        descriptors = getattr(info, "transform_descriptors", None)
        if not descriptors:
            where = (
                f"{self.path}: '{fqn}', record '{info.relative_path}' bytes {info.offset}..{info.offset + info.length}"
            )
            _check_archive(blob, where)
            check_checksum(blob, self._checksum_table().get((fqn, None)), where)
        return blob, descriptors

    # ------------------------------------------------------------------ byte ranges
    def saved_chunks(self, key: str) -> list[SavedChunk] | None:
        """The saved chunks of tensor entry ``key`` (a DCP key: a component key such as
        ``"w.data"`` or a plain tensor's FQN) as byte ranges of the data files, or None when
        some chunk cannot be read by byte range (a record another library wrote, one stored with
        stream transforms, or a tensor that is not one contiguous run; read those with :meth:`read`).

        Each record is checked first as :class:`~ckptq.io.SafeFileSystemReader` checks it (its zip
        directory and pickle CRC, ``weights_only`` unpickling of the pickle alone, dtype and shape
        against the metadata); the payload is not read. Cached per key.

        Raises:
            CheckpointFormatError: ``key`` is not a tensor entry, or a record is truncated, corrupt
                or not what the metadata says (naming the file, byte range and entry).
            UnsafeCheckpointError: a record's pickle cannot be loaded with ``weights_only=True``.
        """
        if key in self._saved:
            return self._saved[key]
        from .io.records import locate_payload

        if not self._saved:
            self._advise_framing()

        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointFormatError(f"{self.path}: '{key}' is not a tensor entry of the checkpoint")
        sums = self._checksum_table()
        out: list[SavedChunk] | None = []
        for c in md.chunks:
            index = MetadataIndex(key, c.offsets)
            info = (self.metadata.storage_data or {}).get(index)
            rel = getattr(info, "relative_path", None)
            if rel is None or isinstance(info, ForeignLocation) or getattr(info, "transform_descriptors", None):
                out = None
                break
            start, length = int(info.offset), int(info.length)
            where = (
                f"{self.path}: '{key}' (chunk at offsets {list(c.offsets)}), record '{rel}' bytes "
                f"{start}..{start + length}"
            )
            try:
                with self._record_file(str(rel)) as f:
                    at = locate_payload(f, start, length, where, md.properties.dtype, tuple(c.sizes))
            except OSError as e:
                raise CheckpointFormatError(
                    f"{where}: the data file cannot be read ({e}); copy the whole checkpoint directory"
                ) from e
            if at is None:
                out = None
                break
            out.append(
                SavedChunk(
                    (tuple(c.offsets), tuple(c.sizes)),
                    md.properties.dtype,
                    str(rel),
                    start,
                    length,
                    start + at[0],
                    sums.get((key, tuple(int(o) for o in c.offsets))),
                    where,
                    at[1],
                )
            )
        self._saved[key] = out
        return out

    def _chunks_for(self, key: str, box: chunks.Box) -> list[SavedChunk] | None:
        """The saved chunks of ``key`` a read of ``box`` needs (here: :meth:`saved_chunks`, all of them)."""
        return self.saved_chunks(key)

    def saved_chunks_for(self, key: str, boxes: list[chunks.Box]) -> list[SavedChunk] | None:
        """:meth:`saved_chunks` as far as reads of ``boxes`` of ``key`` need them: all of the entry's
        chunks (each record checked), or in a view opened from the chunk index only those that
        overlap the boxes (so a process reading a few boxes checks only their records). None as
        :meth:`saved_chunks`: some chunk cannot be read by byte range. Raises as it does."""
        return self.saved_chunks(key)

    def read_box(self, key: str, box: chunks.Box, out: torch.Tensor) -> tuple[int, int] | None:
        """Fill ``out`` (a contiguous CPU tensor of ``box``'s sizes and the entry's stored dtype)
        with the elements of tensor entry ``key`` at ``box``, copied from the byte ranges of the
        saved chunks it overlaps (no whole tensor is assembled). Reads go straight into ``out``
        where the bytes are contiguous on both sides, else through a 1 MiB buffer, a band of rows
        at a time. Each saved chunk the checkpoint records a checksum for is checked the first time
        it is read from (once per view): from the bytes read when they are the whole chunk; for
        a part of a chunk of at most :data:`HOLD_BYTES`, the chunk is read whole, checked, and
        kept for the next boxes that read parts of it; a longer one is read once more, in order.

        Memory: ``out`` plus :data:`STAGING_BYTES` (or one row of a chunk, if larger), plus the
        chunk kept (:data:`HOLD_BYTES` at most) until :meth:`close`.

        Returns:
            ``(checksum, crc32)`` when ``box`` is exactly one saved chunk whose bytes were verified
            against its recorded checksum: that checksum and the zip CRC-32 of its record (so a
            writer need not hash the same bytes again), else None.

        Raises:
            CheckpointFormatError: the chunks cannot be read by byte range (:meth:`saved_chunks` is
                None: use :meth:`read`), a data file is shorter than its metadata says, ``out`` does
                not fit ``box``; ChecksumMismatchError: a chunk's bytes differ from its checksum.
        """
        saved = self._chunks_for(key, box)
        if saved is None:
            raise CheckpointFormatError(f"{self.path}: '{key}' cannot be read by byte range; use read()")
        if tuple(out.shape) != tuple(box[1]) or not out.is_contiguous() or (saved and out.dtype != saved[0].dtype):
            raise CheckpointFormatError(f"{self.path}: '{key}': a buffer {out.dtype} {list(out.shape)} for box {box}")
        covered, known = 0, None
        for c in saved:
            ov = chunks.intersect(box, c.box)
            if ov is None or not math.prod(ov[1]) and ov[1]:
                continue
            covered += math.prod(ov[1])
            self._copy(c, ov, box, out)
            if c.box == tuple(box) and c.verified and c.crc32 is not None:
                known = (c.checksum, c.crc32)
        if covered != math.prod(box[1]):  # check_storage made chunks disjoint and complete
            raise CheckpointFormatError(
                f"{self.path}: the saved chunks of '{key}' cover {covered} of the "
                f"{math.prod(box[1])} elements of box {box}"
            )
        return known

    def whole_chunk(self, key: str, box: chunks.Box) -> SavedChunk | None:
        """The saved chunk of tensor entry ``key`` whose box is exactly ``box``, if one is (and
        the entry can be read by byte range: :meth:`saved_chunks`)."""
        for c in self._chunks_for(key, box) or ():
            if c.box == (tuple(box[0]), tuple(box[1])):
                return c
        return None

    def hash_chunk(self, c: SavedChunk) -> tuple[int, int]:
        """``(checksum, crc32)`` of saved chunk ``c``'s payload: its crc32c (:mod:`ckptq.checksums`),
        checked against the recorded one if the checkpoint has one, and its zip CRC-32 (the one
        its record gives, else computed). Reads the payload once, in order, through the 1 MiB
        staging buffer (for copying the chunk verbatim elsewhere, e.g. with ``copy_file_range``).

        Raises:
            ChecksumMismatchError: the bytes differ from the recorded checksum (naming the file,
                byte range and entry). CheckpointFormatError: the data file is truncated.
        """
        from .io.records import payload_crc32

        nbytes = math.prod(c.box[1]) * c.dtype.itemsize
        stage = self._stage(STAGING_BYTES)
        running, crc = 0, 0
        for at in range(0, nbytes, STAGING_BYTES):
            buf = memoryview(stage[: min(STAGING_BYTES, nbytes - at)])
            self._pread(c, buf, at)
            running = checksum(buf, running)
            if c.crc32 is None:
                crc = payload_crc32(buf, crc)
        if c.checksum is not None:
            self._verify(c, running)
        return running, (c.crc32 if c.crc32 is not None else crc)

    @property
    def local(self) -> bool:
        """Whether the data files are local (have file descriptors: :meth:`data_fd`), not an object store's."""
        return not self._ranges.remote

    def data_fd(self, c: SavedChunk) -> int:
        """A read-only file descriptor of ``c``'s data file (open until :meth:`close`; local
        checkpoints only: :attr:`local`)."""
        return self._fd(c.file)

    def close(self) -> None:
        """Close the data files :meth:`read_box` opened (it reopens them when called again) and unmap
        the idle read buffers (:mod:`ckptq.io.read_buffers`; reads after this do not keep theirs)."""
        self._ranges.close()
        self._advised.clear()
        self._staging = None
        self._held = (None, None)
        fileio.settle([f for f, _ in self._foreign_ahead.values()])
        self._foreign_ahead.clear()
        self._reading.close()

    def _record_file(self, rel: str) -> Any:
        """A context manager giving data file ``rel`` open for reading (remote: the shared handle,
        left open; local: a new file object, closed on exit)."""
        if self._ranges.remote:
            return contextlib.nullcontext(self._ranges.handle(rel))
        return open(self.path / rel, "rb")

    def _fd(self, rel: str) -> int:
        """The descriptor of local data file ``rel`` (:meth:`data_fd`), advised SEQUENTIAL when first
        opened (the kernel's larger readahead window: records are read front to back)."""
        fd = self._ranges.fd(rel)
        if rel not in self._advised:
            self._advised[rel] = 0
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def _pread(self, c: SavedChunk, into: memoryview, at: int, hashed: bool = False) -> int | None:
        """Read ``len(into)`` payload bytes of ``c`` from payload offset ``at``; with ``hashed``, return
        their checksum (:func:`ckptq.checksums.checksum`). See :meth:`_read_runs`."""
        return self._read_runs([(c, into, at, hashed)])[0]

    def _read_runs(self, runs: list[tuple[SavedChunk, memoryview, int, bool]]) -> list[int | None]:
        """Read runs ``(c, into, at, hashed)`` (``len(into)`` payload bytes of ``c`` from payload
        offset ``at``) all at once, and return each one's checksum where ``hashed`` (else None).
        Locally the runs go to the shared read threads together (:func:`ckptq.io.fileio.piece_pool`;
        a run of two :data:`ckptq.io.fileio.PIECE_BYTES` or more in pieces of that size), so the
        disk has several requests in flight from the first run to the last (a sequential stream's
        readahead alone does not give it that), and each piece is hashed by the thread that read it,
        the pieces' checksums joined in order (:func:`ckptq.checksums.combine`; one short run: read
        and hashed on this thread); an object store gets one ranged GET per run, in order."""
        if not self.local or (len(runs) == 1 and len(fileio.piece_spans(len(runs[0][1]))) <= 1):  # one GET / short read
            sums = []
            for c, into, at, hashed in runs:
                if self.local:
                    self._read_ahead(c.file, c.payload + at)
                self._pread_range(c, into, at)
                sums.append(checksum(into) if hashed else None)
            return sums
        pool = fileio.piece_pool()
        jobs = []
        for c, into, at, hashed in runs:
            self._read_ahead(c.file, c.payload + at)
            self._fd(c.file)  # opened here, not by the threads at once
            pieces = fileio.piece_spans(len(into))
            jobs.append([(k, pool.submit(self._pread_piece, c, into[o : o + k], at + o, hashed)) for o, k in pieces])
        sums: list[int | None] = []
        try:
            for (*_, hashed), pieces in zip(runs, jobs, strict=True):
                running = 0
                for k, f in pieces:
                    got = f.result()
                    if hashed:
                        running = combine_checksums(running, got, k)
                sums.append(running if hashed else None)
        finally:
            fileio.settle([f for pieces in jobs for _, f in pieces])  # none still writes into a buffer
        return sums

    def will_read(self, fqns: list[str]) -> None:
        """Say in which order :meth:`read` will be asked for entries (the offline tools say it for the
        entries they read): each read then asks the kernel to fetch the records of the entries after
        it in this order (:data:`READ_AHEAD` bytes of them) while it runs, so the disk reads the next
        entries while this one is converted or written. Without it (or for an entry not in it) a read
        asks for its own records and the :data:`READ_AHEAD` bytes after them in the file. Advice
        only: reads in another order are as correct."""
        self._sequence = list(dict.fromkeys(fqns))
        self._order = {f: i for i, f in enumerate(self._sequence)}
        self._ahead.clear()

    def _record_ranges(self, fqn: str) -> list[tuple[str, int, int]]:
        """``(data file, offset, length)`` of the records of entry ``fqn``, in file order, adjacent
        records merged."""
        storage_data = self.metadata.storage_data or {}
        found = set()
        for k in self.entry(fqn).keys.values():
            md = self.metadata.state_dict_metadata.get(k)
            for c in md.chunks if isinstance(md, TensorStorageMetadata) else [None]:
                info = storage_data.get(MetadataIndex(k, c.offsets) if c is not None else MetadataIndex(k))
                if getattr(info, "relative_path", None) is not None:
                    found.add((str(info.relative_path), int(info.offset), int(info.length)))
        merged: list[tuple[str, int, int]] = []
        for rel, start, length in sorted(found):
            last = merged[-1] if merged else None
            if last is not None and last[0] == rel and start <= last[1] + last[2] + 4096:
                merged[-1] = (rel, last[1], max(last[2], start + length - last[1]))
            else:
                merged.append((rel, start, length))
        return merged

    def _advise_entries(self, fqn: str) -> None:
        """Ask the kernel (on the advice thread: the read does not wait) to fetch the records of entry
        ``fqn`` and of the entries after it in the order :meth:`will_read` gave, up to
        :data:`READ_AHEAD` bytes past it (at most 64 entries), those not asked for yet. Advice only."""
        if not hasattr(os, "posix_fadvise"):
            return
        place = None if self._order is None else self._order.get(fqn)
        if place is None:  # no order: its own records, and the window ahead of them in the file
            for rel, start, _ in self._record_ranges(fqn):
                self._read_ahead(rel, start)
        ahead = 0
        for name in [fqn] if place is None else self._sequence[place : place + 65]:
            asked = self._ahead.get(name)
            if asked is None:
                cap = None if name == fqn else READ_AHEAD - ahead
                asked, whole = 0, True
                for rel, start, length in self._record_ranges(name):
                    n = length if cap is None else min(length, cap - asked)
                    if n <= 0:
                        whole = False
                        break
                    self._advise(rel, start, n)
                    asked += n
                    whole = whole and n == length
                if whole:  # a part asked for is asked again (with more) by the next read
                    self._ahead[name] = asked
            if name != fqn:
                ahead += asked
                if ahead >= READ_AHEAD:
                    return

    def _advise(self, rel: str, start: int, length: int) -> None:
        """``posix_fadvise(WILLNEED)`` of ``length`` bytes of data file ``rel`` from ``start``, on the
        advice thread (the kernel allocates the pages and queues the reads there, not on the reader's
        thread). Errors are ignored: advice only."""
        advise_later([(self._fd(rel), start, length)])

    def _advise_framing(self) -> None:
        """Ask the kernel to fetch the first and last 64 KiB of every record (the ``torch.save``
        framing :meth:`saved_chunks` checks: the pickle at the start, the zip directory at the end)
        at once, so those small reads do not wait for the disk one after the other. Advice only."""
        if not hasattr(os, "posix_fadvise") or not self.local:
            return
        edge = 1 << 16
        for info in (self.metadata.storage_data or {}).values():
            rel = getattr(info, "relative_path", None)
            if rel is None or isinstance(info, ForeignLocation):
                continue
            start, length = int(info.offset), int(info.length)
            try:
                fd = self._fd(str(rel))
                os.posix_fadvise(fd, start, min(edge, length), os.POSIX_FADV_WILLNEED)
                if length > edge:
                    os.posix_fadvise(fd, start + length - edge, edge, os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    def _read_ahead(self, rel: str, pos: int) -> None:
        """Ask the kernel to fetch data file ``rel`` from ``pos`` to ``pos + READ_AHEAD`` (the part not
        asked for yet; only once the window has half run out). Advice only: errors are ignored."""
        end = self._advised.get(rel, 0)
        if not hasattr(os, "posix_fadvise") or pos + READ_AHEAD // 2 < end:
            return
        begin = max(pos, end)
        self._advise(rel, begin, pos + READ_AHEAD - begin)
        self._advised[rel] = pos + READ_AHEAD

    def _pread_piece(self, c: SavedChunk, into: memoryview, at: int, hashed: bool) -> int | None:
        """:meth:`_pread_range`, then (``hashed``) the checksum of the piece, on the thread that read it."""
        self._pread_range(c, into, at)
        return checksum(into) if hashed else None

    def _pread_range(self, c: SavedChunk, into: memoryview, at: int) -> None:
        """Read ``len(into)`` payload bytes of ``c`` from payload offset ``at`` (one thread)."""
        pos, n = c.payload + at, len(into)
        done = 0
        try:
            while done < n:
                got = self._ranges.readinto(c.file, into[done:], pos + done)
                if got <= 0:
                    raise CheckpointFormatError(
                        f"{c.where}: the data file ends inside the record; it is truncated: restore it or re-save"
                    )
                done += got
        except OSError as e:
            raise CheckpointFormatError(f"{c.where}: the data file cannot be read ({e})") from e

    def _stage(self, nbytes: int) -> Any:
        """The staging buffer (a numpy uint8 array), at least ``nbytes`` long."""
        if self._staging is None or len(self._staging) < nbytes:
            import numpy as np

            self._staging = np.empty(max(nbytes, STAGING_BYTES), dtype=np.uint8)
        return self._staging

    def _copy(self, c: SavedChunk, ov: chunks.Box, box: chunks.Box, out: torch.Tensor) -> None:
        # Bytes are copied with numpy (one thread): torch's copy_ splits small copies over its
        # thread pool, which stalls when the writer thread holds the other core.
        item = out.element_size()
        check = c.checksum is not None and not c.verified
        whole = ov == c.box
        if not c.box[1]:  # 0-d
            dst = _bytes_of(out)
            self._pread(c, dst, 0)
            if check:
                self._verify(c, checksum(dst))
            return
        out_b = _u8(out)  # (..., last * itemsize) bytes
        rel_dst = tuple(o - b for o, b in zip(ov[0], box[0], strict=False))
        rel_src = tuple(o - s for o, s in zip(ov[0], c.box[0], strict=False))
        dst = out_b[_slices(rel_dst, ov[1], item)]
        nbytes = math.prod(c.box[1]) * item
        if not whole and (check or self._held[0] is c) and nbytes <= HOLD_BYTES:
            # part of a chunk: the chunk is read once (and checked), and the other parts of it the
            # next boxes ask for (e.g. the row blocks of a reshard) come from memory
            held = self._hold(c, nbytes, check).reshape(tuple(c.box[1][:-1]) + (c.box[1][-1] * item,))
            dst[...] = held[_slices(rel_src, ov[1], item)]
            return
        row = math.prod(c.box[1][1:]) * item  # bytes of one dim-0 slice of the chunk
        r0, nrows = rel_src[0], ov[1][0]
        if tuple(ov[1][1:]) == tuple(c.box[1][1:]) and dst.flags.c_contiguous:  # one run on both sides
            view = memoryview(dst).cast("B")
            running = self._pread(c, view, r0 * row, hashed=check and whole)
            if check and whole:
                self._verify(c, running)
        else:
            band = max(1, STAGING_BYTES // max(row, 1))
            stage = self._stage(min(band, nrows) * row)
            inner = (slice(None),) + _slices(rel_src[1:], ov[1][1:], item)
            running = 0
            for b0 in range(0, nrows, band):
                nb = min(band, nrows - b0)
                buf = stage[: nb * row]
                self._pread(c, memoryview(buf), (r0 + b0) * row)
                if check and whole:
                    running = checksum(memoryview(buf), running)
                rows = buf.reshape((nb,) + tuple(c.box[1][1:-1]) + (c.box[1][-1] * item,))
                dst[b0 : b0 + nb] = rows[inner]
            if check and whole:
                self._verify(c, running)
        if check and not whole:  # read the chunk once, in order, to check it
            nbytes, step = math.prod(c.box[1]) * item, STAGING_BYTES
            stage = self._stage(step)
            running = 0
            for at in range(0, nbytes, step):
                buf = memoryview(stage[: min(step, nbytes - at)])
                self._pread(c, buf, at)
                running = checksum(buf, running)
            self._verify(c, running)

    def _hold(self, c: SavedChunk, nbytes: int, check: bool) -> Any:
        """The ``nbytes`` payload bytes of saved chunk ``c`` (a numpy uint8 array, valid until the next
        call): read at once (:meth:`_read_runs`) and checked with ``check``, unless held already."""
        if self._held[0] is not c:
            self._held = (None, self._held[1])  # nothing held while the buffer is refilled
            buf = self._held[1]
            if buf is None or len(buf) < nbytes:
                import numpy as np

                buf = np.empty(nbytes, dtype=np.uint8)
            (running,) = self._read_runs([(c, memoryview(buf[:nbytes]), 0, check)])
            if check:
                self._verify(c, running)
            self._held = (c, buf)
        return self._held[1][:nbytes]

    def _verify(self, c: SavedChunk, got: int) -> None:
        """``got``, the checksum of ``c``'s bytes as read (maybe hashed in bands), against the recorded one."""
        check_checksum(None, c.checksum, c.where, got=got)
        c.verified = True

    def mapping(self, key: str) -> tuple | None:
        """DCP's flatten mapping (path tuple) of an entry, if the checkpoint has one."""
        pd = self.metadata.planner_data
        if isinstance(pd, dict) and isinstance(pd.get(key), tuple):
            return pd[key]
        return None


class IndexedCheckpointView(CheckpointView):
    """A :class:`CheckpointView` opened from the checkpoint's chunk index (:mod:`ckptq.io.index`)
    instead of unpickling ``.metadata`` whole: the entry table (every entry's dtype, size,
    descriptors: what :func:`~ckptq.reshard.plan.plan_reshard` needs) is read at once; an entry's
    chunk rows when it is first read (:meth:`need`: from :meth:`read_box` the chunks that overlap
    the box, from :meth:`saved_chunks`, :meth:`read` and :meth:`read_raw_bytes` all of them).
    Each block of rows read is verified by its crc32c and the rows of the entries read are checked
    as the full reader checks a checkpoint (:func:`ckptq.io.check_storage`'s checks on arrays:
    bounds, coverage, disjointness, storage locations, byte ranges, record sizes, data file
    lengths; a failure is then named by the exact checks). Same interface and the same results as
    :class:`CheckpointView` on the same checkpoint; open it with :func:`open_indexed`.

    Memory: the entry table, the rows of the entries read (80 bytes a chunk for 3-D entries) and
    DCP's objects for the chunks read.

    Raises:
        CheckpointFormatError: from :class:`ckptq.io.index.ChunkIndex` (a damaged index), or the
            rows of an entry fail a check when they are read.
    """

    def __init__(self, path: PathLike, index: ChunkIndex) -> None:
        self.path = Path(path)
        self.index = index
        for rel in index.files:  # check 3's rules for file names (the data files' lengths: when read)
            check_file_name(rel, self.path, str(self.path / INDEX_FILE), "?")
            if not rel or Path(rel).name.endswith(METADATA_FILE):
                raise CheckpointFormatError(f"{self.path}: the chunk index places records in '{rel}'; it is corrupt")
        self.metadata = index.skeleton()
        self._entries = fold_entries(self.metadata, where=str(self.path))
        self._init_reads()
        self._checksums = {}
        self._rows: dict[str, Any] = {}  # key -> its chunk rows (numpy), checked
        self._made: dict[str, Any] = {}  # key -> bool mask of its rows made into chunks
        self._boxes_made: dict[str, set] = {}  # key -> the boxes its made rows cover

    @property
    def files(self) -> list[Any]:
        return [self.path / rel for rel in sorted(self.index.files)]

    def need(self, wanted: Mapping[str, Any]) -> None:
        """Make the chunks of DCP entries ``wanted`` (key -> boxes of the entry, or None for all of
        it) available to the reads: the rows of the keys not read yet are read and checked together
        (one call for many keys costs far less than one call each), then the chunks that overlap
        the boxes become the entry's chunks and storage locations.

        Raises:
            CheckpointFormatError: a check fails.
        """
        with gc_paused():
            self._read_rows([k for k in wanted if k not in self._rows and k in self.index.names])
            for key, boxes in wanted.items():
                if key in self._rows:
                    self._make(key, boxes)

    def _read_rows(self, keys: list[str]) -> None:
        import numpy as np

        from .io.metadata import boxes_fine, holds, ranges_fine

        if not keys:
            return
        index, sdm, maxnd = self.index, self.metadata.state_dict_metadata, self.index.maxnd
        root = str(self.path)
        numbers = [index.names[k] for k in keys]
        counts = index.entries[numbers, 4]
        starts = np.concatenate([[0], np.cumsum(counts)])
        # stored a column at a time (the checks go through columns), one entry's blocks read at a time
        columns = np.empty((index.width, int(starts[-1])), dtype=np.int64)
        for i, a, b in zip(numbers, starts[:-1].tolist(), starts[1:].tolist(), strict=True):
            columns[:, a:b] = index.rows(i).T
        table = columns.T
        # Padded dims have offset 0, size 1 and extent 1, and a bytes entry is one chunk of one
        # element: every entry is checked as a box grid, in groups of about 2**18 rows (memory).
        dims = index.entries[numbers, 5 : 5 + maxnd]
        fine = bool(np.all(dims.prod(axis=1, dtype=np.float64) < 2.0**53))
        group, first = 1 << 18, 0
        while fine and first < len(keys):
            last = int(np.searchsorted(starts, starts[first] + group, side="right")) - 1
            last = max(last, first + 1)
            a, b = int(starts[first]), int(starts[last])
            entry = np.repeat(np.arange(last - first), counts[first:last])
            rows = table[a:b]
            fine = boxes_fine(entry, rows[:, :maxnd], rows[:, maxnd : 2 * maxnd], dims[first:last], True)
            first = last
        code, st, ln = (table[:, 2 * maxnd + k] for k in range(3))
        fine = fine and bool(((code >= 0) & (code < len(index.files))).all())
        ends = ranges_fine(code, st, ln, len(index.files)) if fine else None
        if ends is not None:  # record sizes (check 4): N elements of dtype D need N * D.itemsize bytes
            tensor = [isinstance(sdm[k], TensorStorageMetadata) for k in keys]
            items = np.array([sdm[k].properties.dtype.itemsize if t else 0 for k, t in zip(keys, tensor, strict=True)])
            need = np.repeat(items, counts)
            for d in range(maxnd):
                need *= table[:, maxnd + d]
            fine = bool((ln >= need).all())
        if (
            not fine
            or ends is None
            or not all(
                holds(os.path.join(root, index.files[f]), int(ends[f]))
                for f in np.flatnonzero(np.bincount(code, minlength=len(index.files))).tolist()
            )
        ):
            self._check_exactly(keys)  # names the failure (or passes a layout the arrays could not clear)
        for k, a, b in zip(keys, starts[:-1].tolist(), starts[1:].tolist(), strict=True):
            self._rows[k] = table[a:b]
            self._made[k] = np.zeros(b - a, dtype=bool)

    def _check_exactly(self, keys: list[str]) -> None:
        """The full reader's checks on DCP objects of every chunk of ``keys`` (naming a failure)."""
        batch, located = {}, {}
        for key in keys:
            chunk_list, where, _ = self.index.read_entry(key)
            md = self.metadata.state_dict_metadata[key]
            if isinstance(md, TensorStorageMetadata):
                md = TensorStorageMetadata(md.properties, md.size, chunk_list)
            batch[key] = md
            located.update(where)
        check_storage(Metadata(batch, storage_data=located), self.path)

    def _make(self, key: str, boxes: Any) -> None:
        """The rows of ``key`` overlapping ``boxes`` (None: all) made into its chunks."""
        import numpy as np

        rows, made = self._rows[key], self._made[key]
        md = self.metadata.state_dict_metadata[key]
        maxnd = self.index.maxnd
        if boxes is None or not isinstance(md, TensorStorageMetadata) or not md.size:
            want = np.ones(len(rows), dtype=bool)
        else:
            nd = len(md.size)
            lo, hi = rows[:, None, :nd], rows[:, None, :nd] + rows[:, None, maxnd : maxnd + nd]
            want = np.zeros(len(rows), dtype=bool)
            done = self._boxes_made.setdefault(key, set())  # boxes whose rows were made already
            boxes = [b for b in dict.fromkeys(boxes) if b not in done]
            done.update(boxes)
            step = max(1, (1 << 22) // max(1, len(rows) * nd))  # rows x boxes x dims compared at once
            for i in range(0, len(boxes), step):
                b_lo = np.array([off for off, _ in boxes[i : i + step]], dtype=np.int64).reshape(1, -1, nd)
                b_hi = b_lo + np.array([size for _, size in boxes[i : i + step]], dtype=np.int64).reshape(1, -1, nd)
                want |= ((lo < b_hi) & (hi > b_lo)).all(axis=2).any(axis=1)
        new = want & ~made
        if not new.any():
            return
        made |= new
        chunk_list, located, sums = self.index.make_chunks(key, rows[made])
        if isinstance(md, TensorStorageMetadata):
            md.chunks = chunk_list
        self.metadata.storage_data.update(located)
        self._checksums.update(sums)
        self._saved.pop(key, None)

    def has_foreign_records(self) -> bool:
        """Whether a plain tensor entry's first record is another library's tensor (the full
        reader presents those through the contract, :func:`ckptq.io.foreign.virtualize`: read such
        a checkpoint with :class:`CheckpointView`). Reads the first index row and the first bytes of
        the first record of each plain tensor entry (one the ckptq record does not describe)."""
        from .io.foreign import virtualize

        sdm, located = {}, {}
        for e in self._entries.values():
            if e.kind != "tensor" or e.descriptor is not None:
                continue
            md = self.metadata.state_dict_metadata[e.fqn]
            first, where, _ = self.index.read_entry(e.fqn, limit=1)
            if first:
                sdm[e.fqn] = TensorStorageMetadata(md.properties, md.size, first)
                located.update(where)
        # the record without its descriptors: those name the entries left out above (virtualize's
        # look at them would only cost, a pass over every descriptor's components)
        planner_data = dict(self.metadata.planner_data or {})
        if isinstance(planner_data.get(CKPTQ_KEY), Mapping):
            planner_data[CKPTQ_KEY] = {**planner_data[CKPTQ_KEY], "tensors": {}}
        probe = Metadata(sdm, planner_data=planner_data, storage_data=located)
        return bool(sdm) and virtualize(probe, self.path) is not probe

    def saved_chunks(self, key: str) -> list[SavedChunk] | None:
        self.need({key: None})
        return super().saved_chunks(key)

    def _chunks_for(self, key: str, box: chunks.Box) -> list[SavedChunk] | None:
        return self.saved_chunks_for(key, [box])

    def saved_chunks_for(self, key: str, boxes: list[chunks.Box]) -> list[SavedChunk] | None:
        self.need({key: boxes})
        return super().saved_chunks(key)

    def read(self, fqn: str) -> QuantizedTensor | torch.Tensor:
        self.need(dict.fromkeys(self.entry(fqn).keys.values()))
        return super().read(fqn)

    def _record_ranges(self, fqn: str) -> list[tuple[str, int, int]]:
        self.need(dict.fromkeys(self.entry(fqn).keys.values()))
        return super()._record_ranges(fqn)

    def read_raw_bytes(self, fqn: str) -> tuple[bytes, Any]:
        self.need({fqn: None})
        return super().read_raw_bytes(fqn)


def open_indexed(path: PathLike) -> IndexedCheckpointView | None:
    """The checkpoint at local directory ``path`` opened from its chunk index
    (:class:`IndexedCheckpointView`), or None when it has none to use (no index file: saved by
    another writer or an older ckptq; an object store; an index ``.metadata`` does not name; another
    library's tensors among its entries): open it with :func:`open_checkpoint` then (which refuses
    an index that is not the one its ``.metadata`` names, :func:`ckptq.io.index.check_index`).

    Raises:
        CheckpointFormatError: the index is damaged: its tables do not match their digest, or it
            names bad data files (remove the index to read the checkpoint through ``.metadata``).
    """
    if storage.is_url(path):
        return None
    p = Path(path)
    p = p.parent if p.name == METADATA_FILE else p
    if not (p / INDEX_FILE).is_file() or not (p / METADATA_FILE).is_file():
        return None
    with gc_paused():
        index = ChunkIndex(p)
        if not index.named_by_metadata():  # a stale index (.metadata of a later save), or another checkpoint's
            return None
        view = IndexedCheckpointView(p, index)
        return None if view.has_foreign_records() else view


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a writable memoryview (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _u8(t: torch.Tensor) -> Any:
    """Contiguous CPU tensor ``t`` (rank >= 1) as a numpy uint8 array of shape ``(..., last * itemsize)``."""
    return t.view(torch.uint8).numpy()


def _slices(offsets: tuple, sizes: tuple, item: int) -> tuple:
    """Index of a box in an array from :func:`_u8` (the last dim counted in bytes)."""
    out = [slice(o, o + n) for o, n in zip(offsets, sizes, strict=False)]
    if out:
        out[-1] = slice(offsets[-1] * item, (offsets[-1] + sizes[-1]) * item)
    return tuple(out)


def _check_archive(blob: bytes, where: str) -> None:
    """A non-tensor record copied verbatim must be a whole ``torch.save`` archive (a zip whose members'
    CRC-32s match); it is never unpickled here."""
    import io
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            bad = z.testzip()
    except Exception as e:  # not a zip, truncated, damaged directory
        raise CheckpointFormatError(
            f"{where}: the record is truncated or corrupt ({type(e).__name__}: {e}); "
            f"restore the file or re-save the checkpoint"
        ) from None
    if bad is not None:
        raise CheckpointFormatError(
            f"{where}: member '{bad}' of the record fails its CRC-32 check; the file "
            f"is corrupt: restore it or re-save the checkpoint"
        )


def _is_dcp(p: Path) -> bool:
    return p.is_dir() and (p / METADATA_FILE).is_file() or p.name == METADATA_FILE


def _open_dcp(p: Path) -> CheckpointView:
    return CheckpointView(p.parent if p.name == METADATA_FILE else p)


#: The kinds of checkpoint :func:`open_checkpoint` tries, in order (:func:`register_source` appends).
_SOURCES: list[SourceKind] = [SourceKind("DCP checkpoint", _is_dcp, _open_dcp), torchsave.SOURCE, safetensors.SOURCE]


def register_source(name: str, detect: Callable[[Path], bool], opener: Callable[[Path], CheckpointSource]) -> None:
    """Teach :func:`open_checkpoint` another kind of checkpoint (tried after ckptq's own).

    Args:
        name: what it is, for messages (``"Hugging Face safetensors"``).
        detect: ``path -> bool``, cheap (file names, a config file), never raising for paths of
            other kinds.
        opener: ``path -> view``: a :class:`ckptq.io.source.CheckpointSource` whose entries are
            :class:`ckptq.contract.Entry` s with ckptq descriptors.
    """
    _SOURCES.append(SourceKind(name, detect, opener))


def open_checkpoint(path: PathLike) -> CheckpointSource:
    """A read-only logical view of the checkpoint at ``path``: :class:`CheckpointView` for a DCP
    directory (or its ``.metadata``), else the view of the first listed source that recognizes it
    (a ``torch.save`` file, a safetensors file or folder, then registered ones).

    Raises:
        CheckpointFormatError: nothing recognizes ``path`` (names what was tried), or it is
            malformed; UnsafeCheckpointError: it would run code.
    """
    if storage.is_url(path):  # object stores: DCP checkpoints (the other sources read local files)
        url = str(storage.location(path))
        return CheckpointView(storage.parent_of(url) if storage.name_of(url) == METADATA_FILE else url)
    p = Path(path)
    refuse_data_file(p)
    for kind in _SOURCES:
        if kind.detect(p):
            return kind.open(p)
    return CheckpointView(p)  # raises the DCP reader's precise error (missing, not DCP, ...)


def refuse_data_file(path: PathLike) -> None:
    """Refuse one ``.distcp`` data file given as a checkpoint: its records can only be located
    and checked through the checkpoint's ``.metadata``, in the folder that holds both.

    Raises:
        CheckpointFormatError: ``path`` is a file named ``*.distcp``; the message names the folder
            to pass instead (or says that its ``.metadata`` is missing).
    """
    p = Path(path)
    if p.suffix != ".distcp" or p.is_dir():
        return
    folder = p.parent
    if (folder / METADATA_FILE).is_file():
        raise CheckpointFormatError(
            f"{p} is one data file of the DCP checkpoint {folder}: its records are read through the "
            f"checkpoint's .metadata; pass the folder instead ({folder})"
        )
    raise CheckpointFormatError(
        f"{p} is a DCP data file, and {folder} has no .metadata to locate its records: pass the "
        f"checkpoint folder (the one holding .metadata and the .distcp files)"
    )

"""The file map of an output (every record's file and offset, fixed before anything is written),
and the thread that writes the records.

An offline writer of a whole checkpoint (``ckptq reshard`` / ``convert``) knows every record of its
output from dtypes and shapes alone, so it gives each one its slot first (:class:`RecordSlot`: target
rank's file, byte offset, length of the ``torch.save`` framing plus payload) and then writes them
in their slots in any order, from any process: :func:`assign_offsets` puts each group of records
(e.g. one tensor's) in a file at a multiple of :data:`RECORD_ALIGN` after the group before it, so
groups written by different processes never share a page. :class:`WriterThread` runs a
:class:`~ckptq.io.writer.CheckpointDirWriter`'s appends on a background thread over two reusable
chunk buffers, so reading (or computing) the next chunk overlaps hashing and writing this one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from .. import chunks
from ..errors import CkptqError
from .records import tensor_record
from .writer import CheckpointDirWriter, encode_chunk

__all__ = ["RECORD_ALIGN", "RecordSlot", "assign_offsets", "WriterThread"]

#: Each group's records in a target file start at a multiple of this (DCP records may have gaps
#: between them): records of different groups, which different processes may write, never share a page.
RECORD_ALIGN = 4096


@dataclasses.dataclass
class RecordSlot:
    """The slot of one record of the output, fixed before anything is written: chunk ``box`` of entry
    ``key`` (global ``size``; ``part``: the component of a quantized tensor, else None) in target
    rank ``rank``'s file at byte ``at``, ``length`` bytes (the ``torch.save`` framing included;
    a bytes entry, ``dtype`` None: its verbatim record). ``piece``: the box of the logical tensor
    the chunk is cut from (a plain tensor's: ``box`` itself).

    Make them with :meth:`tensor` / :meth:`raw` (they know ``length``); :func:`assign_offsets` sets ``at``.
    """

    rank: int
    key: str
    part: str | None
    size: tuple
    box: chunks.Box
    dtype: torch.dtype | None
    piece: chunks.Box | None = None
    at: int = 0
    length: int = 0

    @classmethod
    def tensor(
        cls, rank: int, key: str, part: str | None, size: tuple, box: chunks.Box, dtype: torch.dtype, piece: chunks.Box
    ) -> RecordSlot:
        """A tensor chunk's record (``torch.save`` framing of ``dtype`` and the box's shape + payload)."""
        return cls(rank, key, part, size, box, dtype, piece, length=tensor_record(dtype, tuple(box[1])).length)

    @classmethod
    def raw(cls, rank: int, key: str, length: int) -> RecordSlot:
        """A verbatim non-tensor record of ``length`` bytes."""
        return cls(rank, key, None, (), ((), ()), None, length=length)

    @property
    def nbytes(self) -> int:
        """Payload bytes (0 for a bytes entry)."""
        return 0 if self.dtype is None else math.prod(self.box[1]) * self.dtype.itemsize


def assign_offsets(groups: list[list[RecordSlot]]) -> None:
    """Set every record's ``at``: group after group in list order, a group's records in one file
    contiguous (in list order) and starting at a multiple of :data:`RECORD_ALIGN`. The same on
    every process, so the files are the same bytes however the groups are split over processes."""
    ends: dict[int, int] = {}
    for records in groups:
        started: set = set()
        for o in records:
            pos = ends.get(o.rank, 0)
            if o.rank not in started:
                pos = -(-pos // RECORD_ALIGN) * RECORD_ALIGN
                started.add(o.rank)
            o.at, ends[o.rank] = pos, pos + o.length


class WriterThread:
    """Runs a :class:`CheckpointDirWriter`'s appends on one background thread, in order, so that
    reading the next chunk overlaps checksumming and writing this one. Chunks read into the
    reusable buffers (:meth:`buffer`) go back to the pool once written; at most ``buffers`` of
    them exist, and at most two other writes wait in the queue. An error on the thread is raised
    by the next call (or on exit)."""

    def __init__(self, writer: CheckpointDirWriter, *, buffers: int, buffer_bytes: int) -> None:
        import queue
        import threading

        self.writer = writer
        self._free: queue.Queue = queue.Queue()
        for _ in range(buffers):
            self._free.put(torch.empty(buffer_bytes, dtype=torch.uint8))
        self._jobs: queue.Queue = queue.Queue(maxsize=2)
        self._pending: torch.Tensor | None = None  # the buffer handed out last
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckptq-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._jobs.get()
            if fn is None:
                return
            if self._error is None:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                    self._error = e
            elif getattr(fn, "buffer", None) is not None:
                self._free.put(fn.buffer)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A free chunk buffer's first ``nbytes`` (uint8); waits for one to be written."""
        import queue

        while True:
            self._check()
            try:
                buf = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        self._pending = buf
        return buf[:nbytes]

    def _submit(self, fn: Callable[[], None], buffer: torch.Tensor | None = None) -> None:
        self._check()
        fn.buffer = buffer  # type: ignore[attr-defined]
        self._jobs.put(fn)

    def add_chunk(
        self,
        o: RecordSlot,
        tensor: torch.Tensor,
        *,
        reused: bool = False,
        encode: bool = False,
        known: tuple[int, int] | None = None,
    ) -> None:
        """Queue ``tensor`` (``o``'s dtype and box shape) for writing as record ``o``; ``reused``: it lies in the last
        :meth:`buffer`, which goes back to the pool once written; ``encode``: hash it on this thread
        first (balancing the reading and writing threads), else on the writer thread; ``known``:
        its checksums (:func:`~ckptq.io.writer.encode_chunk`)."""
        if tuple(tensor.shape) != tuple(o.box[1]) or tensor.dtype != o.dtype:  # the slot predicted it
            raise CkptqError(
                f"internal error: '{o.key}' chunk {tuple(o.box[0])} is {tensor.dtype} "
                f"{tuple(tensor.shape)}, its slot holds {o.dtype} {tuple(o.box[1])}; please report it"
            )
        buf = self._pending if reused else None
        chunk = encode_chunk(tensor, known=known) if encode else None

        def run() -> None:
            try:
                if chunk is not None:
                    self.writer.add_encoded(o.rank, o.key, o.size, o.box[0], chunk, at=o.at)
                else:
                    self.writer.add_chunk(o.rank, o.key, o.size, o.box[0], tensor, at=o.at)
            finally:
                if buf is not None:
                    self._free.put(buf)

        self._submit(run, buf)

    def add_bytes(self, o: RecordSlot, record: bytes, transforms: Any) -> None:
        """Queue ``record`` (a verbatim non-tensor record, with its transform descriptors) as record ``o``."""
        self._submit(lambda: self.writer.add_bytes(o.rank, o.key, record, transforms, at=o.at))

    def add_copy(self, o: RecordSlot, src_fd: int, src_offset: int, checksum: int, crc32: int) -> None:
        """Queue :meth:`CheckpointDirWriter.add_copy` of record ``o`` (a chunk copied file to file)."""
        self._submit(
            lambda: self.writer.add_copy(
                o.rank, o.key, o.size, o.box[0], o.dtype, o.box[1], src_fd, src_offset, checksum, crc32, at=o.at
            )
        )

    def __enter__(self) -> WriterThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._jobs.put(None)
        self._thread.join()
        if exc[0] is None:
            self._check()

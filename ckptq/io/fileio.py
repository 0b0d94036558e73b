"""Large sequential file I/O for ckptq's DCP storage writer and reader.

DCP's ``FileSystemWriter`` (torch 2.11 / 2.13 ``torch/distributed/checkpoint/filesystem.py``) writes
each chunk with ``torch.save`` into a buffered stream on one thread by default, copies CUDA tensors
into pageable memory, and fsyncs each file only at its end, so the disk sits idle while the CPU
serializes and the CPU sits idle during the final flush. Its ``FileSystemReader`` reads each
record with ``torch.load`` through a file view and copies it into the target from pageable
memory. This module holds the pieces that :class:`ckptq.io.ChecksumFileSystemWriter` and
:class:`ckptq.io.SafeFileSystemReader` use instead:

* :class:`Flusher`: starts the write-back of a file's dirty pages on a background thread
  (``fdatasync``) every ``sync_every`` bytes, so the disk writes while the CPU keeps producing;
* :class:`Staging`: copies a CUDA tensor out of the GPU in pieces of ``buffer_bytes`` into two
  pinned host buffers on a side stream (the copy of piece *k + 1* runs while piece *k* is hashed
  and written); CPU tensors are used in place;
* :class:`RecordReader` / :class:`BufferPool`: the records of a file read in order, ahead of their
  use, on a background thread straight into their destinations (through a bounded set of pinned
  buffers into CUDA ones), hashed on that thread;
* :func:`pwrite_all` / :func:`pread_into`: whole-buffer ``pwritev`` / ``preadv`` loops;
  :func:`pread_pieces` / :func:`pread_many`: one long read, or several at once, in pieces on
  the shared read threads.

Knobs and their defaults: :data:`DEFAULT_THREADS` files (one writer thread each) per rank,
:data:`DEFAULT_READ_THREADS_CUDA` files read at once where CUDA is in use (:func:`default_read_threads`),
:data:`DEFAULT_BUFFER_BYTES` per staging or read buffer, :data:`DEFAULT_SYNC_EVERY` bytes between
write-back starts, :data:`READ_AHEAD_BUFFERS` pinned buffers and :data:`READ_AHEAD_BYTES` of run-ahead
per file read. What was measured with them, and which
are a choice not yet measured against others: ``docs/benchmarks.md``, "Storage writer and reader at
disk speed".
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_THREADS",
    "DEFAULT_READ_THREADS_CUDA",
    "default_read_threads",
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_SYNC_EVERY",
    "READ_AHEAD_BUFFERS",
    "READ_AHEAD_BYTES",
    "Flusher",
    "Staging",
    "pwrite_all",
    "pread_into",
    "pread_pieces",
    "pread_many",
    "piece_spans",
    "piece_pool",
    "shared_pool",
    "settle",
    "PIECE_BYTES",
    "pinned_or_plain",
    "BufferPool",
    "RecordReader",
    "READ_AHEAD",
    "EARLY_READ_AHEAD",
    "advise_later",
    "willneed",
    "willneed_chunk",
]

#: files written per rank by :class:`ckptq.io.ChecksumFileSystemWriter` (one thread each; DCP's
#: ``FileSystemWriter`` defaults to 1), and data files :class:`ckptq.io.SafeFileSystemReader` reads
#: at once (one thread each) in a process that does not use CUDA (CPU targets: 8 files read by 8
#: threads loaded native checkpoints 6-21% faster than 4 files by 4 threads on both GPU hosts' disks).
DEFAULT_THREADS = 8
#: data files :class:`ckptq.io.SafeFileSystemReader` reads at once in a process that uses CUDA
#: (its targets filled through pinned buffers): loading a native checkpoint of 8 files per rank
#: into GPU targets, 4 threads beat 8 by 9-11% on one H100 (two runs) and by 1-6% on 2 H200 (three
#: runs), and 2 were slower than 4 (``docs/benchmarks.md``).
DEFAULT_READ_THREADS_CUDA = 4


def default_read_threads() -> int:
    """The data files :class:`ckptq.io.SafeFileSystemReader` reads at once when not told:
    :data:`DEFAULT_READ_THREADS_CUDA` in a process that has initialized CUDA, else
    :data:`DEFAULT_THREADS`."""
    return DEFAULT_READ_THREADS_CUDA if torch.cuda.is_available() and torch.cuda.is_initialized() else DEFAULT_THREADS


#: bytes of each pinned staging buffer (two per writer thread) and of each read request.
DEFAULT_BUFFER_BYTES = 32 << 20
#: pinned buffers of ``buffer_bytes`` per data file that :class:`ckptq.io.SafeFileSystemReader` fills
#: CUDA destinations through (each reused once its copy to the GPU is done). 3 (then also the
#: run-ahead bound, 3 x 32 MiB) gave native loads 0.76 of the disk probe's read GB/s on 2 H200,
#: 2026-11-26; 8 is kept.
READ_AHEAD_BUFFERS = 8
#: bytes of records a data file's thread of :class:`ckptq.io.SafeFileSystemReader` reads ahead of
#: the records the caller has committed (at least one record). Their destinations are resolved that
#: far ahead, so a load whose records must be converted (high-precision values re-encoded, another
#: format) holds temporaries of up to this many bytes per file read at once (on the target's GPU
#: where it converts there). With 8 x 32 MiB, high-precision loads read at 0.82 of a plain read of
#: their files; 1 GiB gave 1.05, unbounded 0.99, native loads the same with all three (one H100,
#: 4.36 GB in 8 files, 3 rounds each, 2026-11-26; ``docs/benchmarks.md``).
READ_AHEAD_BYTES = 1 << 30
#: bytes of a data file past the current read that :class:`RecordReader` asks the kernel to fetch
#: meanwhile (:func:`willneed`, a window moved along as the reads go; 128 MiB measured within the
#: spread of 64 on an H100 host, docs/benchmarks.md).
READ_AHEAD = 64 << 20
#: bytes of its own data files a rank's :class:`ckptq.io.SafeFileSystemReader` asks the kernel to fetch
#: as soon as ``.metadata`` is read (``POSIX_FADV_WILLNEED``, split evenly over the files DCP names
#: ``__<rank>_*.distcp``), so the disk reads while the metadata is checked and DCP plans the load:
#: at 38 layers on 2 H200 that took 0.24-0.5 s of a 3.7 s native load before ``read_data`` began
#: (docs/benchmarks.md). A load of another layout reads other files: at most this much is read in vain.
EARLY_READ_AHEAD = 256 << 20
#: bytes written to a file between two starts of its write-back (``fdatasync`` on a background thread).
DEFAULT_SYNC_EVERY = 256 << 20


def pwrite_all(fd: int, parts: list, pos: int) -> int:
    """Write the bytes-like ``parts`` one after another at byte ``pos`` of ``fd`` (``pwritev``,
    repeated until every byte is written); returns the number of bytes written."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(len(v) for v in views)
    done = 0
    while views:
        n = os.pwritev(fd, views[:512], pos + done)  # IOV_MAX is 1024 on Linux
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


#: A read of two of these or more is split by :func:`pread_pieces` into pieces of this size, read at
#: once on :data:`PIECE_THREADS` threads (the disk gets several requests in flight, as one
#: sequential stream's readahead alone does not give it: ``docs/benchmarks.md``).
PIECE_BYTES = 8 << 20
PIECE_THREADS = 4
_pools: dict[str, cf.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(name: str, threads: int) -> cf.ThreadPoolExecutor:
    """The process-wide pool ``name`` of ``threads`` threads (named ``ckptq-<name>``), made on first
    use (under a lock: two first callers at once get the same pool). Every background pool of ckptq
    is one of these: :func:`piece_pool`, the advice thread (:func:`advise_later`), the CRC-32 threads
    (:func:`ckptq.io.records.payload_crc32`), the foreign-record loads ahead
    (:meth:`ckptq.checkpoint.CheckpointView.read`)."""
    with _pools_lock:
        if name not in _pools:
            _pools[name] = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"ckptq-{name}")
        return _pools[name]


def piece_pool() -> cf.ThreadPoolExecutor:
    """The :data:`PIECE_THREADS` threads (named ``ckptq-pread``) that every read in pieces shares
    (:func:`pread_pieces`, :meth:`ckptq.checkpoint.CheckpointView.read`). Its tasks are leaf reads
    (``preadv`` loops) that never wait for another task, so callers on any thread may share it."""
    return shared_pool("pread", PIECE_THREADS)


def pread_pieces(fd: int, buf: Any, pos: int) -> int:
    """:func:`pread_into` of the writable bytes-like ``buf`` from byte ``pos`` of ``fd``, a read of two
    :data:`PIECE_BYTES` or more in pieces read at once on :data:`PIECE_THREADS` threads (shared by
    all callers). Returns the bytes read: fewer only at the end of the file."""
    return pread_many(fd, [(buf, pos)])[0]


def pread_many(fd: int, reads: list[tuple[Any, int]]) -> list[int]:
    """Fill each writable bytes-like ``buf`` of ``reads`` (``(buf, pos)`` pairs) from byte ``pos`` of
    ``fd``, all of them at once: every buffer of two :data:`PIECE_BYTES` or more in pieces of that
    size, and all pieces of all buffers handed to the :data:`PIECE_THREADS` shared threads together,
    so the disk has several requests in flight from the first buffer to the last. A single short
    read runs on the calling thread. Returns the bytes read into each buffer: fewer only at the end
    of the file."""
    views = [(memoryview(buf).cast("B"), pos) for buf, pos in reads]
    if len(views) == 1 and len(piece_spans(len(views[0][0]))) <= 1:
        return [pread_into(fd, *views[0])]
    pool = piece_pool()
    jobs = []
    for view, pos in views:
        jobs.append([(k, pool.submit(pread_into, fd, view[o : o + k], pos + o)) for o, k in piece_spans(len(view))])
    done = []
    try:
        for pieces in jobs:
            total = 0
            for k, f in pieces:
                got = f.result()
                total += got
                if got < k:  # the end of the file: the bytes after are not read
                    break
            done.append(total)
    finally:
        settle([f for pieces in jobs for _, f in pieces])
    return done


def piece_spans(n: int, piece: int | None = None) -> list[tuple[int, int]]:
    """``(offset, length)`` of the pieces ``n`` bytes are split into for work on several threads:
    ``piece`` bytes each (default :data:`PIECE_BYTES`) when ``n`` is two pieces or more, else one
    piece (of at least one byte)."""
    piece = PIECE_BYTES if piece is None else piece
    step = piece if n >= 2 * piece else max(n, 1)
    return [(o, min(step, n - o)) for o in range(0, n, step)]


def settle(futures: list[cf.Future]) -> None:
    """Cancel the reads of ``futures`` not started yet and wait for the others, so that none still
    writes into its buffer once this returns (after an error too). Their errors are not raised here:
    the caller's ``result()`` calls raise the first one."""
    for f in futures:
        f.cancel()
    for f in futures:
        if not f.cancelled():
            f.exception()


#: What one ``posix_fadvise(WILLNEED)`` call is taken to fetch at most where the device's limits
#: cannot be read (not a block device, no sysfs): Linux's default ``read_ahead_kb``.
WILLNEED_FALLBACK = 128 << 10
_willneed_chunks: dict[int, int] = {}


def willneed_chunk(fd: int) -> int:
    """Bytes one ``posix_fadvise(POSIX_FADV_WILLNEED)`` call on ``fd`` makes Linux fetch at most.

    Linux's WILLNEED (``generic_fadvise`` -> ``force_page_cache_ra`` in ``mm/readahead.c``, Linux
    6.18) reads at most ``max(bdi->io_pages, file->f_ra.ra_pages)`` pages of the range
    it is given and drops the rest without a word: the larger of the device's ``max_sectors_kb`` and
    ``read_ahead_kb`` (``/sys/dev/block/<major>:<minor>/queue/``; a partition's are its disk's). A
    256 MiB WILLNEED fetched 8 MiB on a virtio disk with ``read_ahead_kb`` 8192 (docs/benchmarks.md,
    "WILLNEED fetches one read-ahead window per call"). Read once per device (cached);
    :data:`WILLNEED_FALLBACK` where it cannot be read. Never less than 4 KiB."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return WILLNEED_FALLBACK
    chunk = _willneed_chunks.get(dev)
    if chunk is None:
        chunk = WILLNEED_FALLBACK
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for queue in (f"{base}/queue", f"{base}/../queue"):  # a disk's, else a partition's parent's
            try:
                kib = [int(Path(queue, name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb")]
            except (OSError, ValueError):
                continue
            chunk = max(4, *kib) << 10
            break
        _willneed_chunks[dev] = chunk
    return chunk


def willneed(fd: int, start: int, length: int) -> None:
    """``posix_fadvise(fd, start, length, POSIX_FADV_WILLNEED)`` that fetches the whole range: one
    call per :func:`willneed_chunk` bytes (one call fetches at most that much). The kernel allocates
    the page-cache pages and queues their reads in each call (about 0.3 ms per MiB on the 2-core VM),
    so large ranges belong on a background thread (:func:`advise_later`). ``length`` 0 means to the
    end of the file. Raises OSError as ``posix_fadvise`` does."""
    if length <= 0:
        length = os.fstat(fd).st_size - start
    chunk = willneed_chunk(fd)
    end = start + length
    while start < end:
        n = min(chunk, end - start)
        os.posix_fadvise(fd, start, n, os.POSIX_FADV_WILLNEED)
        start += n


def advise_later(ranges: list[tuple[Any, int, int]]) -> None:
    """Ask the kernel to fetch ``(file, start, length)`` ranges (``posix_fadvise(WILLNEED)``), on one
    background thread shared by all callers: the kernel allocates the page-cache pages and queues the
    reads there, not on the caller's thread. ``file`` is an open descriptor (which the caller keeps
    open until the advice has run, or closes: advice on a closed descriptor is lost) or a path
    (opened and closed on that thread). Advice only: errors are ignored, nothing is waited for."""
    if not ranges or not hasattr(os, "posix_fadvise"):
        return

    def advise() -> None:
        for file, start, length in ranges:
            try:
                fd = file if isinstance(file, int) else os.open(file, os.O_RDONLY)
            except OSError:
                continue
            try:
                willneed(fd, start, length)
            except OSError:
                pass
            finally:
                if not isinstance(file, int):
                    os.close(fd)

    shared_pool("advise", 1).submit(advise)


def pread_into(fd: int, buf: Any, pos: int) -> int:
    """Fill the writable bytes-like ``buf`` from byte ``pos`` of ``fd``; returns the bytes read
    (fewer only at the end of the file)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], pos + done)
        if n <= 0:
            break
        done += n
    return done


class Flusher:
    """Starts the write-back of ``fd`` every ``sync_every`` bytes written (``fdatasync`` on one
    background thread, while the caller goes on writing); :meth:`close` waits for it and, with
    ``fsync``, makes the whole file durable. ``sync_every=0`` turns the early starts off."""

    def __init__(self, fd: int, sync_every: int) -> None:
        self.fd, self.every, self.pending = fd, sync_every, 0
        self._pool: cf.ThreadPoolExecutor | None = None
        self._futures: list[cf.Future] = []

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.every and self.pending >= self.every:
            self.pending = 0
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ckptq-writeback")
            self._futures = [f for f in self._futures if not f.done()]
            if not self._futures:  # one in flight at a time: the next starts from where it ended
                self._futures.append(self._pool.submit(os.fdatasync, self.fd))

    def close(self, fsync: bool) -> None:
        try:
            for f in self._futures:
                f.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if fsync:
            os.fsync(self.fd)


def pinned_or_plain(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes``: page-locked when ``pin`` (from torch's caching host
    allocator, so buffers are reused across saves and loads), else ordinary memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class Staging:
    """The bytes of tensors, as memoryviews of CPU memory, piece by piece (for one thread).

    A CPU tensor is yielded in place (copied first only if not contiguous). A CUDA tensor is copied
    into two pinned buffers of ``buffer_bytes`` on a side stream of its device that waits for the
    caller's current stream: the copy of the next piece runs while the caller uses the current
    one, and a piece's buffer is reused only after the caller asked for the piece after it.

    Args:
        buffer_bytes: bytes of each of the two pinned buffers (one piece at most).
    """

    def __init__(self, buffer_bytes: int) -> None:
        self.buffer_bytes = max(1 << 16, int(buffer_bytes))
        self._bufs: list[torch.Tensor] = []
        self._streams: dict[int, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        if device.index not in self._streams:
            self._streams[device.index] = torch.cuda.Stream(device)
        return self._streams[device.index]

    def pieces(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of ``tensor`` (row-major, its dtype's little-endian bytes), in order."""
        t = tensor.detach()
        if t.device.type != "cuda":
            from ..checksums import payload

            yield payload(t)
            return
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n == 0:
            return
        if not self._bufs:
            with torch.cuda.device(t.device):  # page-locked through this device's context
                self._bufs = [pinned_or_plain(self.buffer_bytes, True) for _ in range(2)]
        stream, size = self._stream(t.device), self.buffer_bytes
        stream.wait_stream(torch.cuda.current_stream(t.device))
        events = [torch.cuda.Event(), torch.cuda.Event()]
        count = (n + size - 1) // size

        def launch(i: int) -> None:
            lo, hi = i * size, min(n, (i + 1) * size)
            with torch.cuda.stream(stream):
                self._bufs[i % 2][: hi - lo].copy_(flat[lo:hi], non_blocking=True)
                events[i % 2].record(stream)

        launch(0)
        for i in range(count):
            events[i % 2].synchronize()
            if i + 1 < count:
                launch(i + 1)
            lo, hi = i * size, min(n, (i + 1) * size)
            yield memoryview(self._bufs[i % 2][: hi - lo].numpy()).cast("B")


class _Cancelled(Exception):
    pass


class BufferPool:
    """``count`` uint8 buffers of ``nbytes`` (pinned when ``pin``) handed out and taken back; a
    buffer given back with CUDA events is reused only after they completed (the non-blocking
    copies out of it finished)."""

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        self.nbytes, self.pin = nbytes, pin
        self._free: list[tuple[torch.Tensor | None, Any]] = [(None, None)] * count
        self._cv = threading.Condition()
        self.cancelled = False

    def take(self) -> torch.Tensor:
        with self._cv:
            while not self._free and not self.cancelled:
                self._cv.wait(0.5)
            if self.cancelled:
                raise _Cancelled
            buf, events = self._free.pop()
        for event in events or ():
            event.synchronize()
        return buf if buf is not None else pinned_or_plain(self.nbytes, self.pin)

    def give(self, buf: torch.Tensor, events: Any = None) -> None:
        with self._cv:
            self._free.append((buf, events))
            self._cv.notify()

    def cancel(self) -> None:
        with self._cv:
            self.cancelled = True
            self._cv.notify_all()


class RecordReader:
    """Reads ``torch.save`` records of one file in file order on a background thread, each record's
    payload straight into its destinations (or through pinned buffers into CUDA ones), hashed as it
    arrives, ahead of the consumer.

    For the i-th record ``(start, length, header, nbytes)`` of ``records`` the thread reads its first
    ``len(header)`` bytes and compares them with ``header`` (the framing this torch writes for the
    chunk's dtype and shape); only if they are equal does it call ``prepare(i)`` (on the thread),
    which returns the record's destinations: 1-D uint8 tensors of ``nbytes`` (CPU or CUDA). The
    payload is then read in pieces of ``buffer_bytes``: with ``preadv`` straight into the first CPU
    destination (one copy, from the page cache into the tensor's memory), or, when every destination
    is a CUDA tensor, into a pinned buffer of :attr:`pool` that is copied into them without blocking
    on ``streams`` (the consumer's current stream of each device, captured when it built this
    reader, so its later work on those tensors is ordered after the copies); with ``hashed``, each
    piece's crc32c (:func:`ckptq.checksums.checksum`) continues the record's. :meth:`results`
    yields ``(framed, nbytes read, checksum)`` per record, in order.

    The thread runs at most ``ahead`` bytes of records (at least one record) past the one the
    consumer takes, since ``prepare`` may allocate; ``depth`` pinned buffers of ``buffer_bytes``
    carry CUDA destinations' pieces. It asks the kernel for the next
    :data:`READ_AHEAD` bytes of the file while it hashes and copies (``POSIX_FADV_WILLNEED``), so
    the disk keeps a request queued. Call :meth:`close` when done (or on error: it stops the thread).

    Args:
        path: the file, or an open descriptor of it (read through a duplicate: the caller's stays
            open), or an object's :class:`ckptq.io.storage.RangePrefetcher` (read through its
            ``pread`` / ``readinto``; closed by :meth:`close`).
        fadvise: tell the kernel the file is read sequentially (``POSIX_FADV_SEQUENTIAL``) and fetch ahead.
    """

    def __init__(
        self,
        path: Any,
        records: list,
        prepare: Any,
        *,
        hashed: bool,
        buffer_bytes: int,
        depth: int,
        ahead: int,
        pin: bool,
        fadvise: bool = True,
    ) -> None:
        import queue

        self.device = torch.cuda.current_device() if pin else None  # the caller's, for the pinned buffers
        self.streams = {self.device: torch.cuda.current_stream()} if pin else {}
        self.source = path if hasattr(path, "readinto") else None  # an object store's ranges
        if self.source is not None:
            self.fd, fadvise = -1, False
        else:
            self.fd = os.dup(path) if isinstance(path, int) else os.open(path, os.O_RDONLY)
        self.fadvise = fadvise and hasattr(os, "posix_fadvise")
        if self.fadvise:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.records, self.prepare, self.hashed = records, prepare, hashed
        self.size = max(1 << 16, int(buffer_bytes))
        self.ahead = int(ahead)
        self.pool = BufferPool(depth, self.size, pin)
        self._queue: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._ends = [0]  # bytes of payload up to each record (for the run-ahead bound)
        for r in records:
            self._ends.append(self._ends[-1] + r[3])
        self._taken = 0  # records the consumer has taken
        self._stop = False
        self._advised = 0
        self._thread: threading.Thread | None = None

    def start(self) -> RecordReader:
        self._thread = threading.Thread(target=self._run, name="ckptq-read", daemon=True)
        self._thread.start()
        return self

    def _wait_turn(self, i: int) -> None:
        """Block until record ``i`` is within ``ahead`` bytes of the consumer (or it is the next one)."""
        with self._cv:
            while not self._stop:
                pending = self._ends[i + 1] - self._ends[self._taken]
                if i <= self._taken or pending <= self.ahead:
                    return
                self._cv.wait(0.5)
            raise _Cancelled

    def _advise(self, pos: int) -> None:
        if self.fadvise and pos + READ_AHEAD // 2 >= self._advised:
            begin = max(pos, self._advised)
            willneed(self.fd, begin, pos + READ_AHEAD - begin)
            self._advised = pos + READ_AHEAD

    def _run(self) -> None:
        from ..checksums import checksum

        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            for i, (start, _length, header, nbytes) in enumerate(self.records):
                self._wait_turn(i)
                self._advise(start)
                src = self.source
                head = os.pread(self.fd, len(header), start) if src is None else src.pread(len(header), start)
                if head != header:
                    self._queue.put((False, 0, 0))
                    continue
                dsts = self.prepare(i)
                cpu = next((d for d in dsts if d.device.type == "cpu"), None)
                pos, got, value = start + len(header), 0, 0
                while got < nbytes:
                    want = min(self.size, nbytes - got)
                    self._advise(pos + got + want)
                    buf = None
                    if cpu is not None:
                        part = cpu[got : got + want]
                    else:
                        buf = self.pool.take()
                        part = buf[:want]
                    if src is None:
                        n = pread_into(self.fd, part.numpy(), pos + got)
                    else:
                        n = src.readinto(part.numpy(), pos + got)
                    part = part[:n]
                    if self.hashed and n:
                        value = checksum(part.numpy(), value)
                    events = []
                    for d in dsts:
                        if d is cpu:
                            continue
                        if d.device.type == "cuda":
                            stream = self.streams.get(d.device.index) or torch.cuda.current_stream(d.device)
                            with torch.cuda.stream(stream):
                                d[got : got + n].copy_(part, non_blocking=True)
                                events.append(torch.cuda.Event())
                                events[-1].record()
                        else:
                            d[got : got + n].copy_(part)
                    if buf is not None:
                        self.pool.give(buf, events)
                    got += n
                    if n < want:  # the file ends inside the record: the consumer reports it
                        break
                self._queue.put((True, got, value))
        except _Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put(e)

    def results(self) -> Iterator[tuple[bool, int, int]]:
        """``(framed, payload bytes read, checksum)`` of each record, in order (raising what the thread raised)."""
        for _ in self.records:
            got = self._queue.get()
            if isinstance(got, BaseException):
                raise got
            with self._cv:
                self._taken += 1
                self._cv.notify()
            yield got

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.pool.cancel()
        if self._thread is not None:
            self._thread.join()
        if self.source is not None:
            self.source.close()
        else:
            os.close(self.fd)

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
* :class:`RangeReader` / :class:`BufferPool`: the records of a file read in order, ahead of their
  use, on a background thread into a bounded set of (pinned) buffers;
* :func:`pwrite_all` / :func:`pread_into`: whole-buffer ``pwritev`` / ``preadv`` loops.

Knobs and their defaults: :data:`DEFAULT_THREADS` files (one writer thread each) per rank,
:data:`DEFAULT_BUFFER_BYTES` per staging or read buffer, :data:`DEFAULT_SYNC_EVERY` bytes between
write-back starts, :data:`READ_AHEAD_BUFFERS` per file read. What was measured with them, and which
are a choice not yet measured against others: ``docs/benchmarks.md``, "Storage writer and reader at
disk speed".
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "DEFAULT_THREADS",
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_SYNC_EVERY",
    "READ_AHEAD_BUFFERS",
    "Flusher",
    "Staging",
    "pwrite_all",
    "pread_into",
    "pinned_or_plain",
    "BufferPool",
    "RangeReader",
]

#: files written per rank by :class:`ckptq.io.ChecksumFileSystemWriter` (one thread each; DCP's
#: ``FileSystemWriter`` defaults to 1), and reader threads of :class:`ckptq.io.SafeFileSystemReader`.
DEFAULT_THREADS = 4
#: bytes of each pinned staging buffer (two per writer thread) and of each read request.
DEFAULT_BUFFER_BYTES = 32 << 20
#: read-ahead buffers of ``DEFAULT_BUFFER_BYTES`` per data file being read by :class:`ckptq.io.SafeFileSystemReader`
#: (3 gave native loads 0.76 of the disk probe's read GB/s on 2 H200, 2026-11-26: the files read ahead
#: stalled while the first was used; 8 lets them read further at once).
READ_AHEAD_BUFFERS = 8
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
    buffer given back with a CUDA event is reused only after the event completed (the
    non-blocking copy out of it finished)."""

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
            buf, event = self._free.pop()
        if event is not None:
            event.synchronize()
        return buf if buf is not None else pinned_or_plain(self.nbytes, self.pin)

    def give(self, buf: torch.Tensor, event: Any = None) -> None:
        with self._cv:
            self._free.append((buf, event))
            self._cv.notify()

    def cancel(self) -> None:
        with self._cv:
            self.cancelled = True
            self._cv.notify_all()


class RangeReader:
    """Reads byte ranges of one file ahead of their use, on a background thread, in pieces of at
    most ``buffer_bytes`` into the buffers of a :class:`BufferPool` of ``depth`` buffers.

    ``ranges`` is a list of ``(start, length)``; :meth:`pieces` yields, for the i-th range, its
    pieces in order as ``(offset in the range, buffer, n)``; give each buffer back to
    :attr:`pool` (with an event when a non-blocking copy reads it) once used. Call :meth:`close`
    when done (or on error: it stops the thread).

    Args:
        path: the file, or an open descriptor of it (read through a duplicate: the caller's stays open).
        fadvise: tell the kernel the file is read sequentially (``POSIX_FADV_SEQUENTIAL``).
    """

    def __init__(
        self, path: Any, ranges: list, *, buffer_bytes: int, depth: int, pin: bool, fadvise: bool = True
    ) -> None:
        self.device = torch.cuda.current_device() if pin else None  # the caller's, for the pinned buffers
        import queue

        self.fd = os.dup(path) if isinstance(path, int) else os.open(path, os.O_RDONLY)
        if fadvise and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.ranges, self.size = ranges, max(1 << 16, int(buffer_bytes))
        self.pool = BufferPool(depth, self.size, pin)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> RangeReader:
        self._thread = threading.Thread(target=self._run, name="ckptq-read", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            for start, length in self.ranges:
                done = 0
                while done < length or (length == 0 and done == 0):
                    buf = self.pool.take()
                    want = min(self.size, length - done)
                    n = pread_into(self.fd, buf[:want].numpy(), start + done) if want else 0
                    self._queue.put((done, buf, n))
                    if n < want:  # the file ends early: the consumer reports it
                        return
                    done += want
                    if length == 0:
                        break
        except _Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put(e)

    def pieces(self, length: int) -> Iterator[tuple[int, torch.Tensor, int]]:
        """The pieces of the next range (``length`` bytes long)."""
        done = 0
        while True:
            got = self._queue.get()
            if isinstance(got, BaseException):
                raise got
            off, buf, n = got
            yield off, buf, n
            done = off + n
            if done >= length or n < min(self.size, length - off):
                return

    def close(self) -> None:
        self.pool.cancel()
        if self._thread is not None:
            self._thread.join()
        os.close(self.fd)

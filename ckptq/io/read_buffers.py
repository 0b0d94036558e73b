"""The CPU tensors ckptq reads file bytes into, from memory that earlier reads already faulted in.

Reading a file into a *new* tensor costs, besides the copy out of the page cache, a page fault and
a zeroed page for every 4 KiB of the tensor the first time the read writes it: most of the CPU work
of a read from the page cache, and a large part of a cold one's (``docs/benchmarks.md``, "Read
destinations from a pool of reused blocks"). glibc's ``malloc`` hands
out fresh pages for every block above its mmap threshold (dynamic, at most 32 MiB on 64-bit:
``mallopt(3)``), and on an H100 host (glibc 2.39, torch 2.11) it did so even for the 16 MiB tensors
of a read done one tensor after another (126,000 faults per 0.77 GB: every byte fresh).

:func:`empty_for_read` therefore gives tensors of :data:`POOL_MIN_BYTES` or more out of blocks of
private anonymous memory (``mmap``) that it keeps: when the last tensor using a block's memory is
freed, the block goes back to the pool (a ``weakref.finalize`` on the buffer object the tensor's
storage owns, so views and slices keep it too), and the next request of the same size class (a
multiple of 2 MiB) reuses it, already faulted in. A new block starts 2 MiB-aligned and is advised
``MADV_HUGEPAGE`` (``madvise(2)``), so it is faulted in 2 MiB at a time where the kernel's
transparent huge pages are at ``madvise`` or ``always``.

Blocks are kept only while a read is under way: :func:`reading` (a
:class:`~ckptq.checkpoint.CheckpointView` from its opening to its ``close``, a
:class:`~ckptq.io.SafeFileSystemReader`'s ``read_data``). A block that comes back when no read is
under way is unmapped, and so are the idle blocks when the last read ends; at most
:data:`POOL_BYTES` of idle blocks are kept meanwhile (the oldest are unmapped first). Smaller
tensors, other operating systems and :data:`POOLED` off: ``torch.empty``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["POOLED", "POOL_BYTES", "POOL_MIN_BYTES", "HUGE_PAGES", "Reading", "empty_for_read", "idle_bytes", "reading"]

#: False: :func:`empty_for_read` is plain ``torch.empty`` (the baseline of ``scripts/bench_read_pages.py``).
POOLED = True
#: tensors of fewer bytes come from ``torch.empty`` (glibc reuses heap memory below its mmap threshold).
POOL_MIN_BYTES = 2 << 20
#: idle blocks kept at most, in bytes, while a read is under way.
POOL_BYTES = 512 << 20
#: new blocks advised ``MADV_HUGEPAGE``; False: 4 KiB pages.
HUGE_PAGES = True
_HUGE = 2 << 20  # the x86-64 / arm64 (4 KiB base pages) transparent huge page
_MADV_HUGEPAGE = 14  # linux/mman.h (mmap.MADV_HUGEPAGE where Python defines it)


class _Block:
    """One private anonymous mapping; ``offset`` is where its 2 MiB-aligned usable part starts, of
    which the first ``huge_bytes`` are advised ``MADV_HUGEPAGE``."""

    __slots__ = ("map", "offset", "size")

    def __init__(self, size: int, huge_bytes: int) -> None:
        self.map = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.offset = (-base) % _HUGE
        self.size = size
        if huge_bytes:
            _madvise(base + self.offset, huge_bytes)


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: a block may come back from a GC pass inside take()
        self.idle: list[_Block] = []  # oldest first
        self.idle_bytes = 0
        self.readers = 0

    def take(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // _HUGE) * _HUGE
        block = None
        with self.lock:
            for i in range(len(self.idle) - 1, -1, -1):  # the most recently used first
                if self.idle[i].size == size:
                    block = self.idle.pop(i)
                    self.idle_bytes -= size
                    break
        if block is None:
            block = _Block(size, nbytes // _HUGE * _HUGE if HUGE_PAGES else 0)  # a partial last page: 4 KiB
        owner = (ctypes.c_char * nbytes).from_buffer(block.map, block.offset)
        weakref.finalize(owner, self.give, block).atexit = False
        return torch.frombuffer(owner, dtype=torch.uint8)

    def give(self, block: _Block) -> None:
        with self.lock:
            if not self.readers or block.size > POOL_BYTES:
                return  # unmapped once its last reference goes
            self.idle.append(block)
            self.idle_bytes += block.size
            while self.idle_bytes > POOL_BYTES:
                self.idle_bytes -= self.idle.pop(0).size

    def enter(self) -> None:
        with self.lock:
            self.readers += 1

    def leave(self) -> None:
        with self.lock:
            self.readers = max(0, self.readers - 1)  # a read entered before a fork, left in the child
            if not self.readers:
                self.idle.clear()
                self.idle_bytes = 0

    def after_fork(self) -> None:
        self.lock = threading.RLock()
        self.idle.clear()
        self.idle_bytes = 0
        self.readers = 0


_POOL = _Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.after_fork)


def empty_for_read(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``, for a read to fill whole
    (its bytes are those of an earlier read, like ``torch.empty``'s). Of :data:`POOL_MIN_BYTES` or
    more (Linux, :data:`POOLED`): memory of the pool described in the module docstring, its storage
    not resizable (``resize_`` past its size raises; copies, views, ``share_memory_``, ``pin_memory``
    and ``torch.save`` work as on any CPU tensor); else ``torch.empty``.

    Raises:
        OSError: the kernel refuses a new mapping (out of address space or memory), as
            ``torch.empty`` would raise RuntimeError.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not POOLED or nbytes < POOL_MIN_BYTES or not _LINUX:
        return torch.empty(shape, dtype=dtype)
    return _POOL.take(nbytes).view(dtype).view(shape)


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """While this is entered (by any thread; nested or at once), blocks freed are kept for the next
    :func:`empty_for_read`; when the last one exits, the idle blocks are unmapped."""
    _POOL.enter()
    try:
        yield
    finally:
        _POOL.leave()


class Reading:
    """:func:`reading` for an object's lifetime: entered when made, left by :meth:`close` (once; and
    by the garbage collector when the owner forgot)."""

    def __init__(self) -> None:
        _POOL.enter()
        self._done = weakref.finalize(self, _POOL.leave)

    def close(self) -> None:
        self._done()


def idle_bytes() -> int:
    """Bytes of idle blocks the pool holds now."""
    return _POOL.idle_bytes


_LINUX = sys.platform.startswith("linux")


def _madvise(address: int, length: int) -> None:
    """``madvise(address, length, MADV_HUGEPAGE)``, errors ignored (advice only)."""
    fn = _libc_madvise()
    if fn is not None:
        fn(address, length, getattr(mmap, "MADV_HUGEPAGE", _MADV_HUGEPAGE))


@functools.cache
def _libc_madvise() -> Any:
    """libc's ``madvise`` (Linux), else None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn

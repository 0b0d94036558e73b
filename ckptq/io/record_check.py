"""One ``torch.save`` record of a DCP data file, opened and checked before anything trusts it.

A record is a zip archive whose ``data.pkl`` member is the pickled tensor (dtype, shape, strides,
storage offsets). :func:`check_record_header` checks that pickle against the CRC-32 its zip directory
stores (``torch.load`` checks none); :func:`load_weights_only` unpickles a record with torch's
``weights_only`` unpickler (a refused global is an :class:`~ckptq.errors.UnsafeCheckpointError`);
:func:`check_chunk_tensor` compares what it holds with the chunk the metadata describes.
:class:`ReadView` is a seekable byte window of a data file, so ``zipfile`` reads a record in place.

Used by :class:`~ckptq.io.SafeFileSystemReader` (every record it reads), :mod:`ckptq.io.records`
(payload offsets found after these checks) and :mod:`ckptq.io.foreign` (records another library wrote).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..errors import CheckpointFormatError, UnsafeCheckpointError

__all__ = ["ReadView", "Window", "load_weights_only", "check_chunk_tensor", "check_record_header"]


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

    def read(self, size: int | None = -1) -> bytes:
        """At most ``size`` bytes from ``pos`` (all that is left when ``size`` is negative or None).

        ``io.RawIOBase.read`` allocates ``size`` bytes before it reads; ``zipfile`` and torch's
        reader ask for sizes they take from the record's own (possibly corrupt) zip directory, so
        this never allocates more than the view holds."""
        left = self.size - self.pos
        buf = bytearray(left if size is None or size < 0 else max(0, min(size, left)))
        del buf[self.readinto(buf) :]
        return bytes(buf)


class Window(ReadView):
    """Bytes ``[start, start + length)`` of a seekable binary file, as a file (for ``zipfile``)."""

    def __init__(self, base: Any, start: int, length: int) -> None:
        super().__init__(length)
        self._base, self._start = base, start

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        fd = self._fileno()
        if fd is not None and n:  # straight into ``b`` (torch.load reads storages this way): one copy
            from .fileio import pread_pieces

            got = pread_pieces(fd, memoryview(b).cast("B")[:n], self._start + self.pos)
            self.pos += got
            return got
        self._base.seek(self._start + self.pos)
        data = self._base.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def read_many(self, reads: list[tuple[Any, int]]) -> list[int]:
        """Fill each writable bytes-like ``buf`` of ``reads`` (``(buf, at)`` pairs, ``at`` a byte of
        this window) from the window: all at once on the shared read threads for a plain OS file
        (:func:`ckptq.io.fileio.pread_many`), else one after another. Never reads past the window.
        Returns the bytes read into each buffer (fewer where it ends before the buffer does)."""
        fd = self._fileno()
        if fd is None:
            got = []
            for buf, at in reads:
                self.seek(at)
                got.append(self.readinto(buf))
            return got
        from .fileio import pread_many

        clamped = [(memoryview(buf).cast("B")[: max(0, self.size - at)], self._start + at) for buf, at in reads]
        return pread_many(fd, clamped)

    def _fileno(self) -> int | None:
        """The base file's descriptor when it is a plain OS file (read at absolute offsets), else None."""
        if not hasattr(self, "_fd"):
            try:
                self._fd = self._base.fileno()
            except (AttributeError, OSError, io.UnsupportedOperation):
                self._fd = None
        return self._fd


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

"""``torch.save`` tensor records by byte range: written from a template, read without unpickling data.

A DCP ``FileSystemWriter`` data file is a run of ``torch.save`` records, one per chunk: a zip archive
with *stored* (uncompressed) members ``data.pkl`` (the pickled tensor: dtype, shape, strides),
``byteorder``, ``data/0`` (the raw payload: the elements in row-major order), ``version`` and a few
small others. The payload of a contiguous tensor is one byte range of the file. This module is the
one place that relies on that layout:

* :func:`tensor_record` gives the framing of a record for a (dtype, shape): the bytes before the
  payload and after it, made once per (dtype, shape) by ``torch.save`` itself (with
  ``torch.serialization.skip_data``) and cached, so writing a record is ``header + payload +
  trailer`` with no pickling per record; :meth:`TensorRecord.trailer_for` fills in the payload's
  zip CRC-32 (in the member's data descriptor and in the central directory), so the record is a
  valid zip and byte-for-byte what ``torch.save`` writes, but for the ``.data/serialization_id``
  member (one per template).
* :func:`locate_payload` finds the payload of a record on disk after the checks
  ``SafeFileSystemReader`` makes: the zip directory and ``data.pkl``'s CRC-32
  (:func:`~ckptq.io.record_check.check_record_header`), ``torch.load(weights_only=True)`` of the pickle
  with ``map_location="meta"`` (nothing of the payload is read or allocated), the dtype and shape
  against the metadata, a contiguous little-endian payload inside the record.

Stock ``torch.load`` / ``dcp.load`` read the records this module writes (``tests/test_reshard_fast.py``
compares them with ``torch.save``'s byte for byte).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import struct
import sys
import zlib
from typing import Any

import torch

from ..checksums import crc32_combine
from ..errors import CheckpointFormatError, CkptqError
from .fileio import piece_spans, shared_pool
from .record_check import ReadView

__all__ = ["TensorRecord", "tensor_record", "locate_payload", "payload_crc32"]


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """The framing of a ``torch.save`` record of a contiguous tensor of one dtype and shape.

    Attributes:
        header: the bytes before the payload (zip local headers, ``data.pkl``, ...).
        trailer: the bytes after it, with the payload's CRC-32 fields zero.
        nbytes: payload length (numel * itemsize).
        crc_at: offsets in ``trailer`` of the payload's CRC-32 fields (little-endian uint32).
    """

    header: bytes
    trailer: bytes
    nbytes: int
    crc_at: tuple[int, ...]

    @property
    def length(self) -> int:
        """Bytes of the whole record."""
        return len(self.header) + self.nbytes + len(self.trailer)

    def trailer_for(self, crc32: int) -> bytes:
        """The trailer of a record whose payload has zip CRC-32 ``crc32`` (:func:`payload_crc32`)."""
        t = bytearray(self.trailer)
        packed = struct.pack("<I", crc32 & 0xFFFFFFFF)
        for at in self.crc_at:
            t[at : at + 4] = packed
        return bytes(t)


@functools.lru_cache(maxsize=256)
def tensor_record(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorRecord:
    """The record framing of a contiguous CPU tensor of ``dtype`` and ``shape`` (cached).

    Made by ``torch.save`` under ``skip_data`` (the payload space is left zero), so it follows
    whatever this torch writes; checked by reading it back with ``torch.load(map_location="meta")``.

    Raises:
        CkptqError: this torch lays records out in a way this module does not know (upgrade ckptq).
    """
    probe = torch.empty(shape, dtype=dtype)  # never touched: no memory is committed for it
    nbytes = probe.numel() * probe.element_size()
    sink = _Sink()
    with torch.serialization.skip_data():  # torch seeks over the payload instead of writing it
        torch.save(probe, sink)
    if nbytes == 0 and len(sink.parts) == 1:  # nothing to seek over: split where the payload would be
        blob = bytes(sink.parts[0])
        at = _meta_offset(_Sparse(blob, 0, b""))
        head, trailer = blob[:at], blob[at:]
    elif len(sink.parts) == 2:
        head, trailer = bytes(sink.parts[0]), bytes(sink.parts[1])
        if _meta_offset(_Sparse(head, nbytes, trailer)) != len(head):
            raise _unknown_layout("the payload does not follow the headers")
    else:
        raise _unknown_layout(f"{len(sink.parts)} written runs")
    crc_at = []
    if nbytes:
        if trailer[:4] != b"PK\x07\x08":  # the payload member's data descriptor
            raise _unknown_layout("no data descriptor after the payload")
        crc_at.append(4)
        pos = trailer.find(b"PK\x01\x02")
        while pos >= 0:  # central directory entries: find the payload member's
            name_len = struct.unpack_from("<H", trailer, pos + 28)[0]
            name = trailer[pos + 46 : pos + 46 + name_len]
            if name.endswith(b"/data/0"):
                crc_at.append(pos + 16)
                break
            pos = trailer.find(b"PK\x01\x02", pos + 4)
        if len(crc_at) != 2:
            raise _unknown_layout("no central directory entry for the payload")
    return TensorRecord(head, trailer, nbytes, tuple(crc_at))


class _Sink(io.RawIOBase):
    """A write-only file for ``torch.save``: keeps what is written, as runs split where it seeks."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[bytearray] = [bytearray()]
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        self.parts[-1] += data
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        new = offset if whence == io.SEEK_SET else self.pos + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or new < self.pos:
            raise io.UnsupportedOperation("only forward seeks")
        if new > self.pos:
            self.parts.append(bytearray())
            self.pos = new
        return self.pos


class _Sparse(ReadView):
    """``head``, ``gap`` zero bytes, ``tail`` as one readable file (the gap is never materialized)."""

    def __init__(self, head: bytes, gap: int, tail: bytes) -> None:
        super().__init__(len(head) + gap + len(tail))
        self.head, self.gap, self.tail = head, gap, tail

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        out = memoryview(b).cast("B")
        h, g = len(self.head), len(self.head) + self.gap
        for i0, i1, src, base in ((0, h, self.head, 0), (h, g, None, h), (g, self.size, self.tail, g)):
            lo, hi = max(self.pos, i0), min(self.pos + n, i1)  # the part of this read in this run
            if lo < hi:
                out[lo - self.pos : hi - self.pos] = src[lo - base : hi - base] if src is not None else bytes(hi - lo)
        self.pos += n
        return n


def _unknown_layout(what: str) -> CkptqError:
    return CkptqError(
        f"torch {torch.__version__}: torch.save records have an unknown layout ({what}); "
        f"ckptq's record writer cannot be used with this torch: upgrade ckptq"
    )


def _meta_offset(f: Any) -> int:
    t = torch.load(f, map_location="meta", weights_only=True)
    return int(t.untyped_storage()._checkpoint_offset)


#: A payload of two of these or more gets its CRC-32 from pieces hashed on :data:`CRC_THREADS`
#: threads at once (``zlib.crc32`` releases the GIL), joined with :func:`ckptq.checksums.crc32_combine`.
CRC_PIECE = 2 << 20
CRC_THREADS = 4


def payload_crc32(payload: Any, value: int = 0) -> int:
    """The zip CRC-32 of a payload (a bytes-like object; ``value`` continues a running CRC). A payload
    of two :data:`CRC_PIECE` s or more is hashed in pieces on :data:`CRC_THREADS` threads."""
    view = memoryview(payload).cast("B")
    pieces = piece_spans(len(view), CRC_PIECE)
    if len(pieces) <= 1:
        return zlib.crc32(view, value)
    crcs = list(shared_pool("crc32", CRC_THREADS).map(lambda p: zlib.crc32(view[p[0] : p[0] + p[1]]), pieces))
    for (_, k), crc in zip(pieces, crcs, strict=True):
        value = crc32_combine(value, crc, k)
    return value


#: Bytes read from each end of a record for its checks: its headers, pickle and zip directory are
#: hundreds of bytes (a longer record's middle is its payload, never read here).
_END_BYTES = 16 << 10


def _ends(stream: Any, start: int, length: int) -> _Sparse:
    """The record at ``start .. start + length`` of ``stream`` as a file holding its first and last
    :data:`_END_BYTES` (zeros between): two reads instead of one per zip or pickle field."""
    head_n = min(length, _END_BYTES)
    tail_n = min(length - head_n, _END_BYTES)
    stream.seek(start)
    head = stream.read(head_n)
    stream.seek(start + length - tail_n)
    tail = stream.read(tail_n) if tail_n else b""
    if len(head) != head_n or len(tail) != tail_n:
        raise EOFError(f"the file ends inside the record (bytes {start}..{start + length})")
    return _Sparse(head, length - head_n - tail_n, tail)


def _known_framing(window: _Sparse, length: int, dtype: torch.dtype, sizes: tuple) -> tuple[int, int] | None:
    """``(payload offset, zip CRC-32)`` of a record whose framing is byte for byte the one this torch
    writes for ``dtype`` and ``sizes`` (:func:`tensor_record`: its pickle, hence dtype, shape and
    layout, is then the template's, and needs no unpickling), its two CRC-32 fields of the payload
    agreeing; else None (checked the long way)."""
    try:
        rec = tensor_record(dtype, tuple(sizes))
    except CkptqError:
        return None
    head, tail = window.head, window.tail
    if not window.gap:  # the whole record was read
        head = tail = head + tail
    if (
        not rec.nbytes
        or length != rec.length
        or len(head) < len(rec.header)
        or len(tail) < len(rec.trailer)
        or head[: len(rec.header)] != rec.header
    ):
        return None
    trailer = tail[len(tail) - len(rec.trailer) :]
    crcs = {trailer[at : at + 4] for at in rec.crc_at}
    if len(crcs) != 1:
        return None
    return len(rec.header), struct.unpack("<I", crcs.pop())[0]


def locate_payload(
    stream: Any, start: int, length: int, where: str, dtype: torch.dtype, sizes: tuple[int, ...]
) -> tuple[int, int | None] | None:
    """``(offset, crc32)``: the offset (from ``start``) of the payload of the ``torch.save`` record
    at bytes ``start .. start + length`` of ``stream`` (a seekable binary file), and the zip CRC-32
    its directory records for the payload member (None if the tensor's storage holds more than the
    chunk), after checking it holds a tensor of ``dtype`` and ``sizes`` whose payload lies in the
    record; ``None`` for a valid record whose tensor is not one contiguous little-endian run (read
    it with ``torch.load`` instead).

    Only the zip directory and the pickle are read (hundreds of bytes); the payload is not. A record
    whose framing is the one this torch writes for the chunk (every record ckptq and DCP's writer
    write with this torch) is checked by comparing that framing (:func:`tensor_record`), without
    unpickling, as :class:`~ckptq.io.SafeFileSystemReader` does.

    Raises:
        CheckpointFormatError: the record is truncated or corrupt, or holds another dtype, shape or
            layout than the metadata gives (``where`` names the file, byte range and entry).
        UnsafeCheckpointError: the pickle cannot be loaded with ``weights_only=True``.
    """
    import zipfile

    from .record_check import check_chunk_tensor, check_record_header, load_weights_only

    try:
        window = _ends(stream, start, length)
    except (EOFError, OSError) as e:
        raise CheckpointFormatError(
            f"{where}: the record is truncated or corrupt ({type(e).__name__}: {e}); "
            f"restore the file or re-save the checkpoint"
        ) from e
    known = _known_framing(window, length, dtype, sizes)
    if known is not None:
        return known
    check_record_header(window, where)
    try:
        with zipfile.ZipFile(window) as z:
            order = [n for n in z.namelist() if n.endswith("/byteorder")]
            byteorder = z.read(order[0]).decode() if order else sys.byteorder
            members = [i for i in z.infolist() if i.filename.endswith("/data/0")]
        window.seek(0)
        t = load_weights_only(window, where, "meta")
    except CkptqError:
        raise
    except Exception as e:  # zip / EOF / pickle errors of a damaged record
        raise CheckpointFormatError(
            f"{where}: the record is truncated or corrupt ({type(e).__name__}: {e}); "
            f"restore the file or re-save the checkpoint"
        ) from e
    check_chunk_tensor(t, (dtype, sizes), where)
    storage = t.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    nbytes = t.numel() * t.element_size()
    if byteorder != "little" or not t.is_contiguous() or offset is None:
        return None
    begin = int(offset) + t.storage_offset() * t.element_size()
    if begin < 0 or begin + nbytes > length or storage.nbytes() < t.storage_offset() * t.element_size() + nbytes:
        raise CheckpointFormatError(
            f"{where}: the record's payload (bytes {begin}..{begin + nbytes}) does "
            f"not lie inside it; the data file is corrupt: restore it or re-save"
        )
    whole = len(members) == 1 and members[0].file_size == nbytes and begin == int(offset)
    return begin, (members[0].CRC if whole else None)

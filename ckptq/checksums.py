"""Checksums of checkpoint chunks: what is hashed, with what, and hashing off the writing thread.

Every chunk record ckptq writes (a component chunk of a native tensor, a chunk of a plain or
high-precision tensor, a bytes entry) carries a checksum in the ckptq record of ``.metadata``
(:func:`ckptq.contract.read_checksums` gives the table). The checksum is

* ``crc32c`` (Castagnoli CRC-32, RFC 3720 §B.4) of the chunk's **payload**: the tensor's elements
  in row-major order as the little-endian bytes of its stored dtype (for a bytes entry, its bytes).

It is a checksum of *what was saved*, not of how DCP serialized it: a reader recomputes it from the
tensor it loaded, whatever the record framing (``torch.save`` zip today), so the same chunk written
by ``dcp.save``, ``ckptq reshard`` or ``ckptq convert`` has the same checksum.

The algorithm was chosen by measurement on the 2-core development VM (AMD EPYC, 256 MiB buffers,
one thread): ``crc32c`` (the PyPI package, SSE4.2 / ARMv8 CRC instructions) 5.8-11.6 GB/s,
``xxh3_64`` 5.3 GB/s, ``xxh64`` 3.1 GB/s; ``crc32c`` can release the GIL, so :class:`Hasher` hashes
on a second thread while the writer writes (see docs/benchmarks.md, "Checksums", for its cost in a save).

CUDA tensors are hashed on their GPU by the ``ckptq::crc32c`` kernel (:func:`ckptq.ops.crc32c`:
pieces of the byte range hashed by separate threads and joined with :func:`combine`'s arithmetic),
so a checksum costs no copy of the data to the host; without the kernel (extension not built) a
CUDA tensor is copied to the host and hashed there, as before.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Hashable
from typing import Any

import torch

__all__ = [
    "ALGORITHM",
    "SAFETENSORS_KEY",
    "checksum",
    "check",
    "checksum_key",
    "payload",
    "Hasher",
    "safetensors_table",
    "read_safetensors_table",
    "SIDECAR",
    "write_sidecar",
    "read_sidecar",
    "PlanHasher",
    "combine",
    "crc32_combine",
]

#: the name stored with every checksum table (a reader that does not know it verifies nothing).
ALGORITHM = "crc32c"

#: the ``__metadata__`` key of a safetensors file ckptq wrote (``ckptq export``) holding the checksum
#: of each of its tensors: a JSON object ``{tensor name: "%08x"}`` (safetensors metadata values are
#: strings; fixed-width hex keeps the header's size known before the data is written).
SAFETENSORS_KEY = "ckptq.crc32c"


def payload(data: torch.Tensor | bytes | bytearray | memoryview) -> memoryview:
    """The bytes a checksum covers: a tensor's elements, row-major, as the little-endian bytes of
    its dtype (a CPU tensor; a non-contiguous one is copied to row-major first), or a bytes-like
    object as is. Returns a 1-D ``memoryview`` of unsigned bytes."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        if t.numel() == 0:
            return memoryview(b"")
        return memoryview(t.view(torch.uint8).numpy()).cast("B")
    return memoryview(data).cast("B")


def checksum(data: torch.Tensor | bytes | bytearray | memoryview, value: int = 0) -> int:
    """``crc32c`` of :func:`payload` ``(data)``: an unsigned 32-bit int; with ``value``, the
    checksum continued from ``value`` (the checksum of the bytes before ``data``), so a chunk read
    in parts hashes to the checksum of the whole.

    ``torch.uint8`` views are used, so every dtype (bf16, float8, packed fp4 in uint8) hashes its
    stored bytes. Little-endian hosts only (as every platform torch supports today). A CUDA tensor
    is hashed on its GPU where the kernel is built (the same value; waits for it)."""
    import crc32c

    if isinstance(data, torch.Tensor) and data.device.type == "cuda":
        pending = _on_device(data, value)
        if pending is not None:
            return pending()
    view = payload(data)
    # gil_release_mode=1: release the GIL (the package's default keeps it, measured here: two threads
    # hashing 64 MiB each took 10.0 ms with the default, 6.0 ms released), so :class:`Hasher`'s thread
    # hashes while the writing thread runs; small buffers keep it (releasing costs more than it saves).
    return crc32c.crc32c(view, value, gil_release_mode=1 if len(view) >= 1 << 16 else 0)


def check(data: Any, expected: int | None, where: str, *, got: int | None = None) -> None:
    """Compare the checksum of ``data`` (or ``got``, one computed already, e.g. over parts) with
    ``expected`` (nothing to do when it is None).

    Raises:
        ChecksumMismatchError: they differ; the message starts with ``where`` (the checkpoint, the
            entry, its file and byte range) and says what to do.
    """
    if expected is None:
        return
    got = checksum(data) if got is None else got
    if got != expected:
        from .errors import ChecksumMismatchError

        raise ChecksumMismatchError(
            f"{where}: checksum mismatch (crc32c of the stored bytes is {got:08x}, the checkpoint records "
            f"{expected:08x}): the data file is corrupt. Restore it from a copy or re-save the checkpoint"
        )


def checksum_key(index: Any) -> tuple:
    """The key of a chunk in a checksum table, from a DCP ``MetadataIndex``: ``(fqn, offsets)``
    with ``offsets`` a tuple of ints, or ``None`` for a bytes entry."""
    return index.fqn, None if index.offset is None else tuple(int(o) for o in index.offset)


_SIDE_STREAMS: dict = {}


def _on_device(data: torch.Tensor, value: int = 0):
    """Start the crc32c of CUDA tensor ``data`` on its GPU and return a function that waits for it
    and gives the checksum, or None where the kernel is not available.

    The kernel runs on a side stream of the device that first waits for the current one (so it
    hashes the bytes as they are now, and does not delay what the caller enqueues next, e.g. DCP's
    copy of the tensor to the host), followed by an 8-byte copy of the value to pinned host memory
    and an event; ``data`` is recorded on the side stream, so its memory is not reused before the
    kernel read it."""
    from .ops import crc32c as kernel
    from .ops import crc32c_available

    device = data.device
    if not crc32c_available(device):
        return None
    current = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    side.wait_stream(current)
    with torch.cuda.stream(side):
        on_gpu = kernel(data.detach(), value)
        host = on_gpu.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    data.record_stream(side)

    def result() -> int:
        done.synchronize()
        return int(host)

    return result


# ---------------------------------------------------------------- GF(2) arithmetic of CRC-32s
# Polynomials mod P, stored bit-reflected as the CRCs compute them: bit 31 is the coefficient of
# x^0. A CRC register followed by n bytes is multiplied by x^(8n) mod P, and everything is linear,
# so crc(A + B) = crc(A) * x^(8 |B|) mod P ^ crc(B) (zlib's crc32_combine, Mark Adler, zlib 1.2.12
# crc32.c; the pre- and post-inversion of the register cancel out in the sum). Two polynomials:
# crc32c's (Castagnoli, 0x1EDC6F41; the kernels in ckptq/csrc/crc32c.h do the same) and the zip /
# zlib CRC-32's (ISO 3309, 0x04C11DB7), which torch.save records carry.
_POLY = 0x82F63B78  # crc32c, reflected
_POLY_ZIP = 0xEDB88320  # zip CRC-32, reflected


def _multmodp(a: int, b: int, poly: int = _POLY) -> int:
    """``a * b mod P`` of two reflected polynomials (``poly``: P reflected)."""
    p = 0
    for _ in range(32):
        if a & 0x80000000:
            p ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return p


def _x2n_table(poly: int) -> list[int]:
    table = [0x40000000]  # x^1
    for _ in range(63):
        table.append(_multmodp(table[-1], table[-1], poly))
    return table


_X2N = {poly: _x2n_table(poly) for poly in (_POLY, _POLY_ZIP)}  # x^(2^k) mod P, k = 0..63


def _shift(crc: int, nbytes: int, poly: int = _POLY) -> int:
    """``crc * x^(8 nbytes) mod P``: a CRC register after ``nbytes`` zero bytes (no pre/post
    conditioning)."""
    table, k = _X2N[poly], 3
    while nbytes:
        if nbytes & 1:
            crc = _multmodp(table[k], crc, poly)
        nbytes >>= 1
        k += 1
    return crc


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``crc32c(a + b)`` from ``crc_a = crc32c(a)``, ``crc_b = crc32c(b)`` and ``len_b = len(b)``
    (bytes), without the bytes: ``crc_a * x^(8 len_b) mod P ^ crc_b``. The same arithmetic joins
    the pieces hashed by the GPU kernel's threads (``ckptq/csrc/crc32c.h``)."""
    return _shift(crc_a, len_b) ^ crc_b


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """:func:`combine` for the zip CRC-32 (``zlib.crc32``, the CRC a ``torch.save`` record's zip
    directory holds): ``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``
    in bytes (tests/test_checksums.py compares it with ``zlib.crc32``)."""
    return _shift(crc_a, len_b, _POLY_ZIP) ^ crc_b


class Hasher:
    """Checksums computed on one background thread, so hashing overlaps the caller's writes.

    ``submit(key, data)`` queues ``data`` (kept alive until hashed; a tensor must not be modified
    in place before :meth:`results`), ``results()`` waits and returns ``{key: checksum}``.
    ``crc32c`` releases the GIL, so the hashing thread runs while the writing thread is in
    ``write``/``torch.save``. Thread-safe (``submit`` may be called from several writer threads).
    """

    def __init__(self) -> None:
        self._pool: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(1, thread_name_prefix="ckptq-checksum")
        self._futures: dict[Hashable, cf.Future] = {}

    def submit(self, key: Hashable, data: Any) -> None:
        assert self._pool is not None, "Hasher used after results()/close()"
        if isinstance(data, torch.Tensor) and data.device.type == "cuda":
            pending = _on_device(data)  # hashed on the GPU, in stream order: no host copy
            if pending is not None:
                self._futures[key] = self._pool.submit(pending)
                return
        if isinstance(data, torch.Tensor) and (data.device.type != "cpu" or not data.is_contiguous()):
            data = payload(data)  # copy now: the caller's tensor may be reused after it is written
        self._futures[key] = self._pool.submit(checksum, data)

    def results(self) -> dict[Hashable, int]:
        """``{key: checksum}`` of everything submitted (waits for the hashing thread)."""
        out = {k: f.result() for k, f in self._futures.items()}
        self.close()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._futures = {}


def safetensors_table(values: dict) -> str:
    """The :data:`SAFETENSORS_KEY` value for ``{tensor name: checksum}`` (sorted, fixed width)."""
    import json

    return json.dumps({k: f"{int(v):08x}" for k, v in sorted(values.items())}, separators=(",", ":"))


def read_safetensors_table(metadata: dict | None) -> dict | None:
    """``{tensor name: checksum}`` from a safetensors file's ``__metadata__``, or ``None`` when it
    has no (readable) table: a file another tool wrote, or a damaged header (whose tensors are then
    reported unverified)."""
    import json

    text = (metadata or {}).get(SAFETENSORS_KEY)
    if not isinstance(text, str):
        return None
    try:
        table = json.loads(text)
        return {str(k): int(v, 16) for k, v in table.items() if isinstance(v, str) and len(v) == 8}
    except (ValueError, AttributeError):
        return None


# ---------------------------------------------------------------- per-rank checksum files
#: The file in which rank ``r`` of a ``dcp.save`` planned by :class:`ckptq.QuantizedSavePlanner`
#: stores the checksums of the chunks it wrote, when the storage writer is not ckptq's
#: (:class:`PlanHasher`); the ckptq record of ``.metadata`` lists which ranks wrote one.
SIDECAR = "__{rank}_0.ckptq-crc32c"
#: a checksum file bigger than this is refused unread (a chunk's entry takes < 1 KiB of JSON).
_SIDECAR_LIMIT = 256 << 20


def write_sidecar(directory: Any, rank: int, table: dict) -> None:
    """Write rank ``rank``'s ``{(fqn, offsets or None): checksum}`` as :data:`SIDECAR` in
    ``directory``, atomically (a temporary file, fsynced, renamed into place): JSON
    ``{"algorithm": "crc32c", "rank": r, "chunks": [[fqn, offsets or null, checksum], ...]}``."""
    import json
    import os
    from pathlib import Path

    path = Path(directory) / SIDECAR.format(rank=rank)
    rows = [[fqn, None if off is None else list(off), int(v)] for (fqn, off), v in table.items()]
    data = json.dumps({"algorithm": ALGORITHM, "rank": int(rank), "chunks": rows}, separators=(",", ":"))
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_sidecar(directory: Any, rank: int) -> dict[tuple, int]:
    """Rank ``rank``'s checksum table from :data:`SIDECAR` in ``directory``: ``{(fqn, offsets or
    None): checksum}``.

    Raises:
        CheckpointFormatError: the file is missing (the checkpoint's metadata says rank ``rank``
            wrote it), too big, or not a checksum table of that rank.
    """
    import json
    from pathlib import Path

    from .errors import CheckpointFormatError

    path = Path(directory) / SIDECAR.format(rank=rank)
    fix = "restore it from a copy, or re-save the checkpoint"
    try:
        if path.stat().st_size > _SIDECAR_LIMIT:
            raise CheckpointFormatError(f"{path}: checksum file of {path.stat().st_size} bytes is too big; {fix}")
        doc = json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise CheckpointFormatError(
            f"{path}: missing; the checkpoint's metadata says rank {rank} wrote the checksums of its "
            f"chunks there; {fix}"
        ) from e
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: unreadable checksum file ({type(e).__name__}: {e}); {fix}") from e
    bad = CheckpointFormatError(f"{path}: malformed checksum file (not rank {rank}'s crc32c table); {fix}")
    rows = doc.get("chunks") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or doc.get("algorithm") != ALGORITHM or doc.get("rank") != rank:
        raise bad
    out: dict[tuple, int] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3):
            raise bad
        fqn, off, value = row
        if not (isinstance(fqn, str) and type(value) is int and 0 <= value < 2**32):
            raise bad
        if not (off is None or (isinstance(off, list) and all(type(o) is int for o in off))):
            raise bad
        key = (fqn, None if off is None else tuple(off))
        if out.setdefault(key, value) != value:  # one chunk, two checksums: which one is damaged?
            raise bad
    return out


class PlanHasher:
    """The checksums of one rank's writes in a ``dcp.save`` whose storage writer is not ckptq's.

    The planner hands every value it resolves for the storage writer (``resolve_data``) to
    :meth:`add` (hashed by :class:`Hasher`: CPU values on its thread, CUDA values on their GPU,
    so the writer's own copy to the host is the only one); when the last of the ``expected`` write
    items was added, :meth:`add` waits for the hashing thread and writes the rank's :data:`SIDECAR`
    file before it returns, so the file exists before the storage writer's ``write_data``
    completes, and so before the coordinator writes ``.metadata`` (DCP gathers every rank's write
    results first). Thread-safe (DCP's ``FileSystemWriter`` resolves from several threads with
    ``thread_count > 1``).
    """

    def __init__(self, directory: Any, rank: int, expected: int) -> None:
        import threading

        self.directory, self.rank, self.expected = directory, rank, expected
        self._hasher: Hasher | None = None
        self._lock = threading.Lock()
        self._added = 0

    def add(self, index: Any, data: Any) -> None:
        """Hash ``data`` (a tensor, or the ``io.BytesIO`` of a bytes entry) as write item ``index``'s."""
        if isinstance(data, torch.Tensor):
            data = data.detach()
        else:
            data = bytes(data.getbuffer())
        with self._lock:
            if self._hasher is None:
                self._hasher = Hasher()
            self._hasher.submit(checksum_key(index), data)
            self._added += 1
            if self._added != self.expected:
                return
            hasher, self._hasher = self._hasher, None
        write_sidecar(self.directory, self.rank, hasher.results())

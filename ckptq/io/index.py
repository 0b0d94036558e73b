"""The chunk index: DCP ``.metadata``'s contents as columns a process can read in part.

Reading a DCP checkpoint's ``.metadata`` means unpickling it whole (four Python objects per saved
chunk: about 35 us and 1.8 KiB per chunk, docs/benchmarks.md "Planning at 1T scale"), in every
process that plans. The writers that write ``.metadata`` (:mod:`ckptq.io.writer`) write this file
next to it first, :data:`INDEX_FILE`: a safetensors file (a header giving each tensor's byte
range, then the bytes: a row range of one tensor is one ``pread`` at a known offset) of

* ``entries`` int64 ``(E, 5 + D)``, one row per DCP entry, sorted by FQN: kind (0
  tensor, 1 bytes), dtype (index into the table's ``dtypes``; -1 for bytes), ndim, first row and
  number of rows in ``chunks``, global shape padded with 1 to ``D`` (the largest ndim);
* ``names`` uint8 and ``name_ends`` int64 ``(E,)``: the entries' FQNs, UTF-8, end to end;
* ``chunks`` int64 ``(C, 2 D + 4)``, one row per saved chunk (a bytes entry: one row), an entry's rows
  contiguous, sorted by offsets: offsets and sizes (padded with 0 and 1: a bytes entry is one
  chunk of one element of a ``(1, ..)`` entry), data file (index into ``files``),
  byte offset and length of its record, its crc32c checksum (-1: none);
* ``chunk_crc`` uint32: the crc32c (:mod:`ckptq.checksums`) of each block of :data:`BLOCK_ROWS` rows of
  ``chunks`` (its bytes, little-endian), so that a reader of some rows verifies the blocks it reads;
* ``table`` uint8: JSON (tagged so that tuples and non-string keys come back as they were) of the
  dtype and file-name tables, the ckptq record without its checksum table, digest and index field,
  the rest of ``planner_data`` (DCP's flatten mappings), DCP's metadata version;
* the safetensors header's ``__metadata__``, one key ``ckptq.index``: JSON (sorted keys) of
  ``format`` (``ckptq.index``), ``version`` (1), ``block_rows`` and ``tables_sha256``: SHA-256 of
  everything above but ``chunks`` (the sizes of ``chunks`` included), the index's digest.

``.metadata``'s ckptq record names the index and its digest (:func:`ckptq.contract.with_index`):
the full reader checks that an index present is the one its ``.metadata`` names
(:func:`check_index`); a reader of the index alone checks that ``.metadata`` names the index's
digest by scanning its bytes for it (:meth:`ChunkIndex.named_by_metadata`, no unpickling; a stale
index, left by a later save of another writer, is then not used). Checkpoints without an index
read as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..checksums import checksum
from ..contract import CKPTQ_KEY, DIGEST_KEY, INDEX_KEY, index_digest
from ..errors import CheckpointFormatError
from .storage import is_url

__all__ = [
    "INDEX_FILE",
    "BLOCK_ROWS",
    "build_index",
    "pack_index",
    "save_index",
    "write_index",
    "encode_value",
    "encode_planner_data",
    "ChunkIndex",
    "check_index",
]

#: The index's file name in the checkpoint directory (never a data file: it does not end in ``.distcp``).
INDEX_FILE = ".metadata.index"
#: Rows of ``chunks`` per crc32c block.
BLOCK_ROWS = 256
_FORMAT, _VERSION = "ckptq.index", 1
#: the one key of the safetensors header's ``__metadata__``: the index header, JSON
_HEADER_KEY = "ckptq.index"
_TABLES = ("entries", "names", "name_ends", "chunk_crc", "table")


class _NoIndex(Exception):
    """The metadata holds something the index does not represent (it is then not written)."""


def encode_value(x: Any) -> Any:
    """Builtins (and dtypes) as JSON that the reader turns back into equal values of the same
    types (tuples and dicts tagged ``{"t": [...]}``, ``{"d": [[key, value], ...]}``, dtypes
    ``{"dtype": name}``)."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, list):
        return [encode_value(v) for v in x]
    if isinstance(x, tuple):
        return {"t": [encode_value(v) for v in x]}
    if isinstance(x, dict):
        return {"d": [[encode_value(k), encode_value(v)] for k, v in x.items()]}
    if isinstance(x, torch.dtype):
        return {"dtype": _dtype_name(x)}
    raise _NoIndex(type(x).__name__)


def _plain(x: Any) -> bool:
    """Whether plain JSON gives ``x`` back as it is (str keys, lists, no tuples or dtypes)."""
    if x is None or isinstance(x, (bool, str, int, float)):
        return True
    if type(x) is list:
        return all(_plain(v) for v in x)
    if type(x) is dict:
        return all(type(k) is str and _plain(v) for k, v in x.items())
    return False


def encode_planner_data(record: dict | None, rest: dict) -> dict:
    """The index table's fields for ``.metadata``'s ckptq record (its checksum table, digest and
    index field left out) and the rest of its ``planner_data``: plain JSON where that gives them
    back exactly (``record``; ``mappings``: DCP's flatten mappings, tuples of str and int, sorted
    by key), else
    tagged (:func:`encode_value`; ``record_tagged``, ``planner_data``)."""
    out: dict[str, Any] = {}
    if record and _plain(record):
        out["record"] = record
    elif record:
        out["record_tagged"] = encode_value(record)
    if all(type(k) is str and type(v) is tuple and all(type(p) in (str, int) for p in v) for k, v in rest.items()):
        # by key: the same index however the processes of a save merged them
        out["mappings"] = {k: list(rest[k]) for k in sorted(rest)}
    else:
        out["planner_data"] = encode_value(rest)
    return out


def _decode_planner_data(doc: dict) -> tuple[Any, dict]:
    """``(record or None, rest of planner_data)`` from the fields :func:`encode_planner_data` wrote."""
    record = doc["record"] if "record" in doc else _dec(doc.get("record_tagged"))
    if "mappings" in doc:
        return record, {k: tuple(v) for k, v in doc["mappings"].items()}
    return record, _dec(doc["planner_data"])


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (any torch dtype: an entry may be an int64 step counter)."""
    d = getattr(torch, str(name), None)
    if not isinstance(d, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype '{name}' in the chunk index")
    return d


def _dec(x: Any) -> Any:
    if isinstance(x, list):
        return [_dec(v) for v in x]
    if isinstance(x, dict):
        if "t" in x:
            return tuple(_dec(v) for v in x["t"])
        if "d" in x:
            return {_dec(k): _dec(v) for k, v in x["d"]}
        return _dtype(x["dtype"])
    return x


def _sha(arrays: Mapping[str, np.ndarray], chunks_shape: tuple) -> str:
    h = hashlib.sha256(json.dumps(list(chunks_shape)).encode())
    for name in _TABLES:
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{list(a.shape)}:".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def build_index(metadata: Metadata) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The index of a final ``metadata`` (storage locations and checksum table in place): its
    tensors and safetensors header fields, or None when the metadata holds something the index
    cannot represent (storage locations of another storage layer or with stream transforms,
    planner data that is not builtins): the checkpoint is then read through ``.metadata`` alone."""
    try:
        return _build(metadata)
    except _NoIndex:
        return None


def _build(metadata: Metadata) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # the class DCP's reader unpickles

    sdm, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(storage, Mapping) or not isinstance(sdm, Mapping):
        raise _NoIndex("storage")
    planner_data = dict(metadata.planner_data or {})
    record = dict(planner_data.pop(CKPTQ_KEY, None) or {})
    table = record.pop("checksums", None)
    sums = (table or {}).get("chunks") if isinstance(table, Mapping) else None
    if table is not None and not isinstance(sums, Mapping):
        raise _NoIndex("checksums kept in per-rank files")
    record.pop(DIGEST_KEY, None)
    record.pop(INDEX_KEY, None)
    dtypes: dict[str, int] = {}
    files: dict[str, int] = {}
    maxnd = max([len(md.size) for md in sdm.values() if isinstance(md, TensorStorageMetadata)] or [0])
    ent_rows, names, flat = [], [], []  # flat: the chunk rows, end to end
    zeros, ones = [0] * maxnd, [1] * maxnd
    if not all(type(fqn) is str for fqn in sdm):
        raise _NoIndex("name")
    # a location by (fqn, offsets): a MetadataIndex's equality and hash are those of this pair (its
    # ``index`` is a hint that takes no part), and making one per chunk to look it up costs more
    located = {(k.fqn, k.offset): v for k, v in storage.items() if type(k) is MetadataIndex}
    n_rows = 0
    for fqn in sorted(sdm):  # by name, chunks by offsets: the same index however the save ordered them
        md = sdm[fqn]
        per = (sums or {}).get(fqn) or {}
        if isinstance(md, TensorStorageMetadata):
            nd = len(md.size)
            code = dtypes.setdefault(_dtype_name(md.properties.dtype), len(dtypes))
            boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            kind, shape = 0, list(md.size)
        elif isinstance(md, BytesStorageMetadata):
            nd, code, kind, shape = 0, -1, 1, []
            boxes = [(None, ())]
        else:
            raise _NoIndex(type(md).__name__)
        pad0, pad1 = zeros[nd:], ones[nd:]
        for off, sz in boxes:
            info = located.get((fqn, off))
            rel = getattr(info, "relative_path", None)
            if type(rel) is not str or type(info) is not _StorageInfo or getattr(info, "transform_descriptors", None):
                raise _NoIndex("location")
            f = files.setdefault(rel, len(files))
            flat.extend((*(off or ()), *pad0, *sz, *pad1, f, info.offset, info.length, per.get(off, -1)))
        ent_rows.append([kind, code, nd, n_rows, len(boxes), *shape, *ones[nd:]])
        n_rows += len(boxes)
        names.append(fqn.encode())
    width = 2 * maxnd + 4
    doc = {
        "dtypes": list(dtypes),
        "files": list(files),
        **encode_planner_data(record, planner_data),
        "version": metadata.version if isinstance(getattr(metadata, "version", None), str) else None,
        "checksums": table is not None,
    }
    return pack_index(
        np.array(ent_rows, dtype=np.int64).reshape(len(ent_rows), 5 + maxnd),
        names,
        np.array(flat, dtype=np.int64).reshape(n_rows, width),
        doc,
    )


def pack_index(
    entries: np.ndarray, names: list[bytes], chunks: np.ndarray, doc: dict
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The index's tensors and header from its tables (the module docstring): ``entries`` int64
    ``(E, 5 + D)``, the FQNs UTF-8 encoded, ``chunks`` int64 ``(C, 2 D + 4)`` and the JSON table
    ``doc`` (values tagged by :func:`encode_value`); adds the per-block crc32c and the digest."""
    chunks = np.ascontiguousarray(chunks, dtype=np.int64)
    blocks = [checksum(memoryview(chunks[i : i + BLOCK_ROWS]).cast("B")) for i in range(0, len(chunks), BLOCK_ROWS)]
    arrays = {
        "entries": np.ascontiguousarray(entries, dtype=np.int64),
        "names": np.frombuffer(b"".join(names), dtype=np.uint8),
        "name_ends": np.cumsum([len(n) for n in names], dtype=np.int64),
        "chunk_crc": np.array(blocks, dtype=np.uint32),
        "table": np.frombuffer(json.dumps(doc, separators=(",", ":")).encode(), dtype=np.uint8),
    }
    header = {"format": _FORMAT, "version": _VERSION, "block_rows": BLOCK_ROWS}
    header["tables_sha256"] = _sha(arrays, chunks.shape)
    return {**arrays, "chunks": chunks}, header


def save_index(directory: Path, tensors: dict[str, np.ndarray], header: dict[str, Any]) -> None:
    """Write :func:`pack_index`'s result as :data:`INDEX_FILE` into local ``directory`` (fsynced)."""
    from safetensors.numpy import save

    # one key, sorted: the same bytes each time (safetensors writes its metadata map in no fixed order)
    blob = save(tensors, metadata={_HEADER_KEY: json.dumps(header, sort_keys=True)})
    with open(Path(directory) / INDEX_FILE, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def write_index(directory: Path, metadata: Metadata) -> str | None:
    """Write the index of ``metadata`` into local checkpoint ``directory`` (before ``.metadata``) and
    name it in ``metadata``'s ckptq record (:func:`ckptq.contract.with_index`, changed in place);
    returns its digest, or None when none is written (:func:`build_index`; no ckptq record)."""
    from ..contract import has_record, with_index

    if not has_record(metadata.planner_data):
        return None
    built = build_index(metadata)
    if built is None:
        return None
    save_index(directory, *built)
    digest = built[1]["tables_sha256"]
    metadata.planner_data = with_index(metadata.planner_data, INDEX_FILE, digest)
    return digest


def _bad(where: Any, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{where}: the chunk index '{INDEX_FILE}' {what}; it is corrupt or not this checkpoint's: "
        f"remove it (the checkpoint is then read through '.metadata') or re-save the checkpoint"
    )


class ChunkIndex:
    """A checkpoint's chunk index (:data:`INDEX_FILE`), opened: the tables read whole and verified
    (SHA-256, against the header's digest), the chunk rows read per entry on demand (:meth:`rows`,
    each block of :data:`BLOCK_ROWS` rows verified by its crc32c).

    Attributes:
        digest: the index's digest (the header's ``tables_sha256``).
        names: FQN -> entry number (checkpoint order).
        entries: the ``entries`` table (see the module docstring); dtypes, files: its tables.
        record, planner_data, version, has_checksums: what ``.metadata`` says besides its chunks.

    Raises:
        CheckpointFormatError: the file is not an index of this format, its digest does not match
            its tables, or the tables are inconsistent (:meth:`rows`: a block's crc32c).
    """

    def __init__(self, root: Path) -> None:
        from safetensors import safe_open

        self.root = root
        self._path = root / INDEX_FILE
        try:
            tables = safe_open(str(self._path), framework="np")  # checks the header against the file
            header = json.loads((tables.metadata() or {}).get(_HEADER_KEY, "{}"))
            arrays = {name: tables.get_tensor(name) for name in _TABLES}
            rows = tables.get_slice("chunks")
            shape = tuple(rows.get_shape())
            if rows.get_dtype() != "I64":
                raise ValueError(f"chunks of dtype {rows.get_dtype()}")
            del tables, rows  # its file mapping: the rows are read with pread (their pages are not kept)
            self._rows_at = _data_start(self._path, "chunks")
        except CheckpointFormatError:
            raise
        except Exception as e:  # not a safetensors file, a missing tensor, a damaged header
            raise _bad(root, f"cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(header, dict) or header.get("format") != _FORMAT or header.get("version") != _VERSION:
            raise _bad(root, f"is not a version-{_VERSION} index (header {header})")
        self.digest = header.get("tables_sha256")
        if _sha(arrays, shape) != self.digest:
            raise _bad(root, "does not match its digest (its tables were changed)")
        try:
            self.block_rows = int(header["block_rows"])
            doc = json.loads(bytes(arrays["table"]))
            self.dtypes = [_dtype(d) for d in doc["dtypes"]]
            self.files = [str(f) for f in doc["files"]]
            self.record, self.planner_data = _decode_planner_data(doc)
            self.version, self.has_checksums = doc["version"], bool(doc["checksums"])
            ends = arrays["name_ends"].tolist()
            blob = bytes(arrays["names"])
            starts = [0, *ends[:-1]]
            self.names = {blob[a:b].decode(): i for i, (a, b) in enumerate(zip(starts, ends, strict=True))}
        except CheckpointFormatError:
            raise
        except Exception as e:
            raise _bad(root, f"has a malformed table ({type(e).__name__}: {e})") from None
        self.entries = arrays["entries"]
        self.maxnd = (shape[1] - 4) // 2 if len(shape) == 2 else -1
        self.width = shape[1] if len(shape) == 2 else -1
        self.crcs = arrays["chunk_crc"]
        self._check_tables(shape, len(ends))

    def _check_tables(self, shape: tuple, n_names: int) -> None:
        if len(shape) != 2:
            raise _bad(self.root, f"has chunk rows of shape {list(shape)}, not (rows, columns)")
        e, (n_rows, width) = self.entries, shape
        self.n_rows = n_rows
        maxnd = (width - 4) // 2
        if (
            e.ndim != 2
            or e.shape[1] != 5 + maxnd
            or width != 2 * maxnd + 4
            or len(e) != n_names
            or len(self.names) != n_names
        ):
            raise _bad(self.root, "has tables of inconsistent sizes (or a repeated name)")
        kind, code, nd, start, count = e[:, 0], e[:, 1], e[:, 2], e[:, 3], e[:, 4]
        expected = np.concatenate([[0], np.cumsum(count)[:-1]]) if len(e) else count
        fine = (
            ((kind == 0) & (code >= 0) & (code < len(self.dtypes)) & (nd >= 0) & (nd <= maxnd))
            | ((kind == 1) & (code == -1) & (nd == 0) & (count == 1))
        ).all()
        fine = fine and (count >= 0).all() and (start == expected).all() and int(count.sum()) == n_rows
        padded = np.arange(maxnd)[None, :] >= nd[:, None]
        fine = fine and (e[:, 5:] >= 0).all() and (e[:, 5:][padded] == 1).all()
        fine = fine and len(self.crcs) == -(-n_rows // self.block_rows)
        if not fine:
            raise _bad(self.root, "has an entry table that does not describe its chunk rows")

    def named_by_metadata(self) -> bool:
        """Whether ``.metadata`` names this index: its digest's text is in the file (read in 8 MiB
        pieces, never unpickled). False: ``.metadata`` was replaced by a later save (of another
        writer), or the index was copied from another checkpoint.

        Raises:
            CheckpointFormatError: ``.metadata`` cannot be read."""
        needle = self.digest.encode()
        tail, found = b"", False
        try:
            with open(self.root / ".metadata", "rb") as f:
                while piece := f.read(8 << 20):
                    if needle in tail + piece[: len(needle)] or needle in piece:
                        found = True
                        break
                    tail = piece[-len(needle) :]
        except OSError as e:
            raise CheckpointFormatError(f"{self.root}: '.metadata' cannot be read ({e})") from e
        return found

    def check_rows(self) -> None:
        """Verify every block of chunk rows against its crc32c (the full reader's check).

        Raises:
            CheckpointFormatError: a block does not match."""
        step = self.block_rows * 1024
        for start in range(0, self.n_rows, step):
            self._blocks(start // self.block_rows, -(-min(start + step, self.n_rows) // self.block_rows))

    def _blocks(self, b0: int, b1: int) -> np.ndarray:
        """Rows of blocks ``b0 .. b1 - 1`` (read with ``pread``: no file mapping whose pages stay
        resident), each block verified by its crc32c."""
        rows, width = b0 * self.block_rows, self.width
        n = min(b1 * self.block_rows, self.n_rows) - rows
        buf = bytearray(n * width * 8)
        view, at, done = memoryview(buf), self._rows_at + rows * width * 8, 0
        with open(self._path, "rb", buffering=0) as f:
            while done < len(buf):  # (one read returns at most about 2 GiB)
                got = os.preadv(f.fileno(), [view[done:]], at + done)
                if got <= 0:
                    raise _bad(self.root, f"is truncated (chunk rows {rows}..)")
                done += got
        step = self.block_rows * width * 8
        for b in range(b1 - b0):
            if checksum(view[b * step : (b + 1) * step]) != int(self.crcs[b0 + b]):
                raise _bad(self.root, f"fails the crc32c of its chunk rows {(b0 + b) * self.block_rows}..")
        return np.frombuffer(buf, dtype="<i8").reshape(n, width)

    def rows(self, i: int, limit: int | None = None) -> np.ndarray:
        """The ``chunks`` rows of entry ``i`` (its first ``limit``), the blocks read verified by their crc32c.

        Raises:
            CheckpointFormatError: a block's crc32c does not match.
        """
        start, count = int(self.entries[i, 3]), int(self.entries[i, 4])
        count = count if limit is None else min(count, limit)
        if count == 0:
            return np.zeros((0, self.width), dtype=np.int64)
        b0 = start // self.block_rows
        block = self._blocks(b0, -(-(start + count) // self.block_rows))
        at = start - b0 * self.block_rows
        return block[at : at + count]

    def skeleton(self) -> Metadata:
        """A DCP ``Metadata`` of every entry (dtype, size) without chunks and without storage
        locations (:meth:`read_entry` gives an entry's), with the planner data."""
        sdm: dict[str, Any] = {}
        props = [TensorProperties(dtype=d) for d in self.dtypes]  # read-only: shared by the entries of a dtype
        for name, row in zip(self.names, self.entries.tolist(), strict=True):
            kind, code, nd = row[:3]
            if kind == 1:
                sdm[name] = BytesStorageMetadata()
            else:  # one Size each, as unpickled (a writer copying it pickles what it was given)
                sdm[name] = TensorStorageMetadata(props[code], torch.Size(row[5 : 5 + nd]), [])
        # strings equal to an entry's name are that very object, as in an unpickled .metadata (a
        # writer copying a flatten mapping then pickles the same bytes from either)
        same = {n: n for n in sdm}
        planner_data = {
            same.get(k, k): tuple(same.get(x, x) if type(x) is str else x for x in v) if type(v) is tuple else v
            for k, v in self.planner_data.items()
        }
        if self.record is not None:
            planner_data[CKPTQ_KEY] = self.record
        md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data={})
        if self.version is not None:
            md.version = self.version
        return md

    def read_entry(self, fqn: str, limit: int | None = None) -> tuple[list, dict, dict]:
        """Entry ``fqn``'s chunks (its first ``limit``), their storage locations and checksums:
        ``(chunks, {MetadataIndex: location}, {checksum key: crc32c})`` as ``.metadata`` holds them
        (a bytes entry: no chunks, one location).

        Raises:
            CheckpointFormatError: a block fails its crc32c, a row names a file the index does not
                list, or (the checkpoint has a checksum table) a chunk has no checksum.
        """

        return self.make_chunks(fqn, self.rows(self.names[fqn], limit))

    def make_chunks(self, fqn: str, rows: np.ndarray) -> tuple[list, dict, dict]:
        """:meth:`read_entry` of chunk rows ``rows`` of entry ``fqn`` (read and verified by :meth:`rows`)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        i = self.names[fqn]
        kind, nd, maxnd = int(self.entries[i, 0]), int(self.entries[i, 2]), self.maxnd
        if (rows[:, 2 * maxnd] < 0).any() or (rows[:, 2 * maxnd] >= len(self.files)).any():
            raise _bad(self.root, f"places '{fqn}' in a file it does not list")
        if self.has_checksums and (rows[:, -1] < 0).any():
            raise CheckpointFormatError(
                f"{self.root}: the chunk index has no checksum for a chunk of '{fqn}', though the checkpoint "
                f"has a checksum table: the index is damaged; remove it or re-save the checkpoint"
            )
        chunk_list, storage, sums = [], {}, {}
        for r in rows.tolist():
            f, off, length, crc = r[2 * maxnd :]
            if kind == 1:
                index, key = MetadataIndex(fqn), (fqn, None)
            else:
                offsets, sizes = torch.Size(r[:nd]), torch.Size(r[maxnd : maxnd + nd])
                chunk_list.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
                index, key = MetadataIndex(fqn, offsets), (fqn, tuple(offsets))
            storage[index] = _StorageInfo(self.files[f], off, length)
            if crc >= 0:
                sums[key] = crc
        return chunk_list, storage, sums


def _data_start(path: Path, name: str) -> int:
    """The file offset of tensor ``name``'s bytes in safetensors file ``path`` (its header: 8 bytes
    of little-endian length, then JSON giving each tensor's ``data_offsets`` after the header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        begin = json.loads(f.read(n))[name]["data_offsets"][0]
    return 8 + n + int(begin)


def check_index(root: Any, planner_data: Any, *, where: str, rows: bool = False) -> None:
    """The full reader's check: when ``.metadata``'s ckptq record names an index and that file is
    in ``root``, its tables match their digest and the digest is the one the record names; with
    ``rows`` (``ckptq verify``) also every block of chunk rows matches its crc32c. A load does not
    read the rows (it does not use them; a reader of the index checks the blocks it reads), so the
    index costs a load only its tables.

    Raises:
        CheckpointFormatError: they do not (the index is corrupt, or another checkpoint's).
    """
    digest = index_digest(planner_data)
    if digest is None or is_url(root) or not (Path(root) / INDEX_FILE).is_file():
        return
    index = ChunkIndex(Path(root))
    if index.digest != digest:
        raise _bad(where, "is not the one its '.metadata' names (another checkpoint's, or a stale one)")
    if rows:
        index.check_rows()

"""The DCP ``.metadata`` of a checkpoint, checked against itself and its files before anything trusts it.

:class:`~ckptq.io.SafeFileSystemReader` reads the file and unpickles it through the allow-list
(:mod:`ckptq.io.safe_pickle`; :func:`~ckptq.io.safe_pickle.check_pickle_memo` first refuses a pickle whose memo or data
lengths would allocate gigabytes), then :func:`validate_metadata` makes the checks of :func:`check_storage`
(structure, chunk geometry, storage locations, record sizes, data files), presents the entries of
tensors another library pickled through the ckptq contract (:func:`ckptq.io.foreign.virtualize`)
and validates the ckptq descriptors once (:func:`ckptq.contract.fold_entries`). Every failure is a
:class:`~ckptq.errors.CheckpointFormatError` (or :class:`~ckptq.errors.UnsafeCheckpointError`)
naming the checkpoint, the entry and the file, before anything large is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..checksums import checksum_key
from ..contract import (
    Entry,
    check_checksum_coverage,
    check_digest,
    fold_entries,
    mark_verified,
    merge_sidecar_checksums,
    read_checksums,
    sidecar_ranks,
)
from ..errors import CheckpointFormatError, CkptqError, UnsafeCheckpointError
from .foreign import ForeignLocation, virtualize
from .index import check_index
from .storage import file_size, is_url, join

__all__ = [
    "METADATA_FILE",
    "validate_metadata",
    "check_storage",
    "check_file_name",
    "boxes_fine",
    "ranges_fine",
    "holds",
    "describe_non_dcp",
]

#: The name of the global metadata file DCP's ``FileSystemWriter`` writes.
METADATA_FILE = ".metadata"

PathLike = Union[str, "os.PathLike[str]"]


def validate_metadata(
    metadata: Metadata, root: Path, *, source: str, files: bool = True, complete: bool = True
) -> tuple[Metadata, dict[str, Entry]]:
    """Check an unpickled ``Metadata`` and present it through the ckptq contract.

    Runs checks 1-3 and 5 of :func:`check_storage` (and refuses storage locations outside
    ``root``), then :func:`ckptq.io.foreign.virtualize` (entries of tensors another library
    pickled become the native component entries of their canonical format), then check 4 on the
    result, then :func:`ckptq.contract.fold_entries` (the ckptq descriptors against the entries),
    then :func:`ckptq.contract.check_digest` (edits that passed all of these), then
    :func:`ckptq.io.index.check_index` (a chunk index present is the one the record names), and reads the
    per-rank checksum files the record lists into its checksum table
    (:func:`ckptq.contract.merge_sidecar_checksums`).

    Args:
        metadata: what ``.metadata`` unpickled to (a DCP ``Metadata``).
        root: the checkpoint directory (holds the data files; names it in messages).
        source: how messages name the metadata file.
        files: check that the data files exist and are long enough (check 5).
        complete: check that each entry's chunks cover it (False for per-rank metadata).

    Returns:
        ``(metadata, entries)``: the metadata (a copy when foreign entries were virtualized) and its
        logical entries in the checkpoint's entry order, as :func:`~ckptq.contract.fold_entries` gives them.

    Raises:
        CheckpointFormatError: a check fails (the metadata digest included), a foreign record
            cannot be read, or a checksum file the record lists is missing or malformed.
        UnsafeCheckpointError: a storage location is absolute or leaves ``root``; a foreign record
            references a global nobody maps.
    """
    try:
        _check_fields(metadata)
        _check_locations_inside(metadata, root, source)
        _check_layout(metadata, root, files=files, complete=complete)
    except CkptqError:
        raise
    except Exception as e:  # a value of a type no DCP writes, met before a check named it
        raise CheckpointFormatError(
            f"{source}: the DCP metadata is malformed ({type(e).__name__}: {e}); restore the file or "
            f"re-save the checkpoint"
        ) from e
    raw = metadata
    try:
        metadata = virtualize(metadata, root)
    except CkptqError:
        raise
    except Exception as e:  # a foreign record the adapters cannot make sense of
        raise CheckpointFormatError(
            f"{root}: a record of another library's tensor cannot be read "
            f"({type(e).__name__}: {e}); the data file is corrupt: restore it or re-save"
        ) from e
    _check_record_sizes(metadata, root)
    entries = fold_entries(metadata, where=str(root))
    # Last, the edits that passed every check above: the digest, over the metadata as read.
    check_digest(raw, where=source)
    check_index(root, raw.planner_data, where=source)  # a chunk index next to it is the one it names
    records = [checksum_key(k) for k, v in metadata.storage_data.items() if not isinstance(v, ForeignLocation)]
    if sidecar_ranks(metadata.planner_data) is not None:  # checksums in per-rank files: read them in
        planner_data = merge_sidecar_checksums(metadata.planner_data, root, records)
        metadata = dataclasses.replace(metadata, planner_data=planner_data)
        checksums = read_checksums(planner_data, where=str(root))
    else:
        checksums = check_checksum_coverage(metadata.planner_data, records, where=root)
    mark_verified(metadata, entries=entries, checksums=checksums)
    return metadata, entries


def _check_locations_inside(metadata: Metadata, root: Any, source: str) -> None:
    """Refuse storage locations that are absolute or leave the checkpoint directory ('..')."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    safe: set = set()  # file names already checked (a checkpoint names one file per rank)
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if rel is None or (type(rel) is str and rel in safe):
            continue
        check_file_name(str(rel), root, source, getattr(index, "fqn", "?"))
        if type(info.relative_path) is str:
            safe.add(rel)


def check_file_name(rel: str, root: Any, source: str, fqn: str) -> None:
    """Refuse a storage location's file name that is absolute or leaves the checkpoint directory.

    Raises:
        UnsafeCheckpointError: it does (names ``fqn``, the entry placed there).
    """
    if os.path.isabs(rel) or ".." in Path(rel).parts or "\\" in rel:
        raise UnsafeCheckpointError(
            f"{source}: the metadata points '{fqn}' at '{rel}', outside "
            f"the checkpoint directory '{root}'; refusing to read it"
        )


def describe_non_dcp(p: Path) -> str:
    if list(p.glob("__*.metadata")):
        return (
            f"{p}: has only per-rank metadata files (__<rank>.metadata, written with "
            f"use_collectives=False) and no global '{METADATA_FILE}'; such checkpoints can only be "
            f"loaded into the same topology and are not supported here"
        )
    if list(p.glob("*.safetensors")):
        return f"{p}: is a safetensors directory, not a DCP FileSystemWriter checkpoint (no '{METADATA_FILE}')"
    if list(p.glob("*.distcp")):
        return (
            f"{p}: has .distcp data files but no '{METADATA_FILE}'; the save was probably "
            f"interrupted (DCP writes the metadata last). Re-save the checkpoint"
        )
    return f"{p}: not a DCP checkpoint directory (no '{METADATA_FILE}' file)"


def check_storage(metadata: Metadata, path: PathLike, *, files: bool = True, complete: bool = True) -> None:
    """The one place where a checkpoint's metadata is checked against itself and its files.

    :class:`SafeFileSystemReader` runs it on every metadata it reads (so :func:`read_metadata`,
    :class:`~ckptq.checkpoint.CheckpointView`, inspect, verify and ``dcp.load`` all get it), before
    any tensor is allocated. Checks, in order:

    1. structure: every DCP dataclass has its fields; entries are ``TensorStorageMetadata`` (a
       ``torch.dtype``, a size of ints >= 0, a list of chunks) or ``BytesStorageMetadata``;
       ``planner_data`` a dict or None, ``storage_data`` a dict, ``version`` a version number;
    2. chunk geometry, per tensor entry: each chunk has the entry's rank, offsets and sizes >= 0,
       ``offset + size`` within the entry's size; no two chunks overlap; with ``complete``, the
       chunks cover the entry exactly (their volumes sum to its numel);
    3. storage: every chunk and non-tensor entry has a location with ``offset, length >= 0`` in a
       data file (not ``.metadata``), and every location belongs to a chunk or entry (a removed
       entry leaves its locations behind); in each data file, the byte ranges of distinct records
       do not overlap;
    4. record sizes: a chunk of N elements of dtype D needs at least ``N * D.itemsize`` bytes in
       its record (a foreign record, :mod:`ckptq.io.foreign`: its component's bytes, or 4 bits per
       element for high-precision values), so an absurd size claim (a 2^40-element tensor) is
       refused here rather than by trying to allocate it;
    5. with ``files``: every data file exists under ``path`` and holds ``offset + length`` bytes.

    Storage layers other than DCP's file system one (no ``relative_path`` in ``storage_data``) get
    checks 1 and 2 only.

    Args:
        metadata: the checkpoint's ``Metadata`` (as :class:`SafeFileSystemReader` returns it).
        path: the checkpoint directory (names it in messages; holds the data files).
        files: run check 5.
        complete: run the coverage part of check 2 (False for per-rank metadata).

    Raises:
        CheckpointFormatError: what failed, naming the checkpoint, the entry (FQN) and the file.
    """
    root = path if is_url(path) else Path(path)
    _check_fields(metadata)
    _check_layout(metadata, root, files=files, complete=complete)
    _check_record_sizes(metadata, root)


def _fail(root: Path, msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{root}: {msg}; the metadata is corrupt or does not belong to these "
        f"files: restore '{METADATA_FILE}' or re-save the checkpoint"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x: Any) -> tuple[int, ...] | None:
    if type(x) is torch.Size:  # a tuple of ints by construction (no bools)
        return x
    if not isinstance(x, (tuple, list)) or not all(_is_int(v) for v in x):
        return None
    return tuple(x)


def _check_layout(metadata: Metadata, root: Path, *, files: bool, complete: bool) -> None:
    """Checks 1-3 and 5 of :func:`check_storage` (metadata only, plus file sizes)."""
    sdm = metadata.state_dict_metadata
    if not isinstance(sdm, Mapping):
        raise _fail(root, f"state_dict_metadata is a {type(sdm).__name__}, not a dict")
    pd = metadata.planner_data
    if pd is not None and not isinstance(pd, Mapping):
        raise _fail(root, f"planner_data is a {type(pd).__name__}, not a dict")
    sm = getattr(metadata, "storage_meta", None)
    if sm is not None and not isinstance(sm, StorageMeta):
        raise _fail(root, f"storage_meta is a {type(sm).__name__}, not StorageMeta")
    version = getattr(metadata, "version", None)
    if version is not None and not (isinstance(version, str) and re.fullmatch(r"\d+(\.\d+)*", version)):
        raise _fail(root, f"DCP metadata version {version!r} is not a version number")
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):  # DCP's readers need one (FileSystemReader asserts it)
        raise _fail(root, f"storage_data is a {type(storage).__name__}, not a dict")
    if not _entries_fine(sdm, complete):  # the first failure, in checkpoint order, by name
        for fqn, md in sdm.items():
            if not isinstance(fqn, str):
                raise _fail(root, f"entry name {fqn!r} is not a string")
            if isinstance(md, TensorStorageMetadata):
                _check_chunks(root, fqn, md, complete)
            elif not isinstance(md, BytesStorageMetadata):
                raise _fail(root, f"entry '{fqn}' is described by a {type(md).__name__}")
    with_path = sum(1 for v in storage.values() if hasattr(v, "relative_path"))
    if not with_path:
        return  # another storage layer: its reader checks its own locations
    if with_path != len(storage):
        raise _fail(root, "some storage locations have no file")
    # Every chunk and bytes entry has a location, every location a chunk or entry: first as sets
    # of (fqn, offsets) (C speed); the first failure, in checkpoint order, by the loops below.
    chunk_keys = set()
    for fqn, md in sdm.items():
        if isinstance(md, TensorStorageMetadata):
            chunk_keys.update([(fqn, _key(c.offsets)) for c in md.chunks])
    stored = {(index.fqn, index.offset) for index in storage if type(index) is MetadataIndex}
    if not chunk_keys <= stored or not all(
        (fqn, None) in stored for fqn, md in sdm.items() if not isinstance(md, TensorStorageMetadata)
    ):
        _raise_unlocated(root, sdm, storage)
    n_bytes = sum(1 for md in sdm.values() if not isinstance(md, TensorStorageMetadata))
    ends = _locations_fine(storage, stored, len(chunk_keys) + n_bytes)
    if ends is not None and (not files or all(holds(join(root, rel), end) for rel, end in ends.items())):
        return
    _check_locations(root, sdm, storage, chunk_keys, files)  # names the first failure


def holds(path: Any, end: int) -> bool:
    """``path`` (a local path or URL) is a file of at least ``end`` bytes."""
    size = file_size(path)
    return size is not None and size >= end


def _locations_fine(storage: Mapping, stored: set, expected: int) -> dict[str, int] | None:
    """Check 3 over every location at once (numpy): the end of the last record of each data file
    when all pass; None when one may not (:func:`_check_locations` then finds and names it).

    ``stored``: the (fqn, offsets) of the storage keys that are ``MetadataIndex`` es, known to
    include every chunk's and bytes entry's; ``expected``: how many those are. Equal counts mean
    every location belongs to a chunk or entry."""
    if len(stored) != len(storage) or len(stored) != expected or not storage:
        return None
    infos = list(storage.values())
    offs = [getattr(i, "offset", None) for i in infos]
    lens = [getattr(i, "length", None) for i in infos]
    if not all(type(v) is int for v in offs) or not all(type(v) is int for v in lens):
        return None
    rels = [i.relative_path for i in infos]
    del infos
    names = sorted(set(rels), key=str)
    for rel in names:
        if type(rel) is not str or not rel or Path(rel).name.endswith(METADATA_FILE):
            return None
    code_of = {rel: i for i, rel in enumerate(names)}
    code = np.fromiter((code_of[r] for r in rels), dtype=np.int64, count=len(rels))
    del rels
    try:
        st, ln = np.array(offs, dtype=np.int64), np.array(lens, dtype=np.int64)
    except OverflowError:
        return None
    last = ranges_fine(code, st, ln, len(names))
    return None if last is None else {rel: int(e) for rel, e in zip(names, last.tolist(), strict=True)}


def ranges_fine(code: np.ndarray, st: np.ndarray, ln: np.ndarray, n_files: int) -> np.ndarray | None:
    """Check 3's byte ranges on arrays (int64): record ``i`` at bytes ``st[i] .. st[i] + ln[i]``
    of data file ``code[i]`` (0 .. ``n_files - 1``). The end of the last record of each file when
    offsets and lengths are >= 0 and no two non-empty records of a file overlap; None when one
    may not (the exact check then decides and names it)."""
    if not len(st):
        return np.zeros(n_files, dtype=np.int64)
    if (st < 0).any() or (ln < 0).any() or (st > np.iinfo(np.int64).max - ln).any():
        return None
    en = st + ln
    span = int(en.max()) + 1
    if span * (n_files + 1) >= 1 << 62:
        return None
    last = np.zeros(n_files, dtype=np.int64)
    np.maximum.at(last, code, en)
    keep = en > st
    st, en = st[keep] + code[keep] * span, en[keep] + code[keep] * span  # files apart, in name order
    if len(st) > 1:
        # by start alone: records i before j (st_i <= st_j) overlap iff st_j < en_i, so some record
        # overlaps one before it iff its start is below the largest end before it, ties in any order
        order = np.argsort(st, kind="stable")  # (faster than the default on runs in order)
        st, en = st[order], en[order]
        if (st[1:] < np.maximum.accumulate(en)[:-1]).any():
            return None  # two records overlap (or share a foreign record): the exact check decides
    return last


def _check_locations(root: Path, sdm: Mapping, storage: Mapping, chunk_keys: set, files: bool) -> None:
    """Check 3 (and 5 with ``files``) location by location, naming the first failure."""
    ranges: dict[str, list] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str):
            raise _fail(root, f"storage key {index!r} is not a MetadataIndex")
        if index.offset is None:
            known = isinstance(sdm.get(fqn), BytesStorageMetadata)
        else:
            known = (fqn, _key(index.offset)) in chunk_keys
        if not known:  # DCP writes a location for each chunk of its entries, nothing else
            where = f" at offsets {list(index.offset)}" if index.offset is not None else ""
            raise _fail(
                root,
                f"the storage location of '{fqn}'{where} belongs to no entry or chunk of the "
                f"metadata (an entry or chunk was removed)",
            )
        rel, off, length = info.relative_path, getattr(info, "offset", None), getattr(info, "length", None)
        if (
            not isinstance(rel, (str, os.PathLike))
            or not str(rel)
            or Path(str(rel)).name.endswith(METADATA_FILE)
            or not _is_int(off)
            or not _is_int(length)
            or off < 0
            or length < 0
        ):
            raise _fail(
                root, f"'{fqn}' has a malformed storage location (file {rel!r}, offset {off!r}, length {length!r})"
            )
        ranges.setdefault(str(rel), []).append((off, off + length, fqn, info))
    for rel, spans in sorted(ranges.items()):
        _check_overlaps(root, rel, spans)
        if not files:
            continue
        end, fqn = max((s[1], s[2]) for s in spans)
        size = file_size(join(root, rel))
        if size is None:
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' (holding '{fqn}') is missing; copy the whole checkpoint directory"
            )
        if size < end:
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' is truncated: {size} bytes, but the metadata places "
                f"'{fqn}' up to byte {end}; restore the file or re-save the checkpoint"
            )


def _key(offsets: Any) -> tuple:
    """A chunk's offsets as a hashable key (``torch.Size`` is a tuple already)."""
    return offsets if type(offsets) is torch.Size else tuple(offsets)


def _raise_unlocated(root: Path, sdm: Mapping, storage: Mapping) -> None:
    """The error for the first entry (checkpoint order) or chunk with no storage location."""
    for fqn, md in sdm.items():
        keys = (
            [MetadataIndex(fqn, c.offsets) for c in md.chunks]
            if isinstance(md, TensorStorageMetadata)
            else [MetadataIndex(fqn)]
        )
        for key in keys:
            if key not in storage:
                where = f" chunk at offsets {list(key.offset)}" if key.offset is not None else ""
                raise CheckpointFormatError(
                    f"{root}: entry '{fqn}'{where} has no storage location in the metadata; "
                    f"the checkpoint is incomplete"
                )


def _check_overlaps(root: Path, rel: str, spans: list) -> None:
    """In data file ``rel``, the byte ranges of distinct records do not overlap (``spans``:
    ``(start, end, fqn, location)``); records of one foreign shard share theirs."""
    spans.sort(key=lambda s: (s[0], s[1]))
    prev = None
    for span in spans:
        if span[1] == span[0]:
            continue
        if prev is not None and span[0] < prev[1]:
            shared = (span[0], span[1]) == (prev[0], prev[1]) and _shares_record(span[3], prev[3])
            if not shared:
                raise _fail(
                    root,
                    f"in data file '{rel}', the records of '{prev[2]}' (bytes "
                    f"{prev[0]}..{prev[1]}) and '{span[2]}' (bytes {span[0]}..{span[1]}) "
                    f"overlap",
                )
        if prev is None or span[1] > prev[1]:
            prev = span


def _check_fields(metadata: Metadata) -> None:
    """Every DCP dataclass in ``metadata`` has all its fields (a damaged pickle can rename one)."""
    names: dict[type, frozenset] = {}  # per class: its field names (empty: not a dataclass instance)

    def check(obj: Any) -> None:
        cls = type(obj)
        want = names.get(cls)
        if want is None:
            want = names[cls] = (
                frozenset(f.name for f in dataclasses.fields(obj))
                if dataclasses.is_dataclass(obj) and not isinstance(obj, type)
                else frozenset()
            )
        if not want:
            return
        have = getattr(obj, "__dict__", None)
        if have is not None and want <= have.keys():
            return  # every field set on the instance (the usual case, checked in C)
        missing = [f.name for f in dataclasses.fields(obj) if not hasattr(obj, f.name)]
        if missing:
            raise CheckpointFormatError(
                f"the DCP metadata holds a {cls.__name__} without {missing}; the file is "
                f"corrupt: restore it or re-save the checkpoint"
            )

    check(metadata)
    sdm = getattr(metadata, "state_dict_metadata", None)
    if isinstance(sdm, Mapping):
        for md in sdm.values():
            check(md)
            check(getattr(md, "properties", None))
            chunks = getattr(md, "chunks", None)
            if isinstance(chunks, (list, tuple)):
                for c in chunks:
                    check(c)
    storage = getattr(metadata, "storage_data", None)
    if isinstance(storage, Mapping):
        for index, info in storage.items():
            check(index)
            check(info)


def _shares_record(a: Any, b: Any) -> bool:
    """Virtual chunks of one foreign record (components of one saved shard) share its bytes."""
    return isinstance(a, ForeignLocation) and isinstance(b, ForeignLocation)


def _entries_fine(sdm: Mapping, complete: bool) -> bool:
    """Check 2 (and the entry types of check 1) over all entries at once, with numpy: True when
    every entry passes; False when one may not (the loop of :func:`_check_layout` then finds and
    names it). Entries of chunks that are not plain ``torch.Size`` boxes, or of 2**53 elements or
    more, are left to that loop."""
    by_ndim: dict[int, list] = {}
    ts, chunk_type = torch.Size, ChunkStorageMetadata
    for fqn, md in sdm.items():
        if type(fqn) is not str:
            return False
        if isinstance(md, BytesStorageMetadata):
            continue
        if type(md) is not TensorStorageMetadata:
            return False
        props, size, chunks = md.properties, md.size, md.chunks
        if (
            type(props) is not TensorProperties
            or not isinstance(props.dtype, torch.dtype)
            or type(size) is not ts
            or type(chunks) is not list
            or math.prod(size) >= 1 << 53
        ):
            return False
        for c in chunks:
            if type(c) is not chunk_type or type(c.offsets) is not ts or type(c.sizes) is not ts:
                return False
        if size:
            by_ndim.setdefault(len(size), []).append(md)
        elif len(chunks) > 1 or (complete and not chunks) or (chunks and (chunks[0].offsets or chunks[0].sizes)):
            return False  # a scalar has one chunk of () (none in per-rank metadata)
    try:
        return all(_boxes_fine(nd, mds, complete) for nd, mds in by_ndim.items())
    except (ValueError, OverflowError):  # ragged or huge values: the loop names them
        return False


def _boxes_fine(nd: int, mds: list, complete: bool) -> bool:
    """Check 2 for entries ``mds`` of rank ``nd`` (chunks of ``torch.Size`` boxes), vectorized.

    Disjointness: the non-empty boxes of an entry sorted by (offset, size) per dim,
    lexicographically; two neighbours must differ, and on the first dim where they differ the
    first must end where or before the second starts. Boxes that first differ on dim ``k`` (equal
    on the dims before) then have disjoint intervals there, since the distinct intervals at each
    level of this order are disjoint in order. A disjoint layout not nested this way (bricks)
    returns False and is left to the exact sweep of :func:`_check_disjoint`."""
    counts = np.fromiter((len(md.chunks) for md in mds), dtype=np.int64, count=len(mds))
    n = int(counts.sum())
    entry = np.repeat(np.arange(len(mds)), counts)
    off = np.array([c.offsets for md in mds for c in md.chunks], dtype=np.int64).reshape(n, nd)
    sz = np.array([c.sizes for md in mds for c in md.chunks], dtype=np.int64).reshape(n, nd)
    dims = np.array([md.size for md in mds], dtype=np.int64).reshape(len(mds), nd)
    return boxes_fine(entry, off, sz, dims, complete)


def boxes_fine(entry: np.ndarray, off: np.ndarray, sz: np.ndarray, dims: np.ndarray, complete: bool) -> bool:
    """Check 2 of :func:`check_storage` on arrays (int64): chunk ``i`` of entry ``entry[i]`` at
    ``off[i]`` of ``sz[i]``, entry ``e`` of global size ``dims[e]`` (all of one ndim; entries of
    fewer dims padded with offset 0, size 1). True when every chunk is inside its entry, no two
    chunks of an entry overlap and (``complete``) they cover it; False when one may not (the
    exact checks then decide and name it). Entries of 2**53 elements or more must not be given."""
    nd = off.shape[1]
    volume = np.ones(len(off), dtype=np.int64)
    for d in range(nd):  # a dim at a time (numpy's reductions along a short axis are slow)
        o, s = off[:, d], sz[:, d]
        if (o < 0).any() or (s < 0).any() or (o > dims[:, d][entry] - s).any():  # (o + s may overflow)
            return False
        volume *= s
    if complete:  # exact in float64: every volume and numel < 2**53 (a sum above numel stays above)
        numel = np.ones(len(dims), dtype=np.int64)
        for d in range(nd):
            numel *= dims[:, d]
        if (np.bincount(entry, weights=volume, minlength=len(dims)) != numel).any():
            return False
    keep = volume != 0
    if not keep.all():
        off, sz, entry = off[keep], sz[keep], entry[keep]
    if not nd:
        return len(entry) < 2
    if len(entry) < 2:
        return True
    keys = [a for d in reversed(range(nd)) for a in (sz[:, d], off[:, d])] + [entry]
    if not _in_order(keys):  # (the chunk index keeps an entry's rows in this order: no sort then)
        order = np.lexsort(keys)
        off, sz, entry = off[order], sz[order], entry[order]
    undecided = entry[1:] == entry[:-1]  # neighbours of one entry equal on the dims so far
    for d in range(nd):
        o, s = off[:, d], sz[:, d]
        differ = (o[1:] != o[:-1]) | (s[1:] != s[:-1])
        if (undecided & differ & (o[1:] < o[:-1] + s[:-1])).any():
            return False  # the first dim where they differ: they overlap there
        undecided &= ~differ
    return not undecided.any()  # else two equal boxes of one entry


def _in_order(keys: list) -> bool:
    """Whether the rows are already in ``np.lexsort(keys)`` order (the last key first; equal rows
    in any order): each row after its neighbour on the first key, from the last, where they differ."""
    before = np.zeros(len(keys[0]) - 1, dtype=bool)  # decided: the pair is in order
    for k in reversed(keys):
        a, b = k[:-1], k[1:]
        if (~before & (b < a)).any():
            return False
        before |= b > a
        if before.all():
            return True
    return True


def _check_chunks(root: Path, fqn: str, md: TensorStorageMetadata, complete: bool) -> None:
    """Check 2 of :func:`check_storage` for one tensor entry, chunk by chunk."""
    props = md.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _fail(root, f"tensor '{fqn}' has no valid dtype ({getattr(props, 'dtype', props)!r})")
    size = _ints(md.size)
    if size is None or any(s < 0 for s in size):
        raise _fail(root, f"tensor '{fqn}' has a malformed size {md.size!r}")
    if not isinstance(md.chunks, (list, tuple)):
        raise _fail(root, f"tensor '{fqn}' has chunks {type(md.chunks).__name__}, not a list")
    boxes = []
    for c in md.chunks:
        off = _ints(getattr(c, "offsets", None)) if isinstance(c, ChunkStorageMetadata) else None
        sz = _ints(getattr(c, "sizes", None)) if isinstance(c, ChunkStorageMetadata) else None
        if off is None or sz is None or len(off) != len(size) or len(sz) != len(size):
            raise _fail(root, f"tensor '{fqn}' of size {list(size)} has a malformed chunk {c!r}")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size, strict=False)):
            raise _fail(
                root,
                f"tensor '{fqn}' of size {list(size)} has a chunk at offsets {list(off)} of "
                f"sizes {list(sz)}, outside the tensor",
            )
        if math.prod(sz):
            boxes.append((off, sz))
    _check_disjoint(root, fqn, size, boxes)
    covered = sum(math.prod(s) for _, s in boxes)
    if complete and covered != math.prod(size):
        raise _fail(
            root, f"the chunks of tensor '{fqn}' (size {list(size)}) cover {covered} of its {math.prod(size)} elements"
        )


def _check_disjoint(root: Path, fqn: str, size: tuple, boxes: list) -> None:
    """No two boxes overlap: a sweep along the dim with the most distinct offsets."""
    if len(boxes) < 2:
        return
    dim = max(range(len(size)), key=lambda d: len({b[0][d] for b in boxes})) if size else 0
    if not size:  # 0-d: two non-empty chunks of one element overlap
        raise _fail(root, f"scalar tensor '{fqn}' has {len(boxes)} chunks")
    boxes = sorted(boxes, key=lambda b: b[0][dim])
    active: list = []
    for off, sz in boxes:
        active = [a for a in active if a[0][dim] + a[1][dim] > off[dim]]
        for aoff, asz in active:
            if all(o < ao + asz_ and ao < o + s for o, s, ao, asz_ in zip(off, sz, aoff, asz, strict=False)):
                raise _fail(
                    root,
                    f"tensor '{fqn}': chunks at offsets {list(aoff)} (sizes {list(asz)}) and "
                    f"{list(off)} (sizes {list(sz)}) overlap",
                )
        active.append((off, sz))


def _record_bytes_needed(md: TensorStorageMetadata, sizes: tuple, info: Any) -> int:
    """Bytes a record must hold for a chunk of ``sizes`` of ``md`` (check 4 of :func:`check_storage`)."""
    numel = math.prod(sizes)
    if isinstance(info, ForeignLocation) and info.component is None:
        return (numel + 1) // 2  # high-precision values decoded from >= 4-bit codes
    return numel * md.properties.dtype.itemsize


def _check_record_sizes(metadata: Metadata, root: Path) -> None:
    """Check 4 of :func:`check_storage`."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    located = {(k.fqn, k.offset): v for k, v in storage.items() if type(k) is MetadataIndex}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        itemsize = md.properties.dtype.itemsize
        for c in md.chunks:
            info = located.get((fqn, _key(c.offsets)))
            if info is None:
                info = storage.get(MetadataIndex(fqn, c.offsets))  # a key of another spelling
            length = getattr(info, "length", None)
            if length is None:
                continue
            if type(info) is not ForeignLocation:
                need = itemsize
                for s in c.sizes:
                    need *= s
            else:
                need = _record_bytes_needed(md, tuple(c.sizes), info)
            if int(length) < need:
                need = _record_bytes_needed(md, tuple(c.sizes), info)
                raise _fail(
                    root,
                    f"tensor '{fqn}' ({str(md.properties.dtype).removeprefix('torch.')} "
                    f"{list(md.size)}): its chunk at offsets {list(c.offsets)} of sizes "
                    f"{list(c.sizes)} needs at least {need} bytes, but its record in "
                    f"'{info.relative_path}' has {int(length)}",
                )

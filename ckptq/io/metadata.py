"""The DCP ``.metadata`` of a checkpoint, checked against itself and its files before anything trusts it.

:class:`~ckptq.io.SafeFileSystemReader` reads the file and unpickles it through the allow-list
(:mod:`ckptq.io.safe_pickle`; :func:`check_pickle_memo` first refuses a pickle whose memo would
allocate gigabytes), then :func:`validate_metadata` makes the checks of :func:`check_storage`
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
    check_digest,
    fold_entries,
    mark_verified,
    merge_sidecar_checksums,
    sidecar_ranks,
)
from ..errors import CheckpointFormatError, CkptqError, UnsafeCheckpointError
from .foreign import ForeignLocation, virtualize

__all__ = [
    "METADATA_FILE",
    "check_pickle_memo",
    "validate_metadata",
    "check_storage",
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
    then :func:`ckptq.contract.check_digest` (edits that passed all of these), and reads the
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
    if sidecar_ranks(metadata.planner_data) is not None:  # checksums in per-rank files: read them in
        records = [checksum_key(k) for k, v in metadata.storage_data.items() if not isinstance(v, ForeignLocation)]
        planner_data = merge_sidecar_checksums(metadata.planner_data, root, records)
        metadata = dataclasses.replace(metadata, planner_data=planner_data)
    mark_verified(metadata)
    return metadata, entries


def _pickle_arg_lengths() -> dict[int, int]:
    import pickletools

    return {ord(op.code): 0 if op.arg is None else op.arg.n for op in pickletools.opcodes}


_PICKLE_ARGS = _pickle_arg_lengths()


def check_pickle_memo(data: bytes, source: str) -> None:
    """Refuse a pickle whose memo indices exceed its length before the C unpickler sees it.

    The C unpickler grows its memo array to twice a ``LONG_BINPUT``/``PUT`` index and zero-fills
    it: one flipped byte in ``.metadata`` can ask for gigabytes (a hang, then an allocation
    failure). A real pickle stores at most one memo entry per opcode, so an index >= its length
    is corrupt. Walks the opcodes without building anything; stops at the first unknown opcode
    or STOP (the unpickler then reports what it finds).
    """
    n, i, args = len(data), 0, _PICKLE_ARGS
    frm = int.from_bytes
    while i < n:
        code = data[i]
        i += 1
        k = args.get(code)
        if k is None or code == 0x2E:  # unknown opcode, or STOP
            return
        if k >= 0:
            if code == 0x72 and frm(data[i : i + 4], "little") >= n:  # LONG_BINPUT
                raise CheckpointFormatError(
                    f"{source}: the DCP metadata file is corrupt (a pickle memo index "
                    f"{frm(data[i : i + 4], 'little')} in a {n}-byte file); restore the file or re-save the checkpoint"
                )
            i += k
        elif k == -1:  # up to a newline; GLOBAL and INST take two lines
            end = data.find(b"\n", i)
            if end < 0:
                return
            if code == 0x70:  # PUT
                try:
                    idx = int(data[i:end])
                except ValueError:
                    return
                if idx >= n:
                    raise CheckpointFormatError(
                        f"{source}: the DCP metadata file is corrupt (a pickle memo index {idx} in a "
                        f"{n}-byte file); restore the file or re-save the checkpoint"
                    )
            if code in (0x63, 0x69):
                end = data.find(b"\n", end + 1)
                if end < 0:
                    return
            i = end + 1
        elif k == -2:  # one length byte
            i += 1 + (data[i] if i < n else 0)
        elif k in (-3, -4):  # four length bytes
            length = frm(data[i : i + 4], "little", signed=(k == -3))
            if length < 0:
                return
            i += 4 + length
        elif k == -5:  # eight length bytes
            i += 8 + frm(data[i : i + 8], "little")
        else:
            return


def _check_locations_inside(metadata: Metadata, root: Any, source: str) -> None:
    """Refuse storage locations that are absolute or leave the checkpoint directory ('..')."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        rel = str(rel)
        parts = Path(rel).parts
        if os.path.isabs(rel) or ".." in parts or "\\" in rel:
            raise UnsafeCheckpointError(
                f"{source}: the metadata points '{getattr(index, 'fqn', '?')}' at '{rel}', outside "
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
    root = Path(path)
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
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise _fail(root, f"entry name {fqn!r} is not a string")
        if isinstance(md, TensorStorageMetadata):
            _check_chunks(root, fqn, md, complete)
        elif not isinstance(md, BytesStorageMetadata):
            raise _fail(root, f"entry '{fqn}' is described by a {type(md).__name__}")
    with_path = [hasattr(v, "relative_path") for v in storage.values()]
    if not any(with_path):
        return  # another storage layer: its reader checks its own locations
    if not all(with_path):
        raise _fail(root, "some storage locations have no file")
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
    ranges: dict[str, list] = {}
    chunk_keys = {
        (fqn, tuple(c.offsets)) for fqn, md in sdm.items() if isinstance(md, TensorStorageMetadata) for c in md.chunks
    }
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str):
            raise _fail(root, f"storage key {index!r} is not a MetadataIndex")
        if index.offset is None:
            known = isinstance(sdm.get(fqn), BytesStorageMetadata)
        else:
            known = (fqn, tuple(index.offset)) in chunk_keys
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
        if not files:
            continue
        end, fqn = max((s[1], s[2]) for s in spans)
        target = root / rel
        if not target.is_file():
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' (holding '{fqn}') is missing; copy the whole checkpoint directory"
            )
        size = target.stat().st_size
        if size < end:
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' is truncated: {size} bytes, but the metadata places "
                f"'{fqn}' up to byte {end}; restore the file or re-save the checkpoint"
            )


def _check_fields(metadata: Metadata) -> None:
    """Every DCP dataclass in ``metadata`` has all its fields (a damaged pickle can rename one)."""
    seen: list = [metadata]
    sdm = getattr(metadata, "state_dict_metadata", None)
    if isinstance(sdm, Mapping):
        for md in sdm.values():
            seen.append(md)
            seen.append(getattr(md, "properties", None))
            chunks = getattr(md, "chunks", None)
            if isinstance(chunks, (list, tuple)):
                seen.extend(chunks)
    storage = getattr(metadata, "storage_data", None)
    if isinstance(storage, Mapping):
        for index, info in storage.items():
            seen += [index, info]
    for obj in seen:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            missing = [f.name for f in dataclasses.fields(obj) if not hasattr(obj, f.name)]
            if missing:
                raise CheckpointFormatError(
                    f"the DCP metadata holds a {type(obj).__name__} without {missing}; the file is "
                    f"corrupt: restore it or re-save the checkpoint"
                )


def _shares_record(a: Any, b: Any) -> bool:
    """Virtual chunks of one foreign record (components of one saved shard) share its bytes."""
    return isinstance(a, ForeignLocation) and isinstance(b, ForeignLocation)


def _check_chunks(root: Path, fqn: str, md: TensorStorageMetadata, complete: bool) -> None:
    """Check 2 of :func:`check_storage` for one tensor entry."""
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
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        for c in md.chunks:
            info = storage.get(MetadataIndex(fqn, c.offsets))
            if info is None or not hasattr(info, "length"):
                continue
            need = _record_bytes_needed(md, tuple(c.sizes), info)
            if int(info.length) < need:
                raise _fail(
                    root,
                    f"tensor '{fqn}' ({str(md.properties.dtype).removeprefix('torch.')} "
                    f"{list(md.size)}): its chunk at offsets {list(c.offsets)} of sizes "
                    f"{list(c.sizes)} needs at least {need} bytes, but its record in "
                    f"'{info.relative_path}' has {int(info.length)}",
                )

"""Checkpoints written by other libraries' DCP integrations, read as ckptq checkpoints.

A TransformerEngine DCP checkpoint stores each quantized parameter shard as one pickled TE tensor
per ``.distcp`` record (``torch.save`` of the tensor object: raw buffers + quantizer, rebuilt by
TE's module-level reconstructors), under the tensor's FQN with the logical size and the *fake*
high-precision dtype in ``.metadata``. Such records cannot be read without TE, and the metadata
alone misreports them as bf16.

:func:`virtualize` rewrites such metadata (in memory) into the ckptq contract: each foreign tensor
becomes the native component entries of its canonical format (``w.data``, ``w.scale``, ...) with
one chunk per saved shard and a descriptor carrying its producer, so inspect, reshard/convert, the
load planner and ``CheckpointView`` treat it like a tensor ckptq saved. A tensor whose shards'
block grids do not line up with the global grid (padding inside the global tensor) becomes a
high-precision float32 entry instead, each shard dequantized with its own scales (the exact
values), and says so in its descriptor's note (:data:`ckptq.contract.DESCRIPTOR_NOTE`).
:func:`read_foreign_items` serves the read items of those virtual entries from the records;
:func:`load_record` is the restricted unpickler (torch's ``weights_only`` unpickler plus the
adapters' declared globals, mapped to ckptq stand-ins; nothing else is resolved).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import adapters, chunks
from ..contract import (
    CKPTQ_KEY,
    RECORD_FOREIGN,
    component_fqn,
    has_record,
    high_precision_descriptor,
    make_record,
    native_descriptor,
    read_record,
    saved_world_size,
)
from ..errors import CheckpointFormatError, CkptqError, InconsistentScaleError, ShardingError, UnsafeCheckpointError
from .device import prefetch
from .read_buffers import empty_for_read
from .record_check import Window, check_record_header

__all__ = ["ForeignLocation", "load_record", "virtualize", "read_foreign_items", "shard_canonical"]

#: Bytes read from the start of a record to look for a producer's module names (torch.save writes
#: the pickle, ``archive/data.pkl``, first).
_PEEK = 1 << 16


@dataclasses.dataclass
class _ShardExpectation:
    """What every shard record of one foreign tensor must agree on."""

    fqn: str
    format: str | None
    recipe: Any
    per_tensor: dict  # component name -> bytes of the first shard's value
    problem: str | None = None  # set: high-precision values (why)


@dataclasses.dataclass
class ForeignLocation:
    """Storage location of a virtual chunk: the foreign record of one saved shard.

    ``relative_path``/``offset``/``length`` are those of the record (as DCP's ``_StorageInfo``), so
    storage checks see the real file; ``component`` is the canonical component this chunk is
    (None: the shard's high-precision values); ``box`` is the shard's logical box.
    """

    relative_path: str
    offset: int
    length: int
    component: str | None
    box: chunks.Box
    expect: _ShardExpectation
    transform_descriptors: Any = None


def _versions() -> str:
    return "; ".join(f"{a.producer}: {a.pickle_versions}" for a in adapters.registered() if a.pickle_versions)


def load_record(blob: bytes | Any, *, source: str) -> Any:
    """Unpickle one DCP data record (a ``torch.save`` archive: its bytes, or a seekable file of
    them such as :func:`_open_record`'s window, from which torch reads the storages in place)
    without running its code.

    torch's ``weights_only`` unpickler resolves torch's own tensor types; the foreign globals the
    registered adapters declare resolve to ckptq stand-ins (TE's reconstructors build a payload
    record, its quantizers a plain state holder, its ``DType`` an int). Anything else is refused.

    Raises:
        UnsafeCheckpointError: the record references a global nobody declared (named).
        CheckpointFormatError: the record is truncated or corrupt.
    """
    stream = io.BytesIO(blob) if isinstance(blob, (bytes, bytearray, memoryview)) else blob
    check_record_header(stream, source)  # the pickle's CRC-32: a flipped flag is an error
    globs = [(obj, f"{m}.{n}") for (m, n), obj in adapters.pickle_globals().items()]
    try:
        with _only_ours(globs):
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"global '{found.group(1)}' is not one ckptq maps" if found else str(e).strip().splitlines()[-1]
        raise UnsafeCheckpointError(
            f"{source}: refusing to unpickle this record: {what}. Nothing from it was run. ckptq "
            f"maps only torch's tensor types and the pickles of {_versions()}."
        ) from None
    except Exception as e:  # zip / EOF / shape errors of a damaged record
        raise CheckpointFormatError(f"{source}: the record is truncated or corrupt ({type(e).__name__}: {e})") from None


#: Storages of at most this many bytes are read when :func:`virtualize` looks at a tensor's first
#: record (per-tensor scales and amaxes, small shards); larger ones (the data and block scales)
#: stay unread until the tensor itself is read.
_SKELETON_BYTES = 1 << 16


def _load_skeleton(root: Path | str, info: Any, source: str, *, whole: bool = False) -> Any:
    """The record at ``info`` unpickled as :func:`load_record` does (the pickle's CRC-32 checked, the
    same restricted globals), but with its storages on the ``meta`` device (torch then records each
    storage's offset in the record), then every storage of at most :data:`_SKELETON_BYTES`
    (``whole``: every storage) read from the file into new CPU tensors, all at once
    (:meth:`~ckptq.io.record_check.Window.read_many`: in pieces on the shared read threads), and the
    tensors replaced by views of them. Without ``whole``: what a producer's adapter needs to learn
    the tensor's format, recipe and per-tensor values, without reading its payload; with it: the
    whole record, read faster than ``torch.load``, which reads one storage after another (tensors
    the walk does not reach stay on ``meta``: :func:`_has_meta` tells). Local files only.

    Raises:
        UnsafeCheckpointError / CheckpointFormatError: as :func:`load_record`; OSError.
    """
    limit = None if whole else _SKELETON_BYTES
    with _open_record(root, info) as rec_file:
        check_record_header(rec_file, source)
        globs = [(obj, f"{m}.{n}") for (m, n), obj in adapters.pickle_globals().items()]
        try:
            with _only_ours(globs):
                payload = torch.load(rec_file, map_location="meta", weights_only=True)
        except pickle.UnpicklingError:
            return load_record(rec_file, source=source)  # names the refused global
        found = []  # (holder, attribute, meta tensor, its storage's offset in the record)
        for obj, name, v in _meta_tensors(payload):
            st = v.untyped_storage()
            at = getattr(st, "_checkpoint_offset", None)
            if at is not None and (limit is None or st.nbytes() <= limit):
                found.append((obj, name, v, int(at)))
        storages: dict[int, torch.Tensor] = {}
        for _, _, v, at in sorted(found, key=lambda f: f[3]):  # in file order
            nbytes = v.untyped_storage().nbytes()
            if at < 0 or at + nbytes > rec_file.size:  # checked before anything is allocated from it
                raise CheckpointFormatError(f"{source}: the record is truncated or corrupt (a storage ends past it)")
            if at not in storages:
                storages[at] = empty_for_read((nbytes,), torch.uint8)
        got = rec_file.read_many([(buf.numpy(), at) for at, buf in storages.items()])
        if any(n != buf.numel() for buf, n in zip(storages.values(), got, strict=True)):
            raise CheckpointFormatError(f"{source}: the record is truncated or corrupt (a storage ends past it)")
        for obj, name, v, at in found:
            setattr(obj, name, storages[at].view(v.dtype).as_strided(v.shape, v.stride(), v.storage_offset()))
        return payload


def _load_whole(root: Path | str, info: Any, source: str) -> Any:
    """The record at ``info``, every storage read: for a local file all storages at once
    (:func:`_load_skeleton` with ``whole``), else (an object store's record, or a payload whose
    tensors that walk does not reach) by :func:`load_record`. Raises as :func:`load_record`."""
    from .storage import is_url

    if not is_url(root):
        payload = _load_skeleton(root, info, source, whole=True)
        if not _has_meta(payload):
            return payload
    with _open_record(root, info) as rec_file:
        return load_record(rec_file, source=source)


@contextlib.contextmanager
def _only_ours(globs: list):
    """``torch.serialization.safe_globals(globs)``, with any safe global registered elsewhere under one
    of the same names (e.g. by the foreign library itself, when it is imported) set aside meanwhile,
    so that a name always resolves to ckptq's stand-in, whatever is installed."""
    with _GLOBALS_LOCK:  # torch's safe globals are one process-wide list: one user at a time
        yield from _swap_globals(globs)


#: Held while :func:`_only_ours` has swapped torch's safe globals (a record may be unpickled on a
#: read-ahead thread while the caller's thread unpickles another).
_GLOBALS_LOCK = threading.RLock()


def _swap_globals(globs: list):
    ser = torch.serialization
    ours = {name for _, name in globs}

    def name_of(g) -> str:
        return g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"

    saved = ser.get_safe_globals()
    ser.clear_safe_globals()
    ser.add_safe_globals([g for g in saved if name_of(g) not in ours] + globs)
    try:
        yield
    finally:
        ser.clear_safe_globals()
        ser.add_safe_globals(saved)


def _is_span(info: Any) -> bool:
    """A storage location of int offset and length, both >= 0."""
    off, length = getattr(info, "offset", None), getattr(info, "length", None)
    return type(off) is int and type(length) is int and off >= 0 and length >= 0


def _read_bytes(root: Path, info: Any, length: int | None = None) -> bytes:
    """The bytes of a record (its first ``length`` bytes), never reading past its file's end (one
    ranged read: :func:`ckptq.io.storage.read_range`): a location beyond the file is a
    CheckpointFormatError, not an allocation of its claimed length."""
    from .storage import join, read_range

    start, want = int(info.offset), int(info.length)
    n = want if length is None else min(length, want)
    path = join(root, str(info.relative_path))
    data = read_range(path, start, start + n).getvalue() if start >= 0 and n >= 0 else b""
    if start < 0 or want < 0 or len(data) < n:
        raise CheckpointFormatError(
            f"{root}: record '{info.relative_path}' bytes {start}..{start + want} lies beyond the end of "
            f"the file; the file is truncated or the metadata corrupt: restore them or re-save"
        )
    return data


@contextlib.contextmanager
def _open_record(root: Path | str, info: Any):
    """The record at ``info`` as what :func:`load_record` reads: for a local data file a seekable
    :class:`~ckptq.io.record_check.Window` of it (read with ``preadv`` straight into the reader's
    buffers), for an object store's its bytes (one ranged GET: :func:`_read_bytes`); either way
    after checking that it lies inside the file (a location beyond it is a CheckpointFormatError,
    not an allocation)."""
    from .storage import is_url

    if is_url(root):
        yield _read_bytes(root, info)
        return
    path = Path(root) / str(info.relative_path)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        start, want = int(info.offset), int(info.length)
        if start < 0 or want < 0 or start + want > size:
            raise CheckpointFormatError(
                f"{root}: record '{info.relative_path}' bytes {start}..{start + want} lies beyond the "
                f"file's {size} bytes; the file is truncated or the metadata corrupt: restore them or re-save"
            )
        with contextlib.suppress(OSError, AttributeError):  # read once, in order
            os.posix_fadvise(f.fileno(), start, want, os.POSIX_FADV_SEQUENTIAL)
        yield Window(f, start, want)


def _meta_tensors(obj: Any, depth: int = 0) -> list[tuple[Any, str, torch.Tensor]]:
    """``(holder, attribute, tensor)`` of every ``meta`` tensor of a skeleton payload
    (:func:`_load_skeleton`): attributes of its objects, three levels deep (where the adapters'
    payload records keep their buffers)."""
    found = []
    for name, v in list(vars(obj).items()) if hasattr(obj, "__dict__") and depth < 3 else ():
        if isinstance(v, torch.Tensor):
            if v.device.type == "meta":
                found.append((obj, name, v))
        elif not isinstance(v, type):
            found += _meta_tensors(v, depth + 1)
    return found


def _has_meta(obj: Any) -> bool:
    """Whether a skeleton payload (:func:`_load_skeleton`) still holds unread (``meta``) tensors."""
    return bool(_meta_tensors(obj))


def _per_tensor(qt) -> dict:
    return {
        s.name: qt._components[s.name].reshape(-1).view(torch.uint8).tolist()
        for s in qt.specs
        if s.is_per_tensor(qt.ndim)
    }


def _component_keys(descriptors: Mapping) -> set:
    """The entries the ckptq record's native descriptors name as their components: ckptq wrote
    them as plain tensors, so their records need no look for a foreign producer
    (:func:`ckptq.contract.fold_entries` checks the descriptors themselves)."""
    keys = set()
    for desc in descriptors.values():
        comps = desc.get("components") if isinstance(desc, Mapping) and desc.get("mode") == "native" else None
        if isinstance(comps, Mapping):
            keys.update(c["fqn"] for c in comps.values() if isinstance(c, Mapping) and isinstance(c.get("fqn"), str))
    return keys


def virtualize(metadata: Metadata, root: Path) -> Metadata:
    """``metadata`` with every foreign tensor entry presented through the ckptq contract (a copy;
    ``metadata`` itself is returned unchanged when it has none).

    Looks at the first record of each plain tensor entry whose first bytes name a registered
    producer's module (one record per tensor; the others are checked when they are read): its
    pickle and small storages only (:func:`_load_skeleton`: per-tensor values, never the data or
    block scales, which are read once, when the tensor is), unless the adapter needs more of it.

    Raises:
        UnsafeCheckpointError / CheckpointFormatError: from :func:`load_record`; a component key
            that collides with an existing entry.
    """
    from .storage import is_url

    markers = tuple(m for a in adapters.registered() for m in a.pickle_markers)
    storage = metadata.storage_data
    if not markers or not isinstance(storage, Mapping):
        return metadata
    record = read_record(metadata.planner_data)
    sdm = dict(metadata.state_dict_metadata)
    new_storage = dict(storage)
    descriptors = dict(record["tensors"])
    found = 0
    claimed = _component_keys(record["tensors"])

    def first_records():
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) or fqn in record["tensors"] or fqn in claimed or not md.chunks:
                continue
            info = storage.get(MetadataIndex(fqn, md.chunks[0].offsets))
            if info is not None and hasattr(info, "relative_path"):
                yield fqn, md, info

    heads: dict[str, bytes] = {}
    if is_url(root):  # the first bytes of every candidate at once: records next to each other share a GET
        from .storage import read_ranges

        cands = [(fqn, info) for fqn, _, info in first_records() if _is_span(info)]
        spans = [(str(i.relative_path), int(i.offset), int(i.offset) + min(_PEEK, int(i.length))) for _, i in cands]
        heads = {fqn: h for (fqn, _), h in zip(cands, read_ranges(str(root), spans), strict=True) if h is not None}

    def load_first(item) -> Any:
        """The unpickled first record of a tensor whose first bytes name a producer, else None."""
        fqn, _, info = item
        try:
            head = heads.pop(fqn, None)
            if head is None:
                head = _read_bytes(root, info, _PEEK)
        except (OSError, CheckpointFormatError):
            return None  # a missing or short data file: the storage check names it
        if not any(m in head for m in markers):
            return None
        if not is_url(root):  # its format, recipe and per-tensor values; the payload is read once, later
            return _load_skeleton(root, info, f"{root}: '{fqn}'")
        with _open_record(root, info) as rec_file:
            return load_record(rec_file, source=f"{root}: '{fqn}'")

    def canonical(fqn: str, info: Any, payload: Any, boxes: list) -> tuple:
        """``(payload, canonical tensor, producer)`` of a first record (raising CkptqError when it is not
        storable canonically): from the skeleton, else (any step needs the unread payload's values) from
        the whole record."""
        adapter = adapters.adapter_for(payload)
        skeleton = _has_meta(payload)
        try:
            qt0, producer = adapter.to_canonical(payload, fqn)
            if skeleton:  # what is asked of it below
                _per_tensor(qt0.columnwise_on_grid(tuple(metadata.state_dict_metadata[fqn].size), boxes))
            return payload, qt0, producer
        except Exception:  # noqa: BLE001 - whatever the skeleton could not answer, the whole record does
            if not skeleton:
                raise
        payload = _load_whole(root, info, f"{root}: '{fqn}'")
        return (payload, *adapter.to_canonical(payload, fqn))

    # the next record is read and unpickled on a thread while this one is converted and checked (an
    # error below leaves the generator to the garbage collector, whose close() stops that thread)
    for (fqn, md, info), payload in prefetch(first_records(), load_first, device=torch.device("cpu"), depth=2):
        if payload is None:
            continue
        adapter = adapters.adapter_for(payload)
        if adapter is None:
            continue  # a plain tensor after all
        found += 1
        shape = tuple(md.size)
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        infos = [storage[MetadataIndex(fqn, c.offsets)] for c in md.chunks]
        for c in md.chunks:
            del new_storage[MetadataIndex(fqn, c.offsets)]
        try:
            payload, qt0, producer = canonical(fqn, info, payload, boxes)
        except CkptqError as e:  # not storable canonically: its reads raise this
            expect = _ShardExpectation(fqn, None, None, {}, problem=str(e))
            sdm[fqn] = TensorStorageMetadata(TensorProperties(torch.float32), md.size, md.chunks)
            for box, inf in zip(boxes, infos, strict=False):
                new_storage[MetadataIndex(fqn, torch.Size(box[0]))] = ForeignLocation(
                    inf.relative_path, inf.offset, inf.length, None, box, expect
                )
            continue
        if qt0.dtype != md.properties.dtype:
            raise CheckpointFormatError(
                f"{root}: '{fqn}': the metadata gives it dtype {md.properties.dtype}, but its first record "
                f"holds a {producer.get('class', 'foreign') if isinstance(producer, dict) else 'foreign'} "
                f"tensor of dtype {qt0.dtype}; the metadata and data disagree: restore them or re-save"
            )
        qt0 = qt0.columnwise_on_grid(shape, boxes)  # shards' own columnwise blocks: not presented (derived on load)
        specs = type(qt0).component_specs(shape, qt0.recipe)
        expect = _ShardExpectation(fqn, qt0.FORMAT, qt0.recipe, _per_tensor(qt0))
        try:
            for box in boxes:
                chunks.check_aligned(specs, shape, box, fqn=fqn, fmt=qt0.FORMAT)
        except ShardingError as e:
            expect.problem = (
                f"its saved shards were quantized on block grids that do not line up with the global "
                f"tensor's ({e}); it is read as high-precision float32 values, each shard dequantized "
                f"with its own scales (exact). Keep it so (convert --to float32, or --misaligned "
                f"high-precision), or requantize it (convert --to <format>)"
            )
        desc = native_descriptor(qt0, fqn, shape, producer)
        if expect.problem is not None:
            descriptors[fqn] = high_precision_descriptor(desc, torch.float32, note=expect.problem)
            sdm[fqn] = TensorStorageMetadata(TensorProperties(torch.float32), md.size, md.chunks)
            for box, inf in zip(boxes, infos, strict=False):
                new_storage[MetadataIndex(fqn, torch.Size(box[0]))] = ForeignLocation(
                    inf.relative_path, inf.offset, inf.length, None, box, expect
                )
            continue
        del sdm[fqn]
        descriptors[fqn] = desc
        for spec in specs:
            key = component_fqn(fqn, spec.name)
            if key in metadata.state_dict_metadata:
                raise CheckpointFormatError(
                    f"{root}: foreign tensor '{fqn}' would present its component '{spec.name}' as "
                    f"'{key}', which is already an entry of the checkpoint"
                )
            cmd = TensorStorageMetadata(TensorProperties(spec.dtype), torch.Size(spec.shape(shape)), [])
            for box, inf in zip(boxes, infos, strict=False):
                cbox = chunks.component_box(spec, shape, box, fqn=fqn, fmt=qt0.FORMAT)
                index = MetadataIndex(key, torch.Size(cbox[0]))
                if index in new_storage:
                    continue  # a per-tensor value: one chunk (every shard's is checked on read)
                cmd.chunks.append(ChunkStorageMetadata(torch.Size(cbox[0]), torch.Size(cbox[1])))
                new_storage[index] = ForeignLocation(inf.relative_path, inf.offset, inf.length, spec.name, box, expect)
            sdm[key] = cmd
    if not found:
        return metadata
    planner_data = dict(metadata.planner_data or {}) if isinstance(metadata.planner_data, Mapping) else {}
    world_size = record.get("world_size") or saved_world_size(metadata)[0] or 1
    extra = {k: v for k, v in record.items() if k not in ("version", "world_size", "tensors")}
    if not has_record(metadata.planner_data):
        extra[RECORD_FOREIGN] = True  # no ckptq wrote this checkpoint
    planner_data[CKPTQ_KEY] = make_record(descriptors, world_size, **extra)
    return dataclasses.replace(metadata, state_dict_metadata=sdm, storage_data=new_storage, planner_data=planner_data)


def read_foreign_items(root: Path, storage: Mapping, items: list, planner: Any) -> None:
    """Serve DCP read items of virtual entries (see :func:`virtualize`) from their records: each
    record is loaded once, converted to canonical form by its adapter, checked against the
    tensor's first shard (format, recipe, per-tensor values), then each item's chunk is copied
    into ``planner.resolve_tensor(item)`` and committed.

    Raises:
        CheckpointFormatError / InconsistentScaleError / CkptqError: as described above; the
            tensor's ``problem`` for a tensor that cannot be read canonically.
    """
    by_record: dict[tuple[str, int], list] = {}
    for it in items:
        loc = storage[it.storage_index]
        by_record.setdefault((str(loc.relative_path), int(loc.offset)), []).append((it, loc))
    for (rel, off), group in by_record.items():
        loc0 = group[0][1]
        qt = shard_canonical(root, loc0)
        where = f"{root}: '{loc0.expect.fqn}' (shard at {list(loc0.box[0])}, {rel} byte {off})"
        values = None
        for it, loc in group:
            if loc.component is None:
                if values is None:
                    values = qt.dequantize(torch.float32)
                src = values
            else:
                src = qt._components[loc.component]
            src = narrow_tensor_by_index(src, it.storage_offsets, it.lengths)
            target = planner.resolve_tensor(it).detach()
            if target.size() != src.size():
                raise CheckpointFormatError(
                    f"{where}: read item of size {tuple(src.size())} for a target of {tuple(target.size())}"
                )
            target.copy_(src)
            planner.commit_tensor(it, target)


def shard_canonical(root: Path | str, loc0: ForeignLocation) -> Any:
    """The canonical ckptq tensor of the saved shard whose record ``loc0`` locates: loaded once,
    converted by its adapter, checked against the tensor's first shard (format, recipe, shape,
    per-tensor values).

    Raises:
        CheckpointFormatError / InconsistentScaleError / CkptqError: as :func:`read_foreign_items`.
    """
    exp = loc0.expect
    where = f"{root}: '{exp.fqn}' (shard at {list(loc0.box[0])}, {loc0.relative_path} byte {loc0.offset})"
    if exp.format is None:
        raise CkptqError(exp.problem)
    payload = _load_whole(root, loc0, where)
    adapter = adapters.adapter_for(payload)
    if adapter is None:
        raise CheckpointFormatError(
            f"{where}: holds a {type(payload).__name__}, not a foreign quantized tensor like its first shard"
        )
    qt, _ = adapter.to_canonical(payload, exp.fqn)
    if exp.recipe is not None and qt.recipe != exp.recipe and qt.rowwise_only().recipe == exp.recipe:
        qt = qt.rowwise_only()  # the tensor is presented without its columnwise copy (see virtualize)
    if qt.FORMAT != exp.format or qt.recipe != exp.recipe or tuple(qt.shape) != tuple(loc0.box[1]):
        raise CheckpointFormatError(
            f"{where}: is {qt.FORMAT} {qt.recipe} of shape {tuple(qt.shape)}, but the tensor's "
            f"first shard is {exp.format} {exp.recipe} and the metadata gives this shard "
            f"{tuple(loc0.box[1])}; the shards disagree"
        )
    for name, value in _per_tensor(qt).items() if exp.problem is None else ():
        if value != exp.per_tensor.get(name):
            raise InconsistentScaleError(
                f"{where}: its per-tensor '{name}' differs from the first shard's; the shards were "
                f"quantized with different global values (no amax reduction over the shard "
                f"group), so no single tensor holds them. Read it in high precision per shard "
                f"(convert --to float32) or re-save with amax reduction"
            )
    return qt

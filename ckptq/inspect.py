"""What is in a checkpoint: one row per logical tensor, sizes, formats and optional value stats.

Library only (the CLI in :mod:`ckptq.cli.inspect` renders it). Reads DCP checkpoints (ckptq's,
plain ones, and those other libraries wrote, see :mod:`ckptq.io.foreign`) and every other source
:func:`ckptq.checkpoint.open_checkpoint` opens. Reads no process group, never runs code from the
checkpoint (metadata through :mod:`ckptq.io.safe_pickle`, tensors through ``weights_only`` reads)
and never loads non-tensor entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from . import adapters
from .checkpoint import CheckpointView, open_checkpoint
from .checksums import checksum_key
from .contract import (
    HIGH_PRECISION,
    NATIVE,
    Descriptor,
    Entry,
    has_record,
    read_checksums,
    read_record,
    saved_world_size,
)
from .formats import from_components
from .formats.base import dtype_to_str
from .io.source import CheckpointSource

__all__ = ["inspect_checkpoint"]

#: The ``mode`` of a row that is no ckptq tensor: a plain tensor, or a non-tensor entry (ckptq
#: tensors' rows carry their descriptor's mode, :data:`ckptq.contract.NATIVE` / ``HIGH_PRECISION``).
PLAIN, BYTES = "plain", "bytes"


def inspect_checkpoint(path, *, stats: bool = False, progress: bool = False) -> dict:
    """Describe a DCP ``FileSystemWriter`` checkpoint (ckptq or plain), without a process group.

    One row per *logical* tensor: a natively saved quantized tensor's components
    (``w.data``, ``w.scale``, ``w.amax``, ...) are folded into the row of ``w``.

    Args:
        path: the checkpoint directory (or its ``.metadata`` file).
        stats: also read the data, one logical tensor at a time, and add value statistics.
        progress: show a tqdm progress bar on stderr while reading ``stats``.

    Returns:
        ``{"path": str, "tensors": [row, ...], "summary": {...}}``, in the checkpoint's entry order.
        Every row has:

        - ``fqn``; ``format``: the ckptq format (``nvfp4``, ``mxfp4``, ``mxfp8``, ``fp8_block``, ``fp8_tensor``)
          for quantized tensors, the dtype name (``bfloat16``) for plain tensors, ``bytes`` for
          non-tensor entries;
        - ``mode``: ``native`` / ``high_precision`` (ckptq tensors), ``plain``, or ``bytes``;
        - ``shape`` (logical, list of ints; None for bytes) and ``dtype`` (the logical dtype name:
          the dtype the model had; None for bytes), ``stored_dtype`` (plain and high-precision
          entries, else None);
        - ``bytes``: stored bytes, the sum over components of numel(global size) * element size
          (for bytes entries: the serialized length on disk); ``bits_per_element``:
          ``bytes * 8 / numel`` (None for bytes entries and empty tensors);
        - ``chunks``: number of saved chunks of the entry (of the ``data`` component for native
          tensors); ``recipe`` (ckptq tensors) and ``components`` (native: name ->
          ``{"fqn", "dtype", "shape", "bytes", "chunks"}``), else None;
        - ``producer``: who made a quantized tensor when not ckptq (``"transformer_engine
          MXFP8Tensor"``, from the descriptor), or what a known auxiliary entry of another library
          is (TE's ``._extra_state``), else None; ``note``: why a foreign tensor is stored or read
          in high precision (e.g. shards off the global block grid), else None.
        - with ``stats``: ``stats`` = ``{"min", "max", "nan", "inf"}`` of the values (dequantized
          in fp32 for native tensors; min/max ignore NaN and are None when there is no non-NaN value
          or the dtype has no order), plus for native tensors ``scale_min`` / ``scale_max`` (the
          decoded rowwise scales: FP8 ``scale_inv``, MXFP8 ``2^(e-127)``, NVFP4 E4M3 values) and
          ``scale_nan``, and for NVFP4 ``amax`` (a float, or a list for batched tensors).
          Non-tensor entries get ``stats`` None. Values may be ``inf``/``nan`` floats.

        ``summary``: ``tensors`` (tensor rows), ``objects`` (bytes rows), ``total_bytes`` (stored
        bytes of tensor rows), ``object_bytes``, ``bf16_bytes`` (2 bytes per logical element of
        tensor rows), ``ratio_vs_bf16`` (``total_bytes / bf16_bytes``, None if 0), ``formats``
        (format -> rows), ``world_size`` (ranks that saved: the ckptq record's, else inferred
        from ``__<rank>_*.distcp`` file names, else None), ``world_size_source`` (``"ckptq"``,
        ``"files"`` or None), ``files`` (data files), ``dcp_version``, ``ckptq_version`` (None
        for a checkpoint without a ckptq record), ``checksums`` (``[records with a checksum,
        records]``, None for non-DCP sources).

    Raises:
        CheckpointFormatError: the path is not a readable DCP checkpoint, files are missing or
            truncated, or the ckptq record does not match the stored entries.
        UnsafeCheckpointError: the metadata would run code or points outside the directory.
        UnsupportedFormatError: a ckptq record names a format this ckptq does not know (``stats``).
    """
    view = open_checkpoint(path)
    if isinstance(view, CheckpointView):
        metadata = view.metadata
        entries = view.entries_in_order()  # folded once, as the metadata was read
        stored = _dcp_stored(metadata)
    else:
        metadata, entries = None, {e.fqn: e for e in view.entries()}
        stored = _view_stored(entries)
    rows = [_row_of(e, stored, metadata) for e in entries.values()]
    if stats:
        _add_stats(view, rows, entries, progress)
    summary = _summary(metadata, rows) if metadata is not None else _view_summary(view, rows)
    return {"path": str(view.path), "tensors": rows, "summary": summary}


# ---------------------------------------------------------------------------------------- rows
def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _nbytes(dtype: torch.dtype, size) -> int:
    return _numel(size) * dtype.itemsize


def _row(fqn, fmt, mode, shape, dtype, stored_dtype, nbytes, chunks, recipe=None, components=None) -> dict:
    numel = _numel(shape) if shape is not None else 0
    bpe = nbytes * 8 / numel if shape is not None and numel else None
    return {
        "fqn": fqn,
        "format": fmt,
        "mode": mode,
        "shape": None if shape is None else [int(s) for s in shape],
        "dtype": dtype,
        "stored_dtype": stored_dtype,
        "bytes": int(nbytes),
        "bits_per_element": bpe,
        "chunks": int(chunks),
        "recipe": recipe,
        "components": components,
    }


#: key -> (stored dtype, global size, number of saved chunks) of a tensor entry
Stored = Callable[[str], tuple[torch.dtype, list, int]]


def _dcp_stored(metadata: Metadata) -> Stored:
    sdm = metadata.state_dict_metadata

    def stored(key: str):
        md = sdm[key]
        return md.properties.dtype, [int(s) for s in md.size], len(md.chunks)

    return stored


def _view_stored(entries: Mapping[str, Entry]) -> Stored:
    """What a non-DCP source stores, from its entries' descriptors (one chunk per entry)."""
    table = {}
    for e in entries.values():
        if e.kind == "quantized":
            for name, key in e.keys.items():
                comp = e.descriptor.components[name]
                table[key] = (comp.dtype, list(comp.shape), 1)
        elif e.kind == "tensor":
            table[e.fqn] = (e.dtype, [int(x) for x in e.shape], 1)
    return table.__getitem__


def _row_of(e: Entry, stored: Stored, metadata: Metadata | None) -> dict:
    row = _stored_row(e, stored, metadata)
    producer = e.descriptor.producer if e.descriptor is not None else None
    if isinstance(producer, Mapping):
        parts = (str(producer[k]) for k in ("name", "class", "layout") if producer.get(k))
        row["producer"] = " ".join(dict.fromkeys(parts))  # "modelopt", not "modelopt modelopt" (name = layout)
    else:
        row["producer"] = adapters.describe_entry(e.fqn)
    row["note"] = e.descriptor.note if e.descriptor is not None else None
    return row


def _stored_row(e: Entry, stored: Stored, metadata: Metadata | None) -> dict:
    if e.kind == "bytes":
        storage = metadata.storage_data if metadata is not None and isinstance(metadata.storage_data, Mapping) else {}
        infos = [info for index, info in storage.items() if getattr(index, "fqn", None) == e.fqn]
        nbytes = sum(int(getattr(i, "length", 0)) for i in infos)
        return _row(e.fqn, BYTES, BYTES, None, None, None, nbytes, max(1, len(infos)))
    if e.descriptor is None:  # a plain tensor
        dtype, size, nchunks = stored(e.fqn)
        name = dtype_to_str(dtype)
        return _row(e.fqn, name, PLAIN, list(e.shape), name, name, _nbytes(dtype, size), nchunks)
    desc = e.descriptor
    shape, fmt, recipe = list(desc.shape), desc.format, dict(desc.recipe)
    if e.kind == "tensor":  # high precision
        dtype, size, nchunks = stored(e.fqn)
        return _row(
            e.fqn,
            fmt,
            HIGH_PRECISION,
            shape,
            dtype_to_str(desc.dtype),
            dtype_to_str(dtype),
            _nbytes(dtype, size),
            nchunks,
            recipe,
        )
    components = {}
    for name, key in e.keys.items():
        dtype, size, nchunks = stored(key)
        components[name] = {
            "fqn": key,
            "dtype": dtype_to_str(dtype),
            "shape": size,
            "bytes": _nbytes(dtype, size),
            "chunks": nchunks,
        }
    data = components.get("data") or next(iter(components.values()))
    return _row(
        e.fqn,
        fmt,
        NATIVE,
        shape,
        dtype_to_str(desc.dtype),
        None,
        sum(c["bytes"] for c in components.values()),
        data["chunks"],
        recipe,
        components,
    )


def _view_summary(view: CheckpointSource, rows: list[dict]) -> dict:
    """The summary of a non-DCP source: sizes and formats as for DCP; no world size or DCP version."""
    out = _summary(None, rows)
    out.update(files=len(view.files), source=view.source)
    return out


def _summary(metadata: Metadata | None, rows: list[dict]) -> dict:
    tensor_rows = [r for r in rows if r["mode"] != BYTES]
    total = sum(r["bytes"] for r in tensor_rows)
    bf16 = sum(2 * _numel(r["shape"]) for r in tensor_rows)
    formats: dict[str, int] = {}
    for r in rows:
        formats[r["format"]] = formats.get(r["format"], 0) + 1
    files = set()
    if metadata is not None and isinstance(metadata.storage_data, Mapping):
        files = {str(getattr(i, "relative_path", "")) for i in metadata.storage_data.values()} - {""}
    world_size, source = saved_world_size(metadata) if metadata is not None else (None, None)
    return {
        "tensors": len(tensor_rows),
        "objects": len(rows) - len(tensor_rows),
        "total_bytes": total,
        "object_bytes": sum(r["bytes"] for r in rows if r["mode"] == BYTES),
        "bf16_bytes": bf16,
        "ratio_vs_bf16": total / bf16 if bf16 else None,
        "formats": dict(sorted(formats.items())),
        "world_size": world_size,
        "world_size_source": source,
        "files": len(files),
        "dcp_version": getattr(metadata, "version", None),
        "ckptq_version": (
            read_record(metadata.planner_data)["version"]
            if metadata is not None and has_record(metadata.planner_data)
            else None
        ),
        "checksums": _checksum_count(metadata),
        "source": "dcp" if metadata is not None else None,
    }


def _checksum_count(metadata: Any) -> list | None:
    """``[records with a checksum, records]`` of a DCP checkpoint (None for other sources)."""
    if metadata is None or not isinstance(metadata.storage_data, Mapping):
        return None
    table = read_checksums(metadata.planner_data) or {}
    return [sum(checksum_key(i) in table for i in metadata.storage_data), len(metadata.storage_data)]


# ---------------------------------------------------------------------------------------- data
def _value_stats(x: torch.Tensor) -> dict:
    out: dict[str, Any] = {"min": None, "max": None, "nan": 0, "inf": 0}
    if x.dtype.is_complex:
        out["nan"] = int(torch.isnan(x).sum())
        out["inf"] = int(torch.isinf(x).sum())
        return out
    if x.dtype.is_floating_point:
        x = x.float() if x.itemsize < 4 else x
        nan = torch.isnan(x)
        out["nan"] = int(nan.sum())
        out["inf"] = int(torch.isinf(x).sum())
        x = x[~nan] if out["nan"] else x
    elif x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.numel():
        out["min"], out["max"] = x.min().item(), x.max().item()
    return out


def _quantized_stats(desc: Descriptor, comps: dict[str, torch.Tensor]) -> dict:
    qt = from_components(desc, comps)
    out = _value_stats(qt.dequantize(torch.float32))
    cls = type(qt)
    if cls.SCALE_COMPONENT in comps:
        s = _value_stats(cls.decode_scale(comps[cls.SCALE_COMPONENT]))
        out.update(scale_min=s["min"], scale_max=s["max"], scale_nan=s["nan"])
    if "amax" in comps:
        amax = comps["amax"].float()
        out["amax"] = amax.item() if amax.ndim == 0 else amax.flatten().tolist()
    return out


def _add_stats(view: CheckpointSource, rows: list[dict], entries: Mapping[str, Entry], progress: bool) -> None:
    from tqdm import tqdm

    for row in tqdm(rows, desc="reading", unit="tensor", disable=not progress, leave=False):
        e = entries[row["fqn"]]
        if e.kind == "bytes":
            row["stats"] = None
            view.read_raw_bytes(e.fqn)  # checks the record is intact (never unpickled)
            continue
        value = view.read(e.fqn)
        if e.kind == "quantized":
            row["stats"] = _quantized_stats(e.descriptor, value.components())
        else:
            row["stats"] = _value_stats(value)

"""What is in a DCP checkpoint: one row per logical tensor, sizes, formats and optional value stats.

Library only (the CLI in :mod:`ckptq.cli.inspect` renders it). Reads no process group, never runs
code from the checkpoint (metadata through :mod:`ckptq.io.safe_pickle`, tensors through DCP's
``weights_only`` reads) and never loads non-tensor entries.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .errors import CheckpointFormatError
from .formats.base import dtype_to_str
from .io import SafeFileSystemReader, read_metadata
from .io.reader import load_entries

__all__ = ["inspect_checkpoint"]

PLAIN, NATIVE, HIGH_PRECISION, BYTES = "plain", "native", "high_precision", "bytes"


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

        - ``fqn``; ``format``: the ckptq format (``nvfp4``, ``mxfp8``, ``fp8_block``, ``fp8_tensor``)
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
          ``{"fqn", "dtype", "shape", "bytes", "chunks"}``), else None.
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
        for a checkpoint without a ckptq record).

    Raises:
        CheckpointFormatError: the path is not a readable DCP checkpoint, files are missing or
            truncated, or the ckptq record does not match the stored entries.
        UnsafeCheckpointError: the metadata would run code or points outside the directory.
        UnsupportedFormatError: a ckptq record names a format this ckptq does not know (``stats``).
    """
    from .planners._common import ckptq_planner_data

    root = Path(path)
    metadata = read_metadata(root)
    if root.is_file():
        root = root.parent
    sdm = metadata.state_dict_metadata
    record = ckptq_planner_data(metadata.planner_data)
    has_record = isinstance(metadata.planner_data, Mapping) and "__ckptq__" in metadata.planner_data
    descriptors: Mapping[str, Mapping] = record.get("tensors", {})

    owner: dict[str, str] = {}  # component entry -> logical fqn
    for fqn, desc in descriptors.items():
        _check_descriptor(root, fqn, desc, sdm)
        if desc.get("mode") == NATIVE:
            for comp in desc["components"].values():
                owner[comp["fqn"]] = fqn

    rows: list[dict] = []
    seen: set[str] = set()
    for key, entry in sdm.items():
        fqn = owner.get(key, key)
        if fqn in seen:
            continue
        seen.add(fqn)
        if fqn in descriptors:
            rows.append(_quantized_row(fqn, descriptors[fqn], sdm))
        elif isinstance(entry, TensorStorageMetadata):
            rows.append(_plain_row(fqn, entry))
        else:
            rows.append(_bytes_row(fqn, metadata))

    if stats:
        _add_stats(root, metadata, rows, descriptors, progress)

    return {"path": str(root), "tensors": rows, "summary": _summary(metadata, rows, record, has_record)}


# ---------------------------------------------------------------------------------------- rows
def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _entry_bytes(entry: TensorStorageMetadata) -> int:
    return _numel(entry.size) * entry.properties.dtype.itemsize


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


def _plain_row(fqn: str, entry: TensorStorageMetadata) -> dict:
    name = dtype_to_str(entry.properties.dtype)
    return _row(fqn, name, PLAIN, list(entry.size), name, name, _entry_bytes(entry), len(entry.chunks))


def _bytes_row(fqn: str, metadata: Metadata) -> dict:
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    infos = [info for index, info in storage.items() if getattr(index, "fqn", None) == fqn]
    nbytes = sum(int(getattr(i, "length", 0)) for i in infos)
    return _row(fqn, BYTES, BYTES, None, None, None, nbytes, max(1, len(infos)))


def _quantized_row(fqn: str, desc: Mapping, sdm: Mapping) -> dict:
    shape, fmt, recipe = list(desc["shape"]), desc["format"], dict(desc.get("recipe", {}))
    if desc["mode"] == HIGH_PRECISION:
        entry = sdm[fqn]
        return _row(fqn, fmt, HIGH_PRECISION, shape, desc["dtype"], dtype_to_str(entry.properties.dtype),
                    _entry_bytes(entry), len(entry.chunks), recipe)
    components = {}
    for name, comp in desc["components"].items():
        entry = sdm[comp["fqn"]]
        components[name] = {
            "fqn": comp["fqn"],
            "dtype": dtype_to_str(entry.properties.dtype),
            "shape": [int(s) for s in entry.size],
            "bytes": _entry_bytes(entry),
            "chunks": len(entry.chunks),
        }
    data = components.get("data") or next(iter(components.values()))
    return _row(fqn, fmt, NATIVE, shape, desc["dtype"], None, sum(c["bytes"] for c in components.values()),
                data["chunks"], recipe, components)


def _check_descriptor(root: Path, fqn: str, desc: Any, sdm: Mapping) -> None:
    """The ckptq record of ``fqn`` must be well formed and match the stored entries."""
    where = f"{root}: ckptq tensor '{fqn}'"
    try:
        fmt, mode, shape = desc["format"], desc["mode"], [int(s) for s in desc["shape"]]
        desc["dtype"]
        comps = desc["components"] if mode == NATIVE else {}
        expected = {name: (c["fqn"], c["dtype"], [int(s) for s in c["shape"]]) for name, c in comps.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointFormatError(f"{where}: malformed descriptor {desc!r} ({type(e).__name__}: {e})") from e
    if mode == HIGH_PRECISION:
        entry = sdm.get(fqn)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointFormatError(
                f"{where} ({fmt}, high_precision) has no tensor entry '{fqn}' in the checkpoint; "
                f"the metadata and data disagree"
            )
        if list(entry.size) != shape:
            raise CheckpointFormatError(
                f"{where} ({fmt}, high_precision): stored shape {list(entry.size)} differs from the "
                f"descriptor's logical shape {shape}"
            )
        return
    if mode != NATIVE:
        raise CheckpointFormatError(f"{where}: unknown mode '{mode}' (expected native or high_precision)")
    if not expected:
        raise CheckpointFormatError(f"{where} ({fmt}, native) lists no components")
    for name, (cfqn, cdtype, cshape) in expected.items():
        entry = sdm.get(cfqn)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointFormatError(
                f"{where} ({fmt}): component '{name}' should be stored as tensor entry '{cfqn}', "
                f"but the checkpoint has no such entry"
            )
        got = (dtype_to_str(entry.properties.dtype), list(entry.size))
        if got != (cdtype, cshape):
            raise CheckpointFormatError(
                f"{where} ({fmt}): component '{name}' ('{cfqn}') is stored as {got[0]} {got[1]}, "
                f"but the descriptor says {cdtype} {cshape}"
            )


def _summary(metadata: Metadata, rows: list[dict], record: Mapping, has_record: bool) -> dict:
    tensor_rows = [r for r in rows if r["mode"] != BYTES]
    total = sum(r["bytes"] for r in tensor_rows)
    bf16 = sum(2 * _numel(r["shape"]) for r in tensor_rows)
    formats: dict[str, int] = {}
    for r in rows:
        formats[r["format"]] = formats.get(r["format"], 0) + 1
    files = set()
    if isinstance(metadata.storage_data, Mapping):
        files = {str(getattr(i, "relative_path", "")) for i in metadata.storage_data.values()} - {""}
    world_size, source = (record.get("world_size"), "ckptq") if has_record else (None, None)
    if world_size is None:
        ranks = [int(m.group(1)) for f in files if (m := re.match(r"__(\d+)_\d+\.distcp$", Path(f).name))]
        world_size, source = (max(ranks) + 1, "files") if ranks else (None, None)
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
        "ckptq_version": record.get("version") if has_record else None,
    }


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


def _scale_decoders() -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    from .formats import numerics

    return {
        "fp8_tensor": ("scale_inv", lambda s: s.float()),
        "fp8_block": ("scale_inv", lambda s: s.float()),
        "mxfp8": ("scale", numerics.e8m0_to_fp32),
        "nvfp4": ("scale", lambda s: s.float()),
    }


def _quantized_stats(desc: Mapping, comps: dict[str, torch.Tensor]) -> dict:
    from . import from_components

    qt = from_components(desc, comps)
    out = _value_stats(qt.dequantize(torch.float32))
    name, decode = _scale_decoders().get(desc["format"], (None, None))
    if name in comps:
        s = _value_stats(decode(comps[name]))
        out.update(scale_min=s["min"], scale_max=s["max"], scale_nan=s["nan"])
    if "amax" in comps:
        amax = comps["amax"].float()
        out["amax"] = amax.item() if amax.ndim == 0 else amax.flatten().tolist()
    return out


def _add_stats(root: Path, metadata: Metadata, rows: list[dict], descriptors: Mapping, progress: bool) -> None:
    from tqdm import tqdm

    reader = SafeFileSystemReader(root, metadata=metadata)
    for row in tqdm(rows, desc="reading", unit="tensor", disable=not progress, leave=False):
        if row["mode"] == BYTES:
            row["stats"] = None
        elif row["mode"] == NATIVE:
            comp_keys = {name: c["fqn"] for name, c in row["components"].items()}
            loaded = load_entries(reader, metadata, list(comp_keys.values()))
            row["stats"] = _quantized_stats(descriptors[row["fqn"]], {n: loaded[k] for n, k in comp_keys.items()})
        else:
            row["stats"] = _value_stats(load_entries(reader, metadata, [row["fqn"]])[row["fqn"]])

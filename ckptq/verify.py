"""Check a checkpoint's integrity (every record against its checksum), or compare two checkpoints of
any layout and mode, logical tensor by logical tensor."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from .checkpoint import open_checkpoint, refuse_data_file
from .contract import read_checksums
from .formats.base import QuantizedTensor
from .io import torchsave
from .io.index import check_index
from .io.reader import SafeFileSystemReader
from .io.safetensors import check_safetensors_records, is_safetensors_source
from .metrics import bit_exact, encoding_of, max_abs_error, sqnr_bound, sqnr_db

__all__ = ["verify_checkpoints", "check_integrity"]


def check_integrity(
    path: str | os.PathLike,
    *,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> dict:
    """Read every record of the DCP checkpoint at ``path`` once and check it (``ckptq verify PATH``).

    Each record must be intact (inside its file, loadable with ``weights_only=True``, of the dtype
    and chunk size the metadata gives) and match the checksum the checkpoint records for it
    (:mod:`ckptq.checksums`). Records are read one at a time, in file order.

    Args:
        path: a DCP checkpoint directory, a safetensors file or folder (``ckptq export`` writes a
            checksum per tensor into each file's ``__metadata__``: :data:`ckptq.checksums.SAFETENSORS_KEY`),
            or a ``torch.save`` file (the CRC-32 of each zip member, which torch writes).
        progress: called with the byte length of each record checked.
        on_total: called once, before the first record, with the bytes to check (DCP checkpoints).

    Returns:
        ``{"problems": [{"fqn", "offsets", "file", "start", "end", "problem"}],
        "summary": {"records", "verified", "unverified", "failed", "bytes", "has_checksums", "ok"}}``
        (``bytes`` is None for safetensors and torch.save sources):
        ``verified`` records matched their checksum, ``unverified`` ones were read intact but have
        none (a checkpoint saved without ckptq's storage writer, by an older ckptq, or records
        another library wrote), ``failed`` ones are listed in ``problems``.

    Raises:
        CheckpointFormatError / UnsafeCheckpointError: the metadata cannot be read (then no record
            can be located).
    """
    refuse_data_file(path)
    if is_safetensors_source(Path(path)) or torchsave.detect(Path(path)):
        check = check_safetensors_records if is_safetensors_source(Path(path)) else torchsave.check_torchsave_records
        problems, verified, unverified = check(path, progress=progress)
        rows = [
            {"fqn": name, "offsets": None, "file": rel, "start": start, "end": end, "problem": problem}
            for name, rel, start, end, problem in problems
        ]
        return _integrity_report(rows, verified, unverified, None, verified > 0)
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    check_index(path, metadata.planner_data, where=str(path), rows=True)  # every row block of a chunk index
    reader.set_up_storage_reader(metadata, True)
    nbytes = sum(int(getattr(i, "length", 0) or 0) for i in metadata.storage_data.values())
    if on_total:
        on_total(nbytes)
    problems, verified, unverified = reader.check_records(progress=progress)
    rows = [
        {
            "fqn": index.fqn,
            "offsets": None if index.offset is None else list(index.offset),
            "file": rel,
            "start": start,
            "end": end,
            "problem": problem,
        }
        for index, rel, start, end, problem in problems
    ]
    return _integrity_report(
        rows,
        verified,
        unverified,
        nbytes,
        read_checksums(metadata.planner_data, where=str(path)) is not None,
    )


def _integrity_report(rows: list, verified: int, unverified: int, nbytes: int | None, has_checksums: bool) -> dict:
    return {
        "problems": rows,
        "summary": {
            "records": verified + unverified + len(rows),
            "verified": verified,
            "unverified": unverified,
            "failed": len(rows),
            "bytes": nbytes,
            "has_checksums": has_checksums,
            "ok": not rows,
        },
    }


def _describe(x) -> str:
    if isinstance(x, QuantizedTensor):
        return x.FORMAT
    return str(x.dtype).removeprefix("torch.")


def _same_representation(a, b) -> bool:
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return a.same_layout(b)
    return not isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor) and a.dtype == b.dtype


def _sqnr(a, b) -> float:
    """SQNR in dB; -inf when the noise swamps the signal (inf noise or a zero signal)."""
    try:
        return sqnr_db(a, b)
    except (ValueError, ZeroDivisionError):  # log10(0): e.g. inf values read from a damaged file
        return -math.inf


def _exact(a, b) -> bool:
    if isinstance(a, QuantizedTensor):
        ca, cb = a.components(), b.components()
        return all(bit_exact(ca[k], cb[k]) for k in ca)
    return bit_exact(a, b)


def _judge(row: dict, same_rep: bool, floating: bool, encodings, quantized, min_sqnr: float | None) -> str:
    """The status of a compared tensor pair (see :func:`verify_checkpoints`); sets its bound."""
    if row["bit_exact"]:
        return "bit_exact"
    if min_sqnr is not None:
        row["bound_db"], row["bound"] = min_sqnr, "--min-sqnr"
    elif same_rep:
        return "mismatch"
    elif not floating:  # different integer (or bool) dtypes: the values must be equal
        return "ok" if row["max_abs_error"] == 0 else "mismatch"
    else:
        bound = sqnr_bound(*encodings, quantized=quantized)
        if bound is None:
            return "no_bound"
        row["bound_db"], row["bound"] = bound
    s = row["sqnr_db"]
    return "ok" if s is not None and not math.isnan(s) and s >= row["bound_db"] else "below_threshold"


def _compare(va, vb, fqn: str, min_sqnr: float | None) -> dict:
    """One row of :func:`verify_checkpoints`."""
    row = {
        "fqn": fqn,
        "a": None,
        "b": None,
        "status": None,
        "bit_exact": None,
        "max_abs_error": None,
        "sqnr_db": None,
        "bound_db": None,
        "bound": None,
    }
    if fqn not in va or fqn not in vb:
        row["status"] = "missing_in_a" if fqn not in va else "missing_in_b"
        return row
    ea, eb = va.entry(fqn), vb.entry(fqn)
    if "bytes" in (ea.kind, eb.kind):
        row["a"], row["b"] = (
            ea.kind if ea.kind == "bytes" else "tensor",
            eb.kind if eb.kind == "bytes" else "tensor",
        )
        same = ea.kind == eb.kind == "bytes" and va.read_raw_bytes(fqn)[0] == vb.read_raw_bytes(fqn)[0]
        row["bit_exact"] = same
        row["status"] = "bit_exact" if same else "mismatch"
        return row
    if tuple(ea.shape) != tuple(eb.shape):
        row["a"], row["b"] = list(ea.shape), list(eb.shape)
        row["status"] = "shape_mismatch"
        return row
    xa, xb = va.read(fqn), vb.read(fqn)
    row["a"], row["b"] = _describe(xa), _describe(xb)
    same_rep = _same_representation(xa, xb)
    row["bit_exact"] = same_rep and _exact(xa, xb)
    encodings = (encoding_of(xa), encoding_of(xb))
    quantized = (isinstance(xa, QuantizedTensor), isinstance(xb, QuantizedTensor))
    ha = xa.dequantize(torch.float32) if quantized[0] else xa
    hb = xb.dequantize(torch.float32) if quantized[1] else xb
    del xa, xb
    floating = ha.is_floating_point() and hb.is_floating_point()
    if floating:
        row["max_abs_error"] = max_abs_error(ha, hb)
        row["sqnr_db"] = math.inf if row["bit_exact"] else _sqnr(ha, hb)
    elif not row["bit_exact"]:
        row["max_abs_error"] = max_abs_error(ha.double(), hb.double())
    row["status"] = _judge(row, same_rep, floating, encodings, quantized, min_sqnr)
    return row


def verify_checkpoints(
    path_a: str | os.PathLike,
    path_b: str | os.PathLike,
    *,
    min_sqnr: float | None = None,
    progress: Callable[[], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> dict:
    """Compare checkpoints ``A`` and ``B`` (any layout, world size and mode), one tensor at a time.

    Per logical tensor: bit-exact (same format and recipe, or same plain dtype: every stored byte
    equal), max abs error and SQNR (dB) of the high-precision values (quantized tensors
    dequantized in fp32). A tensor *fails* when it is missing from one side, its shape differs, or:

    - with ``min_sqnr``: it is not bit-exact and its SQNR is below ``min_sqnr``;
    - without: a same-representation pair is not bit-exact; a pair of different formats, recipes or
      float dtypes has an SQNR below the floor its two encodings allow
      (:func:`ckptq.metrics.sqnr_bound`: e.g. 19 dB for NVFP4 vs its high-precision values, 25 dB for
      two E4M3 encodings), or no floor is known for it (status ``no_bound``: pass ``min_sqnr``);
      a pair of different integer dtypes has values that differ.

    Non-tensor entries must have identical stored records.

    Args:
        progress: called after each tensor compared.
        on_total: called once, before the first, with the number of entries to compare.

    Returns:
        ``{"tensors": [{"fqn", "a", "b", "status", "bit_exact", "max_abs_error", "sqnr_db",
        "bound_db", "bound"}], "summary": {"compared", "bit_exact", "failed", "no_bound", "ok",
        "min_sqnr"}}``; ``bound_db`` / ``bound`` are the SQNR floor a tensor was judged by and its
        reason (``min_sqnr`` / ``"--min-sqnr"`` when given), else None; ``status`` is one of
        ``bit_exact``, ``ok``, ``missing_in_a``, ``missing_in_b``, ``shape_mismatch``, ``mismatch``,
        ``below_threshold``, ``no_bound``.

    Raises:
        CheckpointFormatError / UnsafeCheckpointError: a checkpoint cannot be read.
    """
    va, vb = open_checkpoint(path_a), open_checkpoint(path_b)
    names = sorted({e.fqn for e in va.entries()} | {e.fqn for e in vb.entries()})
    if on_total:
        on_total(len(names))
    rows = []
    for fqn in names:
        rows.append(_compare(va, vb, fqn, min_sqnr))
        if progress:
            progress()
    failed = [r for r in rows if r["status"] not in ("bit_exact", "ok")]
    return {
        "tensors": rows,
        "summary": {
            "compared": len(rows),
            "bit_exact": sum(1 for r in rows if r["status"] == "bit_exact"),
            "failed": len(failed),
            "no_bound": sum(1 for r in rows if r["status"] == "no_bound"),
            "ok": not failed,
            "min_sqnr": min_sqnr,
        },
    }

"""``ckptq inspect PATH``: what is in a checkpoint (see :func:`ckptq.inspect.inspect_checkpoint`)."""

from __future__ import annotations

import typer

from . import _output as out
from ._app import command
from ._options import CheckpointArg, JsonOpt

__all__ = ["inspect"]

_HEADERS = ["FQN", "FORMAT", "MODE", "SHAPE", "DTYPE", "SIZE", "BITS/ELEM", "CHUNKS"]
_STATS_HEADERS = ["MIN", "MAX", "NAN", "INF", "SCALE_MIN", "SCALE_MAX", "AMAX"]


@command(
    "inspect",
    short_help="Show the tensors of a checkpoint: format, shape, size, bits per element.",
    examples=[
        "ckptq inspect ckpt            # a DCP checkpoint folder",
        "ckptq inspect ckpt --stats    # also value ranges, NaN/Inf counts, scale ranges, NVFP4 amax",
        "ckptq inspect hf-folder       # ModelOpt, compressed-tensors, DeepSeek-FP8 safetensors folders",
        "ckptq inspect model.pt --json",
    ],
)
def inspect(
    path: CheckpointArg,
    stats: bool = typer.Option(
        False,
        "--stats",
        help="Also read the data (one tensor at a time) and report min/max, NaN/Inf counts of the "
        "(dequantized) values, decoded scale ranges and NVFP4 amax.",
    ),
    json_output: JsonOpt = False,
) -> None:
    """Show the tensors of a checkpoint: format, logical shape, stored size, bits per element, chunks.

    FORMAT reads e.g. "nvfp4+columnwise" when the tensor also stores its separately quantized
    columnwise copy (TransformerEngine's backward-GEMM copy, kept for a bit-exact resume).
    The summary's "size / bf16" is the stored size of the tensors over the size of the same tensors
    at 2 bytes per element (plain float32 tensors count 4 bytes against 2, so it can exceed 1).
    """
    from ..inspect import inspect_checkpoint

    report = inspect_checkpoint(path, stats=stats, progress=stats and out.progress_enabled())
    if json_output:
        out.echo_json(report)
        return
    _print_table(report, stats)
    _print_summary(report["summary"])


def _row_cells(row: dict, stats: bool) -> list:
    shape = "-" if row["shape"] is None else "(" + ", ".join(str(s) for s in row["shape"]) + ")"
    columnwise = (row.get("recipe") or {}).get("columnwise")  # a stored columnwise copy (TE resumes)
    cells = [
        row["fqn"],
        f"{row['format']}+columnwise" if columnwise else row["format"],
        row["mode"],
        shape,
        row["dtype"] or "-",
        out.format_bytes(row["bytes"]),
        out.format_number(row["bits_per_element"], ".3f"),
        row["chunks"],
    ]
    if stats:
        s = row.get("stats") or {}
        cells += [out.format_number(s.get(k)) for k in ("min", "max", "nan", "inf", "scale_min", "scale_max", "amax")]
    return cells


def _print_table(report: dict, stats: bool) -> None:
    rows = report["tensors"]
    foreign = any(r.get("producer") for r in rows)  # a column only when another library made tensors
    headers = _HEADERS + (["PRODUCER"] if foreign else []) + (_STATS_HEADERS if stats else [])
    cells = []
    for r in rows:
        c = _row_cells(r, stats)
        if foreign:
            c.insert(len(_HEADERS), r.get("producer") or "-")
        cells.append(c)
    out.echo_table(cells, headers, empty="No entries found.")
    for r in rows:
        if r.get("note"):
            out.warning(f"'{r['fqn']}': {r['note']}")


def _print_summary(s: dict) -> None:
    ratio = "-" if s["ratio_vs_bf16"] is None else f"{s['ratio_vs_bf16']:.3f}x"
    world = "-" if s["world_size"] is None else str(s["world_size"])
    if s["world_size_source"] == "files":
        world += " (from file names)"
    lines = [
        [
            "tensors",
            f"{s['tensors']} (+ {s['objects']} non-tensor {'entry' if s['objects'] == 1 else 'entries'}, "
            f"{out.format_bytes(s['object_bytes'])})",
        ],
        ["total size", f"{out.format_bytes(s['total_bytes'])} ({s['total_bytes']} bytes)"],
        ["size / bf16", f"{ratio}: stored tensor bytes / {out.format_bytes(s['bf16_bytes'])} (2 bytes per element)"],
        ["formats", ", ".join(f"{k}: {v}" for k, v in s["formats"].items()) or "-"],
        ["world size", world],
        ["files", str(s["files"])],
        ["ckptq", "-" if s["ckptq_version"] is None else f"contract v{s['ckptq_version']}"],
    ]
    if s.get("checksums") is not None:
        have, records = s["checksums"]
        lines.append(
            [
                "checksums",
                f"crc32c, {have} of {records} records" if have else "none (ckptq verify cannot check the data)",
            ]
        )
    out.echo()
    out.echo_table(lines, ["SUMMARY", ""])

"""``ckptq verify PATH``: check a checkpoint's integrity (:func:`ckptq.verify.check_integrity`);
``ckptq verify A B``: compare two checkpoints tensor by tensor (:func:`ckptq.verify.verify_checkpoints`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import _output as out
from ._app import command
from ._options import JsonOpt

__all__ = ["verify"]


@command("verify")
def verify(
    a: Annotated[
        Path, typer.Argument(help="Checkpoint directory (alone: check its integrity).", metavar="A", show_default=False)
    ],
    b: Annotated[
        Path | None,
        typer.Argument(help="Second checkpoint directory, to compare with A.", metavar="[B]", show_default=False),
    ] = None,
    min_sqnr: Annotated[
        float | None,
        typer.Option("--min-sqnr", help="Fail tensors whose SQNR (dB) of high-precision values is below this."),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """With one checkpoint: read every record and check it against its checksum (exit 1 on any
    failure, with a table of what failed). With two: compare them, any layout and mode (bit-exact,
    max abs error, SQNR; exit 1 on a failure)."""
    from ..verify import verify_checkpoints

    if b is None:
        if min_sqnr is not None:
            out.usage_error("--min-sqnr compares two checkpoints: give A and B")
        _integrity(a, json_output)
        return

    report = verify_checkpoints(a, b, min_sqnr=min_sqnr)
    if json_output:
        out.echo_json(report)
    else:
        rows = [
            [
                r["fqn"],
                r["a"] or "-",
                r["b"] or "-",
                r["status"],
                "-" if r["bit_exact"] is None else ("yes" if r["bit_exact"] else "no"),
                out.format_number(r["max_abs_error"]),
                out.format_number(r["sqnr_db"], ".2f"),
            ]
            for r in report["tensors"]
        ]
        out.echo_table(rows, ["FQN", "A", "B", "STATUS", "BIT_EXACT", "MAX_ABS_ERR", "SQNR_DB"])
        s = report["summary"]
        out.echo()
        out.echo(f"{s['compared']} compared, {s['bit_exact']} bit-exact, {s['failed']} failed")
    if not report["summary"]["ok"]:
        raise typer.Exit(1)


def _integrity(path: Path, json_output: bool) -> None:
    from ..verify import check_integrity

    with out.byte_progress("verify") as advance:
        report = check_integrity(path, progress=advance)
    s = report["summary"]
    if json_output:
        out.echo_json(report)
    else:
        if report["problems"]:
            rows = [
                [
                    p["fqn"] + ("" if p["offsets"] is None else f" @{p['offsets']}"),
                    p["file"],
                    f"{p['start']}..{p['end']}",
                    p["problem"],
                ]
                for p in report["problems"]
            ]
            out.echo_table(rows, ["ENTRY", "FILE", "BYTES", "PROBLEM"])
            out.echo()
        size = "" if s["bytes"] is None else f" ({out.format_bytes(s['bytes'])})"
        out.echo(
            f"{s['records']} records{size}: {s['verified']} verified, "
            f"{s['unverified']} without checksum, {s['failed']} failed"
        )
    if not s["has_checksums"]:
        out.warning(
            f"{path} has no checksums (saved without ckptq's storage writer, by an older ckptq or by "
            f"another library): records were checked for structure only"
        )
    if not s["ok"]:
        raise typer.Exit(1)

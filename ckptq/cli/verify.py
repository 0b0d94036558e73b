"""``ckptq verify PATH``: check a checkpoint's integrity (:func:`ckptq.verify.check_integrity`);
``ckptq verify A B``: compare two checkpoints tensor by tensor (:func:`ckptq.verify.verify_checkpoints`)."""

from __future__ import annotations

from typing import Annotated

import typer

from . import _output as out
from ._app import command
from ._options import JsonOpt

__all__ = ["verify"]


@command(
    "verify",
    short_help="Check a checkpoint's checksums, or compare two checkpoints tensor by tensor.",
    examples=[
        "ckptq verify ckpt                      # integrity: every record against its checksum",
        "ckptq verify ckpt ckpt-tp              # same format: every tensor must be bit-exact",
        "ckptq verify ckpt ckpt-bf16            # nvfp4 vs bf16: judged by the NVFP4 floor (19 dB)",
        "ckptq verify ckpt ckpt-e5m2 --min-sqnr 20   # your own SQNR floor for every tensor",
    ],
)
def verify(
    a: Annotated[
        str,
        typer.Argument(
            help="Checkpoint folder (or safetensors / torch.save file). Alone: check its integrity.",
            metavar="A",
            show_default=False,
        ),
    ],
    b: Annotated[
        str | None,
        typer.Argument(help="Second checkpoint, to compare with A.", metavar="B", show_default=False),
    ] = None,
    min_sqnr: Annotated[
        float | None,
        typer.Option(
            "--min-sqnr",
            metavar="DB",
            help="Judge every tensor that is not bit-exact by this SQNR floor (dB) instead of the default.",
        ),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Check a checkpoint, or compare two.

    With A alone: read every record and check it against its checksum; exit 1 on any failure, with
    a table of what failed.

    With A and B: compare them tensor by tensor, whatever their layouts and modes; exit 1 on a
    failure. A pair of the same format and recipe (or the same dtype) must be bit-exact. A lossy
    pair (two formats, recipes or float dtypes) must reach the SQNR floor its two encodings allow
    (e.g. 19 dB for nvfp4 vs its high-precision values, 30 dB for fp8 E4M3, 25 dB for two E4M3
    encodings, 15 dB for a re-encoding to or from nvfp4; the MIN_SQNR column shows each); a pair
    with no known floor is refused: pass --min-sqnr.
    """
    from ..verify import verify_checkpoints

    if b is None:
        if min_sqnr is not None:
            out.usage_error("--min-sqnr compares two checkpoints: give A and B", "ckptq verify")
        _integrity(a, json_output)
        return

    with out.byte_progress("verify", unit="tensor") as bar:
        report = verify_checkpoints(a, b, min_sqnr=min_sqnr, progress=bar, on_total=bar.set_total)
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
                out.format_number(r["bound_db"], ".1f"),
            ]
            for r in report["tensors"]
        ]
        out.echo_table(rows, ["FQN", "A", "B", "STATUS", "BIT_EXACT", "MAX_ABS_ERR", "SQNR_DB", "MIN_SQNR"])
        s = report["summary"]
        out.echo()
        out.echo(f"{s['compared']} compared, {s['bit_exact']} bit-exact, {s['failed']} failed")
    if report["summary"]["no_bound"]:
        pairs = sorted({f"{r['a']} vs {r['b']}" for r in report["tensors"] if r["status"] == "no_bound"})
        out.error(
            f"{report['summary']['no_bound']} tensor(s) pair encodings with no known SQNR floor "
            f"({', '.join(pairs)}): pass --min-sqnr DB to judge them"
        )
    if not report["summary"]["ok"]:
        raise typer.Exit(1)


def _integrity(path: str, json_output: bool) -> None:
    from ..verify import check_integrity

    with out.byte_progress("verify") as bar:
        report = check_integrity(path, progress=bar, on_total=bar.set_total)
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

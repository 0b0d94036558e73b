"""``ckptq verify A B``: compare two checkpoints tensor by tensor (see :func:`ckptq.verify.verify_checkpoints`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import _output as out
from ._app import command
from ._options import JsonOpt

__all__ = ["verify"]


@command("verify")
def verify(
    a: Annotated[Path, typer.Argument(help="First checkpoint directory.", metavar="A", show_default=False)],
    b: Annotated[Path, typer.Argument(help="Second checkpoint directory.", metavar="B", show_default=False)],
    min_sqnr: Annotated[Optional[float], typer.Option("--min-sqnr", help="Fail tensors whose SQNR (dB) of high-precision values is below this.")] = None,
    json_output: JsonOpt = False,
) -> None:
    """Compare two checkpoints of any layout and mode: bit-exact, max abs error, SQNR; exit 1 on a failure."""
    from ..verify import verify_checkpoints

    report = verify_checkpoints(a, b, min_sqnr=min_sqnr)
    if json_output:
        out.echo_json(report)
    else:
        rows = [[r["fqn"], r["a"] or "-", r["b"] or "-", r["status"],
                 "-" if r["bit_exact"] is None else ("yes" if r["bit_exact"] else "no"),
                 out.format_number(r["max_abs_error"]), out.format_number(r["sqnr_db"], ".2f")]
                for r in report["tensors"]]
        out.echo_table(rows, ["FQN", "A", "B", "STATUS", "BIT_EXACT", "MAX_ABS_ERR", "SQNR_DB"])
        s = report["summary"]
        out.echo()
        out.echo(f"{s['compared']} compared, {s['bit_exact']} bit-exact, {s['failed']} failed")
    if not report["summary"]["ok"]:
        raise typer.Exit(1)

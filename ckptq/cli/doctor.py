"""``ckptq doctor``: the environment and which requantize backends are active."""

from __future__ import annotations

import platform

from . import _output as out
from ._app import command
from ._options import JsonOpt

__all__ = ["doctor"]


@command("doctor")
def doctor(json_output: JsonOpt = False) -> None:
    """Report versions and which kernel backends (reference, cpu, cuda) are active, and why not.

    Exits 1 when CKPTQ_BACKEND forces a backend that is not available.
    """
    from .. import __version__
    from ..ops import backend_report

    report = {"ckptq": __version__, "python": platform.python_version(), **backend_report()}
    if json_output:
        out.echo_json(report)
    else:
        out.echo_table(
            [
                ["ckptq", report["ckptq"]],
                ["torch", report["torch"]],
                ["python", report["python"]],
                ["forced backend", report.get("forced") or "-"],
            ],
            ["ENVIRONMENT", ""],
        )
        out.echo()
        out.echo_table(
            [[name, "yes" if b.get("active") else "no", b.get("reason", "")] for name, b in report["backends"].items()],
            ["BACKEND", "ACTIVE", "REASON"],
        )
    forced = report.get("forced")
    if forced and not report["backends"].get(forced, {}).get("active"):
        out.fail(f"CKPTQ_BACKEND forces backend '{forced}', which is not available; unset CKPTQ_BACKEND or build it")

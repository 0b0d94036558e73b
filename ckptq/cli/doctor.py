"""``ckptq doctor``: the environment and which requantize backends are active."""

from __future__ import annotations

import os
import platform

from . import _output as out
from ._app import command
from ._options import JsonOpt

__all__ = ["doctor"]


@command(
    "doctor",
    short_help="Report versions and which kernel backends are active, and why not.",
    examples=["ckptq doctor", "ckptq doctor --json", "CKPTQ_BACKEND=cpu ckptq doctor   # exit 1 if cpu is not active"],
)
def doctor(json_output: JsonOpt = False) -> None:
    """Report versions and which kernel backends (reference, cpu, cuda) are active, and why not.

    Exits 1 when CKPTQ_BACKEND forces a backend that is not available, or names no backend.
    """
    from .. import __version__
    from ..ops import backend_report
    from ..ops._backends import BACKENDS

    report = {"ckptq": __version__, "python": platform.python_version(), **backend_report()}
    env = os.environ.get("CKPTQ_BACKEND") or None
    invalid = env is not None and env not in BACKENDS
    forced = None if invalid else report.get("forced")
    if json_output:
        out.echo_json(report)
    else:
        out.echo_table(
            [
                ["ckptq", report["ckptq"]],
                ["torch", report["torch"]],
                ["python", report["python"]],
                ["forced backend", f"{env!r} (not a backend)" if invalid else (forced or "-")],
            ],
            ["ENVIRONMENT", ""],
        )
        out.echo()
        out.echo_table(
            [[name, "yes" if b.get("active") else "no", b.get("reason", "")] for name, b in report["backends"].items()],
            ["BACKEND", "ACTIVE", "REASON"],
        )
    if invalid:
        out.fail(f"CKPTQ_BACKEND={env!r} is not a backend: set it to one of {', '.join(BACKENDS)}, or unset it")
    if forced and not report["backends"].get(forced, {}).get("active"):
        out.fail(f"CKPTQ_BACKEND forces backend '{forced}', which is not available; unset CKPTQ_BACKEND or build it")

"""Shared argument and option types of the CLI commands (``Annotated`` style, as the ``hf`` CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["JsonOpt", "CheckpointArg"]

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print machine-readable JSON to stdout instead of tables."),
]

CheckpointArg = Annotated[
    Path,
    typer.Argument(
        help="Checkpoint: a DCP directory (the folder holding '.metadata' and the .distcp files).",
        metavar="PATH",
        show_default=False,
    ),
]

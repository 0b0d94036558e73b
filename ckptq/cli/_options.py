"""Shared argument and option types of the CLI commands (``Annotated`` style, as the ``hf`` CLI)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = [
    "JsonOpt",
    "CheckpointArg",
    "SrcArg",
    "DstArg",
    "MeshOpt",
    "PlanOpt",
    "RuleOpt",
    "MisalignedOpt",
    "OverwriteOpt",
    "DryRunOpt",
    "DeviceOpt",
]

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print machine-readable JSON to stdout instead of tables."),
]

CheckpointArg = Annotated[
    str,
    typer.Argument(
        help="Checkpoint: a DCP directory (the folder holding '.metadata' and the .distcp files).",
        metavar="PATH",
        show_default=False,
    ),
]

# ---------------------------------------------------------------- reshard and convert (overwrite: also export)
SrcArg = Annotated[
    str,
    typer.Argument(
        help="Source DCP checkpoint directory or URL (s3://...; only read).", metavar="SRC", show_default=False
    ),
]
DstArg = Annotated[
    str,
    typer.Argument(
        help="Destination directory or URL (s3://...; written atomically).", metavar="DST", show_default=False
    ),
]
MeshOpt = Annotated[str, typer.Option("--mesh", help="Target mesh, e.g. 'dp_shard=4,tp=2' or '8'.")]
PlanOpt = Annotated[
    str,
    typer.Option("--plan", help="Preset (replicate, fsdp2, fsdp2-tp) or a JSON/YAML file of FQN glob -> placements."),
]
RuleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rule",
        help="fsdp2-tp rule GLOB=col|row, e.g. '*.q_proj.weight=col' (repeatable). A glob that matches no "
        "tensor is an error.",
    ),
]
MisalignedOpt = Annotated[
    str,
    typer.Option(
        "--misaligned",
        help=(
            "'error' (write nothing) or 'high-precision' (export tensors whose target cuts split blocks, dequantized)."
        ),
    ),
]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists.")]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run", help="Print what would be written (per tensor and rank) and alignment problems; write nothing."
    ),
]

DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="Where requantizing / dequantizing runs: auto (CUDA when there and the kernels are built), cpu, cuda, "
        "cuda:N. The same bytes either way.",
    ),
]

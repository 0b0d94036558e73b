"""``ckptq reshard SRC DST --mesh ... --plan ...`` and ``ckptq convert SRC DST --to FORMAT``."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from . import _output as out
from ._app import command
from ._options import DryRunOpt, DstArg, JsonOpt, MeshOpt, MisalignedOpt, OverwriteOpt, PlanOpt, RuleOpt, SrcArg

__all__ = ["reshard", "convert"]

GroupedOpt = Annotated[
    str | None,
    typer.Option("--grouped", help="'stack' X0..X{N-1} into one (N, ...) X, or 'split' 3-D X into X0..X{N-1}."),
]
GroupedGlobOpt = Annotated[str, typer.Option("--grouped-glob", help="Which stems --grouped applies to (fnmatch).")]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="Storage dtype of high-precision entries: bfloat16, float16, float32.")
]


def _distributed() -> bool:
    """Started by torchrun with more than one process: split the work over them."""
    from ..distributed import torchrun_world_size

    return torchrun_world_size() > 1


def _run(src, dst, options, mesh, plan, rule, misaligned, overwrite, dry_run, json_output) -> None:
    """Run ``options`` with the flags both commands take, and report (rank 0 under torchrun)."""
    import dataclasses

    from ..reshard import reshard_checkpoint

    options = dataclasses.replace(
        options,
        mesh=mesh,
        plan=plan,
        rules=rule or (),
        misaligned=misaligned,
        overwrite=overwrite,
        dry_run=dry_run,
        progress=out.progress_enabled(),
        distributed=_distributed() and not dry_run,
    )
    _report(reshard_checkpoint(src, dst, options), dry_run=dry_run, json_output=json_output)


def _report(result: dict, *, dry_run: bool, json_output: bool) -> None:
    if result.get("process_rank", int(os.environ.get("RANK", "0") or 0)) != 0:
        return  # under torchrun, rank 0 reports for the job
    summary = result["plan"]
    if dry_run:
        if json_output:
            out.echo_json(summary)
        else:
            _print_plan(summary)
        if summary["problems"]:
            out.fail(f"{len(summary['problems'])} tensor(s) cannot be laid out natively (see PROBLEM)")
        return
    if json_output:
        out.echo_json(result)
        return
    _print_plan(summary)
    for fqn, s in result["requantized"].items():
        out.log(f"requantized '{fqn}': SQNR {s:.2f} dB vs the source values")
    by = f" by {result['processes']} processes" if result.get("processes", 1) > 1 else ""
    out.log(f"wrote {result['path']} for {result['world_size']} ranks{by}")


def _print_plan(summary: dict) -> None:
    rows = [
        [
            t["fqn"],
            t["out"],
            t["format"],
            "(" + ", ".join(map(str, t["shape"])) + ")",
            t["placements"],
            "MISALIGNED" if t["problem"] else ("high precision" if t["note"] else ""),
        ]
        for t in summary["tensors"]
    ]
    out.echo_table(rows, ["FQN", "OUT", "FORMAT", "SHAPE", "PLACEMENTS", "PROBLEM"], empty="No entries.")
    out.echo()
    out.echo_table(
        [[r["rank"], r["file"], out.format_bytes(r["bytes"]), r["chunks"]] for r in summary["ranks"]],
        ["RANK", "FILE", "BYTES", "CHUNKS"],
    )
    for p in summary["problems"]:
        out.warning(p)
    for t in summary["tensors"]:
        if t["note"]:
            out.warning(f"'{t['fqn']}': {t['note']}")


@command("reshard")
def reshard(
    src: SrcArg,
    dst: DstArg,
    mesh: MeshOpt = "1",
    plan: PlanOpt = "fsdp2",
    rule: RuleOpt = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode", help="native or high-precision for every quantized tensor (default: keep each tensor's mode)."
        ),
    ] = None,
    dtype: DtypeOpt = "bfloat16",
    grouped: GroupedOpt = None,
    grouped_glob: GroupedGlobOpt = "*weight",
    misaligned: MisalignedOpt = "error",
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Lay a checkpoint out for a target mesh: one storage file per target rank, streaming tensor by tensor.

    Under torchrun (more than one process) the tensors are split over the processes.
    """
    from ..reshard import ReshardOptions

    options = ReshardOptions(mode=mode, dtype=dtype, grouped=grouped, grouped_glob=grouped_glob)
    _run(src, dst, options, mesh, plan, rule, misaligned, overwrite, dry_run, json_output)


@command("convert")
def convert(
    src: SrcArg,
    dst: DstArg,
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help=(
                "Target: native (each quantized tensor in its own format, e.g. a TransformerEngine "
                "checkpoint's as ckptq components), nvfp4, mxfp8, fp8_block, fp8_tensor, or "
                "bfloat16/float16/float32 (high precision)."
            ),
        ),
    ],
    block: Annotated[str | None, typer.Option("--block", help="fp8_block block, e.g. 1x128 (default 128x128).")] = None,
    two_d: Annotated[bool | None, typer.Option("--two-d/--one-d", help="nvfp4: 16x16 blocks instead of 1x16.")] = None,
    columnwise: Annotated[
        bool | None, typer.Option("--columnwise/--no-columnwise", help="mxfp8: also store the columnwise copy.")
    ] = None,
    fp8_dtype: Annotated[str | None, typer.Option("--fp8-dtype", help="fp8 formats: e4m3 or e5m2.")] = None,
    pow2: Annotated[bool | None, typer.Option("--pow2/--no-pow2", help="fp8 formats: power-of-2 scales.")] = None,
    mesh: MeshOpt = "1",
    plan: PlanOpt = "fsdp2",
    rule: RuleOpt = None,
    misaligned: MisalignedOpt = "error",
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Write every quantized tensor of a checkpoint natively, in another format, or in high precision
    (streaming), optionally resharding.

    Under torchrun (more than one process) the tensors are split over the processes.
    """
    from ..reshard import ReshardOptions

    options = ReshardOptions(to=to, block=block, two_d=two_d, columnwise=columnwise, fp8_dtype=fp8_dtype, pow2=pow2)
    _run(src, dst, options, mesh, plan, rule, misaligned, overwrite, dry_run, json_output)

"""``ckptq reshard SRC DST --mesh ... --plan ...`` and ``ckptq convert SRC DST --to FORMAT``."""

from __future__ import annotations

import os
import re
from typing import Annotated

import typer

from . import _output as out
from ._app import command
from ._options import (
    DeviceOpt,
    DryRunOpt,
    DstArg,
    JsonOpt,
    MeshOpt,
    MisalignedOpt,
    OverwriteOpt,
    PlanOpt,
    RuleOpt,
    SrcArg,
)

__all__ = ["reshard", "convert"]

GroupedOpt = Annotated[
    str | None,
    typer.Option("--grouped", help="'stack' X0..X{N-1} into one (N, ...) X, or 'split' 3-D X into X0..X{N-1}."),
]
GroupedGlobOpt = Annotated[str, typer.Option("--grouped-glob", help="Which stems --grouped applies to (fnmatch).")]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="Storage dtype of high-precision entries: bfloat16, float16, float32.")
]
AllowUnmatchedOpt = Annotated[
    bool, typer.Option("--allow-unmatched", help="Warn about --rule globs that match no tensor instead of failing.")
]
PerRankOpt = Annotated[
    bool, typer.Option("--per-rank", help="List every target rank (large meshes are summarized by default).")
]


def _distributed() -> bool:
    """Started by torchrun with more than one process: split the work over them."""
    from ..distributed import torchrun_world_size

    return torchrun_world_size() > 1


def _run(
    src, dst, options, mesh, plan, rule, allow_unmatched, misaligned, overwrite, dry_run, per_rank, json_output
) -> None:
    """Run ``options`` with the flags both commands take, and report (rank 0 under torchrun)."""
    import dataclasses

    from ..reshard import reshard_checkpoint

    options = dataclasses.replace(
        options,
        mesh=mesh,
        plan=plan,
        rules=rule or (),
        allow_unmatched=allow_unmatched,
        misaligned=misaligned,
        overwrite=overwrite,
        dry_run=dry_run,
        progress=out.progress_enabled(),
        distributed=_distributed() and not dry_run,
    )
    result = reshard_checkpoint(src, dst, options)
    _report(result, dst, dry_run=dry_run, json_output=json_output, per_rank=per_rank)


#: Meshes with more ranks than this print the first and last few (``--per-rank``: all of them).
_RANKS_SHOWN = 16


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _report(result: dict, dst, *, dry_run: bool, json_output: bool, per_rank: bool = False) -> None:
    if result.get("process_rank", int(os.environ.get("RANK", "0") or 0)) != 0:
        return  # under torchrun, rank 0 reports for the job
    summary = result["plan"]
    for glob in summary.get("unmatched_rules") or ():
        out.warning(f"--rule {glob} matches no tensor of the checkpoint (ignored)")
    if dry_run:
        if json_output:
            out.echo_json(summary)
        else:
            _print_plan(summary, per_rank)
        total = sum(r["bytes"] for r in summary["ranks"])
        out.log(
            f"dry run: nothing written; would write {dst} for {_plural(summary['world_size'], 'rank')} "
            f"({_plural(len(summary['ranks']), 'file')}, {out.format_bytes(total)})"
        )
        if summary["problems"]:
            out.fail(f"{len(summary['problems'])} tensor(s) cannot be laid out natively (see PROBLEM)")
        return
    if json_output:
        out.echo_json(result)
        return
    _print_plan(summary, per_rank)
    for fqn, s in result["requantized"].items():
        out.log(f"requantized '{fqn}': SQNR {s:.2f} dB vs the source values")
    by = f" by {result['processes']} processes" if result.get("processes", 1) > 1 else ""
    out.log(f"wrote {result['path']} for {_plural(result['world_size'], 'rank')}{by} (computing on {result['device']})")


def _rank_rows(ranks: list[dict], per_rank: bool) -> list[list]:
    """One row per rank; for a large mesh (unless ``per_rank``) the first and last few and a line
    for the ranks between, with their total size."""
    rows = [[r["rank"], r["file"], out.format_bytes(r["bytes"]), r["chunks"]] for r in ranks]
    if per_rank or len(rows) <= _RANKS_SHOWN:
        return rows
    k = _RANKS_SHOWN // 4
    middle = ranks[k:-k]
    between = [
        f"... {len(middle)} more",
        "(--per-rank for all)",
        out.format_bytes(sum(r["bytes"] for r in middle)),
        sum(r["chunks"] for r in middle),
    ]
    return rows[:k] + [between] + rows[-k:]


def _print_plan(summary: dict, per_rank: bool = False) -> None:
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
    out.echo_table(_rank_rows(summary["ranks"], per_rank), ["RANK", "FILE", "BYTES", "CHUNKS"])
    for p in summary["problems"]:
        out.warning(p)
    for t in summary["tensors"]:
        if t["note"]:
            out.warning(f"'{t['fqn']}': {t['note']}")


@command(
    "reshard",
    short_help="Lay a checkpoint out for a target mesh (one file per target rank).",
    examples=[
        "ckptq reshard ckpt ckpt-4 --mesh 4 --dry-run                 # what would be written",
        "ckptq reshard ckpt ckpt-tp --mesh dp_shard=4,tp=2 --plan fsdp2-tp --rule 'proj.weight=col'",
        "ckptq reshard ckpt-experts ckpt-stacked --grouped stack      # weight0..weight{N-1} -> (N, ...)",
        "torchrun --nproc-per-node 8 -m ckptq reshard ckpt ckpt-64 --mesh 64   # split over 8 processes",
    ],
)
def reshard(
    src: SrcArg,
    dst: DstArg,
    mesh: MeshOpt = "1",
    plan: PlanOpt = "fsdp2",
    rule: RuleOpt = None,
    allow_unmatched: AllowUnmatchedOpt = False,
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
    per_rank: PerRankOpt = False,
    device: DeviceOpt = "auto",
    json_output: JsonOpt = False,
) -> None:
    """Lay a checkpoint out for a target mesh: one storage file per target rank, streaming tensor by tensor.

    Under torchrun (more than one process) each process plans and writes its share of the target files
    (a tensor that is converted: computed by one process).
    """
    from ..reshard import ReshardOptions

    options = ReshardOptions(mode=mode, dtype=dtype, grouped=grouped, grouped_glob=grouped_glob, device=device)
    _run(src, dst, options, mesh, plan, rule, allow_unmatched, misaligned, overwrite, dry_run, per_rank, json_output)


@command(
    "convert",
    short_help="Requantize a checkpoint to another format, or write it in high precision.",
    examples=[
        "ckptq convert ckpt ckpt-nvfp4 --to nvfp4 --two-d       # requantize every quantized tensor",
        "ckptq convert ckpt ckpt-fp8 --to fp8_block --block 1x128",
        "ckptq convert ckpt ckpt-mxfp4 --to mxfp4 --scale-rule rceil",
        "ckptq convert ckpt ckpt-hp --to bfloat16               # high-precision export",
        "ckptq convert te-ckpt ckpt-native --to native          # a TE checkpoint as ckptq tensors",
    ],
)
def convert(
    src: SrcArg,
    dst: DstArg,
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help=(
                "Target: native (each quantized tensor in its own format, e.g. a TransformerEngine "
                "checkpoint's as ckptq components), nvfp4, mxfp4, mxfp8, fp8_block, fp8_tensor, or "
                "bfloat16/float16/float32 (high precision)."
            ),
        ),
    ],
    block: Annotated[
        str | None,
        typer.Option(
            "--block",
            metavar="RxC",
            help="fp8_block block: 128x128 (default) or 1x128, the blocks its consumers (TransformerEngine, "
            "DeepSeek) support; other sizes need --allow-any-block.",
        ),
    ] = None,
    allow_any_block: Annotated[
        bool, typer.Option("--allow-any-block", help="Accept an fp8_block block no known consumer supports.")
    ] = False,
    two_d: Annotated[bool | None, typer.Option("--two-d/--one-d", help="nvfp4: 16x16 blocks instead of 1x16.")] = None,
    columnwise: Annotated[
        bool | None,
        typer.Option(
            "--columnwise/--no-columnwise", help="mxfp8, nvfp4 1x16, fp8_block 1x128: also store the columnwise copy."
        ),
    ] = None,
    fp8_dtype: Annotated[str | None, typer.Option("--fp8-dtype", help="fp8 formats: e4m3 or e5m2.")] = None,
    pow2: Annotated[bool | None, typer.Option("--pow2/--no-pow2", help="fp8 formats: power-of-2 scales.")] = None,
    scale_rule: Annotated[
        str | None,
        typer.Option(
            "--scale-rule",
            help="mxfp4: the E8M0 scale rule, floor (OCP MX default), even, ceil or rceil (docs/formats.md).",
        ),
    ] = None,
    mesh: MeshOpt = "1",
    plan: PlanOpt = "fsdp2",
    rule: RuleOpt = None,
    allow_unmatched: AllowUnmatchedOpt = False,
    misaligned: MisalignedOpt = "error",
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    per_rank: PerRankOpt = False,
    device: DeviceOpt = "auto",
    json_output: JsonOpt = False,
) -> None:
    """Write every quantized tensor of a checkpoint natively, in another format, or in high precision
    (streaming), optionally resharding.

    Under torchrun (more than one process) each process plans and writes its share of the target files
    (a tensor that is converted: computed by one process).
    """
    from ..reshard import ReshardOptions

    if block is not None and not allow_any_block and to.strip().lower() == "fp8_block":
        _check_block(block)
    options = ReshardOptions(
        to=to,
        block=block,
        two_d=two_d,
        columnwise=columnwise,
        fp8_dtype=fp8_dtype,
        pow2=pow2,
        scale_rule=scale_rule,
        device=device,
    )
    _run(src, dst, options, mesh, plan, rule, allow_unmatched, misaligned, overwrite, dry_run, per_rank, json_output)


#: fp8_block blocks that consumers of the format read: 128x128 (weights) and 1x128 (activations,
#: and the weights of some DeepSeek-style checkpoints), as TransformerEngine and DeepSeek-V3 use.
_SUPPORTED_BLOCKS = ("128x128", "1x128")


def _check_block(block: str) -> None:
    """A usage error for an fp8_block ``--block`` that no known consumer reads."""
    text = block.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+x\d+", text) and text not in _SUPPORTED_BLOCKS:  # other text: the library's error
        out.usage_error(
            f"--block {block}: fp8_block's consumers (TransformerEngine, DeepSeek-V3 checkpoints, vLLM) read "
            f"{' or '.join(_SUPPORTED_BLOCKS)} blocks; pass --allow-any-block to write {block} anyway",
            "ckptq convert",
        )

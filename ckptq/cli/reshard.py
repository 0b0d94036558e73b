"""``ckptq reshard SRC DST --mesh ... --plan ...`` and ``ckptq convert SRC DST --to FORMAT``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import _output as out
from ._app import command
from ._options import JsonOpt

__all__ = ["reshard", "convert"]

SrcArg = Annotated[Path, typer.Argument(help="Source DCP checkpoint directory (only read).", metavar="SRC", show_default=False)]
DstArg = Annotated[Path, typer.Argument(help="Destination directory (written atomically).", metavar="DST", show_default=False)]
MeshOpt = Annotated[str, typer.Option("--mesh", help="Target mesh, e.g. 'dp_shard=4,tp=2' or '8'.")]
PlanOpt = Annotated[str, typer.Option("--plan", help="Preset (replicate, fsdp2, fsdp2-tp) or a JSON/YAML file of FQN glob -> placements.")]
RuleOpt = Annotated[Optional[list[str]], typer.Option("--rule", help="fsdp2-tp rule GLOB=col|row, e.g. '*.q_proj.weight=col'. Repeatable.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the per-rank plan and alignment problems; write nothing.")]
GroupedOpt = Annotated[Optional[str], typer.Option("--grouped", help="'stack' X0..X{N-1} into one (N, ...) X, or 'split' 3-D X into X0..X{N-1}.")]
GroupedGlobOpt = Annotated[str, typer.Option("--grouped-glob", help="Which stems --grouped applies to (fnmatch).")]
MisalignedOpt = Annotated[str, typer.Option("--misaligned", help="'error' (write nothing) or 'high-precision' (export tensors whose target cuts split blocks, dequantized).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Storage dtype of high-precision entries: bfloat16, float16, float32.")]


def _run(src, dst, mesh, plan, rules, *, mode, dtype, to, to_recipe, grouped, grouped_glob, misaligned,
         overwrite, dry_run, json_output) -> None:
    from ..checkpoint import CheckpointView
    from ..layout import LayoutPlan, MeshSpec
    from ..reshard import HP_DTYPES, plan_reshard, run_reshard

    if dtype not in HP_DTYPES:
        out.usage_error(f"--dtype {dtype}: expected one of {sorted(HP_DTYPES)}")
    for name, value, allowed in (("--misaligned", misaligned, ("error", "high-precision")),
                                 ("--grouped", grouped, (None, "stack", "split"))):
        if value not in allowed:
            out.usage_error(f"{name} {value}: expected one of {[a for a in allowed if a]}")
    mesh_spec = MeshSpec.parse(mesh)
    layout = LayoutPlan.from_arg(mesh_spec, plan, rules or [])
    view = CheckpointView(src)
    rplan = plan_reshard(view, mesh_spec, layout, mode=mode, hp_dtype=HP_DTYPES[dtype], to=to,
                         to_recipe=to_recipe, grouped=grouped, grouped_glob=grouped_glob,
                         misaligned=misaligned.replace("-", "_"))
    summary = rplan.summary()
    if dry_run:
        if json_output:
            out.echo_json(summary)
        else:
            _print_plan(summary)
        if summary["problems"]:
            out.fail(f"{len(summary['problems'])} tensor(s) cannot be laid out natively (see PROBLEM)")
        return
    from tqdm import tqdm

    total = sum(r["bytes"] for r in summary["ranks"])
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not out.progress_enabled(),
              leave=False) as bar:
        report = run_reshard(view, rplan, dst, overwrite=overwrite, progress=bar.update)
    if json_output:
        out.echo_json({**report, "plan": summary})
        return
    _print_plan(summary)
    for fqn, s in report["requantized"].items():
        out.log(f"requantized '{fqn}': SQNR {s:.2f} dB vs the source values")
    out.log(f"wrote {report['path']} for {report['world_size']} ranks")


def _print_plan(summary: dict) -> None:
    rows = [[t["fqn"], t["out"], t["format"], "(" + ", ".join(map(str, t["shape"])) + ")", t["placements"],
             "MISALIGNED" if t["problem"] else ("high precision" if t["note"] else "")]
            for t in summary["tensors"]]
    out.echo_table(rows, ["FQN", "OUT", "FORMAT", "SHAPE", "PLACEMENTS", "PROBLEM"], empty="No entries.")
    out.echo()
    out.echo_table([[r["rank"], r["file"], out.format_bytes(r["bytes"]), r["chunks"]] for r in summary["ranks"]],
                   ["RANK", "FILE", "BYTES", "CHUNKS"])
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
    mode: Annotated[Optional[str], typer.Option("--mode", help="native or high-precision for every quantized tensor (default: keep each tensor's mode).")] = None,
    dtype: DtypeOpt = "bfloat16",
    grouped: GroupedOpt = None,
    grouped_glob: GroupedGlobOpt = "*weight",
    misaligned: MisalignedOpt = "error",
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Lay a checkpoint out for a target mesh: one storage file per target rank, streaming tensor by tensor."""
    if mode not in (None, "native", "high-precision"):
        out.usage_error(f"--mode {mode}: expected native or high-precision")
    _run(src, dst, mesh, plan, rule, mode=mode and mode.replace("-", "_"), dtype=dtype, to=None,
         to_recipe=None, grouped=grouped, grouped_glob=grouped_glob, misaligned=misaligned,
         overwrite=overwrite, dry_run=dry_run, json_output=json_output)


def _parse_block(text: Optional[str]):
    if text is None:
        return None
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        out.usage_error(f"--block {text}: expected BMxBK such as 1x128 or 128x128")
    return (int(parts[0]), int(parts[1]))


@command("convert")
def convert(
    src: SrcArg,
    dst: DstArg,
    to: Annotated[str, typer.Option("--to", help="Target: nvfp4, mxfp8, fp8_block, fp8_tensor, or bfloat16/float16/float32 (high precision).")],
    block: Annotated[Optional[str], typer.Option("--block", help="fp8_block block, e.g. 1x128 (default 128x128).")] = None,
    two_d: Annotated[Optional[bool], typer.Option("--two-d/--one-d", help="nvfp4: 16x16 blocks instead of 1x16.")] = None,
    columnwise: Annotated[Optional[bool], typer.Option("--columnwise/--no-columnwise", help="mxfp8: also store the columnwise copy.")] = None,
    fp8_dtype: Annotated[Optional[str], typer.Option("--fp8-dtype", help="fp8 formats: e4m3 or e5m2.")] = None,
    pow2: Annotated[Optional[bool], typer.Option("--pow2/--no-pow2", help="fp8 formats: power-of-2 scales.")] = None,
    mesh: MeshOpt = "1",
    plan: PlanOpt = "fsdp2",
    rule: RuleOpt = None,
    misaligned: MisalignedOpt = "error",
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Requantize every quantized tensor of a checkpoint to another format (streaming), optionally resharding."""
    import torch

    recipe = {"block": _parse_block(block), "two_d": two_d, "columnwise": columnwise, "pow2": pow2,
              "fp8_dtype": {None: None, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(fp8_dtype, "bad")}
    if recipe["fp8_dtype"] == "bad":
        out.usage_error(f"--fp8-dtype {fp8_dtype}: expected e4m3 or e5m2")
    recipe = {k: v for k, v in recipe.items() if v is not None}
    from ..formats import FORMATS

    if to in FORMATS:
        import dataclasses

        known = {f.name for f in dataclasses.fields(FORMATS[to].Recipe)}
        extra = sorted(set(recipe) - known)
        if extra:
            out.usage_error(f"--to {to} does not take {', '.join('--' + e.replace('_', '-') for e in extra)}")
    elif recipe:
        out.usage_error(f"--to {to}: recipe options apply only to quantized formats")
    _run(src, dst, mesh, plan, rule, mode=None, dtype=to if to not in FORMATS else "bfloat16", to=to,
         to_recipe=recipe, grouped=None, grouped_glob="*weight", misaligned=misaligned,
         overwrite=overwrite, dry_run=dry_run, json_output=json_output)

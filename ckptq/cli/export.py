"""``ckptq export SRC DST --layout modelopt|compressed-tensors|deepseek-fp8|deepseek-v4|gpt-oss|torchao``: a
Hugging Face safetensors folder (torchao: torchao's own flattened safetensors form)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from . import _output as out
from ._app import command
from ._options import DeviceOpt, JsonOpt, OverwriteOpt

__all__ = ["export"]


@command(
    "export",
    short_help="Write a checkpoint as a Hugging Face safetensors folder in a serving layout.",
    examples=[
        "ckptq export ckpt hf-modelopt --layout modelopt --config config.json",
        "ckptq export ckpt hf-ct --layout compressed-tensors --max-shard-size 2GB",
        "ckptq export ckpt hf-fp8 --layout deepseek-fp8 --format fp8_block --rename '*=model.*'",
        "ckptq export moe-ckpt hf-gpt-oss --layout gpt-oss --config gpt-oss-config.json",
        "torchrun --nproc-per-node 8 -m ckptq export ckpt hf --layout modelopt --max-shard-size 2GB  # 8 processes",
    ],
)
def export(
    src: Annotated[
        str,
        typer.Argument(
            help="Source checkpoint (DCP directory, safetensors folder or file; only read).",
            metavar="SRC",
            show_default=False,
        ),
    ],
    dst: Annotated[
        str, typer.Argument(help="Destination folder (written atomically).", metavar="DST", show_default=False)
    ],
    layout: Annotated[
        str,
        typer.Option(
            "--layout",
            help=(
                "modelopt, compressed-tensors, deepseek-fp8, deepseek-v4, gpt-oss, or torchao"
                " (torchao's own safetensors form)."
            ),
        ),
    ],
    format: Annotated[
        str | None,
        typer.Option(
            "--format",
            help=(
                "Requantize quantized tensors and plain *.weight matrices to nvfp4, mxfp4, mxfp8, fp8_block "
                "or fp8_tensor first (default: keep each tensor's format)."
            ),
        ),
    ] = None,
    ignore: Annotated[
        list[str] | None,
        typer.Option(
            "--ignore",
            help=(
                "FQN / module glob kept in high precision, the model dtype (repeatable; replaces the default "
                "lm_head, embeddings, norms, routers)."
            ),
        ),
    ] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Bytes per shard, e.g. 5GB, 500MB.")] = "5GB",
    rename: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            help="Rename rule FQN glob -> HF name, SRC=DST, e.g. '*=model.*' (repeatable; first match wins).",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help=(
                "The model's config.json to add quantization_config to (default: the one in the source "
                "folder or beside it; without one, export refuses)."
            ),
        ),
    ] = None,
    no_model_config: Annotated[
        bool,
        typer.Option(
            "--no-model-config",
            help="Write config.json with only quantization_config (a folder transformers / vLLM cannot load).",
        ),
    ] = False,
    on_inexact: Annotated[
        str,
        typer.Option(
            "--on-inexact",
            help=(
                "When transformers' default load would decode a weight differently from ckptq (a fp32 scale "
                "a bf16 model cannot hold): refuse (default), float32 (config dtype float32), requantize "
                "(power-of-two scales) or keep."
            ),
        ),
    ] = "refuse",
    overwrite: OverwriteOpt = False,
    device: DeviceOpt = "auto",
    json_output: JsonOpt = False,
) -> None:
    """Write a checkpoint as a Hugging Face safetensors folder in a serving layout (streaming, sharded).

    Under torchrun (more than one process) the shard files are split over the processes."""
    from ..adapters.hf import DEFAULT_IGNORE
    from ..distributed import torchrun_world_size
    from ..export import export_checkpoint

    result = export_checkpoint(
        src,
        dst,
        layout=layout,
        format=format,
        ignore=DEFAULT_IGNORE if ignore is None else tuple(ignore),
        max_shard_size=max_shard_size,
        names=rename or None,
        config=False if no_model_config else config,
        on_inexact=on_inexact,
        overwrite=overwrite,
        progress=out.progress_enabled(),
        device=device,
        distributed=torchrun_world_size() > 1,
    )
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return  # under torchrun, rank 0 reports for the job
    if json_output:
        out.echo_json(result)
        return
    rows = [
        [
            fqn,
            fmt,
            "requantized" if fqn in result["requantized"] else "",
            ""
            if fqn not in result["numerics"]
            else ("exact" if result["numerics"][fqn] == 0 else f"{result['numerics'][fqn]} ulp"),
        ]
        for fqn, fmt in result["quantized"].items()
    ]
    out.echo_table(rows, ["FQN", "FORMAT", "", "DECODE VS CKPTQ"], empty="No quantized tensors.")
    consumer = result["consumer"]
    out.log(f"read by: {consumer['loaders']}")
    for fqn, d in consumer["differs"].items():
        out.log(
            f"{fqn}: loads differently in a {consumer['dtype']} model ({d['elements']} values, max abs diff "
            f"{d['max_abs_diff']:.3g}; kept: --on-inexact keep)"
        )
    for fqn, db in consumer["requantized_sqnr_db"].items():
        out.log(f"{fqn}: requantized to power-of-two scales ({db:.1f} dB vs the source)")
    for fqn, why in consumer["unloadable"].items():
        out.log(f"{fqn}: {why} (kept: --on-inexact keep)")
    out.log(
        f"wrote {result['path']} ({result['layout']}): {len(result['files'])} shard(s), "
        f"{out.format_bytes(result['bytes'])}, {result['tensors']} tensors, "
        f"{len(result['high_precision'])} kept in high precision; model config: {result['config_from']}; "
        f"computing on {result['device']}"
    )

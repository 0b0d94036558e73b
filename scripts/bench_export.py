"""Benchmark ``ckptq export`` (Hugging Face safetensors) against a plain ``safetensors.torch.save_file``.

``python scripts/bench_export.py [--gb 1] [--layout compressed-tensors] [--repeat 3] [--workdir DIR]``

1. A synthetic checkpoint of about ``--gb`` GB (decimal): NVFP4 (4096 x 8192) and MXFP8 (4096 x 4096)
   weights with random valid component bytes, saved natively by ``dcp.save`` + ``QuantizedSavePlanner``.
2. ``export_checkpoint(src, dst, layout=...)`` (each tensor in its own format: reads the DCP
   checkpoint tensor by tensor, maps it to the layout's tensors, streams the shards, writes the index
   and configs, renames into place): wall time and GB/s of output bytes.
3. The time to read the source alone (``open_checkpoint(src).read`` of every entry), which every
   export includes.
4. In the same run, plain tools' route: read every source tensor's components into memory
   (materialized) with ckptq's view, then one ``save_file``.
5. In the same run, the baseline: the *same output tensors* (loaded into memory beforehand, so the
   baseline does no reading or conversion) written with ``safetensors.torch.save_file`` into the same
   shard split. GB/s of the same bytes.

Each measurement is the median of ``--repeat`` runs, export and baseline interleaved so that both see
the same page-cache and disk conditions (every run writes new files, deleted afterwards).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def make_checkpoint(path: Path, gb: float) -> int:
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.formats import MXFP8Tensor, NVFP4Tensor
    from ckptq.formats.mxfp8 import MXFP8Recipe
    from ckptq.formats.nvfp4 import NVFP4Recipe

    g = torch.Generator().manual_seed(0)
    sd, total, i = {}, 0, 0
    while total < gb * 1e9:
        if i % 3 == 2:
            m, k = 4096, 4096
            comps = {
                "data": torch.randint(0, 0x7E, (m, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
                "scale": torch.randint(110, 135, (m, k // 32), dtype=torch.uint8, generator=g),
            }
            t = MXFP8Tensor(comps, (m, k), torch.bfloat16, MXFP8Recipe())
        else:
            m, k = 4096, 8192
            comps = {
                "data": torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g),
                "scale": torch.randint(0x20, 0x70, (m, k // 16), dtype=torch.uint8, generator=g).view(
                    torch.float8_e4m3fn
                ),
                "amax": torch.tensor(3.25),
            }
            t = NVFP4Tensor(comps, (m, k), torch.bfloat16, NVFP4Recipe())
        sd[f"model.layers.{i}.mlp.proj.weight"] = t
        total += sum(c.numel() * c.element_size() for c in comps.values())
        i += 1
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--layout", default="compressed-tensors")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from safetensors.torch import load_file, save_file

    from ckptq.export import export_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    t0 = time.perf_counter()
    src_bytes = make_checkpoint(src, args.gb)
    print(f"source: {src_bytes / 1e9:.3f} GB of components in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    from ckptq.checkpoint import open_checkpoint

    read_times = []
    for _ in range(args.repeat):  # what reading the source alone costs (part of every export)
        t0 = time.perf_counter()
        view = open_checkpoint(src)
        for e in view.entries():
            view.read(e.fqn)
        read_times.append(time.perf_counter() - t0)

    # first export: gives the output tensors the baseline writes (the same bytes, in the same shards)
    result = export_checkpoint(
        src,
        work / "export_first",
        layout=args.layout,
        max_shard_size=args.max_shard_size,
        config=False,
        on_inexact="keep",
    )
    out_bytes = result["bytes"]
    shards = {f: {k: v.clone() for k, v in load_file(str(work / "export_first" / f)).items()} for f in result["files"]}
    shutil.rmtree(work / "export_first")

    # interleaved, so that both see the same page-cache / disk conditions
    def read_then_save_file(dst: Path) -> None:
        """What plain tools do: read every source tensor's components into memory, then save_file."""
        view = open_checkpoint(src)
        tensors = {}
        for e in view.entries():
            x = view.read(e.fqn)
            for name, c in x.components().items() if hasattr(x, "components") else [("", x)]:
                tensors[f"{e.fqn}.{name}" if name else e.fqn] = c.contiguous().clone()
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})

    export_times, base_times, route_times = [], [], []
    for r in range(args.repeat):
        dst = work / f"export{r}"
        t0 = time.perf_counter()
        export_checkpoint(
            src, dst, layout=args.layout, max_shard_size=args.max_shard_size, config=False, on_inexact="keep"
        )
        export_times.append(time.perf_counter() - t0)
        shutil.rmtree(dst)
        dst = work / f"plain{r}"
        dst.mkdir()
        t0 = time.perf_counter()
        for f, tensors in shards.items():
            save_file(tensors, str(dst / f), metadata={"format": "pt"})
        base_times.append(time.perf_counter() - t0)
        shutil.rmtree(dst)
        dst = work / f"route{r}"
        dst.mkdir()
        t0 = time.perf_counter()
        read_then_save_file(dst)
        route_times.append(time.perf_counter() - t0)
        shutil.rmtree(dst)

    te, tb, tr = statistics.median(export_times), statistics.median(base_times), statistics.median(read_times)
    report = {
        "layout": args.layout,
        "source_bytes": src_bytes,
        "output_bytes": out_bytes,
        "shards": len(result["files"]),
        "export_s": round(te, 3),
        "export_GBps": round(out_bytes / te / 1e9, 3),
        "save_file_s": round(tb, 3),
        "save_file_GBps": round(out_bytes / tb / 1e9, 3),
        "export_over_save_file": round(te / tb, 2),
        "read_source_s": round(tr, 3),
        "read_then_save_file_s": round(statistics.median(route_times), 3),
        "read_then_save_file_GBps": round(out_bytes / statistics.median(route_times) / 1e9, 3),
        "export_minus_read_GBps": round(out_bytes / max(te - tr, 1e-9) / 1e9, 3),
        "export_runs_s": [round(x, 3) for x in export_times],
        "save_file_runs_s": [round(x, 3) for x in base_times],
        "torch": torch.__version__,
    }
    print(json.dumps(report, indent=2))
    print(
        f"| export ({args.layout}) | {out_bytes / 1e9:.3f} GB | {te:.2f} s | {report['export_GBps']} GB/s |\n"
        f"| safetensors.torch.save_file (same bytes, in memory) | {out_bytes / 1e9:.3f} GB | {tb:.2f} s | "
        f"{report['save_file_GBps']} GB/s |\n"
        f"| read source (ckptq view, materialized) + save_file, one shard | {out_bytes / 1e9:.3f} GB | "
        f"{report['read_then_save_file_s']:.2f} s | {report['read_then_save_file_GBps']} GB/s |"
    )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

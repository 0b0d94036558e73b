"""Benchmark: convert a TransformerEngine-written DCP checkpoint to ckptq native vs reshard the same bytes.

One command: ``python scripts/bench_te_convert.py [--gb 1.0] [--repeat 3] [--workdir DIR]``.

1. A TE-shaped DCP checkpoint of about ``--gb`` GB: 4096-wide Linear weights as TE tensors of the
   test stand-in (``tests/te_standin``: TE's classes, reconstructors and padded/swizzled buffer
   layouts), half MXFP8 with its columnwise copy and swizzled scales, half NVFP4 16x16, saved with
   DCP's default planner (each record a pickled TE tensor, as TE's own DCP integration writes).
2. ``ckptq convert SRC DST --to native`` (= ``ckptq.reshard_checkpoint(src, dst)``: the TE records
   read without TE, unpadded, unswizzled and written as ckptq components) -- the time TE users pay.
3. ``ckptq reshard`` of the resulting native checkpoint (the same canonical bytes) to the same layout.
4. ``cp -r`` + ``sync`` of the TE checkpoint (the copy limit of this disk).

Each step is timed in this process, median of ``--repeat`` runs, page cache warm (every step
reads the same files right before). Ratios are against ``cp -r`` in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _make_te_checkpoint(path: Path, gb: float) -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    from _te import standin

    te = standin()
    shape = (4096, 4096)
    sd, total, i = {}, 0, 0
    g = torch.Generator().manual_seed(0)
    while total < gb * 1e9:
        x = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        if i % 2 == 0:
            t = te.make_te_tensor(x, "mxfp8", swizzled=True, seed=i)  # rowwise + columnwise, ~2.06 B/elem
        else:
            t = te.make_te_tensor(x, "nvfp4", two_d=True, columnwise=True, seed=i)  # ~0.56 B/elem + colwise
        sd[f"model.layers.{i}.weight"] = t
        total += sum(b.numel() * b.element_size() for b in te.te_buffers(t).values())
        i += 1
    dcp.save(sd, checkpoint_id=str(path))
    return len(sd)


def _timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    import torch

    import ckptq

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-bench-te-"))
    work.mkdir(parents=True, exist_ok=True)
    src, native, out, copy = work / "te", work / "native", work / "resharded", work / "copy"
    for p in (src, native, out, copy):
        shutil.rmtree(p, ignore_errors=True)
    t0 = time.perf_counter()
    n = _make_te_checkpoint(src, args.gb)
    print(
        f"made a TE-shaped checkpoint of {n} tensors, {_dir_bytes(src) / 1e9:.2f} GB, "
        f"in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )

    def convert():
        ckptq.reshard_checkpoint(src, native, overwrite=True)

    def reshard():
        ckptq.reshard_checkpoint(native, out, overwrite=True)

    def cp():
        shutil.rmtree(copy, ignore_errors=True)
        subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
        os.sync()

    convert()  # warm the page cache and create the native source of step 3
    t_cp = _timed(cp, args.repeat)
    t_convert = _timed(convert, args.repeat)
    t_reshard = _timed(reshard, args.repeat)
    te_bytes, native_bytes = _dir_bytes(src), _dir_bytes(native)
    rows = [
        ("cp -r + sync (TE checkpoint)", t_cp, te_bytes),
        ("convert TE -> ckptq native", t_convert, te_bytes),
        ("reshard ckptq native (same canonical bytes)", t_reshard, native_bytes),
    ]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}; median of {args.repeat}"
    )
    print("| step | seconds | bytes read | GB/s | vs cp -r |")
    print("|---|---|---|---|---|")
    for name, t, b in rows:
        print(f"| {name} | {t:.2f} | {b / 1e9:.3f} GB | {b / t / 1e9:.2f} | {t_cp / t:.2f}x |")
    print(f"TE checkpoint {te_bytes / 1e9:.3f} GB (padded scales, pickles) -> native {native_bytes / 1e9:.3f} GB")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

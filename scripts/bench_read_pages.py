"""The tensors a read fills: from ckptq's pool of reused blocks or from ``torch.empty``, A/B.

``python scripts/bench_read_pages.py [--mib 64] [--tensors 6] [--rounds 8] [--cold] [--source DIR]
[--modes pool,torch] [--out r.json]``

A checkpoint of ``--tensors`` bf16 tensors of ``--mib`` MiB each is saved with
``ckptq.io.ChecksumFileSystemWriter`` (or ``--source``: any checkpoint ckptq opens, e.g. the
TransformerEngine source of ``scripts/bench_offline.py``). Each run is a fresh process that opens it
with ``ckptq.open_checkpoint``, says the order (``will_read``) and reads every entry (the source read
of ``convert`` / ``export`` / ``reshard``), its destinations allocated in one of the ``--modes``:
``pool`` (``ckptq.io.read_buffers``, the default: blocks reused, new ones on huge pages),
``pool_4k`` (the same without the huge-page advice) or ``torch`` (``POOLED`` off: ``torch.empty``,
what glibc gives); they alternate, the order of each round rotated. A fresh process, because a
tensor's memory is faulted in only the first time: a long-running process pays for it once. The
file stays in the page cache (the CPU side of the read alone;
``--cold``: dropped before every run, ``posix_fadvise(DONTNEED)`` and ``drop_caches`` where
allowed). Reported per setting: median seconds, GB/s of data-file bytes, CPU seconds per GB
(user + system, all threads) and minor page faults of the read; and each mode's median over the
first mode's.
``--mib 5 --tensors 2 --rounds 1`` finishes in seconds: a check of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import ckptq.io.read_buffers as read_buffers
from ckptq.checkpoint import open_checkpoint

read_buffers.POOLED = sys.argv[3] != "torch"
read_buffers.HUGE_PAGES = sys.argv[3] == "pool"
usage = lambda: resource.getrusage(resource.RUSAGE_SELF)
u0, t0 = usage(), time.perf_counter()
view = open_checkpoint(sys.argv[2])
fqns = [e.fqn for e in view.entries() if e.kind != "bytes"]
view.will_read(fqns)
for fqn in fqns:
    view.read(fqn)
view.close()
s, u1 = time.perf_counter() - t0, usage()
cpu_s = u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime
print(json.dumps({"s": s, "cpu_s": cpu_s, "faults": u1.ru_minflt - u0.ru_minflt}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=64.0, help="MiB per bf16 tensor of the saved checkpoint")
    ap.add_argument("--tensors", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cold", action="store_true", help="drop the files from the page cache before every run")
    ap.add_argument("--source", default=None, help="read this checkpoint instead of saving one")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--modes", default="pool,torch", help="comma-separated: pool, pool_4k, torch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"pool", "pool_4k", "torch"}:
        ap.error(f"--modes: pool, pool_4k or torch, not {args.modes!r}")

    import torch
    import torch.distributed.checkpoint as dcp
    from bench_gpu_checkpoint import _plain_read
    from bench_storage_io import drop_file_cache

    from ckptq.io import ChecksumFileSystemWriter

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-bench-pages-"))
    src = Path(args.source) if args.source else work / "ckpt"
    if not args.source:
        cols = 4096
        rows = max(1, int(args.mib * (1 << 20)) // (2 * cols))
        g = torch.Generator().manual_seed(0)
        sd = {
            f"layers.{i}.weight": torch.randn(rows, cols, generator=g).to(torch.bfloat16) for i in range(args.tensors)
        }
        dcp.save(sd, storage_writer=ChecksumFileSystemWriter(src), no_dist=True)
        del sd
    nbytes = sum(f.stat().st_size for f in src.glob("*.distcp"))
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for setting in modes[r % len(modes) :] + modes[: r % len(modes)]:
            if args.cold:
                drop_file_cache([src])
            else:  # in the page cache: read once first
                _plain_read(sorted(src.glob("*.distcp")), 1)
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(ROOT), str(src), setting], check=True, capture_output=True, text=True
            )
            runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for setting, xs in runs.items():
        s = statistics.median(x["s"] for x in xs)
        summary[setting] = {
            "median_s": round(s, 4),
            "GBps": round(nbytes / s / 1e9, 3),
            "cpu_s_per_GB": round(statistics.median(x["cpu_s"] for x in xs) / nbytes * 1e9, 3),
            "faults": int(statistics.median(x["faults"] for x in xs)),
            "runs_s": [round(x["s"], 4) for x in xs],
        }
    report = {
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()},
        "thp": _thp(),
        "source": str(args.source or f"{args.tensors} x {args.mib} MiB bf16"),
        "bytes": nbytes,
        "cold": args.cold,
        "rounds": args.rounds,
        "modes": summary,
        "over_first": {m: round(x["median_s"] / summary[modes[0]]["median_s"], 3) for m, x in summary.items()},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{report['source']}, {nbytes / 1e9:.3f} GB, {'cold' if args.cold else 'page cache'}, THP {report['thp']}")
    print("| destinations | median s | GB/s | CPU s per GB | minor faults |")
    print("|---|---|---|---|---|")
    for setting, x in summary.items():
        print(f"| {setting} | {x['median_s']} | {x['GBps']} | {x['cpu_s_per_GB']} | {x['faults']} |")
    for m, ratio in report["over_first"].items():
        if m != modes[0]:
            print(f"{m} takes {ratio}x the time of {modes[0]} (medians of {args.rounds})")


def _thp() -> str | None:
    """The kernel's transparent huge page mode (``[madvise]`` etc.), None where there is none."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    main()

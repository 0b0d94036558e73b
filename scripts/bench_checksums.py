"""Benchmark: what checksums cost a save and a load (goal: < 5% of save time).

One command: ``python scripts/bench_checksums.py [--gb 1.0] [--repeat 5] [--workdir DIR]``.

A state dict of about ``--gb`` GB of ckptq tensors (4096x4096 weights, alternately MXFP8 and
NVFP4, plus a bf16 norm per layer) is saved with ``dcp.save`` + ``QuantizedSavePlanner`` through

* DCP's ``FileSystemWriter`` with the planner's checksums turned off (the baseline: no checksums),
* DCP's ``FileSystemWriter`` as users call it (the planner hashes every value it hands the writer on
  a second thread and each rank writes a checksum file: ``save_planner_checksums``), and
* ``ckptq.io.ChecksumFileSystemWriter`` (crc32c of every chunk, hashed on a second thread),

in rotating order, ``--repeat`` times each, into fresh directories (each save fsyncs its files, as DCP
does by default; the previous output is removed and ``--settle`` seconds pass before each save).
The same is done for loads (``QuantizedLoadPlanner`` with
``SafeFileSystemReader``, ``verify_checksums`` on vs off) and for the hashing alone (``crc32c`` of
the same bytes on one thread). Reported: median seconds, GB/s, and the overhead ratio against the
baseline measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _state_dict(gb: float):
    import torch

    import ckptq

    sd, total, i = {}, 0, 0
    g = torch.Generator().manual_seed(0)
    while total < gb * 1e9:
        x = torch.randn(4096, 4096, generator=g) * 0.02
        q = ckptq.quantize(x, "mxfp8" if i % 2 == 0 else "nvfp4")
        sd[f"layers.{i}.weight"] = q
        sd[f"layers.{i}.norm"] = torch.randn(4096, generator=g).to(torch.bfloat16)
        total += sum(c.nbytes for c in q.components().values()) + 4096 * 2
        i += 1
    return sd, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds to wait after removing the previous output: on this VM a write into pages "
        "freed moments ago costs up to 3x more (see the Resharding section of docs/benchmarks.md)",
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    import crc32c
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.checksums import payload
    from ckptq.io import ChecksumFileSystemWriter, SafeFileSystemReader

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-bench-checksums-"))
    work.mkdir(parents=True, exist_ok=True)
    sd, nbytes = _state_dict(args.gb)
    saves = ["save_plain", "save_planner_checksums", "save_checksums"]
    times: dict[str, list[float]] = {k: [] for k in (*saves, "load_unverified", "load_verified", "hash_only")}

    class NoChecksumsPlanner(ckptq.QuantizedSavePlanner):  # the baseline: the planner hashes nothing
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            self.checksums_by_writer()
            return plan

    for r in range(args.repeat):
        for kind in saves[r % 3 :] + saves[: r % 3]:
            path = work / f"{kind}"
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            time.sleep(args.settle)  # let the host take back the freed pages before every save alike
            writer = ChecksumFileSystemWriter(path) if kind == "save_checksums" else dcp.FileSystemWriter(path)
            planner = NoChecksumsPlanner() if kind == "save_plain" else ckptq.QuantizedSavePlanner()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
            times[kind].append(time.perf_counter() - t0)
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        for kind, verify in (("load_unverified", False), ("load_verified", True)):
            t0 = time.perf_counter()
            dcp.load(
                target,
                storage_reader=SafeFileSystemReader(work / "save_checksums"),
                planner=ckptq.QuantizedLoadPlanner(verify_checksums=verify),
                no_dist=True,
            )
            times[kind].append(time.perf_counter() - t0)
        views = [
            payload(c)
            for v in sd.values()
            for c in (v.components().values() if isinstance(v, ckptq.QuantizedTensor) else [v])
        ]
        t0 = time.perf_counter()
        for m in views:
            crc32c.crc32c(m)
        times["hash_only"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "bytes": nbytes,
        "repeat": args.repeat,
        "median_s": med,
        "runs_s": times,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "save_overhead": med["save_checksums"] / med["save_plain"] - 1,
        "save_overhead_planner_checksums": med["save_planner_checksums"] / med["save_plain"] - 1,
        "load_overhead": med["load_verified"] / med["load_unverified"] - 1,
        "hash_share_of_save_if_serial": med["hash_only"] / med["save_plain"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

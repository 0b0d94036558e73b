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

Where CUDA is available (``--cuda auto``, the default; ``--cuda on|off``), the same state dict on
the GPU is saved too (``--cuda-gb`` of it), through the same three writers plus
``save_planner_checksums_hostcopy`` (the planner's checksums with the GPU kernel turned off
(``CKPTQ_BACKEND=reference``): each CUDA tensor copied to the host and hashed there, as before the
kernel); ``hash_only_gpu`` is the kernel alone over the same tensors (``ckptq.ops.crc32c``,
synchronized), ``hash_only_host_copy`` a host copy plus ``crc32c`` of each. Its results are under
``"cuda"`` in the JSON, with the same fields.
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


def _timed_saves(sd, work: Path, saves: list[str], args, *, cuda: bool) -> dict[str, list[float]]:
    """``--repeat`` saves of ``sd`` of each kind in ``saves``, rotating order; seconds per kind."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.io import ChecksumFileSystemWriter

    class NoChecksumsPlanner(ckptq.QuantizedSavePlanner):  # the baseline: the planner hashes nothing
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            self.checksums_by_writer()
            return plan

    times: dict[str, list[float]] = {k: [] for k in saves}
    for r in range(args.repeat):
        for kind in saves[r % len(saves) :] + saves[: r % len(saves)]:
            path = work / kind
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            time.sleep(args.settle)  # let the host take back the freed pages before every save alike
            writer = ChecksumFileSystemWriter(path) if kind == "save_checksums" else dcp.FileSystemWriter(path)
            planner = NoChecksumsPlanner() if kind == "save_plain" else ckptq.QuantizedSavePlanner()
            hostcopy = kind.endswith("_hostcopy")
            if hostcopy:
                os.environ["CKPTQ_BACKEND"] = "reference"  # ckptq.ops.crc32c serves nothing: the host-copy path
            try:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
                times[kind].append(time.perf_counter() - t0)
            finally:
                if hostcopy:
                    os.environ.pop("CKPTQ_BACKEND")
    return times


def _summary(times: dict[str, list[float]], nbytes: int, args) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "bytes": nbytes,
        "repeat": args.repeat,
        "median_s": med,
        "runs_s": times,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "save_overhead": med["save_checksums"] / med["save_plain"] - 1,
        "save_overhead_planner_checksums": med["save_planner_checksums"] / med["save_plain"] - 1,
    }
    if "save_planner_checksums_hostcopy" in med:
        out["save_overhead_planner_checksums_hostcopy"] = med["save_planner_checksums_hostcopy"] / med["save_plain"] - 1
    return out


def _components(sd) -> list:
    import ckptq

    return [c for v in sd.values() for c in (v.components().values() if isinstance(v, ckptq.QuantizedTensor) else [v])]


def _cuda_run(sd_cpu, args, work: Path) -> dict:
    import crc32c
    import torch

    from ckptq import ops
    from ckptq.checksums import payload

    sd = {k: v.to("cuda") for k, v in sd_cpu.items()}
    nbytes = sum(c.nbytes for c in _components(sd))
    saves = ["save_plain", "save_planner_checksums", "save_checksums", "save_planner_checksums_hostcopy"]
    times = _timed_saves(sd, work / "cuda", saves, args, cuda=True)
    comps = _components(sd)
    kernel = ops.crc32c(comps[0]) is not None
    times["hash_only_gpu"], times["hash_only_host_copy"] = [], []
    for _ in range(args.repeat):
        if kernel:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            values = [ops.crc32c(c) for c in comps]
            torch.cuda.synchronize()
            times["hash_only_gpu"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        host = [crc32c.crc32c(payload(c)) for c in comps]
        times["hash_only_host_copy"].append(time.perf_counter() - t0)
        if kernel:
            assert [int(v) for v in values] == host, "GPU and host crc32c differ"
    out = _summary({k: v for k, v in times.items() if v}, nbytes, args)
    out["device"] = torch.cuda.get_device_name(0)
    out["gpu_kernel"] = kernel
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--cuda-gb", type=float, default=None, help="size of the CUDA state dict (default: --gb)")
    ap.add_argument("--cuda", choices=("auto", "on", "off"), default="auto")
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
    from ckptq.io import SafeFileSystemReader

    use_cuda = args.cuda == "on" or (args.cuda == "auto" and torch.cuda.is_available())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-bench-checksums-"))
    work.mkdir(parents=True, exist_ok=True)
    sd, nbytes = _state_dict(args.gb)
    saves = ["save_plain", "save_planner_checksums", "save_checksums"]
    times = _timed_saves(sd, work, saves, args, cuda=False)
    times.update({k: [] for k in ("load_unverified", "load_verified", "hash_only")})
    views = [payload(c) for c in _components(sd)]
    for _ in range(args.repeat):
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
        t0 = time.perf_counter()
        for m in views:
            crc32c.crc32c(m)
        times["hash_only"].append(time.perf_counter() - t0)
    result = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        **_summary(times, nbytes, args),
        "settle_s": args.settle,
        "workdir": str(work),
    }
    med = result["median_s"]
    result["load_overhead"] = med["load_verified"] / med["load_unverified"] - 1
    result["hash_share_of_save_if_serial"] = med["hash_only"] / med["save_plain"]
    if use_cuda:
        if args.cuda_gb is not None and args.cuda_gb != args.gb:
            sd, _ = _state_dict(args.cuda_gb)
        result["cuda"] = _cuda_run(sd, args, work)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

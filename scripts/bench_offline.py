"""Benchmark the offline tools (convert, export, reshard) on the CPU and on a CUDA device against the disk.

``python scripts/bench_offline.py [--gb 1.0] [--repeat 3] [--devices cpu,cuda] [--workdir DIR] [--json PATH]``

1. Disk probe: a plain file of the source's size written with 16 MiB writes + ``fsync`` (write GB/s),
   dropped from the page cache (``posix_fadvise(DONTNEED)``, no root needed), read back with 16 MiB
   ``readinto`` calls (read GB/s): what one sequential stream gets from this disk. The file is kept
   and read again (cold) right before every timed run: these virtio disks move by +-20% from one
   read to the next, so each run is set against the disk's read speed of that moment.
2. Sources (untimed): a TransformerEngine-shaped DCP checkpoint of about ``--gb`` GB written by DCP's
   default planner with the TE stand-in of ``tests/te_standin`` (every record a pickled TE tensor:
   per-tensor FP8 with its transposed copy and MXFP8 with its columnwise copy and swizzled scales,
   4096 x 4096, or ``--dim``: 8192 makes every data buffer 64 MiB), and its ckptq-native conversion
   (``convert --to native``).
3. Timed, each on every device of ``--devices`` (``cuda`` only where a CUDA device is there):
   ``read``: ``open_checkpoint`` + ``read`` of every entry, their order given first (``will_read``,
   as the tools give it; CPU; the source read every tool does);
   ``convert TE -> nvfp4``; ``convert TE -> native`` (no kernels: CPU only);
   ``export native -> modelopt nvfp4`` (every weight requantized); ``export native -> bf16``
   (compressed-tensors, every weight dequantized: ``ignore=["*"]``); ``reshard native -> mesh 2 + nvfp4``;
   ``reshard native -> mesh 2`` (byte copies: CPU only).
   Before every timed run the source's files are dropped from the page cache (``posix_fadvise(DONTNEED)``
   after ``sync``); the run ends with ``os.sync()`` (the output is on disk). Median of ``--repeat``.

``--cases read,convert`` runs only the cases whose name starts with one of the words.

Reported per case: seconds, CPU seconds of this process (all threads; and per GB of source), GB/s
of source bytes, the probe's read GB/s in the reads just before the runs (median), and
``disk_fraction``: the median over the runs of (source bytes / the read GB/s of the probe read just
before the run + output bytes / probe write GB/s) / seconds, the share of the disk-bound time (1.0 =
as fast as the probe's sequential read of the source plus write of the output; goal >= 0.8);
``disk_fraction_start_probe`` sets the median seconds against the first probe's faster read (the
measure before the probe was repeated). JSON (``--json``) + a markdown table on stdout.
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
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

CHUNK = 16 << 20


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far, all its threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_cache(path: Path) -> None:
    """Drop ``path``'s files (a file or a tree) from the page cache: ``sync``, then
    ``posix_fadvise(DONTNEED)`` on each (clean pages are dropped; no root needed)."""
    os.sync()
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def probe_read(path: Path, buf: bytearray) -> float:
    """Seconds of one cold sequential read of ``path`` (dropped from the page cache first) in
    ``len(buf)``-byte ``readinto`` calls into ``buf``."""
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def disk_probe(work: Path, nbytes: int) -> dict:
    """Sequential write (+ fsync) and two reads (after DONTNEED) of a plain file of ``nbytes``,
    ``work / "probe.bin"``, which is kept (:func:`probe_read` reads it again)."""
    path = work / "probe.bin"
    buf = bytearray(os.urandom(1 << 20) * (CHUNK >> 20))
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(left, CHUNK)
            f.write(memoryview(buf)[:n])
            left -= n
        os.fsync(f.fileno())
    t_write = time.perf_counter() - t0
    reads = [probe_read(path, buf) for _ in range(2)]
    t_read = min(reads)
    return {
        "bytes": nbytes,
        "write_s": round(t_write, 3),
        "write_GBps": round(nbytes / t_write / 1e9, 3),
        "read_s": round(t_read, 3),
        "read_GBps": round(nbytes / t_read / 1e9, 3),
        "read_runs_s": [round(x, 3) for x in reads],
    }


def make_te_checkpoint(path: Path, gb: float, dim: int = 4096) -> int:
    """Per-tensor FP8 and MXFP8 TE tensors (stand-in), ``dim`` x ``dim``, saved with DCP's default planner."""
    import torch.distributed.checkpoint as dcp
    from _te import standin

    te = standin()
    sd, total, i = {}, 0, 0
    g = torch.Generator().manual_seed(0)
    while total < gb * 1e9:
        x = (torch.randn(dim, dim, generator=g) * 0.02).to(torch.bfloat16)
        kind = "float8" if i % 2 == 0 else "mxfp8"
        t = te.make_te_tensor(x, kind, swizzled=kind == "mxfp8", seed=i)  # rowwise + columnwise
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = t
        total += sum(b.numel() * b.element_size() for b in te.te_buffers(t).values())
        i += 1
    dcp.save(sd, checkpoint_id=str(path))
    return len(sd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dim", type=int, default=4096, help="rows and columns of every source tensor")
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    ap.add_argument("--cases", default="", help="comma-separated words: run only the cases whose name starts with one")
    args = ap.parse_args()

    import ckptq
    from ckptq.checkpoint import open_checkpoint
    from ckptq.export import export_checkpoint

    t_start = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-bench-offline-"))
    work.mkdir(parents=True, exist_ok=True)
    te_src, native = work / "te", work / "native"
    for p in (te_src, native):
        shutil.rmtree(p, ignore_errors=True)
    t0 = time.perf_counter()
    n = make_te_checkpoint(te_src, args.gb, args.dim)
    ckptq.reshard_checkpoint(te_src, native, device="cpu")
    te_bytes, native_bytes = dir_bytes(te_src), dir_bytes(native)
    print(
        f"sources: TE {n} tensors {te_bytes / 1e9:.3f} GB, native {native_bytes / 1e9:.3f} GB "
        f"({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    probe = disk_probe(work, te_bytes)
    probe_path, probe_buf = work / "probe.bin", bytearray(CHUNK)
    print(f"disk probe: {probe}", file=sys.stderr)

    devices = [d for d in args.devices.split(",") if d]
    if "cuda" in devices and not torch.cuda.is_available():
        devices.remove("cuda")
    dst = work / "out"

    def read_all(src, piece=None):
        def run(device):
            import ckptq.io.fileio as fileio

            saved = fileio.PIECE_BYTES
            fileio.PIECE_BYTES = piece or saved  # a piece larger than any chunk: one preadv per run of bytes
            try:
                read(src)
            finally:
                fileio.PIECE_BYTES = saved

        return run

    def read(src):
        view = open_checkpoint(src)
        fqns = [e.fqn for e in view.entries() if e.kind != "bytes"]
        if hasattr(view, "will_read"):  # the order of the reads, as the tools give it
            view.will_read(fqns)
        for fqn in fqns:
            view.read(fqn)
        if hasattr(view, "close"):
            view.close()

    def reshard(src, **kw):
        return lambda device: ckptq.reshard_checkpoint(src, dst, overwrite=True, device=device, **kw)

    def export(**kw):
        return lambda device: export_checkpoint(
            native, dst, config=False, on_inexact="keep", overwrite=True, device=device, **kw
        )

    cases = [  # name, source, function, runs on the GPU
        ("read TE source (open + read every entry)", te_src, read_all(te_src), False),
        ("read native source (open + read every entry)", native, read_all(native), False),
        ("read native source, one thread per read", native, read_all(native, piece=1 << 62), False),
        ("convert TE -> nvfp4", te_src, reshard(te_src, to="nvfp4"), True),
        ("export native -> modelopt nvfp4", native, export(layout="modelopt", format="nvfp4"), True),
        ("export native -> bf16 (compressed-tensors)", native, export(layout="compressed-tensors", ignore=["*"]), True),
        ("reshard native -> mesh 2 + nvfp4", native, reshard(native, mesh="2", to="nvfp4"), True),
        ("reshard native -> mesh 2 (byte copies)", native, reshard(native, mesh="2"), False),
        ("convert TE -> native (no kernels)", te_src, reshard(te_src), False),
    ]
    wanted = [w.strip() for w in args.cases.split(",") if w.strip()]
    cases = [c for c in cases if not wanted or any(c[0].startswith(w) for w in wanted)]
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    results: list[dict] = []

    def save() -> dict:
        """The report so far, written to ``--json`` (after every case: a run cut short keeps its results)."""
        report = {
            "machine": {
                "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "gpu": gpu_name,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "workdir": str(work),
            "gb": args.gb,
            "dim": args.dim,
            "repeat": args.repeat,
            "te_source_bytes": te_bytes,
            "native_source_bytes": native_bytes,
            "disk_probe": probe,
            "results": results,
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2))
        return report

    for name, src, fn, gpu in cases:
        for device in devices if gpu else ["cpu"]:
            if time.perf_counter() - t_start > args.budget_s:
                results.append({"case": name, "device": device, "skipped": "time budget"})
                save()
                continue
            row = {"case": name, "device": device, "source_bytes": dir_bytes(src)}
            try:
                times, cpu, probes = [], [], []
                for _ in range(args.repeat):
                    shutil.rmtree(dst, ignore_errors=True)
                    probes.append(probe["bytes"] / probe_read(probe_path, probe_buf))  # the disk just now
                    drop_cache(src)
                    c0, t0 = _cpu_s(), time.perf_counter()
                    report = fn(device)
                    os.sync()
                    times.append(time.perf_counter() - t0)
                    cpu.append(_cpu_s() - c0)
                t = statistics.median(times)
                out_bytes = dir_bytes(dst) if dst.exists() else 0
                write_s = out_bytes / (probe["write_GBps"] * 1e9)
                fractions = [(row["source_bytes"] / rate + write_s) / x for rate, x in zip(probes, times, strict=True)]
                bound = row["source_bytes"] / (probe["read_GBps"] * 1e9) + write_s
                row.update(
                    seconds=round(t, 3),
                    runs_s=[round(x, 3) for x in times],
                    output_bytes=out_bytes,
                    GBps=round(row["source_bytes"] / t / 1e9, 3),
                    probe_read_GBps=round(statistics.median(probes) / 1e9, 3),
                    probe_runs_GBps=[round(x / 1e9, 3) for x in probes],
                    disk_fraction=round(statistics.median(fractions), 3),
                    disk_fraction_runs=[round(x, 3) for x in fractions],
                    disk_fraction_start_probe=round(bound / t, 3),
                    cpu_s=round(statistics.median(cpu), 3),
                    cpu_s_per_GB=round(statistics.median(cpu) / row["source_bytes"] * 1e9, 3),
                    ran_on=(report or {}).get("device", "cpu") if isinstance(report, dict) else "cpu",
                )
                if isinstance(report, dict) and "seconds" in report:
                    row["tool_seconds"] = {k: round(v, 3) for k, v in report["seconds"].items()}
            except Exception as e:  # noqa: BLE001 - recorded, the other cases still run
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            print(json.dumps(row), file=sys.stderr)
            results.append(row)
            save()
    shutil.rmtree(dst, ignore_errors=True)
    probe_path.unlink(missing_ok=True)

    save()
    print(
        f"machine: {os.cpu_count()} cores, GPU {gpu_name}, torch {torch.__version__}; disk probe: read "
        f"{probe['read_GBps']} GB/s (first), write {probe['write_GBps']} GB/s; median of {args.repeat}, caches "
        "dropped, the probe read again before every run"
    )
    print("| case | device | seconds | source GB/s | probe read GB/s (same runs) | disk fraction | CPU s per GB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "seconds" in r:
            print(
                f"| {r['case']} | {r['ran_on']} | {r['seconds']:.2f} | {r['GBps']} | {r['probe_read_GBps']} "
                f"| {r['disk_fraction']} | {r['cpu_s_per_GB']} |"
            )
        else:
            print(f"| {r['case']} | {r['device']} | {r.get('error') or r.get('skipped')} | | | | |")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

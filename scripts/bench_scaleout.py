"""Scale-out of the offline tools against the disk: ``reshard``, ``convert`` and ``export`` under
torchrun with 1, 2, 4, 8 processes on one host, beside the disk's own sequential bandwidth.

One command: ``python scripts/bench_scaleout.py --workdir /tmp/ckptq-scaleout --size-gb 20
--json OUT.json --markdown OUT.md [--only reshard,export] [--procs 1,8,2,4] [--budget-s 220]``.

1. The source (made once, reused when ``--workdir`` holds one of the asked size): ``--size-gb`` of
   FP8 per-tensor weights (``fp8_tensor``, scale_inv 1.0, random E4M3 bytes without NaN), 256 MiB
   each ([16384, 16384] E4M3), saved by one ``dcp.save`` with ckptq's planner over 8 writer threads
   (8 files). A pool of 4 random matrices is reused for every tensor: the bytes' values do not
   matter for I/O and generating them would take longer than writing them.
2. The disk probe, in this same run: ``--probe-gb`` written with 64 MiB ``write`` calls by 1 and by 8
   threads (one file each), ``fsync``; the files dropped from the page cache
   (``posix_fadvise(POSIX_FADV_DONTNEED)``; no root needed) and read back the same way. The disk's
   write / read bandwidth is the faster of the two stream counts.
3. Each run: the source files dropped from the page cache, then ``torchrun --standalone
   --nproc-per-node N`` of this script's worker, which joins a gloo group, waits at a barrier (the
   imports and start are outside the timing), runs the API call with ``distributed=True`` (N > 1),
   waits at a barrier, and writes its seconds and its ``/proc/self/io`` (``read_bytes`` /
   ``write_bytes``: bytes fetched from / sent to storage by that process) to a file. The output is
   deleted after each run (the disk holds the source and one output). ``OMP_NUM_THREADS`` = cores / N.

   * ``reshard``: to ``--mesh 8`` (FSDP2 ``Shard(0)``: every weight cut into 8 row chunks, copied by
     byte range);
   * ``convert``: the same with ``--to nvfp4`` (every weight dequantized and requantized);
   * ``export``: ``--layout modelopt --no-model-config --on-inexact keep`` with shards of two
     tensors (``max_shard_size`` 2.2 weights, so 8 processes get whole files each).

Reported per run: the call's seconds (rank 0, between the barriers), the whole command's wall, the
bytes read (the source's size) and written (the output's size), the aggregate GB/s ((read + written)
/ call), speedup and efficiency against 1 process, and the fraction of the disk's speed: the
disk-bound time ``read / disk read GB/s + written / disk write GB/s`` over the call's seconds
(reads and writes counted as not overlapping on the device, so 1.0 is the disk's speed for that
mix). ``--budget-s`` stops starting runs that the time left would not fit (they are listed as
skipped) and kills a run still going at the end of it (listed with the error). GB = 1e9 bytes.
``--combine A.json B.json ...`` merges the JSON of several calls on one machine (each a subset of
the runs, ``--only`` / ``--procs``) into one table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("reshard", "convert", "export")
CHUNK = 64 << 20


# ------------------------------------------------------------------------------ page cache, disk probe
def drop_cache(paths) -> None:
    """Drop ``paths`` (files, or folders: every file under them) from the page cache (clean pages only)."""
    for p in paths:
        p = Path(p)
        for f in [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _stream_write(path: Path, nbytes: int, buf: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)


def _stream_read(path: Path, buf: bytearray) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    return n


def probe_disk(workdir: Path, total_bytes: int, streams_list=(1, 8)) -> dict:
    """Sequential write (+ fsync) and read (after dropping the pages) of ``total_bytes`` split over
    1 and over 8 files, one thread each; GB/s per stream count and the best of them."""
    buf = memoryview(os.urandom(CHUNK))
    out: dict = {"bytes": total_bytes}
    for streams in streams_list:
        files = [workdir / f"probe-{streams}-{i}" for i in range(streams)]
        per = total_bytes // streams

        def run(fn, args_list):
            threads = [threading.Thread(target=fn, args=a) for a in args_list]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - t0

        tw = run(_stream_write, [(f, per, buf) for f in files])
        drop_cache(files)
        tr = run(_stream_read, [(f, bytearray(CHUNK)) for f in files])
        for f in files:
            f.unlink()
        out[f"write_gbps_{streams}"] = per * streams / tw / 1e9
        out[f"read_gbps_{streams}"] = per * streams / tr / 1e9
    out["write_gbps"] = max(v for k, v in out.items() if k.startswith("write_gbps_"))
    out["read_gbps"] = max(v for k, v in out.items() if k.startswith("read_gbps_"))
    return out


# ------------------------------------------------------------------------------ the source
def make_source(path: Path, size_gb: float, side: int) -> dict:
    """``size_gb`` of ``side`` x ``side`` FP8 per-tensor weights (rounded up to a multiple of 8
    tensors), reused when ``path`` already holds them."""
    count = max(8, -(-int(size_gb * 1e9 / (side * side)) // 8) * 8)
    stamp = path / "bench_scaleout.json"
    if (
        stamp.exists()
        and json.loads(stamp.read_text()).get("tensors") == count
        and json.loads(stamp.read_text()).get("side") == side
    ):
        return {**json.loads(stamp.read_text()), "reused": True}
    shutil.rmtree(path, ignore_errors=True)
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.formats.fp8 import Float8Recipe

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, 0x7F, (side, side), dtype=torch.uint8, generator=g) for _ in range(min(4, count))]
    one = torch.tensor(1.0)
    sd = {
        f"model.layers.{i}.mlp.proj.weight": ckptq.Float8Tensor(
            {"data": pool[i % len(pool)].view(torch.float8_e4m3fn), "scale_inv": one},
            (side, side),
            torch.bfloat16,
            Float8Recipe(),
        )
        for i in range(count)
    }
    t1 = time.perf_counter()
    writer = dcp.FileSystemWriter(str(path), thread_count=8, single_file_per_rank=True, sync_files=True)
    dcp.save(sd, storage_writer=writer, planner=ckptq.QuantizedSavePlanner())
    t2 = time.perf_counter()
    info = {
        "tensors": count,
        "side": side,
        "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "generate_s": t1 - t0,
        "save_s": t2 - t1,
    }
    stamp.write_text(json.dumps(info))
    return {**info, "reused": False}


# ------------------------------------------------------------------------------ one timed run
def worker(op: str, src: str, dst: str, result: str, side: int) -> None:
    """Under torchrun: barrier, the call, barrier; this process's seconds and /proc/self/io to ``result``.rank."""
    import torch.distributed as dist

    from ckptq.export import export_checkpoint
    from ckptq.reshard import reshard_checkpoint

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
        dist.barrier()
    t0 = time.perf_counter()
    if op == "export":
        export_checkpoint(
            src,
            dst,
            layout="modelopt",
            config=False,
            on_inexact="keep",
            max_shard_size=int(2.2 * side * side),  # two weights a file
            distributed=world > 1,
        )
    else:
        reshard_checkpoint(src, dst, mesh="8", to="nvfp4" if op == "convert" else None, distributed=world > 1)
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - t0
    with open("/proc/self/io") as f:
        io = {k: int(v) for k, v in (line.split(": ") for line in f)}
    Path(f"{result}.{rank}").write_text(json.dumps({"rank": rank, "seconds": seconds, **io}))
    if world > 1:
        dist.destroy_process_group()


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def timed_run(
    op: str, procs: int, src: Path, src_bytes: int, workdir: Path, cores: int, side: int, timeout: float | None
) -> dict:
    dst = workdir / f"out-{op}-{procs}"
    shutil.rmtree(dst, ignore_errors=True)
    res = workdir / f"result-{op}-{procs}"
    for f in workdir.glob(res.name + ".*"):
        f.unlink()
    drop_cache([src])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, cores // procs)),
        "CKPTQ_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    cmd += [str(Path(__file__).resolve()), "--worker", op, "--src", str(src), "--dst", str(dst), "--result", str(res)]
    cmd += ["--side", str(side)]
    t0 = time.perf_counter()
    with open(workdir / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: their own session
            proc.wait()
        wall = time.perf_counter() - t0
        err.seek(0)
        stderr = err.read()
    if proc.returncode != 0:
        for p in [dst, *workdir.glob(f".{dst.name}.ckptq-tmp-*")]:
            shutil.rmtree(p, ignore_errors=True)
        why = f"killed after {timeout:.0f} s (time budget)" if proc.returncode == -signal.SIGKILL else stderr[-3000:]
        return {"op": op, "procs": procs, "error": why, "wall_s": wall}
    ranks = sorted((json.loads(f.read_text()) for f in workdir.glob(res.name + ".*")), key=lambda r: r["rank"])
    for f in workdir.glob(res.name + ".*"):
        f.unlink()
    written = _dir_bytes(dst)
    shutil.rmtree(dst, ignore_errors=True)
    return {
        "op": op,
        "procs": procs,
        "wall_s": wall,
        "call_s": ranks[0]["seconds"],
        "read_bytes": src_bytes,
        "written_bytes": written,
        "io_read_bytes": sum(r["read_bytes"] for r in ranks),  # fetched from storage, all processes
        "io_write_bytes": sum(r["write_bytes"] for r in ranks),
        "io_rchar": sum(r["rchar"] for r in ranks),
    }


def summarize(runs: list[dict], disk: dict) -> None:
    """Add GB/s and the fraction of the disk (``disk``: the probe of the run's own call) to each
    measured run, and the speedup / efficiency against the same op's 1-process run in ``runs``."""
    for r in runs:
        if "call_s" not in r:
            continue
        moved = r["read_bytes"] + r["written_bytes"]
        r["gbps"] = moved / r["call_s"] / 1e9
        disk_s = r["read_bytes"] / (disk["read_gbps"] * 1e9) + r["written_bytes"] / (disk["write_gbps"] * 1e9)
        r["disk_bound_s"] = disk_s
        r["of_disk"] = disk_s / r["call_s"]
    _speedups(runs)


def _speedups(runs: list[dict]) -> None:
    base = {r["op"]: r["call_s"] for r in runs if r["procs"] == 1 and "call_s" in r}
    for r in runs:
        if "call_s" in r and r["op"] in base:
            r["speedup"] = base[r["op"]] / r["call_s"]
            r["efficiency"] = r["speedup"] / r["procs"]


def combine(paths: list[Path]) -> dict:
    """One result from several calls' JSON (the same machine; each a subset of the runs, e.g. the
    4-minute requests): every op x processes measured once (a measured run beats a skipped one;
    the first file wins otherwise), "of disk" against its own call's probe, speedups against the
    1-process run of whichever call measured it."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    best: dict = {}
    for res in results:
        for r in res["runs"]:
            r = {**r, "date": res["date"]}
            key = (r["op"], r["procs"])
            if key not in best or ("call_s" in r and "call_s" not in best[key]):
                best[key] = r
    runs = sorted(best.values(), key=lambda r: (OPS.index(r["op"]), r["procs"]))
    _speedups(runs)
    return {
        **results[0],
        "date": ", ".join(dict.fromkeys(res["date"] for res in results)),
        "machines": sorted({res["machine"] for res in results}),
        "probes": [{"date": res["date"], **res["disk"]} for res in results],
        "combined_from": [str(p) for p in paths],
        "runs": runs,
    }


def markdown(result: dict) -> str:
    lines = [
        f"Machine: {'; '.join(result.get('machines', [result['machine']]))}; {result['date']}; source "
        f"{result['source']['bytes'] / 1e9:.1f} GB ({result['source']['tensors']} FP8 tensors of "
        f"{result['source']['side']}^2 bytes).",
        "",
    ]
    for d in result.get("probes", [result["disk"]]):
        lines.append(
            f"Disk probe{' of ' + d['date'] if 'date' in d else ''} ({d['bytes'] / 1e9:.1f} GB, fsync, page cache "
            f"dropped before reading): write {d['write_gbps_1']:.2f} GB/s (1 stream) / {d['write_gbps_8']:.2f} "
            f"(8 streams); read {d['read_gbps_1']:.2f} / {d['read_gbps_8']:.2f} GB/s."
        )
    lines += [
        "",
        "| op | processes | call (s) | wall (s) | read + written (GB) | GB/s | speedup | efficiency | of disk |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if "call_s" not in r:
            why = "skipped (time budget)" if r.get("skipped") else r["error"].splitlines()[-1][:80]
            lines.append(f"| {r['op']} | {r['procs']} | {why} | | | | | | |")
            continue
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        ef = f"{r['efficiency']:.2f}" if "efficiency" in r else ""
        lines.append(
            f"| {r['op']} | {r['procs']} | {r['call_s']:.2f} | {r['wall_s']:.1f} | "
            f"{r['read_bytes'] / 1e9:.1f} + {r['written_bytes'] / 1e9:.1f} | {r['gbps']:.2f} | {sp} | {ef} | "
            f"{r['of_disk']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckptq-scaleout"))
    ap.add_argument("--size-gb", type=float, default=20.0)
    ap.add_argument("--probe-gb", type=float, default=4.0)
    ap.add_argument("--side", type=int, default=16384, help="each weight is side x side E4M3 (16384: 256 MiB)")
    ap.add_argument("--procs", default="1,8,2,4", help="process counts, in the order run (1 first: the baseline)")
    ap.add_argument("--only", default=",".join(OPS), help="ops to run, comma-separated")
    ap.add_argument(
        "--runs", help="op:procs pairs in the order run, e.g. export:1,export:8,convert:4 (instead of --only/--procs)"
    )
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop starting runs past this many seconds (0: none)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--keep-source", action="store_true", help="leave the source in --workdir for a next call")
    ap.add_argument("--worker", choices=OPS, help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--combine", type=Path, nargs="+", help="merge these calls' --json files (no runs)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.src, args.dst, args.result, args.side)
        return
    if args.combine:
        _emit(combine(args.combine), args)
        return
    t_start = time.perf_counter()
    if args.runs:
        todo = [(op, int(n)) for op, n in (pair.split(":") for pair in args.runs.split(","))]
    else:  # every op's 1 and 8 first: what a budget cut leaves out is the middle
        todo = [(op, int(n)) for n in args.procs.split(",") for op in args.only.split(",") if op]
    ops = list(dict.fromkeys(op for op, _ in todo))
    assert set(ops) <= set(OPS), ops
    args.workdir.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    src = args.workdir / "src"
    size_gb, asked = args.size_gb, args.size_gb
    if not (src / "bench_scaleout.json").exists():  # the source + one output (convert's is smaller) + the probe
        free = shutil.disk_usage(args.workdir).free / 1e9
        size_gb = min(size_gb, (free - args.probe_gb - 1.0) / 2.2)
        if size_gb < asked:
            print(f"only {free:.1f} GB free in {args.workdir}: the source is {size_gb:.1f} GB, not {asked}", flush=True)
    source = make_source(src, size_gb, args.side)
    source["asked_gb"] = asked
    disk = probe_disk(args.workdir, int(args.probe_gb * 1e9))
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    result = {
        "machine": f"{cpu}, {cores} cores usable, {ram:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": cores,
        "source": source,
        "disk": disk,
        "runs": [],
    }
    durations: dict[str, float] = {}  # op -> the last run's wall: the estimate for the next
    for op, n in todo:
        left = args.budget_s - (time.perf_counter() - t_start)
        if args.budget_s and left < max(10.0, durations.get(op, 0.0) * 1.1):
            result["runs"].append({"op": op, "procs": n, "skipped": True})
            continue
        r = timed_run(op, n, src, source["bytes"], args.workdir, cores, args.side, left if args.budget_s else None)
        durations[op] = r["wall_s"] if n == 1 else min(durations.get(op, r["wall_s"]), r["wall_s"])
        result["runs"].append(r)
        print(json.dumps(r)[:400], flush=True)
    result["runs"].sort(key=lambda r: (ops.index(r["op"]), r["procs"]))
    summarize(result["runs"], disk)
    result["total_s"] = time.perf_counter() - t_start
    if not args.keep_source:
        shutil.rmtree(src, ignore_errors=True)
    _emit(result, args)


def _emit(result: dict, args) -> None:
    """Print the markdown table of ``result``; write it and the JSON where ``--markdown`` / ``--json`` say."""
    md = markdown(result)
    print(md)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.markdown:
        args.markdown.write_text(md)


if __name__ == "__main__":
    main()

"""A timeline of one cold read of a checkpoint against its disk: where the disk waits.

``python scripts/trace_read.py --source DIR [--mode view|probe] [--rounds 2] [--device vda] [--out trace.json]``

The source's files are dropped from the page cache (``posix_fadvise(DONTNEED)``), then read by
``view`` (``ckptq.open_checkpoint(DIR)`` + ``will_read`` + ``read`` of every entry, what the
offline tools do) or by ``probe`` (its data files in 16 MiB ``readinto`` calls into one buffer: the
disk's own sequential speed), while a thread samples the disk's ``/proc/diskstats`` line (the
device that holds ``DIR``) every 2 ms. Events recorded, seconds from the start:

* ``("disk", t, sectors_read, ios_in_flight, io_ms)``;
* ``("piece", start, end, bytes, file_offset, thread)``: each ``preadv`` run of the view (or each
  ``readinto`` of the probe);
* ``("fadvise", start, end, offset, length, advice)``: every ``posix_fadvise`` (3 = ``WILLNEED``,
  2 = ``SEQUENTIAL``, 4 = ``DONTNEED``);
* ``("open", 0, end)``, ``("entry", start, end, fqn)``, ``("end", t)``.

Printed per round: seconds, the open's seconds, the disk's GB/s in 50 ms windows, the fraction of
samples with I/O in flight and their mean depth, and what the disk read during the open. Linux
only (``/proc/diskstats``); the device found from the directory's ``st_dev`` unless ``--device``
names it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def disk_name(path: Path) -> str:
    """The ``/proc/diskstats`` name of the block device that holds ``path``."""
    dev = os.stat(path).st_dev
    for line in open("/proc/diskstats"):
        f = line.split()
        if (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return f[2]
    raise SystemExit(f"{path}: its device {os.major(dev)}:{os.minor(dev)} is not in /proc/diskstats")


def trace(src: Path, mode: str, dev: str) -> list:
    """One cold read of ``src`` (see the module docstring); the events."""
    from bench_offline import drop_cache

    import ckptq.checkpoint as cp

    events: list = []
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for line in open("/proc/diskstats"):
                f = line.split()
                if f[2] == dev:
                    events.append(("disk", now(), int(f[5]), int(f[11]), int(f[12])))
            time.sleep(0.002)

    real_piece, real_fadvise = cp.CheckpointView._pread_range, os.posix_fadvise

    def piece(self, c, into, at):
        t = now()
        real_piece(self, c, into, at)
        events.append(("piece", t, now(), len(into), c.payload + at, threading.current_thread().name))

    def fadvise(fd, offset, length, advice):
        t = now()
        real_fadvise(fd, offset, length, advice)
        events.append(("fadvise", t, now(), offset, length, advice))

    drop_cache(src)
    time.sleep(0.2)
    cp.CheckpointView._pread_range, os.posix_fadvise = piece, fadvise
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        t0 = time.perf_counter()
        sampler.start()
        if mode == "probe":
            buf = bytearray(16 << 20)
            for f in sorted(src.glob("*.distcp")):
                with open(f, "rb", buffering=0) as fh:
                    while True:
                        t = now()
                        n = fh.readinto(buf)
                        events.append(("piece", t, now(), n, 0, "main"))
                        if not n:
                            break
        else:
            view = cp.open_checkpoint(src)
            events.append(("open", 0.0, now()))
            fqns = [e.fqn for e in view.entries() if e.kind != "bytes"]
            view.will_read(fqns)
            for fqn in fqns:
                t = now()
                view.read(fqn)
                events.append(("entry", t, now(), fqn))
            view.close()
        events.append(("end", now()))
        time.sleep(0.02)
    finally:
        done.set()
        sampler.join()
        cp.CheckpointView._pread_range, os.posix_fadvise = real_piece, real_fadvise
    return events


def summary(events: list) -> dict:
    """Seconds, the open, the disk's GB/s per 50 ms, busy fraction and depth, bytes read in the open."""
    end = next(e[1] for e in events if e[0] == "end")
    disk = [e for e in events if e[0] == "disk"]
    s0 = disk[0][2]
    points = [(e[1], (e[2] - s0) * 512) for e in disk]
    windows, t = [], 0.0
    while t < end:
        a = next((p for p in points if p[0] >= t), None)
        b = next((p for p in points if p[0] >= t + 0.05), None)
        if a and b and b[0] > a[0]:
            windows.append(round((b[1] - a[1]) / (b[0] - a[0]) / 1e9, 2))
        t += 0.05
    during = [e[3] for e in disk if e[1] < end]
    opened = next((e[2] for e in events if e[0] == "open"), 0.0)
    in_open = [p[1] for p in points if p[0] <= opened]
    return {
        "seconds": round(end, 3),
        "open_s": round(opened, 3),
        "disk_GBps_per_50ms": windows,
        "busy_fraction": round(sum(1 for x in during if x > 0) / max(1, len(during)), 2),
        "mean_in_flight": round(sum(during) / max(1, len(during)), 1),
        "MB_read_during_open": round((in_open[-1] if in_open else 0) / 1e6, 1),
        "MB_read": round(points[-1][1] / 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True)
    ap.add_argument("--mode", choices=("view", "probe"), default="view")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default=None, help="the /proc/diskstats name to sample (default: the source's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    src = Path(args.source)
    dev = args.device or disk_name(src)
    runs = []
    for r in range(args.rounds):
        events = trace(src, args.mode, dev)
        runs.append({"summary": summary(events), "events": events})
        print(f"{args.mode} {src.name} round {r} on {dev}: {json.dumps(runs[-1]['summary'])}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"source": str(src), "mode": args.mode, "device": dev, "runs": runs}))


if __name__ == "__main__":
    main()

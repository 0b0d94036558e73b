"""Do a checkpoint's files read slower than the disk probe's one file, and why? Two diagnostics.

``python scripts/bench_disk_layout.py layout [--gib 4] [--rounds 3] [--dir D] [--out r.json]``: the same
bytes written as one file, as 8 files written at once by 8 threads (as ``ChecksumFileSystemWriter``
writes a rank's files: 32 MiB ``pwrite`` calls, ``fdatasync`` every 64 MiB on a side thread, fsync
at the end), and as 8 such files each ``posix_fallocate``-d to its size first; for each: write GB/s,
extents per file (``filefrag``), and read GB/s after the cache is dropped with one stream over the
files, 4 threads and 8 threads (a file per thread).

``python scripts/bench_disk_layout.py age [--gib 4] [--fill-gib 12] [--rounds 3]``: a file read right
after it was written (as the disk probe reads its file) against the same file and 8 files read
after ``--fill-gib`` GiB of other writes (as a load reads a checkpoint saved earlier): whether a
cache below the machine makes fresh data read faster.

Page cache dropped before every read (``posix_fadvise(DONTNEED)`` and ``drop_caches`` where
allowed). ``--gib 0.05 --rounds 1`` is a quick check of the script (``tests/test_bench_scripts.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MB = 1 << 20
PIECE = 32 * MB


def _write_file(path: Path, nbytes: int, block: memoryview, falloc: bool, sync_every: int = 64 * MB) -> None:
    """``nbytes`` of ``block`` repeated into ``path`` as ckptq's writer writes a data file: whole-piece
    ``pwritev`` calls, write-back started every ``sync_every`` bytes (:class:`ckptq.io.fileio.Flusher`),
    fsynced at the end; ``falloc``: ``posix_fallocate`` of the whole size first."""
    from ckptq.io.fileio import Flusher, pwrite_all

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if falloc:
            os.posix_fallocate(fd, 0, nbytes)
        flusher, pos = Flusher(fd, sync_every), 0
        try:
            while pos < nbytes:
                n = pwrite_all(fd, [block[: min(len(block), nbytes - pos)]], pos)
                flusher.wrote(n)
                pos += n
        finally:
            flusher.close(fsync=True)
    finally:
        os.close(fd)


def write_set(d: Path, files: int, nbytes: int, block: memoryview, falloc: bool = False) -> tuple[list, float]:
    """``nbytes`` in ``files`` files of ``d`` written at once (a thread each); (paths, seconds)."""
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / f"f{i}" for i in range(files)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(lambda p: _write_file(p, nbytes // files, block, falloc), paths))
    return paths, time.perf_counter() - t0


def read_set(paths: list, threads: int) -> float:
    """GB/s reading ``paths`` whole (32 MiB reads), ``threads`` files at once, cache dropped first."""
    from bench_storage_io import drop_file_cache

    drop_file_cache(paths)
    todo, lock = iter(paths), threading.Lock()

    def worker() -> int:
        buf, got = bytearray(PIECE), 0
        while True:
            with lock:
                p = next(todo, None)
            if p is None:
                return got
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    got += n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda _: worker(), range(threads)))
    return total / (time.perf_counter() - t0) / 1e9


def extents(paths: list) -> list:
    out = []
    for p in paths:
        try:
            r = subprocess.run(["filefrag", str(p)], capture_output=True, text=True, check=True)
            out.append(int(r.stdout.rsplit(":", 1)[1].split()[0]))
        except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
            out.append(None)  # no filefrag here
    return out


def layout_round(root: Path, nbytes: int, block: memoryview) -> dict:
    out = {}
    for name, files, falloc in (("one_file", 1, False), ("eight_files", 8, False), ("eight_fallocated", 8, True)):
        paths, secs = write_set(root / name, files, nbytes, block, falloc)
        r = out[name] = {"write_GBps": nbytes / secs / 1e9, "extents": extents(paths), "read1_GBps": read_set(paths, 1)}
        if files > 1:
            r["read4_GBps"], r["read8_GBps"] = read_set(paths, 4), read_set(paths, 8)
        shutil.rmtree(root / name)
    return out


def age_round(root: Path, nbytes: int, fill: int, block: memoryview) -> dict:
    one, _ = write_set(root / "one", 1, nbytes, block)
    out = {"one_file_right_after": read_set(one, 1)}
    eight, _ = write_set(root / "eight", 8, nbytes, block)
    out["eight_files_right_after"] = read_set(eight, 1)
    write_set(root / "fill", 8, fill, block)
    out["eight_files_later"] = read_set(eight, 1)
    out["one_file_later"] = read_set(one, 1)
    out["eight_files_later_8_threads"] = read_set(eight, 8)
    shutil.rmtree(root)
    return out


def main() -> None:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("layout", "age"))
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--fill-gib", type=float, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptq-disk-layout")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root, nbytes = Path(args.dir), int(args.gib * 2**30)
    block = memoryview(np.random.default_rng(0).integers(0, 255, PIECE, dtype=np.uint8)).cast("B")
    rounds = []
    for _ in range(args.rounds):
        if args.what == "layout":
            r = layout_round(root, nbytes, block)
        else:
            r = age_round(root, nbytes, int(args.fill_gib * 2**30), block)
        rounds.append(r)
        print(json.dumps(r), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"what": args.what, "GiB": args.gib, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()

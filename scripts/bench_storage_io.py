"""Storage writer / reader throughput on the CPU: ckptq's vs DCP's, against the disk's own bandwidth.

``python scripts/bench_storage_io.py [--gb 0.5] [--repeat 3] [--dir /tmp/ckptq-io] [--out r.json]``: one
process (``no_dist``), CPU tensors of a Llama-style layer shape (4096 x 4096 and 14336 x 4096 pieces),
``--gb`` GB of bf16 in all. Measured in one run, every case once per round (rounds interleaved, so a
disk whose speed drifts favours no case), median of ``--repeat`` rounds:

* disk probe (:func:`disk_probe`): one plain large file written with 64 MiB ``write`` calls and
  fsynced, then read back with 32 MiB reads after ``posix_fadvise(DONTNEED)`` (and
  ``drop_caches`` where allowed): the disk's sequential bandwidth for this process;
* saves (``dcp.save``, files fsynced) of the bf16 state dict and of the same tensors quantized
  (attention MXFP8, MLP NVFP4: ckptq native) with DCP's ``FileSystemWriter`` (its defaults: one
  thread) and ``ckptq.io.ChecksumFileSystemWriter`` (checksums on) at each ``--threads`` value,
  and the high-precision save (``QuantizedSavePlanner(mode="high_precision")``: bf16 values);
* loads (page cache dropped first, as for the probe) of each checkpoint with DCP's
  ``FileSystemReader`` and ``ckptq.io.SafeFileSystemReader`` (checksums verified; its default
  ``thread_count``, and ``_t{n}`` cases at the other ``--threads`` values), each with the CPU
  seconds the process used during it (all threads; ``cpu_s_per_GB``).

GB/s = bytes of the checkpoint's data files / seconds. ``--gb 0.05 --repeat 1`` finishes in seconds
(``tests/test_bench_scripts.py`` runs it as a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 1 << 20


def drop_file_cache(paths) -> bool:
    """Evict the page cache of ``paths`` (files or directories, walked): ``posix_fadvise(DONTNEED)``
    on each file (its pages are clean after the fsync of a save), then ``drop_caches`` where this
    process may write it. Returns whether ``drop_caches`` worked."""
    for p in paths:
        p = Path(p)
        for f in [p] if p.is_file() else (x for x in p.rglob("*") if x.is_file()):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def disk_probe(path: Path, nbytes: int, barrier=lambda: None) -> dict:
    """The disk's sequential bandwidth: ``nbytes`` written to one new file with 64 MiB ``write``
    calls then fsynced (timed from open to the end of the fsync), the file's cache dropped
    (:func:`drop_file_cache`), then read back with 32 MiB ``readinto`` calls. ``barrier`` is called
    before each timed part (all ranks of a multi-process run probe at once)."""
    import numpy as np

    block = np.random.default_rng(0).integers(0, 255, 64 * MB, dtype=np.uint8)
    n = max(1, nbytes // block.nbytes)
    barrier()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(n):
            f.write(block)
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    dropped = drop_file_cache([path])
    buf = bytearray(32 * MB)
    barrier()
    t0 = time.perf_counter()
    got = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            got += k
    read_s = time.perf_counter() - t0
    os.remove(path)
    total = n * block.nbytes
    return {
        "GB": total / 1e9,
        "write_s": write_s,
        "read_s": read_s,
        "write_GBps": total / write_s / 1e9,
        "read_GBps": got / read_s / 1e9,
        "caches_dropped": dropped,
    }


def data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.distcp"))


def _state_dicts(gb: float):
    import torch

    import ckptq

    g = torch.Generator().manual_seed(0)
    shapes = [("self_attn.q_proj", (4096, 4096)), ("mlp.gate_proj", (14336, 4096))]
    bf16, total, i = {}, 0, 0
    while total < gb * 1e9:
        name, shape = shapes[i % 2]
        if i % 2 == 1 and total + 14336 * 4096 * 2 > gb * 1e9:  # small sizes: attention pieces only
            shape = (max(128, int((gb * 1e9 - total) // (2 * 4096)) // 128 * 128), 4096)
        bf16[f"layers.{i // 2}.{name}.weight"] = torch.randn(shape, generator=g, dtype=torch.bfloat16)
        total += shape[0] * shape[1] * 2
        i += 1
    rules = {"*.self_attn.*": "mxfp8", "*.mlp.*": "nvfp4"}
    return bf16, ckptq.quantize_state_dict(bf16, rules)


def _cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far, all its threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rounds(cases: dict, repeat: int, cpu: dict | None = None) -> dict:
    """Every case once per round, ``repeat`` rounds: name -> list of seconds of ``case()`` (and,
    into ``cpu`` when given, name -> list of the process's CPU seconds during each)."""
    out = {name: [] for name in cases}
    for _ in range(repeat):
        for name, (prepare, run) in cases.items():
            prepare()
            c0, t0 = _cpu_s(), time.perf_counter()
            run()
            out[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(name, []).append(_cpu_s() - c0)
    return out


def table(report: dict) -> str:
    """The markdown table of a run's JSON (``--table``): GB/s of every save and load, and vs the probe."""
    p = report["disk_probe"]
    lines = [
        f"{report['cpu_count']} CPUs, torch {report['torch']}, {report['gb_bf16']} GB of bf16, "
        f"{report['repeat']} rounds; disk probe: write {p['write_GBps']:.2f} GB/s, read {p['read_GBps']:.2f} GB/s",
        "",
        "| case | GB | seconds (median) | GB/s | vs disk probe |",
        "|---|---|---|---|---|",
    ]
    for name, v in report["saves"].items():
        lines.append(
            f"| save {name} | {v['GB']:.3f} | {v['s']:.3f} | {v['GBps']:.2f} | {v['GBps'] / p['write_GBps']:.2f} |"
        )
    for name, v in report["loads"].items():
        cpu = f" ({v['cpu_s_per_GB']:.2f} CPU s/GB)" if "cpu_s_per_GB" in v else ""
        lines.append(f"| load {name}{cpu} | | {v['s']:.3f} | {v['GBps']:.2f} | {v['GBps'] / p['read_GBps']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.5, help="GB of bf16 in the state dict")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="1,4", help="thread_count values of ckptq's writer/reader")
    ap.add_argument("--buffer-mib", type=int, default=None, help="buffer_bytes of ckptq's writer/reader, MiB")
    ap.add_argument("--dir", default="/tmp/ckptq-io")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, help="print the markdown table of a run's JSON and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return

    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.io import ChecksumFileSystemWriter, SafeFileSystemReader

    warnings.filterwarnings("ignore", message=".*(assuming the intent|existing checkpoint).*")
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    bf16, native = _state_dicts(args.gb)
    threads = [int(t) for t in args.threads.split(",")]
    knobs = {} if args.buffer_mib is None else {"buffer_bytes": args.buffer_mib * MB}
    probe = disk_probe(root / "probe", max(int(args.gb * 1e9), 256 * MB))

    saves = {  # name: (state dict, planner maker, writer maker)
        "bf16_dcp_writer": (bf16, lambda: None, lambda p: dcp.FileSystemWriter(p)),
        "native_dcp_writer": (native, ckptq.QuantizedSavePlanner, lambda p: dcp.FileSystemWriter(p)),
    }
    for n in threads:
        saves[f"bf16_ckptq_writer_t{n}"] = (
            bf16,
            lambda: None,
            lambda p, n=n: ChecksumFileSystemWriter(p, thread_count=n, **knobs),
        )
        saves[f"native_ckptq_writer_t{n}"] = (
            native,
            ckptq.QuantizedSavePlanner,
            lambda p, n=n: ChecksumFileSystemWriter(p, thread_count=n, **knobs),
        )
    saves["high_precision_ckptq_writer"] = (
        native,
        lambda: ckptq.QuantizedSavePlanner(mode="high_precision"),
        lambda p: ChecksumFileSystemWriter(p, **knobs),
    )

    def save_case(name, sd, planner, writer):
        return (
            lambda: shutil.rmtree(root / name, ignore_errors=True),
            lambda: dcp.save(sd, storage_writer=writer(root / name), planner=planner(), no_dist=True),
        )

    times = rounds({name: save_case(name, *c) for name, c in saves.items()}, args.repeat)
    res = {"disk_probe": probe, "saves": {}, "loads": {}}
    for name, all_s in times.items():
        t, nbytes = statistics.median(all_s), data_bytes(root / name)
        res["saves"][name] = {"s": t, "GB": nbytes / 1e9, "GBps": nbytes / t / 1e9, "all_s": all_s}

    def targets(sd):
        return {k: torch.empty_like(v) for k, v in sd.items()}

    t_bf16, t_native = targets(bf16), targets(native)
    first = f"_t{threads[-1]}"
    loads = {  # name: (checkpoint, targets, planner maker, reader maker)
        "bf16_dcp_reader": ("bf16_dcp_writer", t_bf16, lambda: None, dcp.FileSystemReader),
        "native_dcp_reader": ("native_dcp_writer", t_native, ckptq.QuantizedLoadPlanner, dcp.FileSystemReader),
        "bf16_safe_reader": (f"bf16_ckptq_writer{first}", t_bf16, lambda: None, SafeFileSystemReader),
        "native_safe_reader": (
            f"native_ckptq_writer{first}",
            t_native,
            ckptq.QuantizedLoadPlanner,
            lambda p: SafeFileSystemReader(p, **knobs),
        ),
        "high_precision_safe_reader": (
            "high_precision_ckptq_writer",
            targets(native),
            ckptq.QuantizedLoadPlanner,
            lambda p: SafeFileSystemReader(p, **knobs),
        ),
    }
    from ckptq.io.fileio import DEFAULT_THREADS

    for n in threads:  # the reader at the other thread counts (the cases above use its default)
        if n != DEFAULT_THREADS:
            loads[f"bf16_safe_reader_t{n}"] = (
                f"bf16_ckptq_writer{first}",
                t_bf16,
                lambda: None,
                lambda p, n=n: SafeFileSystemReader(p, thread_count=n, **knobs),
            )
            loads[f"native_safe_reader_t{n}"] = (
                f"native_ckptq_writer{first}",
                t_native,
                ckptq.QuantizedLoadPlanner,
                lambda p, n=n: SafeFileSystemReader(p, thread_count=n, **knobs),
            )
    dropped = []

    def load_case(src, tg, planner, reader):
        return (
            lambda: dropped.append(drop_file_cache([root / src])),
            lambda: dcp.load(tg, storage_reader=reader(root / src), planner=planner(), no_dist=True),
        )

    cpu: dict = {}
    times = rounds({name: load_case(*c) for name, c in loads.items()}, args.repeat, cpu)
    for name, all_s in times.items():
        t, nbytes = statistics.median(all_s), data_bytes(root / loads[name][0])
        c = statistics.median(cpu[name])
        res["loads"][name] = {
            "s": t,
            "GBps": nbytes / t / 1e9,
            "all_s": all_s,
            "cpu_s": c,
            "cpu_s_per_GB": c / nbytes * 1e9,
        }
    res["loads_caches_dropped"] = all(dropped)
    best = max((n for n in res["saves"] if n.startswith("native_ckptq")), key=lambda n: res["saves"][n]["GBps"])
    res["ratios"] = {
        "native_save_vs_disk_write": res["saves"][best]["GBps"] / probe["write_GBps"],
        "native_save_vs_dcp_writer": res["saves"][best]["GBps"] / res["saves"]["native_dcp_writer"]["GBps"],
        "native_load_vs_disk_read": res["loads"]["native_safe_reader"]["GBps"] / probe["read_GBps"],
        "native_load_vs_dcp_reader": res["loads"]["native_safe_reader"]["GBps"]
        / res["loads"]["native_dcp_reader"]["GBps"],
        "bf16_load_vs_dcp_reader": res["loads"]["bf16_safe_reader"]["GBps"] / res["loads"]["bf16_dcp_reader"]["GBps"],
    }
    report = {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "gb_bf16": args.gb,
        "repeat": args.repeat,
        "threads": threads,
        "buffer_bytes": knobs.get("buffer_bytes"),
        **res,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

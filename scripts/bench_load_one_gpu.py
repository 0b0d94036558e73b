"""Where one process's load of a native checkpoint into CUDA targets spends its time.

``python scripts/bench_load_one_gpu.py [--layers 8] [--dir /tmp/ckptq-load-one] [--repeat 3]``: one
process, no process group (``dcp.load(..., no_dist=True)``), the Llama-style model of
``bench_gpu_checkpoint.py`` (attention MXFP8, MLP NVFP4, whole tensors on GPU 0), saved once with
``ChecksumFileSystemWriter``; and the first bf16 tensors that add up to the same stored bytes, saved
with DCP's writer. Timed (median of ``--repeat``), each case from the disk (files dropped from the
page cache: ``posix_fadvise(DONTNEED)``, ``drop_caches`` where allowed) and again from the page cache
("hot": what is not disk time): a plain read of the native files (one thread, 32 MiB ``readinto``:
the reference), the native load with ``SafeFileSystemReader`` and with DCP's ``FileSystemReader``,
and the bf16 load with both. Then a ``cProfile`` of one native load from the disk (``--no-profile``
to skip). Prints the table; on a machine without CUDA it runs on the CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--divide", type=int, default=1, help="divide the model's dims by this (a quick run)")
    ap.add_argument("--dir", default="/tmp/ckptq-load-one")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp
    from bench_gpu_checkpoint import RULES, _shapes
    from bench_storage_io import drop_file_cache

    import ckptq
    import ckptq.io

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    g = torch.Generator(device=dev).manual_seed(0)
    bf16 = {
        k: torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) for k, s in _shapes(args.layers, args.divide)
    }
    native = ckptq.quantize_state_dict(bf16, RULES)
    writer = ckptq.io.ChecksumFileSystemWriter(root / "native")
    dcp.save(native, storage_writer=writer, planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    nbytes = sum(f.stat().st_size for f in (root / "native").glob("*.distcp"))
    same, n = {}, 0
    for k, v in bf16.items():
        if n >= nbytes:
            break
        same[k], n = v, n + v.nbytes
    dcp.save(same, checkpoint_id=root / "bf16", no_dist=True)
    del bf16
    tn = {k: torch.empty_like(v) for k, v in native.items()}
    tb = {k: torch.empty_like(v) for k, v in same.items()}

    def plain(d: Path) -> None:
        view = memoryview(bytearray(32 << 20))
        for f in sorted(d.glob("*.distcp")):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(view):
                    pass

    def load(targets, name, reader=None, planner=None):
        storage = reader(root / name) if reader else None
        return lambda: dcp.load(
            targets, checkpoint_id=root / name, storage_reader=storage, planner=planner, no_dist=True
        )

    safe, qlp = ckptq.io.SafeFileSystemReader, ckptq.QuantizedLoadPlanner
    cases = {  # name: (checkpoint, function)
        "plain read of the native files (1 thread)": ("native", lambda: plain(root / "native")),
        "native, SafeFileSystemReader": ("native", lambda: load(tn, "native", safe, qlp())()),
        "native, DCP's FileSystemReader": ("native", lambda: load(tn, "native", None, qlp())()),
        "bf16 same bytes, DCP's FileSystemReader": ("bf16", lambda: load(tb, "bf16")()),
        "bf16 same bytes, SafeFileSystemReader": ("bf16", lambda: load(tb, "bf16", safe)()),
    }
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"{where}, torch {torch.__version__}, {args.layers} layers / {args.divide}: native {nbytes / 1e9:.3f} GB")
    print("| case | from | seconds | GB/s | CPU s |\n|---|---|---|---|---|")
    for name, (ckpt, fn) in cases.items():
        size = sum(f.stat().st_size for f in (root / ckpt).glob("*.distcp"))
        for hot in (False, True):
            wall, cpu = [], []
            for _ in range(args.repeat):
                if hot:
                    fn()
                else:
                    drop_file_cache([root / ckpt])
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                sync()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            t = statistics.median(wall)
            src = "page cache" if hot else "disk"
            print(f"| {name} | {src} | {t:.3f} | {size / t / 1e9:.2f} | {statistics.median(cpu):.2f} |")
    if not args.no_profile:
        drop_file_cache([root / "native"])
        prof = cProfile.Profile()
        prof.enable()
        cases["native, SafeFileSystemReader"][1]()
        sync()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

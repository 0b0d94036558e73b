"""How far a data file's reading thread should run ahead of the load: ``SafeFileSystemReader``'s
``read_ahead_bytes`` A/B on cold loads.

``python scripts/bench_read_ahead.py [--layers 10] [--rounds 3] [--aheads 256M,1G,inf] [--out r.json]``
(one process, ``no_dist``; ``--device cuda`` by default). The layers of
``scripts/bench_gpu_checkpoint.py``'s model (random bf16 weights quantized: attention MXFP8, MLP
NVFP4) are saved twice with ``ChecksumFileSystemWriter`` (8 files): natively and as high-precision
values (``QuantizedSavePlanner(mode="high_precision")``: bf16, 10 layers = 4.36 GB). Each round
then loads both into the quantized targets (the high-precision one re-encoded on the target's device)
once per ``--aheads`` value, after a plain read of the same files (one stream, 32 MiB reads: the
disk's speed for those bytes), the page cache dropped before each (``posix_fadvise(DONTNEED)``, and
``drop_caches`` where allowed). GB/s = bytes of the data files / seconds (median of the rounds).
``--device cpu --layers 1 --divide 8 --rounds 1`` finishes in seconds: a check of the script.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _bytes(text: str) -> int:
    """``256M`` / ``1G`` / ``inf`` (no bound: more than any checkpoint) -> bytes."""
    if text == "inf":
        return 1 << 62
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main() -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from bench_gpu_checkpoint import RULES, _plain_read, _shapes
    from bench_storage_io import drop_file_cache

    import ckptq
    from ckptq.io import ChecksumFileSystemWriter, SafeFileSystemReader

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--divide", type=int, default=1, help="divide every dimension (quick checks)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--aheads", default="256M,1G,inf")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default="/tmp/ckptq-read-ahead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    bf16 = {
        k: torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) for k, s in _shapes(args.layers, args.divide)
    }
    native = ckptq.quantize_state_dict(bf16, RULES)
    del bf16
    saves = {
        "native": ckptq.QuantizedSavePlanner(),
        "high_precision": ckptq.QuantizedSavePlanner(mode="high_precision"),
    }
    for name, planner in saves.items():
        dcp.save(native, storage_writer=ChecksumFileSystemWriter(root / name), planner=planner, no_dist=True)
    targets = {k: torch.empty_like(v) for k, v in native.items()}
    aheads = args.aheads.split(",")
    times: dict = {}
    for _ in range(args.rounds):
        for src in saves:
            files = sorted((root / src).glob("*.distcp"))
            for case in ["plain_read", *aheads]:
                drop_file_cache([root / src])
                sync()
                t0 = time.perf_counter()
                if case == "plain_read":
                    _plain_read(files, 1)
                else:
                    reader = SafeFileSystemReader(root / src, read_ahead_bytes=_bytes(case))
                    dcp.load(targets, storage_reader=reader, planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
                sync()
                times.setdefault(src, {}).setdefault(case, []).append(time.perf_counter() - t0)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "layers": args.layers}
    for src, cases in times.items():
        nbytes = sum(f.stat().st_size for f in (root / src).glob("*.distcp"))
        plain = statistics.median(cases["plain_read"])
        out[src] = {
            case: {
                "GBps": nbytes / statistics.median(ts) / 1e9,
                "vs_plain_read": plain / statistics.median(ts),
                "all_s": ts,
            }
            for case, ts in cases.items()
        }
        out[src]["GB"] = nbytes / 1e9
        for case, r in out[src].items():
            if case != "GB":
                print(f"{src:15s} {case:10s} {r['GBps']:.3f} GB/s  {r['vs_plain_read']:.2f} of the plain read")
    shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

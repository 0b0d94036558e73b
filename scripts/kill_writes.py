"""kill -9 at random moments of every ckptq write path; the destination is never an accepted partial.

One command: ``python scripts/kill_writes.py [--kills 20] [--seed 0] [--mb 64]``.

For each write path -- ``dcp.save`` with :class:`ckptq.io.AtomicFileSystemWriter`, ``ckptq reshard``,
``ckptq convert`` (requantize to NVFP4) and ``ckptq export`` (compressed-tensors safetensors) -- a
child process repeats the operation into the same destination (``overwrite``) until it is killed
with SIGKILL after a random delay. After each kill the destination must be either absent (no run
completed yet) or a *whole* output: it passes ``ckptq verify PATH`` (every record intact and
matching its checksum) and holds exactly the expected tensors (``ckptq verify`` against a reference
output made beforehand: bit-exact). A destination that exists but fails either check is an
**accepted partial**, the failure this script exists to find. Kills that landed while the child was
writing (its staging folder existed) are counted, so the figure shows the kills were not all
between runs; the next run removes the staging folders that killed runs left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_CHILD = r"""
import sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
import torch, torch.distributed.checkpoint as dcp, ckptq
from ckptq.io import AtomicFileSystemWriter
from ckptq.export import export_checkpoint
src, dst, op = {src!r}, {dst!r}, {op!r}
sd = torch.load({sd!r}, weights_only=False) if op == "save" else None
print("ready", flush=True)
while True:
    if op == "save":
        dcp.save(sd, storage_writer=AtomicFileSystemWriter(dst), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    elif op == "reshard":
        ckptq.reshard_checkpoint(src, dst, mesh="dp_shard=2,tp=2", plan="fsdp2-tp", overwrite=True)
    elif op == "convert":
        ckptq.reshard_checkpoint(src, dst, to="nvfp4", overwrite=True)
    else:
        export_checkpoint(src, dst, layout="compressed-tensors", overwrite=True, config=False, on_inexact="keep")
"""


def _state(mb: float) -> dict:
    import torch

    import ckptq

    g = torch.Generator().manual_seed(0)
    sd, total, i = {}, 0, 0
    while total < mb * 2**20:
        w = torch.randn(1024, 1024, generator=g) * 0.02
        sd[f"model.layers.{i}.mlp.weight"] = ckptq.quantize(w, "mxfp8")
        sd[f"model.layers.{i}.norm.weight"] = torch.randn(1024, generator=g)
        total += 1024 * 1024 * 33 // 32 + 4096
        i += 1
    return sd


def _whole(dst: Path, reference: Path) -> tuple[bool, str]:
    from ckptq.verify import check_integrity, verify_checkpoints

    try:
        integrity = check_integrity(dst)["summary"]
        if not integrity["ok"] or integrity["verified"] != integrity["records"]:
            return False, f"integrity {integrity}"
        same = verify_checkpoints(reference, dst)["summary"]
        if same["bit_exact"] != same["compared"]:
            return False, f"compare {same}"
    except Exception as e:  # noqa: BLE001 - any failure to read a complete-looking output is the finding
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def run(
    kills: int, seed: int, mb: float, work: Path, ops=("save", "reshard", "convert", "export"), max_delay: float = 2.0
) -> dict:
    """Kill each op ``kills`` times; returns ``{op: {"kills", "mid_write", "absent", "whole", "partial", "bad"}}``."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.export import export_checkpoint
    from ckptq.io import AtomicFileSystemWriter

    warnings.filterwarnings("ignore")
    sd = _state(mb)
    src = work / "src"
    dcp.save(sd, storage_writer=AtomicFileSystemWriter(src), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    torch.save(sd, work / "sd.pt")
    refs = {
        "save": src,
        "reshard": work / "ref-reshard",
        "convert": work / "ref-convert",
        "export": work / "ref-export",
    }
    ckptq.reshard_checkpoint(src, refs["reshard"], mesh="dp_shard=2,tp=2", plan="fsdp2-tp")
    ckptq.reshard_checkpoint(src, refs["convert"], to="nvfp4")
    export_checkpoint(src, refs["export"], layout="compressed-tensors", config=False, on_inexact="keep")
    rng = random.Random(seed)
    out = {}
    for op in ops:
        dst = work / f"dst-{op}"
        stats = {"kills": 0, "mid_write": 0, "absent": 0, "whole": 0, "partial": 0, "bad": []}
        for _ in range(kills):
            code = _CHILD.format(root=str(ROOT), src=str(src), dst=str(dst), op=op, sd=str(work / "sd.pt"))
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, max_delay))
            # writing right now: the save's staging folder (renamed into place when a save completes)
            # or this child's own temporary output folder
            mine = f".dst-{op}.ckptq-saving" if op == "save" else f".dst-{op}.ckptq-tmp-{proc.pid}"
            staging = (work / mine).exists()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            stats["kills"] += 1
            stats["mid_write"] += staging
            if not dst.exists():
                stats["absent"] += 1
                continue
            ok, why = _whole(dst, refs[op])
            if ok:
                stats["whole"] += 1
            else:
                stats["partial"] += 1
                stats["bad"].append(why)
        out[op] = stats
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="kills per write path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mb", type=float, default=64, help="size of the source checkpoint")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptq-kill-"))
    try:
        result = run(args.kills, args.seed, args.mb, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for op, s in result.items():
        print(
            f"{op:8s} kills {s['kills']:3d}  landed mid-write {s['mid_write']:3d}  absent {s['absent']:3d}  "
            f"whole {s['whole']:3d}  accepted partials {s['partial']}"
        )
        for why in s["bad"]:
            print("   ", why)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(s["partial"] for s in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

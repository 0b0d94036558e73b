"""Run a function on N CPU processes with a gloo process group (spawned, FileStore rendezvous).

Failures in any rank are re-raised in the parent with the rank's traceback text. Results are the
per-rank return values (picklable), in rank order.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_distributed(world_size: int, fn, *args, timeout: float = 240.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, fn, args, queue), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = {}, []
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"--- rank {rank} ---\n{payload}")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]

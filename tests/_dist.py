"""Run a function on N processes with a process group (FileStore rendezvous): gloo on CPU, or
``backend="cpu:gloo,cuda:nccl"`` with rank r on GPU r.

The ranks are forked from a ``multiprocessing`` fork server that imported torch, its distributed
packages and ckptq once for the session: a spawned rank spends about 4.5 s of CPU importing them
(2-core VM, torch 2.13 CPU), which every rank of the suite's many 2- and 4-rank runs paid again.
As with the spawn method, a rank inherits nothing of the test process: it gets the test process's
environment, ``sys.path`` and working directory at the call, imports ``fn``'s module afresh, and
makes its own process group.

Each rank runs one intra-op thread unless ``OMP_NUM_THREADS`` says otherwise: up to 4 ranks share
the CI machine's 2 cores, and a pool of the machine's size per rank oversubscribes them.

Failures in any rank are re-raised in the parent with the rank's traceback text. Results are the
per-rank return values (picklable), in rank order.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NCCL = "cpu:gloo,cuda:nccl"  # DCP's object collectives on gloo, tensors on NCCL (as FSDP2 jobs run)

# Imported once by the fork server; every rank is forked from it with these loaded.
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ckptq", "_dist"]


def two_gpus(fn):
    """Mark a test ``cuda`` and skip it on machines with fewer than 2 CUDA devices (NCCL)."""
    return pytest.mark.cuda(pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")(fn))


def _context():
    """The fork-server context, its preload list set (the server starts at the first rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank, world_size, store_path, backend, fn, args, queue, environ):
    # the test process's environment at the call, as a spawned process has it (sys.path and the
    # working directory come with every process the context starts)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        kw = {}
        if "nccl" in backend:
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size, **kw)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_distributed(world_size: int, fn, *args, timeout: float = 240.0, backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend``; return results by rank."""
    ctx = _context()
    queue = ctx.Queue()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, backend, fn, args, queue, environ), daemon=True)
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

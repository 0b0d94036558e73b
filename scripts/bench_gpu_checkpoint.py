"""Save / load throughput of DCP checkpoints on GPUs: the default planner on bf16 vs ckptq.

One command (a machine with 2 CUDA GPUs, or 1; NCCL + gloo): ``python scripts/bench_gpu_checkpoint.py
[--layers 38] [--dir /tmp/ckptq-bench] [--out results.json]``.

A Llama-style model (hidden 4096, GQA 32/8 heads, intermediate 14336; random weights), FSDP2-style
``Shard(0)`` DTensors over the GPUs (``--layers 38``: 8.3 GB of bf16 per GPU on 2 GPUs). Measured in
one run, each save into a fresh directory (``FileSystemWriter``, files fsynced), per rank:

(a) ``dcp.save`` of the bf16 weights with DCP's default planner;
(b) ``dcp.save`` of ckptq native tensors (attention MXFP8, MLP NVFP4, quantized beforehand);
(c) quantize on save: ``QuantizedSavePlanner(quantize=...)`` on the bf16 weights (quantizing included);
and the same three with ``dcp.async_save``: the time the caller is blocked (staging) and the total
(for (c), ``ckptq.quantize_state_dict`` before ``async_save``, so staging copies the compact bytes);
loads of (a) and (b) into targets of the same layout, of (b) on 2 GPUs into ``Shard(1)`` targets
(another placement), and of (b) on 1 GPU (rank 0 alone, ``no_dist``).

Reference bandwidths measured in the same run: device-to-device copy of 2 GiB on each GPU, and the
disk's write bandwidth (4 GiB written and fsynced by each rank at once). Page cache: loads read what
the saves just wrote; the script tries ``echo 3 > /proc/sys/vm/drop_caches`` before each load and
reports whether that worked. GB/s = stored bytes of the rank's checkpoint files / seconds (median of
``--repeat``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN, KV, INTER = 4096, 1024, 14336
RULES = {"*.self_attn.*": "mxfp8", "*.mlp.*": "nvfp4"}


def _shapes(layers: int):
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)
        yield f"{p}.self_attn.k_proj.weight", (KV, HIDDEN)
        yield f"{p}.self_attn.v_proj.weight", (KV, HIDDEN)
        yield f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)
        yield f"{p}.mlp.gate_proj.weight", (INTER, HIDDEN)
        yield f"{p}.mlp.up_proj.weight", (INTER, HIDDEN)
        yield f"{p}.mlp.down_proj.weight", (HIDDEN, INTER)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _dir_bytes(path: Path, rank: int) -> int:
    return sum(f.stat().st_size for f in Path(path).glob(f"__{rank}_*.distcp"))


def _worker(rank: int, ws: int, args, queue) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptq

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=ws, device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (ws,))
    dev = torch.device("cuda", rank)
    res: dict = {"rank": rank}

    # reference bandwidths
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    res["copy_GBps"] = 2 * x.nbytes / statistics.median(t) / 1e9  # read + write
    del x, y
    blob = torch.empty(1 << 30, dtype=torch.uint8).numpy().tobytes()
    dist.barrier()
    t0 = time.perf_counter()
    with open(Path(args.dir) / f"disk_probe_{rank}", "wb") as f:
        for _ in range(4):
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()
    res["disk_write_GBps_per_rank"] = 4 * len(blob) / (time.perf_counter() - t0) / 1e9
    os.remove(Path(args.dir) / f"disk_probe_{rank}")

    def dtensor(local, full_shape, placement=Shard(0)):
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(full_shape),
                                  stride=(full_shape[1], 1))

    g = torch.Generator(device=dev).manual_seed(rank)
    bf16 = {}
    for fqn, shape in _shapes(args.layers):
        local = torch.randn((shape[0] // ws, shape[1]), generator=g, device=dev, dtype=torch.bfloat16)
        bf16[fqn] = dtensor(local, shape)
    res["bf16_GB_per_rank"] = sum(v._local_tensor.nbytes for v in bf16.values()) / 1e9
    native = ckptq.quantize_state_dict(bf16, RULES)
    torch.cuda.synchronize()

    def timed(fn, path: Path) -> float:
        times = []
        for _ in range(args.repeat):
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(path)
            torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    root = Path(args.dir)
    cases = {
        "a_default_bf16": (lambda p: dcp.save(bf16, checkpoint_id=p), None),
        "b_ckptq_native": (lambda p: dcp.save(native, checkpoint_id=p, planner=ckptq.QuantizedSavePlanner()), None),
        "c_quantize_on_save": (lambda p: dcp.save(bf16, checkpoint_id=p,
                                                  planner=ckptq.QuantizedSavePlanner(quantize=RULES)), None),
    }
    for name, (fn, _) in cases.items():
        t = timed(fn, root / name)
        nbytes = _dir_bytes(root / name, rank)
        res[f"save_{name}"] = {"s": t, "GB": nbytes / 1e9, "GBps": nbytes / t / 1e9}

    def async_case(name, make_sd, planner_fn):
        block, total = [], []
        for _ in range(args.repeat):
            path = root / f"async_{name}"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fut = dcp.async_save(make_sd(), checkpoint_id=path, planner=planner_fn())
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            dist.barrier()
            block.append(t1 - t0)
            total.append(t2 - t0)
        res[f"async_{name}"] = {"blocked_s": statistics.median(block), "total_s": statistics.median(total)}

    async_case("a_default_bf16", lambda: bf16, lambda: None)
    async_case("b_ckptq_native", lambda: native, ckptq.QuantizedSavePlanner)
    async_case("c_quantize_then_async", lambda: ckptq.quantize_state_dict(bf16, RULES), ckptq.QuantizedSavePlanner)

    # loads
    def load_case(name, src, target, planner):
        times, dropped = [], True
        for _ in range(args.repeat):
            if rank == 0:
                dropped = _drop_caches() and dropped
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dcp.load(target, checkpoint_id=root / src, planner=planner)
            torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        nbytes = sum(_dir_bytes(root / src, r) for r in range(ws)) / ws
        res[f"load_{name}"] = {"s": t, "GBps": nbytes / t / 1e9, "caches_dropped": dropped}

    load_case("a_default_bf16", "a_default_bf16", {k: torch.empty_like(v) for k, v in bf16.items()}, None)
    targets = {k: torch.empty_like(v) for k, v in native.items()}
    load_case("b_ckptq_native", "b_ckptq_native", targets, ckptq.QuantizedLoadPlanner())
    # another placement: Shard(1) (TP row-parallel) targets of the same quantized layouts
    shard1 = {}
    for fqn, shape in _shapes(args.layers):
        fmt = "mxfp8" if "self_attn" in fqn else "nvfp4"
        local = ckptq.quantize(torch.zeros((shape[0], shape[1] // ws), device=dev, dtype=torch.bfloat16), fmt)
        shard1[fqn] = dtensor(local, shape, Shard(1))
    load_case("b_native_into_shard1", "b_ckptq_native", shard1, ckptq.QuantizedLoadPlanner())
    del shard1, targets
    queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _one_gpu_load(args, queue) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    targets = {}
    for fqn, shape in _shapes(args.layers):
        fmt = "mxfp8" if "self_attn" in fqn else "nvfp4"
        targets[fqn] = ckptq.quantize(torch.zeros(shape, device=dev, dtype=torch.bfloat16), fmt)
    root = Path(args.dir) / "b_ckptq_native"
    times = []
    for _ in range(args.repeat):
        dropped = _drop_caches()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dcp.load(targets, checkpoint_id=root, planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    nbytes = sum(f.stat().st_size for f in root.glob("*.distcp"))
    t = statistics.median(times)
    queue.put({"load_b_native_on_1_gpu": {"s": t, "GBps": nbytes / t / 1e9, "caches_dropped": dropped}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=38)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptq-bench-gpu")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import json

    import torch
    import torch.multiprocessing as mp

    ws = min(2, torch.cuda.device_count())
    assert ws >= 1, "needs a CUDA GPU"
    if ws == 1:
        print("only 1 GPU: world size 1 (the 'other placement' load is then Shard(1) over 1 rank)", file=sys.stderr)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ws, args, queue)) for r in range(ws)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=3000) for _ in range(ws)]
    for p in procs:
        p.join()
    p = ctx.Process(target=_one_gpu_load, args=(args, queue))
    p.start()
    one = queue.get(timeout=3000)
    p.join()
    results.sort(key=lambda r: r["rank"])
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "world_size": ws,
              "layers": args.layers, "repeat": args.repeat, "ranks": results, **one}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Save / load throughput of DCP checkpoints on GPUs: the default planner on bf16 vs ckptq.

One command (a machine with 2 CUDA GPUs, or 1; NCCL + gloo): ``python scripts/bench_gpu_checkpoint.py
[--layers 38] [--dir /tmp/ckptq-bench] [--out results.json]``. ``--device cpu --divide 8 --layers 1
--probe-gib 0.01 --keep-caches`` runs the same on 2 CPU processes (gloo) at 1/64 of the size, in
seconds: a check of the script, not a measurement (``tests/test_bench_scripts.py`` runs it).

A Llama-style model (hidden 4096, GQA 32/8 heads, intermediate 14336; random weights), FSDP2-style
``Shard(0)`` DTensors over the GPUs (``--layers 38``: 8.3 GB of bf16 per GPU on 2 GPUs). Measured in
one run, each save into a fresh directory (files fsynced), per rank:

(a) ``dcp.save`` of the bf16 weights with DCP's default planner and ``FileSystemWriter``, and the same
    with ``ckptq.io.ChecksumFileSystemWriter`` (the storage writer's share, same bytes);
(b) ``dcp.save`` of ckptq native tensors (attention MXFP8, MLP NVFP4, quantized beforehand) with
    ``QuantizedSavePlanner`` and ``ChecksumFileSystemWriter`` (``--dcp-writer-native``: also with
    DCP's ``FileSystemWriter``, the comparison of the 2026-11-23 runs);
(d) high precision: ``QuantizedSavePlanner(mode="high_precision")`` of (b)'s tensors (bf16 values);
(c) quantize on save: ``QuantizedSavePlanner(quantize=...)`` on the bf16 weights (quantizing included);
and (a) (DCP's defaults), (b), (c), (d) with ``dcp.async_save``: the time the caller is blocked
(staging) and the total (for (c), ``ckptq.quantize_state_dict`` before ``async_save``, so staging
copies the compact bytes), next to the copy of the same bytes out of the GPU into pinned host
memory allocated beforehand (``d2h_s``: one non-blocking copy per tensor, one wait); ckptq's
staging memory is reserved before the first async save (``ckptq.io.reserve_staging``, timed
apart as ``reserve_staging``; ``--cold-staging``: not, so the first save allocates it). Loads, page
cache dropped before each: (a) with DCP's reader; (b) with DCP's ``FileSystemReader`` and with
``ckptq.io.SafeFileSystemReader`` (checksums verified); (d) with ``SafeFileSystemReader`` and its
files read plainly (one stream, the disk's speed for those bytes); and the
default planner on the first bf16 tensors that add up to (b)'s stored bytes, with both readers, so
that (b)'s load GB/s is compared at the same size (each load has fixed costs: the metadata,
planning, per-file opens). ``--placement-loads``: (b) into ``Shard(1)`` targets too;
``--one-gpu-load``: (b) on 1 GPU (rank 0 alone, ``no_dist``).

Reference bandwidths measured in the same run: device-to-device copy of ``--probe-gib`` GiB on each
GPU, and the disk (``scripts/bench_storage_io.disk_probe``: ``--disk-gib`` GiB written with large
writes and fsynced, then read back after its cache is dropped, by every rank at once). Page cache:
each checkpoint's files get ``posix_fadvise(DONTNEED)`` and the script tries
``echo 1 > /proc/sys/vm/drop_caches`` before each load (``caches_dropped`` says whether that
worked). GB/s = stored bytes of the rank's checkpoint files / seconds (median of the rounds; the
saves, the async saves and the loads each run every case once per round, up to ``--repeat``
rounds, so that a disk whose speed drifts during the run favours no case; ``--budget-s`` caps the
rounds so that the run ends in time: the JSON's ``rounds`` says how many ran; ``--saves-only``: the
saves alone, with the whole budget, for more rounds of them).
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


def _shapes(layers: int, divide: int = 1):
    hidden, kv, inter = HIDDEN // divide, KV // divide, INTER // divide
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.self_attn.q_proj.weight", (hidden, hidden)
        yield f"{p}.self_attn.k_proj.weight", (kv, hidden)
        yield f"{p}.self_attn.v_proj.weight", (kv, hidden)
        yield f"{p}.self_attn.o_proj.weight", (hidden, hidden)
        yield f"{p}.mlp.gate_proj.weight", (inter, hidden)
        yield f"{p}.mlp.up_proj.weight", (inter, hidden)
        yield f"{p}.mlp.down_proj.weight", (hidden, inter)


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
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptq
    import ckptq.io
    from ckptq.io import SafeFileSystemReader

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_storage_io import disk_probe, drop_file_cache

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=ws, device_id=dev)
        sync = torch.cuda.synchronize
    else:  # a quick run of the script itself on CPU processes
        dev, sync = torch.device("cpu"), (lambda: None)
        dist.init_process_group("gloo", rank=rank, world_size=ws)
    mesh = init_device_mesh(dev.type, (ws,))
    res: dict = {"rank": rank}
    started = time.perf_counter()
    cpu_group = dist.new_group(backend="gloo")

    # reference bandwidths
    x = torch.empty(int(args.probe_gib * 2**29), dtype=torch.bfloat16, device=dev)  # probe_gib GiB
    y = torch.empty_like(x)
    sync()
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        sync()
        t.append(time.perf_counter() - t0)
    res["copy_GBps"] = 2 * x.nbytes / statistics.median(t) / 1e9  # read + write
    del x, y
    probe = disk_probe(Path(args.dir) / f"disk_probe_{rank}", int(args.disk_gib * 2**30), barrier=dist.barrier)
    res["disk_probe"] = probe
    res["disk_write_GBps_per_rank"] = probe["write_GBps"]
    res["disk_read_GBps_per_rank"] = probe["read_GBps"]

    def dtensor(local, full_shape, placement=None):
        return DTensor.from_local(
            local,
            mesh,
            [Shard(0) if placement is None else placement],
            run_check=False,
            shape=torch.Size(full_shape),
            stride=(full_shape[1], 1),
        )

    g = torch.Generator(device=dev).manual_seed(rank)
    bf16 = {}
    for fqn, shape in _shapes(args.layers, args.divide):
        local = torch.randn((shape[0] // ws, shape[1]), generator=g, device=dev, dtype=torch.bfloat16)
        bf16[fqn] = dtensor(local, shape)
    res["bf16_GB_per_rank"] = sum(v._local_tensor.nbytes for v in bf16.values()) / 1e9
    native = ckptq.quantize_state_dict(bf16, RULES)
    sync()
    setup_s = time.perf_counter() - started
    left = max(30.0, args.budget_s - setup_s)
    res["setup_s"] = setup_s

    def rounds(cases: dict, prepare, call, wait: bool = False, budget: float = float("inf"), after=None) -> dict:
        """Every case once per round, up to ``--repeat`` rounds (fewer when the next round would
        end after ``budget`` seconds from now; at least one), so that a disk whose speed drifts
        during the run favours no case: ``prepare(name, case)`` on rank 0 (untimed), then
        ``call(name, case)`` on every rank (``wait``: it returns a future, e.g.
        ``dcp.async_save``'s, then waited for), then ``after(name, case)`` on every rank (untimed,
        before a barrier). Returns name -> [(seconds until ``call`` returned, seconds until all
        ranks finished)]."""
        out = {name: [] for name in cases}
        begin = time.perf_counter()
        for r in range(args.repeat):
            for name, case in cases.items():
                if rank == 0:
                    prepare(name, case)
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                result = call(name, case)
                sync()
                t1 = time.perf_counter()
                if wait:
                    result.result()
                dist.barrier()
                out[name].append((t1 - t0, time.perf_counter() - t0))
                if after is not None:
                    after(name, case)
                    dist.barrier()
            used = time.perf_counter() - begin
            stop = torch.tensor([float(used * (r + 2) / (r + 1) > budget)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=cpu_group)  # every rank stops together
            if stop.item():
                break
        return out

    root = Path(args.dir)
    writer = ckptq.io.ChecksumFileSystemWriter
    saves = {  # name: save function; "ckptq" cases: ckptq's storage writer (checksums on)
        "a_default_bf16": lambda p: dcp.save(bf16, checkpoint_id=p),
        "a_bf16_ckptq_writer": lambda p: dcp.save(bf16, storage_writer=writer(p)),
        "b_ckptq_native": lambda p: dcp.save(native, storage_writer=writer(p), planner=ckptq.QuantizedSavePlanner()),
        "d_high_precision": lambda p: dcp.save(
            native, storage_writer=writer(p), planner=ckptq.QuantizedSavePlanner(mode="high_precision")
        ),
        "c_quantize_on_save": lambda p: dcp.save(
            bf16, storage_writer=writer(p), planner=ckptq.QuantizedSavePlanner(quantize=RULES)
        ),
    }
    if args.dcp_writer_native:
        saves["b_native_dcp_writer"] = lambda p: dcp.save(native, checkpoint_id=p, planner=ckptq.QuantizedSavePlanner())
    loaded = {"a_default_bf16", "b_ckptq_native", "d_high_precision"}  # the loads below read these
    saved_bytes: dict = {}

    def after_save(name, prefix=""):
        # each rank's stored bytes, then the checkpoints no load reads are removed (disk space: at 38
        # layers the saves and async saves of one round hold ~100 GB on 2 ranks)
        saved_bytes[prefix + name] = _dir_bytes(root / (prefix + name), rank)
        dist.barrier()
        if rank == 0 and (prefix or name not in loaded):
            shutil.rmtree(root / (prefix + name), ignore_errors=True)

    if args.loads_only:  # the checkpoints the loads read, saved once (untimed); no async saves
        saves = {"b_ckptq_native": saves["b_ckptq_native"]}
    times = rounds(
        saves,
        lambda name, _: shutil.rmtree(root / name, ignore_errors=True),
        lambda name, save: save(root / name),
        budget=0.0 if args.loads_only else 0.9 * left if args.saves_only else 0.3 * left,
        after=lambda name, _: after_save(name),
    )
    res["rounds"] = {"saves": len(next(iter(times.values())))}
    for name in saves:
        all_s = [t for _, t in times[name]]
        t, nbytes = statistics.median(all_s), saved_bytes[name]
        res[f"save_{name}"] = {"s": t, "GB": nbytes / 1e9, "GBps": nbytes / t / 1e9, "all_s": all_s}
    if args.saves_only:  # no async saves, no loads: the saves had the whole budget
        dist.barrier()
        if rank == 0:
            for name in loaded:
                shutil.rmtree(root / name, ignore_errors=True)
        queue.put(res)
        dist.barrier()
        dist.destroy_process_group()
        return

    async_saves = (
        {}
        if args.loads_only
        else {  # name: (state dict maker, planner maker, storage writer maker or None)
            "a_default_bf16": (lambda: bf16, lambda: None, None),
            "b_ckptq_native": (lambda: native, ckptq.QuantizedSavePlanner, writer),
            "d_high_precision": (lambda: native, lambda: ckptq.QuantizedSavePlanner(mode="high_precision"), writer),
            "c_quantize_then_async": (
                lambda: ckptq.quantize_state_dict(bf16, RULES),
                ckptq.QuantizedSavePlanner,
                writer,
            ),
        }
    )
    if args.async_bf16_ckptq:
        async_saves["a_bf16_ckptq_writer"] = (lambda: bf16, lambda: None, writer)
    if async_saves and not args.cold_staging:  # ckptq's staging memory reserved at setup, timed apart
        sync()
        t0 = time.perf_counter()
        reserved = {n: ckptq.io.reserve_staging(c[0]()) / 1e9 for n, c in async_saves.items() if c[2] is writer}
        res["reserve_staging"] = {"s": time.perf_counter() - t0, "GB_per_case": reserved}
    times = (
        {}
        if not async_saves
        else rounds(
            async_saves,
            lambda name, _: shutil.rmtree(root / f"async_{name}", ignore_errors=True),
            lambda name, c: dcp.async_save(
                c[0](),
                checkpoint_id=root / f"async_{name}",
                planner=c[1](),
                storage_writer=c[2](root / f"async_{name}") if c[2] else None,
            ),
            wait=True,
            budget=0.3 * left,
            after=lambda name, _: after_save(name, "async_"),
        )
    )
    res["rounds"]["async"] = len(next(iter(times.values()), ()))
    # the copy out of the GPU of the same bytes into pinned memory (what staging must at least take)
    d2h_sources = {"a_default_bf16": bf16, "a_bf16_ckptq_writer": bf16, "b_ckptq_native": native}
    d2h = {}
    for sd in (bf16, native):
        d2h[id(sd)] = _d2h_seconds(sd, sync) if args.device == "cuda" else None
    for name in async_saves:
        sd = d2h_sources.get(name, native)
        blocked = [b for b, _ in times[name]]
        res[f"async_{name}"] = {
            "blocked_s": statistics.median(blocked),
            "total_s": statistics.median(t for _, t in times[name]),
            "all_blocked_s": blocked,
            "d2h_s": d2h[id(sd)],
            "blocked_vs_d2h": statistics.median(blocked) / d2h[id(sd)] if d2h[id(sd)] else None,
        }
    res["d2h_bf16_s"], res["d2h_native_s"] = d2h[id(bf16)], d2h[id(native)]

    # loads
    # the default planner on as many bf16 bytes as (b) stores: per-load fixed costs weigh the same
    same, nbytes = {}, 0
    for k, v in bf16.items():
        if nbytes >= res["save_b_ckptq_native"]["GB"] * 1e9:
            break
        same[k], nbytes = v, nbytes + v._local_tensor.nbytes
    dcp.save(same, checkpoint_id=root / "a_same_bytes")
    same_targets = {k: torch.empty_like(v) for k, v in same.items()}
    targets = {k: torch.empty_like(v) for k, v in native.items()}
    native_planner = ckptq.QuantizedLoadPlanner()
    split: dict = {}  # load case -> [(start of read_data, its end)] on this rank
    safe, dcp_reader = _timed(SafeFileSystemReader, split), _timed(FileSystemReader, split)
    own_files = sorted((root / "b_ckptq_native").glob(f"__{rank}_*.distcp"))
    loads = {  # name: (checkpoint, targets or a function that reads, planner, storage reader class)
        "a_default_bf16": ("a_default_bf16", {k: torch.empty_like(v) for k, v in bf16.items()}, None, dcp_reader),
        "a_default_bf16_same_bytes_as_b": ("a_same_bytes", same_targets, None, dcp_reader),
        "a_same_bytes_safe_reader": ("a_same_bytes", same_targets, None, safe),
        "b_native_dcp_reader": ("b_ckptq_native", targets, native_planner, dcp_reader),
        "b_native_safe_reader": ("b_ckptq_native", targets, native_planner, safe),
        "d_high_precision_safe_reader": ("d_high_precision", targets, native_planner, safe),
        # the same files as (b), read plainly by every rank at once: one stream, then a thread per file
        "p_plain_read_native_files": ("b_ckptq_native", lambda: _plain_read(own_files, 1), None, None),
        "p_plain_read_native_files_threads": (
            "b_ckptq_native",
            lambda: _plain_read(own_files, len(own_files)),
            None,
            None,
        ),
    }
    if not args.loads_only:  # (d)'s files read plainly, one stream: the disk's speed for its bytes
        hp_files = sorted((root / "d_high_precision").glob(f"__{rank}_*.distcp"))
        loads["p_plain_read_high_precision_files"] = ("d_high_precision", lambda: _plain_read(hp_files, 1), None, None)
    if args.loads_only:
        del loads["a_default_bf16"], loads["d_high_precision_safe_reader"]
        for n in (2, 8):  # other numbers of files read at once per rank (the default with CUDA in use: 4)
            loads[f"b_native_safe_reader_{n}_threads"] = (
                "b_ckptq_native",
                targets,
                native_planner,
                _timed(SafeFileSystemReader, split, thread_count=n),
            )
    if args.placement_loads:
        # another placement: Shard(1) (TP row-parallel) targets of the same quantized layouts
        shard1 = {}
        for fqn, shape in _shapes(args.layers, args.divide):
            fmt = "mxfp8" if "self_attn" in fqn else "nvfp4"
            local = ckptq.quantize(torch.zeros((shape[0], shape[1] // ws), device=dev, dtype=torch.bfloat16), fmt)
            shard1[fqn] = dtensor(local, shape, Shard(1))
        loads["b_native_into_shard1"] = ("b_ckptq_native", shard1, native_planner, safe)
    dropped = []
    times = rounds(
        loads,
        lambda name, c: dropped.append(not args.keep_caches and drop_file_cache([root / c[0]])),
        lambda name, c: (
            c[1]()
            if callable(c[1])
            else dcp.load(c[1], checkpoint_id=root / c[0], planner=c[2], storage_reader=c[3](root / c[0], case=name))
        ),
        budget=0.4 * left,
    )
    for name, (src, *_) in loads.items():
        all_s = [t for _, t in times[name]]
        t = statistics.median(all_s)
        nbytes = sum(_dir_bytes(root / src, r) for r in range(ws)) / ws
        res[f"load_{name}"] = {"s": t, "GBps": nbytes / t / 1e9, "caches_dropped": all(dropped), "all_s": all_s}
        if split.get(name):  # where the load's time went: before read_data (metadata, planning), in it, after
            res[f"load_{name}"].update(
                before_read_s=statistics.median(b - i for i, b, _ in split[name]),
                read_data_s=statistics.median(e - b for _, b, e in split[name]),
                after_read_s=statistics.median(a - (e - i) for a, (i, _, e) in zip(all_s, split[name], strict=True)),
            )
    res["rounds"]["loads"] = len(next(iter(times.values())))
    del loads, targets, same_targets
    if rank == 0:
        shutil.rmtree(root / "a_same_bytes", ignore_errors=True)
    queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _timed(reader_class, split: dict, **kwargs):
    """``reader_class`` whose instances note, in ``split[case]``, when they were made (the start of
    the ``dcp.load`` that makes them), when ``read_data`` began and when it returned: what comes
    before is reading the metadata and DCP's collective planning, what comes after is DCP's final
    collective (waiting for the slowest rank)."""

    class Timed(reader_class):
        def __init__(self, path, case: str):
            self._case, self._made = case, time.perf_counter()
            super().__init__(path, **kwargs)

        def read_data(self, plan, planner):
            begin = time.perf_counter()
            fut = super().read_data(plan, planner)
            fut.wait()
            split.setdefault(self._case, []).append((self._made, begin, time.perf_counter()))
            return fut

    return Timed


def _plain_read(files: list, threads: int) -> None:
    """Read ``files`` whole with 32 MiB ``readinto`` calls into one buffer per thread, ``threads``
    files at once (1: one after another): the disk's speed for exactly the files a load reads."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path):
        buf = bytearray(min(32 << 20, max(1, path.stat().st_size)))
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))


def _d2h_seconds(sd: dict, sync) -> float:
    """Seconds to copy every tensor of ``sd`` (DTensor locals, quantized components) out of the
    GPU into pinned host buffers allocated beforehand: one non-blocking copy each, one wait
    (median of 3, after one warm-up)."""
    import torch

    srcs = []
    for v in sd.values():
        local = getattr(v, "_local_tensor", v)
        srcs += list(local._components.values()) if hasattr(local, "_components") else [local]
    dsts = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in srcs]
    times = []
    for i in range(4):
        sync()
        t0 = time.perf_counter()
        for s, d in zip(srcs, dsts, strict=True):
            d.copy_(s, non_blocking=True)
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _one_gpu_load(args, queue) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq

    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    targets = {}
    for fqn, shape in _shapes(args.layers, args.divide):
        fmt = "mxfp8" if "self_attn" in fqn else "nvfp4"
        targets[fqn] = ckptq.quantize(torch.zeros(shape, device=dev, dtype=torch.bfloat16), fmt)
    root = Path(args.dir) / "b_ckptq_native"
    times = []
    for _ in range(args.repeat):
        dropped = not args.keep_caches and _drop_caches()
        sync()
        t0 = time.perf_counter()
        dcp.load(targets, checkpoint_id=root, planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
        sync()
        times.append(time.perf_counter() - t0)
    nbytes = sum(f.stat().st_size for f in root.glob("*.distcp"))
    t = statistics.median(times)
    queue.put({"load_b_native_on_1_gpu": {"s": t, "GBps": nbytes / t / 1e9, "caches_dropped": dropped}})


def _collect(queue, procs, n: int) -> list:
    """``n`` results from ``queue``; exits if a process died first (its traceback is on stderr)."""
    import queue as q

    out = []
    while len(out) < n:
        try:
            out.append(queue.get(timeout=5))
        except q.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit("a benchmark process failed (see its traceback above)")
    for p in procs:
        p.join()
    return out


#: the rows of docs/benchmarks.md's table: (row, save case, load case, async case)
TABLE = [
    ("default planner, bf16 (DCP's writer/reader)", "a_default_bf16", "a_default_bf16", "a_default_bf16"),
    ("default planner, bf16, ckptq's writer/reader", "a_bf16_ckptq_writer", "a_same_bytes_safe_reader", None),
    ("ckptq native (MXFP8 / NVFP4)", "b_ckptq_native", "b_native_safe_reader", "b_ckptq_native"),
    ("ckptq high precision (bf16 values)", "d_high_precision", "d_high_precision_safe_reader", "d_high_precision"),
    ("quantize on save (async: quantize_state_dict first)", "c_quantize_on_save", None, "c_quantize_then_async"),
]


def table(report: dict) -> str:
    """The markdown table of a run's JSON (``--table``): per rank, GB/s of saves and loads, the
    time ``async_save`` blocked and the D2H copy of the same bytes, with the ratios the goals name."""

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = []
    for r in report["ranks"]:
        p = r["disk_probe"]
        lines += [
            f"rank {r['rank']} ({report['gpu']}, {report['layers']} layers, {r['bf16_GB_per_rank']:.2f} GB of bf16 "
            f"per rank, rounds {r['rounds']}):",
            "",
            "| | save GB/s | load GB/s | async_save blocked s | D2H copy s | blocked / D2H |",
            "|---|---|---|---|---|---|",
            f"| disk probe (one file, large writes + fsync; reads after DONTNEED) | {f(p['write_GBps'])} "
            f"| {f(p['read_GBps'])} | | | |",
        ]
        for row, save, load, asy in TABLE:
            sv = r.get(f"save_{save}", {}).get("GBps")
            ld = r.get(f"load_{load}", {}).get("GBps") if load else None
            a = r.get(f"async_{asy}", {}) if asy else {}
            lines.append(
                f"| {row} | {f(sv)} | {f(ld)} | {f(a.get('blocked_s'), '{:.3f}')} | {f(a.get('d2h_s'), '{:.3f}')} "
                f"| {f(a.get('blocked_vs_d2h'))} |"
            )
        gbps = {k: v.get("GBps") for k, v in r.items() if isinstance(v, dict)}.get  # None where not run

        def ratio(a, b):
            return "-" if a is None or b is None else f"{a / b:.2f}"

        nat_save, nat_load = gbps("save_b_ckptq_native"), gbps("load_b_native_safe_reader")
        bf16_save, bf16_ours = gbps("save_a_default_bf16"), gbps("save_a_bf16_ckptq_writer")
        parts = [
            f"native save vs default planner {ratio(nat_save, bf16_save)}x",
            f"native save vs disk write {ratio(nat_save, p['write_GBps'])}",
            f"bf16 save, ckptq's writer vs DCP's {ratio(bf16_ours, bf16_save)}x",
        ]
        if nat_load is not None:  # not --saves-only
            parts += [
                f"native load vs the same bytes of bf16 (DCP's reader) "
                f"{ratio(nat_load, gbps('load_a_default_bf16_same_bytes_as_b'))}x",
                f"native load vs disk read {ratio(nat_load, p['read_GBps'])}",
                f"native load, ckptq's reader vs DCP's {ratio(nat_load, gbps('load_b_native_dcp_reader'))}x",
                f"native load vs a plain read of its files (one stream) "
                f"{ratio(nat_load, gbps('load_p_plain_read_native_files'))}",
            ]
        lines += ["", "; ".join(parts)]
        hp, hp_plain = r.get("load_d_high_precision_safe_reader"), r.get("load_p_plain_read_high_precision_files")
        if hp and hp_plain:  # runs since 2026-11-26 (seventh session)
            lines.append(
                f"high-precision load vs disk read {hp['GBps'] / p['read_GBps']:.2f}, vs a plain read of its files "
                f"{hp['GBps'] / hp_plain['GBps']:.2f}; staging reserved before the async saves in "
                f"{r.get('reserve_staging', {}).get('s', float('nan')):.2f} s"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=38)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptq-bench-gpu")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: 2 gloo processes on the CPU (to try the script itself, with small sizes)",
    )
    ap.add_argument("--divide", type=int, default=1, help="divide the model's dims by this (e.g. 8 for a quick run)")
    ap.add_argument("--keep-caches", action="store_true", help="do not try to drop the page cache before loads")
    ap.add_argument("--disk-gib", type=float, default=4.0, help="GiB the disk probe writes and reads per rank")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=float("inf"),
        help="seconds for the whole run: saves, async saves and loads get 30/30/40%% of what setup leaves, "
        "and stop after the round that would overrun it (at least one round each)",
    )
    ap.add_argument("--dcp-writer-native", action="store_true", help="also save native with DCP's own writer")
    ap.add_argument("--async-bf16-ckptq", action="store_true", help="also async_save bf16 with ckptq's writer")
    ap.add_argument(
        "--cold-staging",
        action="store_true",
        help="no ckptq.io.reserve_staging before the async saves (the first one allocates its staging memory)",
    )
    ap.add_argument("--placement-loads", action="store_true", help="also load native into Shard(1) targets")
    ap.add_argument("--one-gpu-load", action="store_true", help="also load native on 1 GPU (no_dist)")
    ap.add_argument(
        "--saves-only",
        action="store_true",
        help="only the saves, with 90%% of the budget (more rounds); no async saves, no loads",
    )
    ap.add_argument(
        "--loads-only",
        action="store_true",
        help="only the loads (their checkpoints saved once, untimed; no async saves, no full bf16 load)",
    )
    ap.add_argument(
        "--probe-gib",
        type=float,
        default=2.0,
        help="GiB copied by the device-to-device copy probe",
    )
    ap.add_argument("--table", default=None, help="print the markdown table of a run's JSON and exit")
    args = ap.parse_args()

    import json

    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return

    import torch
    import torch.multiprocessing as mp

    ws = min(2, torch.cuda.device_count()) if args.device == "cuda" else 2
    if ws < 1:
        sys.exit("needs a CUDA GPU (or --device cpu)")
    if ws == 1:
        print("only 1 GPU: world size 1 (the 'other placement' load is then Shard(1) over 1 rank)", file=sys.stderr)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ws, args, queue)) for r in range(ws)]
    for p in procs:
        p.start()
    results = _collect(queue, procs, ws)
    one = {}
    if args.one_gpu_load:
        p = ctx.Process(target=_one_gpu_load, args=(args, queue))
        p.start()
        (one,) = _collect(queue, [p], 1)
    results.sort(key=lambda r: r["rank"])
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {
        "gpu": device,
        "torch": torch.__version__,
        "world_size": ws,
        "layers": args.layers,
        "repeat": args.repeat,
        "ranks": results,
        **one,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Benchmark offline resharding against the plain DCP route, and planning at 405B scale.

One command: ``python scripts/bench_reshard.py [--layers 16] [--workdir DIR] [--markdown docs/benchmarks.md]``.

1. A synthetic Llama-style checkpoint (hidden 4096, GQA 32/8 heads, intermediate 14336; attention
   weights MXFP8, MLP weights NVFP4, stored natively; component bytes are random but valid) saved by
   4 ranks with FSDP2 ``Shard(0)``.
2. The copy limit and ckptq, interleaved, ``--repeat`` rounds (median): ``cp -r SRC DST && sync``;
   ``ckptq reshard`` to ``dp_shard=2,tp=2`` (FSDP2 over TP: q/k/v/gate/up column-, o/down
   row-parallel), one process (wall, throughput = checkpoint bytes / s, ratio to the copy, peak RSS
   against the bound: the process baseline -- ``VmHWM`` of the same command with ``--dry-run`` --
   plus 2x the largest saved chunk); the same under ``torchrun --nproc-per-node N``
   (``--processes``); ``ckptq convert --to nvfp4`` (the MXFP8 attention weights requantized, the
   NVFP4 ones copied; kernel seconds reported by ``--json`` apart from the rest), one process and
   under ``torchrun`` (the call's own seconds, from ``--json``, beside the wall); and, with
   ``--before DIR``, the ``ckptq`` package found in DIR (an older checkout) doing the same reshard.
3. With ``--plain-route``: the route a user has with plain tools (``dcp_to_torch_save``, then 4
   ranks each ``torch.load(mmap=True)`` the file and ``dcp.save`` their DTensor shards). With
   ``--load``: load time of the target layout (4 gloo ranks, QuantizedLoadPlanner) from the
   resharded checkpoint vs from the original (DCP's load-time resharding).
4. Planning at scale without tensors: DCP metadata of a Llama-3-405B layout (NVFP4 weights) saved by
   1024 FSDP2 ranks, planned for dp_shard=256,tp=8 (2048 ranks): time and memory.

Every measured step runs in its own process (peak RSS: ``VmHWM`` of that process at exit); timings
are the median of ``--repeat`` runs. Results go to stdout as a markdown table (and into ``--markdown`` if given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

HIDDEN, KV, INTER = 4096, 1024, 14336
COL = ["*.q_proj.weight", "*.k_proj.weight", "*.v_proj.weight", "*.gate_proj.weight", "*.up_proj.weight"]
ROW = ["*.o_proj.weight", "*.down_proj.weight"]


def _layer_shapes(layers: int):
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN), "mxfp8"
        yield f"{p}.self_attn.k_proj.weight", (KV, HIDDEN), "mxfp8"
        yield f"{p}.self_attn.v_proj.weight", (KV, HIDDEN), "mxfp8"
        yield f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN), "mxfp8"
        yield f"{p}.mlp.gate_proj.weight", (INTER, HIDDEN), "nvfp4"
        yield f"{p}.mlp.up_proj.weight", (INTER, HIDDEN), "nvfp4"
        yield f"{p}.mlp.down_proj.weight", (HIDDEN, INTER), "nvfp4"
        yield f"{p}.input_layernorm.weight", (HIDDEN,), None


def _synthetic_local(shape, fmt, rows: slice, seed: int):
    """A valid quantized shard with random bytes: rows ``rows`` of a (M, K) tensor."""
    import torch

    import ckptq

    g = torch.Generator().manual_seed(seed)
    m = rows.stop - rows.start
    k = shape[1]
    if fmt == "mxfp8":
        data = torch.randint(0, 0x7F, (m, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        scale = torch.randint(110, 130, (m, k // 32), dtype=torch.uint8, generator=g)
        return ckptq.MXFP8Tensor({"data": data, "scale": scale}, (m, k), torch.bfloat16, ckptq.formats.MXFP8Recipe())
    data = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(0x20, 0x7E, (m, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    amax = torch.tensor(3.5)  # one global amax: the shards agree
    return ckptq.NVFP4Tensor(
        {"data": data, "scale": scale, "amax": amax}, (m, k), torch.bfloat16, ckptq.formats.NVFP4Recipe()
    )


def _save_worker(rank, ws, path, layers):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptq

    mesh = init_device_mesh("cpu", (ws,))
    sd = {}
    for j, (fqn, shape, fmt) in enumerate(_layer_shapes(layers)):
        n = shape[0] // ws
        rows = slice(rank * n, rank * n + n)
        local = (
            torch.ones(n, dtype=torch.bfloat16) if fmt is None else _synthetic_local(shape, fmt, rows, 1000 * j + rank)
        )
        stride = (shape[1], 1) if len(shape) == 2 else (1,)
        sd[fqn] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    dcp.save(sd, checkpoint_id=path, planner=ckptq.QuantizedSavePlanner())
    return True


# Peak RSS is VmHWM of the measured process's own address space, written at its exit: wait4's
# ru_maxrss would also count the parent's RSS at fork time (exec folds the old mm's high-water mark in).
_HWM = (
    "import atexit, runpy, sys\n"
    "out = sys.argv[1]\n"
    "def _hwm():\n"
    "    kib = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
    "    open(out, 'w').write(kib)\n"
    "atexit.register(_hwm)\n"
    "if sys.argv[2] == '-m':\n"
    "    sys.argv = sys.argv[3:]\n"
    "    runpy.run_module(sys.argv[0], run_name='__main__')\n"
    "else:\n"
    "    exec(sys.argv[3])\n"
)


def _vm_hwm() -> int:
    """Peak RSS (bytes) of this process's address space so far."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def _run_measured(args: list[str], env=None, cwd=None, stdout=None) -> tuple[float, int]:
    """Run ``python -m MODULE ...`` (args ``["-m", module, ...]``) or ``python -c CODE`` (args
    ``["-c", code]``); return (wall seconds, peak RSS bytes of that process)."""
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "err"), "w+") as err:
        hwm = os.path.join(tmp, "hwm")
        t0 = time.perf_counter()
        # stderr to a file, not a pipe: a full pipe would block the child
        proc = subprocess.run(
            [sys.executable, "-c", _HWM, hwm, *args],
            env=env or os.environ.copy(),
            stdout=stdout or subprocess.DEVNULL,
            stderr=err,
            cwd=cwd,
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{args[:2]} failed:\n{err.read()[-3000:]}")
        with open(hwm) as f:
            return wall, int(f.read()) * 1024


def _with_json(run, cmd: list[str], env) -> tuple:
    """``run(cmd, env, stdout=...)`` (:func:`_run_measured` or :func:`_run_wall`) of a command given
    ``--json``: what ``run`` returns, and the JSON report the command printed."""
    with tempfile.TemporaryFile("w+") as out:
        res = run(cmd, env, stdout=out)
        out.seek(0)
        return res, json.load(out)


def _run_wall(cmd: list[str], env=None, cwd=None, stdout=None) -> float:
    """Wall seconds of a command (its output discarded unless ``stdout``; a failure raises with its stderr)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        env=env or os.environ.copy(),
        stdout=stdout or subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=cwd,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:6]} failed:\n{proc.stderr[-3000:]}")
    return wall


def _largest_chunk(path) -> int:
    """Bytes of the largest tensor chunk a checkpoint saved."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptq.io import read_metadata

    md = read_metadata(path)
    return max(
        math.prod(c.sizes) * m.properties.dtype.itemsize
        for m in md.state_dict_metadata.values()
        if isinstance(m, TensorStorageMetadata)
        for c in m.chunks
    )


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


# ------------------------------------------------------------------ plain route (re-save) worker
def _resave_worker(rank, ws, pt_path, out, layers):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    full = torch.load(pt_path, mmap=True, weights_only=True)
    import fnmatch

    sd = {}
    for key, t in full.items():
        if not isinstance(t, torch.Tensor):
            sd[key] = t
            continue
        base = key.rsplit(".", 1)[0] if key.endswith((".data", ".scale", ".amax")) else key
        if t.ndim == 0:
            placements = [Replicate(), Replicate()]
        elif any(fnmatch.fnmatchcase(base, g) for g in COL):
            placements = [_StridedShard(0, split_factor=2), Shard(0)]
        elif any(fnmatch.fnmatchcase(base, g) for g in ROW):
            placements = [Shard(0), Shard(1)]
        else:
            placements = [Shard(0), Replicate()]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        size, off = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        local = t
        for d, (o, s) in enumerate(zip(off, size, strict=False)):
            local = local.narrow(d, o, s)
        sd[key] = DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    dcp.save(sd, checkpoint_id=out)
    return _vm_hwm()


def _load_worker(rank, ws, path, layers, repeat):
    import time as _t

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import ckptq
    from ckptq.io import SafeFileSystemReader
    from ckptq.placement import MeshSpec, PlacementRules, dtensor_box

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    spec = MeshSpec(("dp_shard", "tp"), (2, 2))
    plan = PlacementRules(spec, "fsdp2-tp", {**{g: "col" for g in COL}, **{g: "row" for g in ROW}})
    times = []
    for _ in range(repeat):
        sd = {}
        for fqn, shape, fmt in _layer_shapes(layers):
            placements = plan.placements(fqn, len(shape))
            probe = DTensor.from_local(
                torch.empty(0),
                mesh,
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=(shape[1], 1) if len(shape) == 2 else (1,),
            )
            (_, size) = dtensor_box(probe, fqn=fqn)
            if fmt is None:
                local = torch.empty(size, dtype=torch.bfloat16)
            else:
                local = torch.empty_like(_synthetic_local((size[0], size[1]), fmt, slice(0, size[0]), 0))
            sd[fqn] = DTensor.from_local(
                local,
                mesh,
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=(shape[1], 1) if len(shape) == 2 else (1,),
            )
        dist.barrier()
        t0 = _t.perf_counter()
        dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=ckptq.QuantizedLoadPlanner())
        dist.barrier()
        times.append(_t.perf_counter() - t0)
    return times


# ------------------------------------------------------------------ 405B planning at scale
PLAN_SCRIPT = r"""
import resource, sys, time, tracemalloc
sys.path.insert(0, {root!r})
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                   TensorStorageMetadata)
from ckptq.checkpoint import CheckpointView
from ckptq.contract import CKPTQ_KEY, make_record, native_descriptor
from ckptq.placement import PlacementRules, MeshSpec
from ckptq.reshard import plan_reshard
import ckptq

H, KV, I, L, V, SAVERS = 16384, 1024, 53248, 126, 128256, 1024
shapes = {{}}
for i in range(L):
    p = f"model.layers.{{i}}"
    shapes.update({{f"{{p}}.self_attn.q_proj.weight": (H, H), f"{{p}}.self_attn.k_proj.weight": (KV, H),
                   f"{{p}}.self_attn.v_proj.weight": (KV, H), f"{{p}}.self_attn.o_proj.weight": (H, H),
                   f"{{p}}.mlp.gate_proj.weight": (I, H), f"{{p}}.mlp.up_proj.weight": (I, H),
                   f"{{p}}.mlp.down_proj.weight": (H, I)}})
shapes["model.embed_tokens.weight"] = (V, H)
shapes["lm_head.weight"] = (V, H)
params = sum(a * b for a, b in shapes.values())
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
probe = ckptq.quantize(torch.zeros(32, 32), "nvfp4")
md, tensors = {{}}, {{}}
for fqn, shape in shapes.items():
    desc = native_descriptor(probe, fqn, shape)
    for spec in probe.component_specs(shape, probe.recipe):
        key = desc.components[spec.name].fqn
        cshape = spec.shape(shape)
        if spec.dims:  # FSDP2 Shard(0) over SAVERS ranks (torch.chunk boxes)
            step = -(-cshape[0] // SAVERS)
            chunks = [ChunkStorageMetadata(torch.Size([min(r * step, cshape[0])] + [0] * (len(cshape) - 1)),
                                           torch.Size([max(0, min(step, cshape[0] - r * step))] + list(cshape[1:])))
                      for r in range(SAVERS)]
        else:
            chunks = [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
        md[key] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), torch.Size(cshape), chunks)
    tensors[fqn] = desc
metadata = Metadata(md, planner_data={{CKPTQ_KEY: make_record(tensors, SAVERS)}})
t_meta = time.perf_counter() - t0
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
view = CheckpointView("/nonexistent", metadata=metadata)
mesh = MeshSpec(("dp_shard", "tp"), (256, 8))
rules = PlacementRules(mesh, "fsdp2-tp", {{"*q_proj*": "col", "*k_proj*": "col", "*v_proj*": "col",
                                          "*gate_proj*": "col", "*up_proj*": "col", "*o_proj*": "row",
                                          "*down_proj*": "row"}})
t0 = time.perf_counter()
plan = plan_reshard(view, mesh, rules)
t_plan = time.perf_counter() - t0
rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
per_rank = plan.bytes_per_rank()
print(json.dumps({{"params": params, "tensors": len(shapes), "saved_chunks": sum(len(m.chunks) for m in md.values()),
                  "target_ranks": mesh.world_size, "boxes": sum(len(j.owners) for j in plan.jobs),
                  "problems": len(plan.problems), "metadata_build_s": t_meta, "plan_s": t_plan,
                  "metadata_mib": (rss1 - rss0) / 1024, "plan_mib": (rss2 - rss1) / 1024,
                  "max_rank_gib": max(per_rank.values()) / 2**30, "total_gib": sum(per_rank.values()) / 2**30}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16: about 2.3 GB)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per timing (median)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--markdown", default=None, help="append the results table to this file")
    ap.add_argument("--processes", type=int, default=2, help="torchrun processes of the scale-out row (0: skip)")
    ap.add_argument("--before", default=None, help="a directory holding an older ckptq package to time as well")
    ap.add_argument("--no-convert", action="store_true", help="skip the convert row")
    ap.add_argument("--plain-route", action="store_true", help="also time dcp_to_torch_save + 4-rank re-save")
    ap.add_argument("--load", action="store_true", help="also time 4-rank loads of both layouts")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds to wait after removing the last output")
    args = ap.parse_args()
    from _dist import run_distributed

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src, dst, pt, resaved = work / "src", work / "dst", work / "full.pt", work / "resaved"
    copy = work / "copy"
    for p in (dst, resaved, copy):
        shutil.rmtree(p, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "CKPTQ_DISABLE_PROGRESS_BARS": "1"}
    t0 = time.perf_counter()
    if not (src / ".metadata").is_file():
        shutil.rmtree(src, ignore_errors=True)
        run_distributed(4, _save_worker, str(src), args.layers, timeout=3600)
        print(f"saved with 4 ranks in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    size = _dir_bytes(src)
    gb = size / 1e9

    rules = sum([["--rule", f"{g}=col"] for g in COL] + [["--rule", f"{g}=row"] for g in ROW], [])
    reshard_args = ["reshard", str(src), str(dst), "--mesh", "dp_shard=2,tp=2", "--plan", "fsdp2-tp", *rules]

    def fresh() -> None:
        for p in (dst, copy):
            shutil.rmtree(p, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        # The VM hands freed memory back to its host a few seconds after it is freed (free page
        # reporting): a command started at once rewrites the warm pages the last output left,
        # one started later faults fresh ones in. Every command starts after the same pause.
        time.sleep(args.settle)

    runs: dict[str, list] = {k: [] for k in ("cp", "ckptq", "dist", "before", "convert", "dist_convert")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.processes}"]
    # torchrun gives each process OMP_NUM_THREADS=1 unless set: give each its share of the cores that
    # the one process uses, so the two rows use the same cores.
    dist_env = {
        **env,
        "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // max(1, args.processes)))
        ),
    }
    convert_args = ["convert", str(src), str(dst), "--to", "nvfp4", "--json"]
    _, base_rss = _run_measured(["-m", "ckptq", *reshard_args, "--dry-run"], env)
    for i in range(args.repeat):  # interleaved, so that each round sees the same machine
        fresh()
        runs["cp"].append(_run_wall(["sh", "-c", f"cp -r '{src}' '{copy}' && sync"]))
        fresh()
        (w, r), report = _with_json(_run_measured, ["-m", "ckptq", *reshard_args, "--json"], env)
        runs["ckptq"].append((w, r, report["seconds"]["total"]))
        if i == 0:
            largest = max(_largest_chunk(src), _largest_chunk(dst))
        if args.processes > 1:
            fresh()
            w, report = _with_json(_run_wall, [*torchrun, "-m", "ckptq", *reshard_args, "--json"], dist_env)
            runs["dist"].append((w, report["seconds"]["total"]))
        if args.before:
            fresh()
            before_env = {**env, "PYTHONPATH": str(Path(args.before).absolute())}
            runs["before"].append(_run_measured(["-m", "ckptq", *reshard_args], before_env, cwd=args.before))
        if not args.no_convert:
            fresh()
            (w, r), report = _with_json(_run_measured, ["-m", "ckptq", *convert_args], env)
            sec = report["seconds"]
            runs["convert"].append((w, r, sec["transform"], sec["total"], sec["whole_reads"]))
            if args.processes > 1:
                fresh()
                w, report = _with_json(_run_wall, [*torchrun, "-m", "ckptq", *convert_args], dist_env)
                sec = report["seconds"]  # rank 0's report: the call until the job committed
                runs["dist_convert"].append((w, sec["total"], sec["transform"]))
    fresh()
    med = statistics.median
    cp_wall = med(runs["cp"])
    ck_wall = med(r[0] for r in runs["ckptq"])
    ck_call = med(r[2] for r in runs["ckptq"])
    ck_rss = max(r[1] for r in runs["ckptq"])
    bound = base_rss + 2 * largest

    plain = None
    if args.plain_route:
        base_runs = []
        for _ in range(args.repeat):
            pt.unlink(missing_ok=True)
            shutil.rmtree(resaved, ignore_errors=True)
            w1, r1 = _run_measured(
                [
                    "-c",
                    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
                    f"dcp_to_torch_save({str(src)!r}, {str(pt)!r})",
                ],
                env,
            )
            t1 = time.perf_counter()
            rss_ranks = run_distributed(4, _resave_worker, str(pt), str(resaved), args.layers, timeout=3600)
            base_runs.append((w1, time.perf_counter() - t1, r1, max(rss_ranks), sum(rss_ranks)))
        plain = [
            med(r[0] for r in base_runs),
            med(r[1] for r in base_runs),
            max(r[2] for r in base_runs),
            max(r[3] for r in base_runs),
            max(r[4] for r in base_runs),
        ]
        pt.unlink(missing_ok=True)
        shutil.rmtree(resaved, ignore_errors=True)
    loads = None
    if args.load:
        _run_measured(["-m", "ckptq", *reshard_args], env)
        loads = [
            statistics.median(
                max(ts)
                for ts in zip(
                    *run_distributed(4, _load_worker, str(p), args.layers, args.repeat, timeout=3600), strict=False
                )
            )
            for p in (dst, src)
        ]

    scale = None
    if not args.skip_scale:
        script = "import json\n" + PLAN_SCRIPT.format(root=str(ROOT))
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        scale = json.loads(out.stdout.strip().splitlines()[-1])

    machine = (
        f"{platform.node()}: {os.cpu_count()} CPU cores, Linux {platform.release()}, Python {platform.python_version()}"
    )
    import torch

    def row(name: str, wall: float, rss: str = "", note: str = "") -> str:
        return f"| {name} | {wall:.2f} | {gb / wall:.2f} | {cp_wall / wall:.2f} | {rss} | {note} |"

    lines = [
        f"### Offline reshard vs copy ({time.strftime('%Y-%m-%d %H:%M')} UTC, {machine}, torch {torch.__version__})",
        "",
        f"Synthetic Llama-style checkpoint: {args.layers} layers (hidden 4096, GQA 32/8, intermediate 14336), "
        f"attention MXFP8 + MLP NVFP4 native, {gb:.2f} GB ({size / 2**30:.2f} GiB), saved by 4 ranks with FSDP2 "
        f"Shard(0). Target: dp_shard=2,tp=2 (FSDP2 over TP). Median of {args.repeat} interleaved rounds (each "
        f"output removed and `sync`ed, then a {args.settle:.0f} s pause, before the next command). "
        f"Largest saved chunk {largest / 2**20:.1f} MiB; "
        f"process baseline (`VmHWM` of the same command with `--dry-run`) {base_rss / 2**20:.0f} MiB, so the "
        f"memory bound is {bound / 2**20:.0f} MiB.",
        "",
        "| route | wall (s) | GB/s | ratio to `cp` | peak RSS (MiB) | notes |",
        "|---|---|---|---|---|---|",
        row("`cp -r` + `sync` (the copy limit)", cp_wall),
        row(
            "`ckptq reshard`, 1 process",
            ck_wall,
            f"{ck_rss / 2**20:.0f}",
            f"bound {bound / 2**20:.0f}: {'within' if ck_rss <= bound else 'OVER'} (+{(ck_rss - base_rss) / 2**20:.1f} "
            f"MiB over the baseline); the call {ck_call:.2f} s",
        ),
    ]
    if runs["dist"]:
        d, d_call = (med(r[i] for r in runs["dist"]) for i in range(2))
        lines.append(
            row(
                f"`torchrun --nproc-per-node {args.processes} -m ckptq reshard`",
                d,
                "",
                f"{d / ck_wall:.2f}x the 1-process time (includes torchrun's own start); the call "
                f"{d_call:.2f} s ({d_call / ck_call:.2f}x)",
            )
        )
    if runs["before"]:
        b = med(w for w, _ in runs["before"])
        lines.append(
            row(
                "`ckptq reshard` before (torch.save records, whole tensors)",
                b,
                f"{max(r for _, r in runs['before']) / 2**20:.0f}",
                f"{b / ck_wall:.2f}x the new time",
            )
        )
    if runs["convert"]:
        c = med(r[0] for r in runs["convert"])
        k = med(r[2] for r in runs["convert"])
        tot = med(r[3] for r in runs["convert"])
        rd = med(r[4] for r in runs["convert"])
        lines.append(
            row(
                "`ckptq convert --to nvfp4`, 1 process",
                c,
                f"{max(r[1] for r in runs['convert']) / 2**20:.0f}",
                f"of the {tot:.2f} s call: kernels (requantize MXFP8 -> NVFP4, SQNR) {k:.2f} s, reading "
                f"those tensors whole {rd:.2f} s, the rest (NVFP4 byte-range copies, hashing, "
                f"writing) {tot - k - rd:.2f} s",
            )
        )
    if runs["dist_convert"]:
        dc, dtot, dk = (med(r[i] for r in runs["dist_convert"]) for i in range(3))
        c, tot = med(r[0] for r in runs["convert"]), med(r[3] for r in runs["convert"])
        lines.append(
            row(
                f"`torchrun --nproc-per-node {args.processes} -m ckptq convert --to nvfp4`",
                dc,
                "",
                f"{dc / c:.2f}x the 1-process time; the call {dtot:.2f} s ({dtot / tot:.2f}x), kernels "
                f"{dk:.2f} s summed over the processes (each tensor computed once)",
            )
        )
    lines.append("")
    if plain:
        b_conv, b_save, b_rss1, b_rss2, b_rss_sum = plain
        lines += [
            "| plain route | wall (s) | GB/s | peak RSS (GiB) |",
            "|---|---|---|---|",
            f"| `dcp_to_torch_save` + 4-rank `torch.load(mmap=True)` + `dcp.save` | {b_conv + b_save:.1f} "
            f"({b_conv:.1f} + {b_save:.1f}) | {gb / (b_conv + b_save):.2f} | {b_rss1 / 2**30:.2f} convert, "
            f"{b_rss2 / 2**30:.2f} per re-save rank ({b_rss_sum / 2**30:.2f} for the 4) |",
            "",
        ]
    if loads:
        lines += [
            "| load on dp_shard=2,tp=2 (4 gloo ranks, QuantizedLoadPlanner) | wall (s) |",
            "|---|---|",
            f"| from the resharded checkpoint (each rank reads its own file) | {loads[0]:.2f} |",
            f"| from the original FSDP2 x4 checkpoint (DCP load-time resharding) | {loads[1]:.2f} |",
            "",
        ]
    if scale:
        lines += [
            f"Planning at scale (metadata only, no tensors): Llama-3-405B layout ({scale['params'] / 1e9:.0f}B params, "
            f"{scale['tensors']} weights as NVFP4 native), "
            f"saved by 1024 ranks ({scale['saved_chunks']:,} saved chunks), "
            f"planned for dp_shard=256,tp=8 = {scale['target_ranks']} ranks ({scale['boxes']:,} target boxes, "
            f"{scale['problems']} alignment problems, "
            f"largest rank {scale['max_rank_gib']:.3f} GiB of {scale['total_gib']:.1f} GiB): "
            f"building the metadata {scale['metadata_build_s']:.1f} s / {scale['metadata_mib']:.0f} MiB, "
            f"planning {scale['plan_s']:.1f} s / {scale['plan_mib']:.0f} MiB.",
            "",
        ]
    text = "\n".join(lines)
    print(text)
    print(
        json.dumps(
            {
                "runs": runs,
                "bytes": size,
                "largest_chunk": largest,
                "baseline_rss": base_rss,
                "plain": plain,
                "loads": loads,
                "scale": scale,
            }
        ),
        file=sys.stderr,
    )
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

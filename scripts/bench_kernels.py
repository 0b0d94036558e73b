#!/usr/bin/env python
"""Benchmark of the ckptq requantize kernels against a plain copy and against the peers.

One command::

    python scripts/bench_kernels.py                      # device: cuda if available, else cpu
    python scripts/bench_kernels.py --device cpu --pairs all --json out.json
    python scripts/bench_kernels.py --render out.json    # (re)write docs/benchmarks.md from results

For each source -> target pair it measures, on the same device and in the same run:

* ``ckptq``: the public API (``ckptq.quantize`` / ``ckptq.requantize`` / ``.dequantize``) on the
  fastest backend (the fused C++/CUDA kernel). On a GPU every function (ckptq, copy and peers) is
  timed both as back-to-back calls and from a CUDA graph of ``--iters`` calls (device time, no
  Python launch overhead) where it can be captured; the faster counts, the JSON keeps both;
* ``copy``: ``dst.copy_(src)`` of buffers that move the same number of bytes; ``ratio`` is
  ``t_copy / t_ckptq``, i.e. the fraction of copy bandwidth the kernel reaches;
* ``eager``: the pure-PyTorch reference (the spec) through the same API, ``CKPTQ_BACKEND=reference``;
* ``compile``: the reference numerics (``ckptq.numerics``) under ``torch.compile``;
* ``torchao``: torchao's own quantize function for that target where torchao is installed
  (``nvfp4_quantize``, ``triton_to_mxfp8_dim0``, ``triton_fp8_blockwise_weight_quant_rhs``,
  ``NVFP4Tensor.dequantize``), eager and under ``torch.compile``; torchao's numerics differ from
  ckptq's (other rounding rules), so this compares speed only.

On a CPU the run also measures the machine's copy bandwidth out of cache (``copy_bandwidth``:
``b.copy_(a)`` of two buffers of at least twice the last-level cache, with 1 thread and with all
of torch's threads; read + write bytes counted), and the table gives each kernel's GB/s against
both, plus the fastest peer's time over ckptq's (>= 1: ckptq is at least as fast).

Bytes moved = bytes of the source components read once + bytes of the target components written
once ("logical"). Targets with a per-tensor amax (nvfp4, fp8_tensor) read the source twice (amax
pass + encode pass): ``traffic`` adds that second read. Times are medians over ``--reps`` runs, each
run timing ``--iters`` back-to-back calls (CUDA events on GPU, perf_counter on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ckptq  # noqa: E402
from ckptq import numerics as N  # noqa: E402
from ckptq import ops  # noqa: E402

HP = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ["fp32", "bf16", "fp16", "fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4"]
TARGET_PAIRS = ["bf16->nvfp4", "bf16->mxfp8", "bf16->fp8_block", "mxfp8->nvfp4", "nvfp4->bf16"]
EXTRA_PAIRS = [
    "bf16->nvfp4[amax]",
    "mxfp8->nvfp4[amax]",
    "bf16->fp8_tensor",
    "bf16->mxfp8[cw]",
    "bf16->nvfp4[2d]",
    "fp8_block->nvfp4",
    "nvfp4->mxfp8",
    "mxfp8->bf16",
    "fp8_block->bf16",
    "bf16->mxfp4",
    "bf16->mxfp4[rceil]",
    "mxfp4->bf16",
    "mxfp8->mxfp4",
    "mxfp4->nvfp4",
]
BYTES_PER_ELEM = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_tensor": 1,
    "fp8_block": 1,
    "mxfp8": 1 + 1 / 32,
    "nvfp4": 0.5 + 1 / 16,
    "mxfp4": 0.5 + 1 / 32,
}
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")


def parse_pair(name: str):
    base, _, opt = name.partition("[")
    src, dst = base.split("->")
    opt = opt.rstrip("]")
    rec = {"2d": {"two_d": True}, "cw": {"columnwise": True}, "rceil": {"scale_rule": "rceil"}}.get(opt, {})
    return src, dst, rec, opt == "amax"


# ------------------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, reps: int, iters: int, warmup: int = 1) -> float:
    """Median seconds per call over ``reps`` runs of ``iters`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters)
    return statistics.median(out)


def graph_time(fn, device, reps: int, iters: int) -> float:
    """Device time per call: ``iters`` calls captured in one CUDA graph, median replay time / iters.
    Removes the Python / launch overhead that back-to-back calls may still expose."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    t = time_fn(g.replay, device, reps, 1) / iters
    del g
    torch.cuda.empty_cache()
    return t


def best_time(fn, device, reps: int, iters: int) -> tuple[float, dict]:
    """(seconds per call, details): the faster of back-to-back calls and, on a GPU, the CUDA-graph
    replay (device time without launch overhead; a graph can also be slower, e.g. a D2D memcpy node
    runs on the copy engines). Applied alike to ckptq, the copy and every peer."""
    t_call = time_fn(fn, device, reps, iters)
    info = {"call_s": t_call}
    if device.type == "cuda":
        try:
            info["graph_s"] = graph_time(fn, device, reps, iters)
            return min(t_call, info["graph_s"]), info
        except Exception as e:  # noqa: BLE001  (e.g. a host copy inside the function)
            info["graph"] = f"n/a: {type(e).__name__}: {str(e)[:120]}"
            torch.cuda.synchronize(device)
    return t_call, info


def nbytes(t) -> int:
    if isinstance(t, dict):
        return sum(v.numel() * v.element_size() for v in t.values())
    if isinstance(t, ckptq.QuantizedTensor):
        return nbytes(t.components())
    return t.numel() * t.element_size()


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), or 0 if unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    v = f.read().strip()
            except OSError:
                continue
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(v[-1:], 1)
            best = max(best, int(v.rstrip("KMG")) * mult)
    except OSError:
        pass
    return best


def copy_bandwidth(reps: int) -> dict:
    """CPU copy bandwidth out of cache: ``b.copy_(a)`` of uint8 buffers of max(2 x LLC, 512 MiB)
    each, with 1 thread and with torch's thread count; GB/s counts the bytes read + written."""
    llc = llc_bytes()
    n = max(2 * llc, 512 * 2**20)
    a = torch.ones(n, dtype=torch.uint8)
    b = torch.zeros(n, dtype=torch.uint8)  # touched, so no page faults are timed
    threads = torch.get_num_threads()
    out = {"buffer_bytes": n, "llc_bytes": llc}
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        try:
            s = time_fn(lambda: b.copy_(a), torch.device("cpu"), max(3, reps), 1)
        finally:
            torch.set_num_threads(threads)
        out[f"threads{t}_gbps"] = 2 * n / s / 1e9
    out["threads"] = threads
    return out


# ------------------------------------------------------------------------------------ inputs
def make_input(src: str, min_bytes: int, k: int, device) -> tuple:
    """(source, bf16 high-precision tensor) with the source's components >= min_bytes."""
    m = max(128, math.ceil(min_bytes / (k * BYTES_PER_ELEM[src]) / 128) * 128)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((m, k), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    if src in HP:
        return x.to(HP[src]), x
    return ckptq.quantize(x, src), x  # quantized with the fastest backend


def api_call(src, dst: str, rec: dict, amax):
    """The public-API call of this pair (what a user runs)."""
    kw = {"amax": amax} if amax is not None else {}
    if dst in HP:
        return lambda: src.dequantize(HP[dst])
    if isinstance(src, ckptq.QuantizedTensor):
        return lambda: ckptq.requantize(src, dst, **rec, **kw)
    return lambda: ckptq.quantize(src, dst, **rec, **kw)


def reference_fn(src, dst: str, rec: dict, amax):
    """A plain-tensor function of the reference numerics (what torch.compile gets)."""
    if isinstance(src, ckptq.QuantizedTensor):
        comps, fmt, r = src.components(), src.FORMAT, src.recipe
        if fmt == "fp8_tensor":
            args, dec = (comps["data"], comps["scale_inv"]), N.dequantize_fp8_tensor
        elif fmt == "fp8_block":
            args, dec = (comps["data"], comps["scale_inv"]), lambda d, s: N.dequantize_fp8_block(d, s, r.block)
        elif fmt == "mxfp8":
            args, dec = (comps["data"], comps["scale"]), N.dequantize_mxfp8
        elif fmt == "mxfp4":
            args, dec = (comps["data"], comps["scale"]), N.dequantize_mxfp4
        else:
            args, dec = (
                (comps["data"], comps["scale"], comps["amax"]),
                (lambda d, s, a: N.dequantize_nvfp4(d, s, a, two_d=r.two_d)),
            )
    else:
        args, dec = (src,), lambda x: x
    if dst in HP:
        dt = HP[dst]
        if isinstance(src, ckptq.QuantizedTensor):
            if src.FORMAT == "nvfp4":
                return (lambda d, s, a: N.dequantize_nvfp4(d, s, a, dt, two_d=src.recipe.two_d)), args
            return (lambda *a: dec(*a).to(dt)), args
        return (lambda x: N._canonical_nan(N._f32(x)).to(dt)), args
    enc = {
        "nvfp4": lambda x: N.quantize_nvfp4(x, two_d=rec.get("two_d", False), amax=amax),
        "mxfp8": lambda x: N.quantize_mxfp8(x, columnwise=rec.get("columnwise", False)),
        "mxfp4": lambda x: N.quantize_mxfp4(x, scale_rule=rec.get("scale_rule", "floor")),
        "fp8_block": lambda x: N.quantize_fp8_block(x),
        "fp8_tensor": lambda x: N.quantize_fp8_tensor(x),
    }[dst]
    return (lambda *a: enc(dec(*a))), args


def torchao_fn(src, dst: str, rec: dict, x_bf16, amax):
    """torchao's function for this pair, or raise with the reason."""
    import torchao  # noqa: F401

    if isinstance(src, torch.Tensor) and not isinstance(src, ckptq.QuantizedTensor) and src.dtype == torch.bfloat16:
        if dst == "nvfp4" and not rec:
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

            def f(x=src):
                a = torch.max(torch.abs(x)) if amax is None else amax
                return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(a))

            return f, "nvfp4_quantize"
        if dst == "mxfp8" and not rec:
            if src.device.type == "cuda":
                from torchao.prototype.mx_formats.kernels import triton_to_mxfp8_dim0

                return (lambda x=src: triton_to_mxfp8_dim0(x, 32, "rceil")), "triton_to_mxfp8_dim0"
            from torchao.prototype.mx_formats.mx_tensor import to_mx

            return (lambda x=src: to_mx(x, torch.float8_e4m3fn, 32)), "to_mx"
        if dst == "fp8_block" and not rec and src.device.type == "cuda":
            from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_weight_quant_rhs

            return (
                lambda x=src: triton_fp8_blockwise_weight_quant_rhs(x, 128)
            ), "triton_fp8_blockwise_weight_quant_rhs"
    if isinstance(src, ckptq.QuantizedTensor) and src.FORMAT == "nvfp4" and dst == "bf16":
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

        c = src.components()
        t = NVFP4Tensor(c["data"], c["scale"], 16, torch.bfloat16, per_tensor_scale=c["amax"] / 2688.0)
        return (lambda: t.dequantize(torch.bfloat16)), "NVFP4Tensor.dequantize"
    if isinstance(src, ckptq.QuantizedTensor) and src.FORMAT == "mxfp8" and dst == "nvfp4" and not rec:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

        c = src.components()

        def f():
            x = to_dtype(c["data"], c["scale"].view(torch.float8_e8m0fnu), torch.float8_e4m3fn, 32, torch.bfloat16)
            a = torch.max(torch.abs(x)) if amax is None else amax
            return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(a))

        return f, "to_dtype + nvfp4_quantize"
    raise NotImplementedError("no torchao function for this pair")


# ------------------------------------------------------------------------------------- runner
def machine_name(device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} threads ({os.cpu_count()} cores visible)"


def bench_pair(name, device, args, deadline) -> dict:
    src_fmt, dst, rec, with_amax = parse_pair(name)
    k = args.k or (16384 if device.type == "cuda" else 4096)
    src, x = make_input(src_fmt, int(args.size_mib * 2**20), k, device)
    amax = N._matrix_amax(x.float()).to(device) if with_amax else None
    call = api_call(src, dst, rec, amax)
    out = call()
    r_bytes, w_bytes = nbytes(src), nbytes(out)
    per_tensor = dst in ("nvfp4", "fp8_tensor") and not with_amax
    row = {
        "pair": name,
        "shape": list(x.shape),
        "read_bytes": r_bytes,
        "write_bytes": w_bytes,
        "backend": ops.backend_name(device),
        "amax_pass": per_tensor,
    }
    del out
    iters = args.iters
    t, row["ckptq_timing"] = best_time(call, device, args.reps, iters)
    half = (r_bytes + w_bytes) // 2
    a = torch.empty(half, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t_copy, row["copy_timing"] = best_time(functools.partial(b.copy_, a), device, args.reps, iters)
    del a, b
    row.update(
        t_ckptq_s=t,
        t_copy_s=t_copy,
        gbps=(r_bytes + w_bytes) / t / 1e9,
        copy_gbps=(r_bytes + w_bytes) / t_copy / 1e9,
        ratio=t_copy / t,
    )
    row["traffic_ratio"] = (r_bytes * (2 if per_tensor else 1) + w_bytes) / t / row["copy_gbps"] / 1e9
    peers = {}
    if not args.no_eager and time.time() < deadline:
        with ops.force("reference"):
            try:
                peers["eager"] = time_fn(call, device, max(1, args.reps // 2), 1)
            except Exception as e:  # noqa: BLE001
                peers["eager"] = f"n/a: {type(e).__name__}: {e}"
    want_compile = not args.no_compile and (name in TARGET_PAIRS or args.compile_all)
    if want_compile and time.time() < deadline:
        try:
            fn, fargs = reference_fn(src, dst, rec, amax)
            cf = torch.compile(fn, dynamic=False)
            t0 = time.time()
            cf(*fargs)
            sync(device)
            row["compile_s"] = time.time() - t0
            peers["compile"], row["compile_timing"] = best_time(lambda: cf(*fargs), device, args.reps, iters)
        except Exception as e:  # noqa: BLE001
            peers["compile"] = f"n/a: {type(e).__name__}: {str(e)[:200]}"
    if not args.no_torchao and name in TARGET_PAIRS and time.time() < deadline:
        stage = "torchao"  # the column a failure is reported in
        try:
            fn, label = torchao_fn(src, dst, rec, x, amax)
            row["torchao_fn"] = label
            if not args.no_torchao_eager:
                peers["torchao"], row["torchao_timing"] = best_time(fn, device, args.reps, iters)
            if time.time() < deadline and not args.no_compile:
                stage = "torchao_compile"
                cf = torch.compile(fn, dynamic=False)
                cf()
                peers["torchao_compile"], row["torchao_compile_timing"] = best_time(cf, device, args.reps, iters)
        except Exception as e:  # noqa: BLE001
            peers[stage] = f"n/a: {type(e).__name__}: {str(e)[:200]}"
    row["peers_s"] = peers
    row["speedup"] = {k: (v / t if isinstance(v, float) else None) for k, v in peers.items()}
    return row


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.size_mib is None:
        args.size_mib = 256 if device.type == "cuda" else 16
    pairs = list(TARGET_PAIRS)
    if args.pairs == "all":
        pairs += EXTRA_PAIRS + [
            f"{a}->{b}"
            for a in FORMATS
            for b in FORMATS
            if a != b and f"{a}->{b}" not in TARGET_PAIRS + EXTRA_PAIRS and not (a in HP and b in HP)
        ]
    elif args.pairs not in ("targets", None):
        pairs = args.pairs.split(",")
    res = {
        "device": device.type,
        "machine": machine_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "backend": ops.backend_report(),
        "size_mib": args.size_mib,
        "reps": args.reps,
        "iters": args.iters,
        "rows": [],
    }
    try:
        import torchao

        res["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001
        res["torchao"] = f"not available: {type(e).__name__}: {e}"
    if device.type == "cpu":
        res["loadavg_start"] = os.getloadavg()
        res["copy_bw"] = copy_bandwidth(args.reps)
        print(f"copy bandwidth out of cache: {res['copy_bw']}", flush=True)
    deadline = time.time() + args.budget_s
    for name in pairs:
        t0 = time.time()
        try:
            row = bench_pair(name, device, args, deadline)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"pair": name, "error": f"{type(e).__name__}: {e}"}
        row["wall_s"] = time.time() - t0
        res["rows"].append(row)
        print(summary_line(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cpu":
        res["loadavg_end"] = os.getloadavg()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    return res


# ------------------------------------------------------------------------------------ output
def fmt_peer(row, key):
    v = row.get("peers_s", {}).get(key)
    if v is None:
        return "-"
    if isinstance(v, str):
        return "n/a"
    return f"{v * 1e3:.3g} ms ({row['speedup'][key]:.1f}x)"


def summary_line(row) -> str:
    if "error" in row:
        return f"{row['pair']:<24} ERROR {row['error']}"
    peers = " ".join(f"{k}={fmt_peer(row, k)}" for k in row.get("peers_s", {}))
    return (
        f"{row['pair']:<24} {row['gbps']:8.1f} GB/s  copy {row['copy_gbps']:8.1f} GB/s  ratio {row['ratio']:.2f}"
        f" (traffic {row['traffic_ratio']:.2f})  {peers}"
    )


def peer_gbps(row, key) -> str:
    v = row.get("peers_s", {}).get(key)
    if v is None:
        return "-"
    if isinstance(v, str):
        return "n/a"
    return f"{v * 1e3:.3g} ms, {(row['read_bytes'] + row['write_bytes']) / v / 1e9:.2f} GB/s"


def fastest_peer(row):
    """(name, seconds) of the fastest peer measured for the row, eager reference excluded."""
    got = [(k, v) for k, v in row.get("peers_s", {}).items() if isinstance(v, float) and k != "eager"]
    return min(got, key=lambda kv: kv[1]) if got else (None, None)


PEER_NAMES = {"compile": "torch.compile ref", "torchao": "torchao", "torchao_compile": "torchao compiled"}


def markdown_table_cpu(res: dict) -> str:
    bw = res["copy_bw"]
    t = bw["threads"]
    c1, ct = bw["threads1_gbps"], bw[f"threads{t}_gbps"]
    la0, la1 = res.get("loadavg_start"), res.get("loadavg_end")
    lines = [
        f"### CPU: {res['machine']}",
        "",
        f"torch {res['torch']}, torchao {res.get('torchao')}, measured {res['date']}; "
        f"sources of >= {res['size_mib']:g} MiB "
        f"(last-level cache {bw['llc_bytes'] / 2**20:.0f} MiB); median of {res['reps']} runs of {res['iters']} call(s) "
        f"(wall time), ckptq and every peer in the same process"
        + (
            f"; load average {la0[0]:.1f} at the start, {la1[0]:.1f} at the end (other jobs shared the machine)"
            if la0 and la1
            else ""
        )
        + ".",
        "",
        f"Copy bandwidth out of cache (`b.copy_(a)`, two {bw['buffer_bytes'] / 2**20:.0f} MiB buffers, read + write "
        f"counted): **1 thread {c1:.1f} GB/s, {t} threads {ct:.1f} GB/s**.",
        "",
        f"| pair | shape | MiB read + written | ckptq | GB/s | / 1-thread copy | / {t}-thread copy | "
        "torch.compile ref | torchao | torchao compiled | eager ref | fastest peer / ckptq |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["rows"]:
        if "error" in row:
            lines.append(f"| {row['pair']} | error: {row['error'][:80]} |" + " |" * 10)
            continue
        mib = (row["read_bytes"] + row["write_bytes"]) / 2**20
        name, best = fastest_peer(row)
        ratio = f"{best / row['t_ckptq_s']:.2f} ({PEER_NAMES[name]})" if name else "-"
        lines.append(
            f"| {row['pair']} | {'x'.join(map(str, row['shape']))} | {mib:.0f} | {row['t_ckptq_s'] * 1e3:.3g} ms | "
            f"{row['gbps']:.2f} | {row['gbps'] / c1:.2f} | {row['gbps'] / ct:.2f} | {peer_gbps(row, 'compile')} | "
            f"{peer_gbps(row, 'torchao')} | {peer_gbps(row, 'torchao_compile')} | {peer_gbps(row, 'eager')} | {ratio} |"
        )
    lines += [
        "",
        "GB/s: bytes of the source components read once + target components written once, per second. "
        "'fastest peer / ckptq': the fastest peer's time over ckptq's (>= 1: ckptq is at least as fast), "
        "eager reference excluded. " + _footnotes(res),
        "",
    ]
    return "\n".join(lines)


def _footnotes(res: dict) -> str:
    """The torchao functions used and the peers that could not be measured, for a table's legend."""
    notes = sorted(
        {
            f"{r['pair']} {k}: {v[5:].splitlines()[0][:120]}"
            for r in res["rows"]
            for k, v in r.get("peers_s", {}).items()
            if isinstance(v, str)
        }
    )
    fns = sorted({r["torchao_fn"] for r in res["rows"] if "torchao_fn" in r})
    return ("torchao functions: " + ", ".join(fns) + ". " if fns else "") + (
        "Not measured: " + "; ".join(notes) + "." if notes else ""
    )


def markdown_table(res: dict) -> str:
    if res["device"] == "cpu" and "copy_bw" in res:
        return markdown_table_cpu(res)
    dev = "GPU" if res["device"] == "cuda" else "CPU"
    lines = [
        f"### {dev}: {res['machine']}",
        "",
        f"torch {res['torch']}, torchao {res.get('torchao')}, measured {res['date']}; "
        f"sources of >= {res['size_mib']} MiB; "
        f"median of {res['reps']} runs of {res['iters']} calls"
        + (" (faster of back-to-back calls and CUDA-graph replay)." if res["device"] == "cuda" else " (wall time)."),
        "",
        "| pair | shape | MiB read + written | ckptq | GB/s | copy GB/s | ratio to copy | with amax pass "
        "| eager ref | torch.compile ref | torchao | torchao compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["rows"]:
        if "error" in row:
            lines.append(f"| {row['pair']} | error: {row['error'][:80]} |" + " |" * 10)
            continue
        mib = (row["read_bytes"] + row["write_bytes"]) / 2**20
        lines.append(
            f"| {row['pair']} | {'x'.join(map(str, row['shape']))} | {mib:.0f} | {row['t_ckptq_s'] * 1e3:.3g} ms | "
            f"{row['gbps']:.0f} | {row['copy_gbps']:.0f} | {row['ratio']:.2f} | "
            f"{row['traffic_ratio']:.2f} | {fmt_peer(row, 'eager')} | {fmt_peer(row, 'compile')} | "
            f"{fmt_peer(row, 'torchao')} | {fmt_peer(row, 'torchao_compile')} |"
        )
    lines += [
        "",
        "Peer columns: time per call and (in parentheses) how many times slower than ckptq (below 1.0x: "
        "the peer is faster). 'ratio to copy' counts each source byte read once; 'with amax pass' also "
        "counts the second read of the source that per-tensor targets (nvfp4 without amax=, fp8_tensor) "
        "need (it can exceed 1 where that second read partly hits L2). [amax]: amax= given (one pass); "
        "[cw]: mxfp8 with the columnwise copy; [2d]: nvfp4 16x16 blocks. " + _footnotes(res),
        "",
    ]
    return "\n".join(lines)


def render_subsection(res: dict, path: str = DOCS) -> None:
    """Replace only the '### CPU: ...' (or '### GPU: ...') table of the '## Kernels' section with this
    result, up to the next '####'/'###'/'##' heading (a hand-written '#### ...' analysis under the table
    is kept); everything else in the file is kept."""
    text = open(path).read()
    start = text.find("## Kernels")
    dev = "GPU" if res["device"] == "cuda" else "CPU"
    a = text.find(f"\n### {dev}:", start) + 1 if start >= 0 else 0
    if start < 0 or a == 0:
        return render([res], path)
    ends = [i for i in (text.find("\n#### ", a), text.find("\n### ", a), text.find("\n## ", a)) if i >= 0]
    b = min(ends) + 1 if ends else len(text)
    text = text[:a] + markdown_table(res).rstrip("\n") + "\n\n" + text[b:]
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def render(results: list[dict], path: str = DOCS) -> None:
    """Write the '## Kernels' section of docs/benchmarks.md (other sections are kept)."""
    head = (
        "## Kernels\n\nMeasured with `python scripts/bench_kernels.py` (see its docstring for what is "
        "timed). ckptq runs the fused C++ (CPU) or CUDA kernel of `ckptq/csrc`.\n\n"
    )
    body = head + "\n".join(markdown_table(r) for r in results)
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    start = text.find("## Kernels")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        nxt = text.find("\n## ", start + 1)
        old = text[start : nxt + 1] if nxt >= 0 else text[start:]
        a = old.find("### Analysis")  # hand-written analysis of the section is kept
        if a >= 0:
            body = body.rstrip("\n") + "\n\n" + old[a:].rstrip("\n") + "\n"
        text = text[:start] + body + ("\n" + text[nxt + 1 :] if nxt >= 0 else "")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--pairs", default="targets", help="'targets' (default), 'all', or a comma list like bf16->nvfp4")
    p.add_argument("--size-mib", type=float, default=None, help="minimum source size (default 256 GPU, 16 CPU)")
    p.add_argument("--k", type=int, default=0, help="last dim (default 16384 GPU, 4096 CPU)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=None, help="calls per timed run (default 10 GPU, 1 CPU)")
    p.add_argument("--no-eager", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-all", action="store_true", help="torch.compile the reference for every pair")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--no-torchao-eager", action="store_true", help="time torchao only under torch.compile")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip peers once this many seconds have passed")
    p.add_argument("--json", help="write results here (after every pair)")
    p.add_argument("--markdown", nargs="?", const=DOCS, help="update the Kernels section of this file")
    p.add_argument(
        "--subsection",
        action="store_true",
        help="with --markdown/--render: replace only this device's '### CPU:'/'### GPU:' table",
    )
    p.add_argument("--render", nargs="+", metavar="JSON", help="only render these result files into --markdown")
    args = p.parse_args(argv)
    if args.render:
        results = [json.load(open(f)) for f in args.render]
        if args.subsection:
            for r in results:
                render_subsection(r, args.markdown or DOCS)
        else:
            render(results, args.markdown or DOCS)
        print("\n\n".join(markdown_table(r) for r in results))
        return
    if args.iters is None:
        args.iters = 10 if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda" else 1
    res = run(args)
    print()
    print(markdown_table(res))
    if args.markdown:
        if args.subsection:
            render_subsection(res, args.markdown)
        else:
            render([res], args.markdown)


if __name__ == "__main__":
    main()

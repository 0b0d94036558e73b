#!/usr/bin/env python
"""NVFP4 encode on the GPU (the streaming 1x16 encode): bf16 -> nvfp4 against a device-to-device copy.

    python scripts/bench_nvfp4_encode.py --json out.json

Measured in one process, on one GPU, interleaved round by round (each round times every case once,
so drift hits all cases alike):

* ``copy``: ``dst.copy_(src)`` of two uint8 buffers of (bytes read + bytes written) / 2 each, i.e. a
  copy that moves the same bytes as the encode (the definition of ``scripts/bench_kernels.py``);
* ``two-pass``: ``ckptq.quantize(x, "nvfp4")`` (amax computed: the amax kernel, then the streaming
  encode kernel);
* ``single-pass``: ``ckptq.quantize(x, "nvfp4", amax=a)`` (amax given: the encode kernel alone);
* both with ``CKPTQ_NVFP4_ENCODE=tile`` (the new encode arithmetic in the one-tile-per-CTA
  kernel instead of the streaming kernel) and ``CKPTQ_NVFP4_ENCODE=baseline`` (the earlier encode
  kernel: per-block division, threshold E2M1 rounding), and the amax kernel alone (``ckptq.ops.amax``).

Each case's time is the faster of (a) the median over ``--reps`` rounds of ``--iters`` back-to-back
calls timed with CUDA events and (b) the median over the rounds of the replay of a CUDA graph of
``--iters`` calls, divided by ``--iters`` (as ``bench_kernels.py``). GB/s = (source bytes + output
bytes) / time, each byte counted once (the two-pass kernel reads the source twice; that second read
is not counted, as in ``docs/benchmarks.md``); ``ratio`` = copy time / case time. Before timing, the
outputs of every case are compared byte for byte with each other and with the reference (the
spec) run on the same GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_kernels import nbytes  # noqa: E402  (this folder is on sys.path when run as a script)

import ckptq  # noqa: E402
from ckptq import numerics as N  # noqa: E402
from ckptq import ops  # noqa: E402

ENV = "CKPTQ_NVFP4_ENCODE"


class Case:
    """A timed callable; ``env`` is the CKPTQ_NVFP4_ENCODE value it runs under (None: unset)."""

    def __init__(self, name, fn, env=None):
        self.name, self.fn, self.env = name, fn, env
        self.graph = None
        self.b2b, self.replay = [], []

    def __enter__(self):
        self._old = os.environ.get(ENV)
        if self.env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self.env
        return self

    def __exit__(self, *exc):
        if self._old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self._old

    def capture(self, iters):
        # The env var is read by the host code at launch, so the graph captures the kernel choice.
        try:
            self._capture(iters)
        except Exception as e:  # noqa: BLE001  (then back-to-back calls only)
            self.graph, self.graph_error = None, f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.synchronize()

    def _capture(self, iters):
        with self:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(iters):
                    self.fn()
            self.graph = g

    def time_round(self, iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self:
            self.fn()
            a.record()
            for _ in range(iters):
                self.fn()
            b.record()
            b.synchronize()
        self.b2b.append(a.elapsed_time(b) / 1e3 / iters)
        if self.graph is None:
            return
        self.graph.replay()  # warm
        a.record()
        self.graph.replay()
        b.record()
        b.synchronize()
        self.replay.append(a.elapsed_time(b) / 1e3 / iters)

    def result(self):
        t_b2b = statistics.median(self.b2b)
        t_graph = statistics.median(self.replay) if self.replay else float("inf")
        r = {
            "t_s": min(t_b2b, t_graph),
            "b2b_median_s": t_b2b,
            "graph_median_s": t_graph if self.replay else None,
            "b2b_runs_s": self.b2b,
            "graph_runs_s": self.replay,
        }
        if getattr(self, "graph_error", None):
            r["graph_error"] = self.graph_error
        return r


def check_same(outs: dict, ref) -> dict:
    """Byte comparison of every case's components with the reference's."""
    res = {}
    for name, q in outs.items():
        comps, rc = q.components(), ref.components()
        same = list(comps) == list(rc) and all(
            torch.equal(comps[k].reshape(-1).view(torch.uint8), rc[k].reshape(-1).view(torch.uint8)) for k in rc
        )
        res[name] = bool(same)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192x16384", help="M x K of the bf16 source (default: 256 MiB)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--reps", type=int, default=7, help="rounds (median over them; >= 5)")
    ap.add_argument("--iters", type=int, default=10, help="calls per timed run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the CKPTQ_NVFP4_ENCODE=tile/baseline cases")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "needs a GPU"
    dev = torch.device("cuda")
    m, k = (int(v) for v in args.shape.split("x"))
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn((m, k), generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16).to(dt)
    amax = N._matrix_amax(x.float())
    assert ops.backend_name(dev) == "cuda", ops.backend_report()

    cases = [
        Case("two_pass", lambda: ckptq.quantize(x, "nvfp4")),
        Case("single_pass", lambda: ckptq.quantize(x, "nvfp4", amax=amax)),
    ]
    if not args.no_baseline:
        cases += [
            Case("two_pass_tile", lambda: ckptq.quantize(x, "nvfp4"), env="tile"),
            Case("single_pass_tile", lambda: ckptq.quantize(x, "nvfp4", amax=amax), env="tile"),
            Case("two_pass_baseline", lambda: ckptq.quantize(x, "nvfp4"), env="baseline"),
            Case("single_pass_baseline", lambda: ckptq.quantize(x, "nvfp4", amax=amax), env="baseline"),
        ]
    cases.append(Case("amax_kernel", lambda: ops.amax(x)))

    # Bytes and correctness (every case's bytes against the reference on this GPU).
    outs = {}
    for c in cases:
        if c.name.startswith(("two_pass", "single_pass")):  # every kernel variant's bytes
            with c:
                outs[c.name] = c.fn()
    with ops.force("reference"):
        ref = ckptq.quantize(x, "nvfp4")
    same = check_same(outs, ref)
    assert all(same.values()), f"bytes differ from the reference: {same}"
    r_bytes, w_bytes = nbytes(x), nbytes(outs["two_pass"])
    del outs, ref
    torch.cuda.synchronize()

    half = (r_bytes + w_bytes) // 2
    a = torch.empty(half, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy = Case("copy", lambda: b.copy_(a))
    everything = [copy] + cases
    for c in everything:
        c.capture(args.iters)
    for _ in range(args.reps):
        for c in everything:
            c.time_round(args.iters)

    t_copy = copy.result()["t_s"]
    p = torch.cuda.get_device_properties(dev)
    res = {
        "what": "bf16->nvfp4 encode vs device-to-device copy (streaming 1x16 encode)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": [m, k],
        "dtype": args.dtype,
        "read_bytes": r_bytes,
        "write_bytes": w_bytes,
        "reps": args.reps,
        "iters": args.iters,
        "bit_exact_vs_reference": same,
        "copy": dict(copy.result(), gbps=(r_bytes + w_bytes) / t_copy / 1e9),
        "cases": {},
    }
    for c in cases:
        r = c.result()
        moved = r_bytes if c.name == "amax_kernel" else r_bytes + w_bytes
        r.update(gbps=moved / r["t_s"] / 1e9, ratio_to_copy=t_copy / r["t_s"] * (moved / (r_bytes + w_bytes)))
        if c.name.startswith("two_pass"):  # also counting the second read of the source
            r["traffic_ratio"] = (2 * r_bytes + w_bytes) / r["t_s"] / ((r_bytes + w_bytes) / t_copy)
        res["cases"][c.name] = r
    print(
        f"{res['device']}, torch {res['torch']}, {args.dtype} {m}x{k}: read {r_bytes / 2**20:.0f} MiB + "
        f"write {w_bytes / 2**20:.0f} MiB; copy {res['copy']['gbps']:.0f} GB/s ({t_copy * 1e6:.1f} us)"
    )
    for name, r in res["cases"].items():
        extra = f"  (with amax pass {r['traffic_ratio']:.2f})" if "traffic_ratio" in r else ""
        print(f"  {name:<22} {r['t_s'] * 1e6:8.1f} us  {r['gbps']:7.0f} GB/s  ratio {r['ratio_to_copy']:.3f}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

"""What the first ``dcp.async_save`` of a process pays for its staging memory, and ways to pay less.

``python scripts/bench_staging_alloc.py [--layers 19] [--rounds 3] [--out r.jsonl]`` (one CUDA GPU).
The state dict is the byte sizes of the components of ``scripts/bench_gpu_checkpoint.py``'s native
state dict (attention MXFP8: E4M3 codes + one E8M0 scale per 32; MLP NVFP4: packed E2M1 codes + one
E4M3 scale per 16 + a per-tensor value), as uint8 tensors on the GPU (19 layers: 2.70 GB, what each
rank holds at 38 layers on 2 GPUs). Each case runs in a process of its own (a cold pinned-memory
allocator, as a training process's first save has), cases interleaved over ``--rounds`` rounds:

* ``torch_each``: ``torch.empty(pin_memory=True)`` per tensor, then one non-blocking copy each and
  one synchronize: what staging into fresh memory costs (``ckptq.io.reserve_staging`` allocates this
  way, and so does the first async save without it);
* ``torch_each_env``: the same with torch's host allocator told to page-lock with
  ``cudaHostRegister`` on 8 threads (``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
  pinned_num_register_threads:8``, a documented torch setting);
* ``torch_each_thr8``: the per-tensor allocations made from 8 threads at once;
* ``register_touch8``: one anonymous ``mmap`` block (2 MiB aligned), its pages touched by 8 threads,
  then one ``cudaHostRegister`` of it (tensors at 512-byte aligned offsets in it);
* ``pageable``: the copy into new ordinary (not page-locked) memory.

Each process then times the copy into page-locked memory allocated beforehand (``d2h_s``: median of
3 after a warm-up): ``ratio`` = cold seconds / ``d2h_s``. One JSON line per process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CASES = ("torch_each", "torch_each_env", "torch_each_thr8", "register_touch8", "pageable")
REGISTER_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def component_bytes(layers: int) -> list[int]:
    """Bytes of each component tensor of the native state dict of ``layers`` layers: the shapes and
    rules of ``scripts/bench_gpu_checkpoint.py`` (matched as ``ckptq.quantize_state_dict`` matches
    them), each format's components (:meth:`ckptq.formats.QuantizedTensor.component_specs`)."""
    from bench_gpu_checkpoint import RULES, _shapes

    from ckptq.formats import format_class
    from ckptq.planners.quantize import _rule

    out = []
    for fqn, shape in _shapes(layers):
        fmt, options = _rule(fqn, RULES)
        cls = format_class(fmt)
        out += [math.prod(s.shape(shape)) * s.dtype.itemsize for s in cls.component_specs(shape, cls.Recipe(**options))]
    return out


def one_case(case: str, layers: int) -> dict:
    import torch

    torch.cuda.set_device(0)
    sizes = component_bytes(layers)
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for n in sizes]
    torch.cuda.synchronize()
    keep: list = []
    t0 = time.perf_counter()
    if case in ("torch_each", "torch_each_env"):
        dsts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    elif case == "torch_each_thr8":
        with ThreadPoolExecutor(8) as pool:
            dsts = list(pool.map(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True), sizes))
    elif case == "register_touch8":
        import mmap

        mib2, offsets, total = 2 << 20, [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // 512) * 512
        total = -(-total // mib2) * mib2
        m = mmap.mmap(-1, total + mib2)
        raw = torch.frombuffer(m, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % mib2
        block = raw[skip : skip + total]
        step = -(-total // 8 // mib2) * mib2
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda a: block[a : a + step].zero_(), range(0, total, step)))
        err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), total, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        keep += [m, raw, block]
        dsts = [block[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
    elif case == "pageable":
        dsts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    else:
        raise SystemExit(f"unknown case {case}")
    for s, d in zip(srcs, dsts, strict=True):
        d.copy_(s, non_blocking=True)
    torch.cuda.synchronize()
    cold = time.perf_counter() - t0
    warm = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    times = []
    for i in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s, d in zip(srcs, warm, strict=True):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    d2h = statistics.median(times)
    if keep:
        torch.cuda.cudart().cudaHostUnregister(keep[2].data_ptr())
    return {
        "variant": case,
        "GB": sum(sizes) / 1e9,
        "tensors": len(sizes),
        "cold_s": cold,
        "d2h_s": d2h,
        "ratio": cold / d2h,
        "device": torch.cuda.get_device_name(0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a case in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_case(args.one, args.layers)), flush=True)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_staging_alloc needs a CUDA GPU")
    results = []
    for _ in range(args.rounds):
        for case in args.cases.split(","):
            env = dict(os.environ)
            if case == "torch_each_env":
                env["PYTORCH_CUDA_ALLOC_CONF"] = REGISTER_CONF
            cmd = [sys.executable, __file__, "--one", case, "--layers", str(args.layers)]
            line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip()
            results.append(json.loads(line.splitlines()[-1]))
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line.splitlines()[-1] + "\n")
    for case in args.cases.split(","):
        rs = [r for r in results if r["variant"] == case]
        print(
            f"{case:22s} cold s {[round(r['cold_s'], 3) for r in rs]}  D2H s {[round(r['d2h_s'], 3) for r in rs]}  "
            f"cold / D2H median {statistics.median(r['ratio'] for r in rs):.1f}"
        )


if __name__ == "__main__":
    main()

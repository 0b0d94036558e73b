"""Object-storage round trip: ckptq's ``dcp.save`` / ``dcp.load`` to ``s3://`` against a plain
``s3fs`` upload and download of the same bytes, on one S3 server.

One command: ``python scripts/bench_s3.py [--mb 512] [--runs 3] [--out r.json]``.

Without ``--endpoint`` it starts moto's standalone S3 server (``python -m moto.server``, from
``pip install 'moto[server]'``) on a free port of 127.0.0.1 with made-up credentials; with
``--endpoint URL`` (and the usual ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``) it uses that
server and the bucket of ``--bucket``, which must exist. Steps, in one process, interleaved,
``--runs`` rounds (median):

1. ckptq: ``dcp.save`` of a state dict of MXFP8 tensors (``--mb`` MB of payload in all, 8 tensors)
   with ``AtomicFileSystemWriter("s3://...", overwrite=True)`` and ``QuantizedSavePlanner``, then
   ``dcp.load`` into a fresh state dict (its allocation timed with the load) with
   ``SafeFileSystemReader`` and ``QuantizedLoadPlanner`` (checksums checked); the load is checked
   bit-exact against what was saved.
2. plain s3fs: ``pipe_file`` of the bytes of each data object step 1 wrote, one after another
   (from memory; s3fs 2026.9: one PUT below 100 MiB, else a multipart upload of 50 MiB parts, 10
   at once), then ``cat_file`` of each back (a HEAD, then ranged GETs of 50 MiB, 10 at once).

GB/s = bytes of the data objects / seconds (GB = 1e9 bytes); the round trip is save + load. The
S3 requests of each step are counted by operation (botocore's ``before-call`` event on the one
s3fs client every step uses). The JSON (``--out``) holds every run's seconds and requests, the
medians, the ratio of the round trips' throughputs, the load average before and after, the
machine and the date.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free port of 127.0.0.1; returns (process, endpoint URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("moto's S3 server did not start") from None
            time.sleep(0.1)


def _state(mb: int) -> dict:
    import torch

    import ckptq

    g = torch.Generator().manual_seed(0)
    n = 8
    cols = 4096
    rows = max(32, (mb * 1_000_000 // n // cols) // 32 * 32)  # fp8 payload: 1 byte/element (+1/32 scales)
    return {f"layers.{i}.weight": ckptq.quantize(torch.randn(rows, cols, generator=g), "mxfp8") for i in range(n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="payload MB of the state dict (default 512)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--endpoint", help="an S3 endpoint URL (default: start moto's server here)")
    ap.add_argument("--bucket", default="ckptq-bench")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    proc = None
    if args.endpoint is None:
        proc, endpoint = start_moto()
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    else:
        endpoint = args.endpoint
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        result = run(args, endpoint)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def run(args, endpoint: str) -> dict:
    import s3fs
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.io import AtomicFileSystemWriter, SafeFileSystemReader

    fs = s3fs.S3FileSystem()
    if args.endpoint is None:
        fs.mkdir(args.bucket)
    load_before = os.getloadavg()
    calls: collections.Counter = collections.Counter()
    fs.s3.meta.events.register("before-call.s3", lambda model, **_: calls.update([model.name]))
    requests: dict[str, list[dict]] = {"ckptq_save": [], "ckptq_load": [], "s3fs_put": [], "s3fs_get": []}

    def taken(step: str) -> None:
        requests[step].append(dict(sorted(calls.items())))
        calls.clear()

    sd = _state(args.mb)
    prefix = f"{args.bucket}/{uuid.uuid4().hex[:8]}"
    url = f"s3://{prefix}/ck"
    runs: dict[str, list[float]] = {"ckptq_save": [], "ckptq_load": [], "s3fs_put": [], "s3fs_get": []}
    nbytes = objects = 0
    for _ in range(args.runs):
        calls.clear()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=AtomicFileSystemWriter(url, overwrite=True), planner=ckptq.QuantizedSavePlanner())
        t1 = time.perf_counter()
        taken("ckptq_save")
        out = {k: torch.zeros_like(v) for k, v in sd.items()}  # in the load's time, as cat_file's buffers
        dcp.load(out, storage_reader=SafeFileSystemReader(url), planner=ckptq.QuantizedLoadPlanner())
        t2 = time.perf_counter()
        taken("ckptq_load")
        for k, v in sd.items():
            for name, c in v.components().items():
                if not torch.equal(out[k].components()[name].view(torch.uint8), c.view(torch.uint8)):
                    raise SystemExit(f"the load of {k}.{name} differs from what was saved")
        del out
        data = [p for p in fs.ls(f"{prefix}/ck", refresh=True) if p.endswith(".distcp")]
        blobs = [fs.cat_file(p) for p in data]  # the same bytes, for the plain copy (not timed)
        nbytes, objects = sum(len(b) for b in blobs), len(blobs)
        calls.clear()
        t3 = time.perf_counter()
        for i, b in enumerate(blobs):
            fs.pipe_file(f"{prefix}/plain/{i}.bin", b)
        t4 = time.perf_counter()
        taken("s3fs_put")
        back = [fs.cat_file(f"{prefix}/plain/{i}.bin") for i in range(len(blobs))]
        t5 = time.perf_counter()
        taken("s3fs_get")
        assert back == blobs
        del blobs, back
        fs.rm(f"{prefix}/plain", recursive=True)
        for k, s in zip(runs, (t1 - t0, t2 - t1, t4 - t3, t5 - t4), strict=True):
            runs[k].append(s)
    fs.rm(prefix, recursive=True)
    med = {k: statistics.median(v) for k, v in runs.items()}

    def gbps(s: float) -> float:
        return round(nbytes / s / 1e9, 3)

    return {
        "what": "dcp.save + dcp.load via ckptq to s3:// vs s3fs pipe_file + cat_file of the same bytes",
        "server": "moto (python -m moto.server) on 127.0.0.1" if args.endpoint is None else "given endpoint",
        "bytes": nbytes,
        "objects": objects,
        "runs": args.runs,
        "seconds": runs,
        "requests": requests,
        "median_s": med,
        "round_trip_ratio": round(
            (med["s3fs_put"] + med["s3fs_get"]) / (med["ckptq_save"] + med["ckptq_load"]), 3
        ),  # ckptq's round-trip throughput / the plain copy's
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "GBps": {
            "ckptq_save": gbps(med["ckptq_save"]),
            "ckptq_load": gbps(med["ckptq_load"]),
            "ckptq_round_trip": gbps(med["ckptq_save"] + med["ckptq_load"]),
            "s3fs_put": gbps(med["s3fs_put"]),
            "s3fs_get": gbps(med["s3fs_get"]),
            "s3fs_round_trip": gbps(med["s3fs_put"] + med["s3fs_get"]),
        },
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "torch": torch.__version__,
        "s3fs": s3fs.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


if __name__ == "__main__":
    main()

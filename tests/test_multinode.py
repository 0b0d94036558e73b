"""The offline tools across "nodes": two torchrun agents (``--nnodes 2 --node-rank 0|1``, a static
rendezvous on 127.0.0.1, gloo), one process each, standing in for two hosts. ``reshard``, ``convert``
and ``export`` write the one-process output byte for byte, and no process opens for reading a file
of the staging folder (its own or another's) before the end: rank 0 writes ``.metadata`` and the
index from what the others sent it, not from their files (docs/design.md, "Several processes,
several hosts"). An export whose rank-1 process fails raises on both nodes and leaves nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptq
from ckptq.distributed import expect_shared_dir
from ckptq.errors import CkptqError
from ckptq.export import export_checkpoint
from ckptq.io.writer import CheckpointDirWriter
from ckptq.reshard import reshard_checkpoint
from ckptq.verify import verify_checkpoints

RESHARD = dict(mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=["*.q_proj.weight=col", "*.o_proj.weight=row"])
CONVERT = dict(to="nvfp4", mesh="3", plan="fsdp2")
EXPORT = dict(layout="modelopt", format="nvfp4", config=False, on_inexact="keep", max_shard_size=70_000)

# Runs under torchrun: each process records every file it opens for reading inside a staging folder
# (``.<dst>.ckptq-tmp-<pid>``), then runs the three tools split over the job.
WORKER = r"""
import builtins, io, json, os, sys

opened = []

def _watch(fn, reading):
    def wrapped(file, *args, **kwargs):
        # a file of a staging folder opened for reading (not the folder itself: Python 3.12's rmtree
        # opens the folder it removes)
        if (isinstance(file, (str, bytes, os.PathLike)) and ".ckptq-tmp-" in os.fsdecode(file)
                and reading(args, kwargs) and not os.path.isdir(file)):
            opened.append(os.fsdecode(file))
        return fn(file, *args, **kwargs)
    return wrapped

def _py_reading(args, kwargs):
    mode = args[0] if args else kwargs.get("mode", "r")
    return "r" in mode or "+" in mode

def _os_reading(args, kwargs):
    flags = args[0] if args else kwargs.get("flags", 0)
    return (flags & os.O_ACCMODE) != os.O_WRONLY

builtins.open = io.open = _watch(builtins.open, _py_reading)
os.open = _watch(os.open, _os_reading)
# The watch sees reads (pathlib's and os.open's), not writes:
from pathlib import Path
probe = Path(sys.argv[2]) / f".probe.ckptq-tmp-{os.getpid()}"
with open(probe, "wb") as f:
    f.write(b"x")
assert opened == [] and probe.read_bytes() == b"x"
os.close(os.open(probe, os.O_RDONLY))
assert opened == [str(probe)] * 2, opened
probe.unlink()
opened.clear()

import torch.distributed as dist
from ckptq.export import export_checkpoint
from ckptq.reshard import reshard_checkpoint

# One process group for the three calls (the tools use it, as in a job that has one): making and
# destroying the default group once per call can hang in the next init_process_group under a
# two-agent torchrun (torch 2.13, gloo).
dist.init_process_group("gloo")
src, out, reshard, convert, export = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:6])
reports = {
    "reshard": reshard_checkpoint(src, os.path.join(out, "reshard"), distributed=True, **reshard),
    "convert": reshard_checkpoint(src, os.path.join(out, "convert"), distributed=True, **convert),
    "export": export_checkpoint(src, os.path.join(out, "export"), distributed=True, **export),
}
rank = int(os.environ["RANK"])
# A process that fails (rank 1's disk, say): every process raises, nothing is committed.
import ckptq.export as ex
if rank == 1:
    def broken(f, t):
        raise OSError("No space left on device (injected)")
    ex._write_tensor = broken
try:
    export_checkpoint(src, os.path.join(out, "failed"), distributed=True, **export)
    failure = None
except Exception as e:
    failure = f"{type(e).__name__}: {e}"
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "node": os.environ["GROUP_RANK"], "opened": opened, "failure": failure,
               "processes": [reports[k]["processes"] for k in ("reshard", "convert")],
               "export": {k: reports["export"][k] for k in ("files", "bytes", "tensors", "consumer")}}, f)
dist.destroy_process_group()
"""


@pytest.fixture()
def src(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "layers.0.q_proj.weight": ckptq.quantize(torch.randn(512, 256, generator=g), "nvfp4"),
        "layers.0.o_proj.weight": ckptq.quantize(torch.randn(256, 512, generator=g), "mxfp8"),
        "layers.1.q_proj.weight": ckptq.quantize(torch.randn(256, 256, generator=g), "mxfp8"),
        "layers.1.o_proj.weight": torch.randn(256, 256, generator=g),
        "norm.weight": torch.randn(256, generator=g),
        "step": 5,
    }
    path = tmp_path / "src"
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.name != ".metadata"}


@pytest.mark.slow
def test_two_nodes_write_the_one_process_outputs(src, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    reshard_checkpoint(src, one / "reshard", **RESHARD)
    reshard_checkpoint(src, one / "convert", **CONVERT)
    ref = export_checkpoint(src, one / "export", **EXPORT)
    assert len(ref["files"]) >= 2  # both nodes get a shard file
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ckptq.__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        "CKPTQ_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    port = _free_port()
    args = [str(src), str(two), *(json.dumps(o) for o in (RESHARD, CONVERT, EXPORT))]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(script),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["node"] for r in ranks] == ["0", "1"]
    # the failing process's OSError reaches rank 0 as the CkptqError naming the destination (write_error)
    failed = f"rank 1: CkptqError: writing {two / 'failed'} failed: OSError: No space left on device (injected)"
    assert failed in ranks[0]["failure"], ranks[0]["failure"]
    assert ranks[1]["failure"] is not None and "injected" in ranks[1]["failure"]
    assert all(r["processes"] == [2, 2] for r in ranks)
    # No process read a file of a staging folder: not its own, not another node's.
    assert [r["opened"] for r in ranks] == [[], []]
    # Every file the same bytes as one process's (DCP's pickled .metadata aside: compared by content).
    for name in ("reshard", "convert", "export"):
        assert _files(one / name) == _files(two / name), name
    for name in ("reshard", "convert"):
        summary = verify_checkpoints(one / name, two / name)["summary"]
        assert summary["ok"] and summary["bit_exact"] == summary["compared"], name
    got = ranks[1]["export"]
    assert got == {k: json.loads(json.dumps(ref[k])) for k in ("files", "bytes", "tensors", "consumer")}
    assert sorted(os.listdir(two)) == ["convert", "export", "rank0.json", "rank1.json", "reshard"]  # no staging left


def test_rank0_refuses_records_it_cannot_see(tmp_path):
    """A process that wrote into a folder rank 0 does not see (a host-local path of the same name):
    rank 0 stats every record's file before ``.metadata`` and refuses; a process other than rank 0
    that cannot see the staging folder refuses before writing."""
    other = CheckpointDirWriter(tmp_path / "host1")
    other.add_chunk(1, "w", (4, 4), (0, 0), torch.ones(4, 4))
    root = CheckpointDirWriter(tmp_path / "host0")
    root.add_chunk(0, "v", (4,), (0,), torch.ones(4))
    root.merge_local(other.close_local())
    with pytest.raises(CkptqError, match=r"__1_0.distcp is missing.*file system every host sees"):
        root.finish({})
    assert not (tmp_path / "host0" / ".metadata").exists()

    class Rank1:
        rank = 1

    with pytest.raises(CkptqError, match="rank 1 cannot see"):
        expect_shared_dir(tmp_path / "elsewhere", Rank1())
    expect_shared_dir(tmp_path / "host0", Rank1())
    expect_shared_dir(tmp_path / "elsewhere", None)

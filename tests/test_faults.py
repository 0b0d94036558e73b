"""Faults during ckptq's writes (the fast subset of ``scripts/fault_matrix.py``, which runs every
fault x operation x {2, 4} ranks at random moments): a full disk, a read-only destination, a
reader during an overwrite, a rank killed midway through a 2-rank ``dcp.save``. In each, an old
checkpoint at the destination stays whole (bytes compared), nothing half-written is accepted and
no staging folder is left (or, after kill -9, the next run removes it)."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckptq
from ckptq.export import export_checkpoint
from ckptq.io import AtomicFileSystemWriter, SafeFileSystemReader

ROOT = Path(__file__).resolve().parents[1]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.weight": ckptq.quantize(torch.randn(128, 256, generator=g), "mxfp8") for i in range(4)}
    sd["norm.weight"] = torch.randn(256, generator=g)
    return sd


def _save(sd: dict, path: Path) -> None:
    dcp.save(sd, storage_writer=AtomicFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)


def _load(path: Path, reader: SafeFileSystemReader | None = None, planner=None) -> dict:
    """Every tensor entry of the DCP checkpoint at ``path`` as stored (raw entries)."""
    md = SafeFileSystemReader(path).read_metadata()
    sd = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=reader or SafeFileSystemReader(path), planner=planner, no_dist=True)
    return sd


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert_same_bytes(a[k], b[k], k)


def _leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.ckptq-"))


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """A full disk, as ``ulimit -f``: writes past ``nbytes`` fail with EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.fixture(scope="module")
def old_new(tmp_path_factory):
    """Two checkpoints of the same entries, other values: ``(old, new)`` paths."""
    d = tmp_path_factory.mktemp("faults")
    _save(_state(1), d / "old")
    _save(_state(2), d / "new")
    return d / "old", d / "new"


def test_disk_full_during_a_save(old_new, tmp_path):
    old, _ = old_new
    dst = tmp_path / "ck"
    shutil.copytree(old, dst)
    before = _load(dst)
    with _file_size_limit(20_000), pytest.raises(BaseException) as e:  # DCP wraps errors in its CheckpointException
        _save(_state(2), dst)
    msg = str(e.value)
    assert (
        f"CkptqError: {dst}: the save failed on 1 rank(s)" in msg
        and "nothing was committed" in msg
        and "File too large" in msg
        and "ulimit -f" in msg
    )
    _assert_same(_load(dst), before)
    assert _leftovers(dst) == []


@pytest.mark.parametrize("tool", ["convert", "export"])
def test_disk_full_during_an_offline_tool(old_new, tmp_path, tool):
    old, new = old_new
    dst = tmp_path / "out"
    run = {
        "convert": lambda src: ckptq.reshard_checkpoint(src, dst, to="nvfp4", overwrite=True),
        "export": lambda src: export_checkpoint(src, dst, layout="compressed-tensors", config=False, overwrite=True),
    }[tool]
    run(old)
    files = {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    with _file_size_limit(30_000), pytest.raises(ckptq.CkptqError) as e:
        run(new)
    assert f"writing {dst} failed" in str(e.value) and "File too large" in str(e.value)
    assert {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()} == files  # unchanged
    assert _leftovers(dst) == []


def test_read_only_destination(old_new, tmp_path):
    """A read-only destination folder: a clear error, nothing changed. Root ignores permissions,
    so as root the run is a child process without the capabilities that bypass them (setpriv)."""
    old, new = old_new
    dst = tmp_path / "ro" / "ck"
    dst.parent.mkdir()
    shutil.copytree(old, dst)
    before = _load(dst)
    os.chmod(dst.parent, 0o555)
    try:
        code = (
            "import sys, torch.distributed.checkpoint as dcp, ckptq\n"
            "from ckptq.io import AtomicFileSystemWriter\n"
            "try:\n"
            f"    ckptq.reshard_checkpoint({str(new)!r}, {str(dst)!r}, to='nvfp4', overwrite=True)\n"
            "except ckptq.CkptqError as e:\n"
            "    print('refused:', str(e).replace(chr(10), ' '))\n"
            "try:\n"
            f"    dcp.save({{}}, storage_writer=AtomicFileSystemWriter({str(dst)!r}), no_dist=True)\n"
            "except BaseException as e:\n"
            "    print('refused:', str(e).replace(chr(10), ' '))\n"
        )
        cmd = [sys.executable, "-c", code]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: permissions cannot be enforced")
            cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner", *cmd]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    finally:
        os.chmod(dst.parent, 0o755)
    refusals = [ln for ln in out.stdout.splitlines() if ln.startswith("refused:")]
    assert len(refusals) == 2, out.stdout + out.stderr
    assert all(f"{dst.parent} is not writable (read-only); nothing was written" in r for r in refusals), refusals
    _assert_same(_load(dst), before)
    assert sorted(os.listdir(dst.parent)) == ["ck"]


class _OverwriteAfterPlanning(torch.distributed.checkpoint.DefaultLoadPlanner):
    """Saves ``new`` over the checkpoint being loaded after the load read its metadata and
    before it reads any record: the overwrite swaps the directories and removes the old files."""

    def __init__(self, new: dict, dst: Path) -> None:
        super().__init__()
        self.new, self.dst = new, dst

    def create_local_plan(self):
        _save(self.new, self.dst)
        return super().create_local_plan()


def test_reader_during_an_overwrite_sees_the_old_checkpoint_whole(old_new, tmp_path):
    """A load that read ``.metadata`` before an overwrite swapped the directory gets exactly the
    old tensors (the reader holds that checkpoint's files open), not records of both: unpinned, it
    would read the new files through the old metadata (a checksum error, or with stock DCP the new
    bytes at the old offsets)."""
    old, new = old_new
    dst = tmp_path / "ck"
    shutil.copytree(old, dst)
    before, after = _load(old), _load(new)
    got = _load(dst, planner=_OverwriteAfterPlanning(_state(2), dst))
    _assert_same(got, before)
    _assert_same(_load(dst), after)  # the overwrite completed
    assert _leftovers(dst) == []


_KILLED_RANK = r"""
import os, signal, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
sys.path[:0] = [{root!r}, {tests!r}]
import ckptq
from ckptq.io import AtomicFileSystemWriter
from test_faults import _state

class KillMidway(ckptq.QuantizedSavePlanner):
    calls = 0
    def resolve_data(self, item):  # rank 1 dies (kill -9) after writing part of its records
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(item)

dist.init_process_group("gloo")
dcp.save(_state(2), storage_writer=AtomicFileSystemWriter({dst!r}), planner=KillMidway())
"""


@pytest.mark.slow
def test_rank_killed_midway_through_a_save(old_new, tmp_path):
    """torchrun, 2 gloo ranks, rank 1 SIGKILLed while writing: the job fails, the old checkpoint
    is whole, the staging folder is not a checkpoint (no ``.metadata``) and the next save into the
    destination removes it."""
    old, new = old_new
    dst = tmp_path / "ck"
    shutil.copytree(old, dst)
    before = _load(dst)
    script = tmp_path / "killed_rank.py"
    script.write_text(_KILLED_RANK.format(root=str(ROOT), tests=str(ROOT / "tests"), dst=str(dst)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode != 0
    _assert_same(_load(dst), before)
    assert _leftovers(dst) == [".ck.ckptq-saving"]
    assert not (dst.parent / ".ck.ckptq-saving" / ".metadata").exists()
    _save(_state(2), dst)
    _assert_same(_load(dst), _load(new))
    assert _leftovers(dst) == []

"""Faults during ckptq's writes (the fast subset of ``scripts/fault_matrix.py``, which runs every
fault x operation x {2, 4} ranks at random moments): a full disk (``ulimit -f``, and a real
ENOSPC on a small tmpfs), a read-only destination, a reader during an overwrite, a process killed
midway through a ``dcp.async_save``'s background write, a rank killed midway through a 2-rank
``dcp.save``; ``dcp.save`` and ``dcp.async_save`` alike. In each, an old checkpoint at the
destination stays whole (bytes compared), nothing half-written is accepted and no staging folder
is left (or, after kill -9, the next run removes it)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckptq
from ckptq.export import export_checkpoint
from ckptq.io import AtomicFileSystemWriter, SafeFileSystemReader, dcp_failure

ROOT = Path(__file__).resolve().parents[1]
SAVES = ("save", "async_save")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.weight": ckptq.quantize(torch.randn(128, 256, generator=g), "mxfp8") for i in range(4)}
    sd["norm.weight"] = torch.randn(256, generator=g)
    return sd


def _save(sd: dict, path: Path, mode: str = "save") -> None:
    """``dcp.save`` or ``dcp.async_save`` (then its future's result) of ``sd`` into ``path``."""
    kw = dict(storage_writer=AtomicFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    if mode == "save":
        dcp.save(sd, **kw)
    else:
        dcp.async_save(sd, **kw).result()


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


@pytest.mark.parametrize("mode", SAVES)
def test_disk_full_during_a_save(old_new, tmp_path, mode):
    """``async_save``: the write fails on DCP's background thread; the future's ``result()``
    raises it (wrapped in DCP's ``CheckpointException``, the ckptq error inside)."""
    old, _ = old_new
    dst = tmp_path / "ck"
    shutil.copytree(old, dst)
    before = _load(dst)
    with _file_size_limit(20_000), pytest.raises(CheckpointException) as e:
        _save(_state(2), dst, mode)
    err = dcp_failure(e.value, str(dst))
    msg = str(err)
    assert type(err) is ckptq.CkptqError, msg
    assert (
        msg.startswith(f"{dst}: the save failed on 1 rank(s)")
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
            "import sys, torch, torch.distributed.checkpoint as dcp, ckptq, ckptq.io\n"
            "from ckptq.io import AtomicFileSystemWriter\n"
            "try:\n"
            f"    ckptq.reshard_checkpoint({str(new)!r}, {str(dst)!r}, to='nvfp4', overwrite=True)\n"
            "except ckptq.CkptqError as e:\n"
            "    print('refused:', str(e).replace(chr(10), ' '))\n"
            "try:\n"
            f"    dcp.save({{}}, storage_writer=AtomicFileSystemWriter({str(dst)!r}), no_dist=True)\n"
            "except BaseException as e:\n"
            "    print('refused:', str(e).replace(chr(10), ' '))\n"
            f"f = dcp.async_save({{'x': torch.ones(3)}}, storage_writer=AtomicFileSystemWriter({str(dst)!r}),"
            " no_dist=True)\n"
            "try:\n"
            "    f.result()\n"
            "except BaseException as e:\n"
            f"    e = ckptq.io.dcp_failure(e, {str(dst)!r})\n"
            "    print('refused:', type(e).__name__, str(e).replace(chr(10), ' '))\n"
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
    assert len(refusals) == 3, out.stdout + out.stderr
    assert refusals[2].startswith("refused: CkptqError"), refusals  # async_save: out of its future
    assert all(f"{dst.parent} is not writable (read-only); nothing was written" in r for r in refusals), refusals
    _assert_same(_load(dst), before)
    assert sorted(os.listdir(dst.parent)) == ["ck"]


class _OverwriteAfterPlanning(torch.distributed.checkpoint.DefaultLoadPlanner):
    """Saves ``new`` over the checkpoint being loaded after the load read its metadata and
    before it reads any record: the overwrite swaps the directories and removes the old files."""

    def __init__(self, new: dict, dst: Path, mode: str) -> None:
        super().__init__()
        self.new, self.dst, self.mode = new, dst, mode

    def create_local_plan(self):
        _save(self.new, self.dst, self.mode)
        return super().create_local_plan()


@pytest.mark.parametrize("mode", SAVES)
def test_reader_during_an_overwrite_sees_the_old_checkpoint_whole(old_new, tmp_path, mode):
    """A load that read ``.metadata`` before an overwrite swapped the directory gets exactly the
    old tensors (the reader holds that checkpoint's files open), not records of both: unpinned, it
    would read the new files through the old metadata (a checksum error, or with stock DCP the new
    bytes at the old offsets)."""
    old, new = old_new
    dst = tmp_path / "ck"
    shutil.copytree(old, dst)
    before, after = _load(old), _load(new)
    got = _load(dst, planner=_OverwriteAfterPlanning(_state(2), dst, mode))
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


def test_failed_async_save_frees_its_staged_copy(old_new, tmp_path):
    """An ``async_save`` that fails before writing (here: the staging directory cannot be made)
    leaves the writer's kept staging copy free for the next save of the same tensors, which
    copies into it instead of allocating (and, for CUDA state dicts, page-locking) another."""
    from ckptq.io import writer as w

    dst = tmp_path / "ck"
    blocker = tmp_path / ".ck.ckptq-saving"
    blocker.write_text("a file where the staging directory goes")
    w._STAGED.clear()
    with pytest.raises(CheckpointException) as e:
        _save(_state(1), dst, "async_save")
    assert "cannot make the staging directory" in str(dcp_failure(e.value, str(dst)))
    ((key, kept),) = w._STAGED.items()
    owner = w._STAGED_BUSY[key]  # the save's thread, which ends just after setting the future's exception
    assert isinstance(owner, threading.Thread)
    owner.join(timeout=30)
    blocker.unlink()
    _save(_state(2), dst, "async_save")
    assert list(w._STAGED) == [key] and w._STAGED[key] is kept and key not in w._STAGED_BUSY
    _assert_same(_load(dst), _load(old_new[1]))
    w._STAGED.clear()


_KILLED_ASYNC = r"""
import os, signal, sys, time, warnings, torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
sys.path[:0] = [{root!r}, {tests!r}]
import ckptq
from ckptq.io import AtomicFileSystemWriter
from test_faults import _state

class KillMidway(ckptq.QuantizedSavePlanner):
    calls = 0
    def resolve_data(self, item):  # on DCP's background thread: kill -9 after part of the records
        self.calls += 1
        if self.calls >= 3:  # >=: the writer's threads share the count
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(item)

future = dcp.async_save(_state(2), storage_writer=AtomicFileSystemWriter({dst!r}), planner=KillMidway(), no_dist=True)
while not future.done():  # the training loop goes on meanwhile
    time.sleep(0.005)
"""


def test_process_killed_during_an_async_save(old_new, tmp_path):
    """kill -9 while ``dcp.async_save``'s background thread writes (one process): the old
    checkpoint is whole, the staging folder is not a checkpoint, the next save removes it."""
    old, new = old_new
    dst = tmp_path / "ck"
    shutil.copytree(old, dst)
    before = _load(dst)
    code = _KILLED_ASYNC.format(root=str(ROOT), tests=str(ROOT / "tests"), dst=str(dst))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    _assert_same(_load(dst), before)
    assert _leftovers(dst) == [".ck.ckptq-saving"]
    assert not (dst.parent / ".ck.ckptq-saving" / ".metadata").exists()
    _save(_state(2), dst, "async_save")
    _assert_same(_load(dst), _load(new))
    assert _leftovers(dst) == []


def _fault_matrix():
    spec = importlib.util.spec_from_file_location("fault_matrix", ROOT / "scripts" / "fault_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ENOSPC = r"""
import json, shutil, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = [{root!r}, {tests!r}]
from pathlib import Path
import ckptq, ckptq.io
from ckptq import reshard_checkpoint as reshard
from ckptq.export import export_checkpoint as export
from test_faults import _fault_matrix, _leftovers, _save, _state

fm = _fault_matrix()
src = {{age: Path({work!r}) / f"src-{{age}}" for age in ("old", "new")}}
ops = {{
    "save": lambda age, dst: _save(_state(1 if age == "old" else 2), dst),
    "async_save": lambda age, dst: _save(_state(1 if age == "old" else 2), dst, "async_save"),
    "reshard": lambda age, dst: reshard(src[age], dst, mesh="dp_shard=2", plan="fsdp2", overwrite=True),
    "convert": lambda age, dst: reshard(src[age], dst, to="nvfp4", overwrite=True),
    "export": lambda age, dst: export(src[age], dst, layout="compressed-tensors", config=False, overwrite=True),
}}
for op, run in ops.items():
    mount = Path({work!r}) / op
    mount.mkdir()
    fm.mount_tmpfs(mount, 64 << 20)
    dst = mount / "dst"
    run("old", dst)
    files = {{str(p.relative_to(dst)): p.read_bytes() for p in dst.rglob("*") if p.is_file()}}
    used = shutil.disk_usage(mount).used
    fm.mount_tmpfs(mount, used + used // 2, remount=True)  # room for half of the new output
    try:
        run("new", dst)
        error = None
    except BaseException as e:  # dcp.save / async_save: DCP's CheckpointException around the ckptq error
        error = e if isinstance(e, ckptq.CkptqError) else ckptq.io.dcp_failure(e, str(dst))
    print(json.dumps({{
        "op": op, "dst": str(dst), "error": error and f"{{type(error).__name__}}: {{error}}",
        "unchanged": files == {{str(p.relative_to(dst)): p.read_bytes() for p in dst.rglob("*") if p.is_file()}},
        "left": _leftovers(dst),
    }}))
"""


def test_real_disk_full(old_new, tmp_path):
    """A real ENOSPC: each operation overwrites its old output on a tmpfs with room for half of
    the new one (mounted in a private mount namespace: ``unshare -m`` as root, ``unshare -rm``
    otherwise; skipped where neither may mount). Each fails with a ``CkptqError`` naming the
    destination and ENOSPC; the old output is unchanged (bytes) and no staging folder is left."""
    prefix, why = _fault_matrix().mount_namespace()
    if prefix is None:
        pytest.skip(f"no small file system can be mounted here: {why}")
    old, new = old_new
    shutil.copytree(old, tmp_path / "src-old")
    shutil.copytree(new, tmp_path / "src-new")
    code = _ENOSPC.format(root=str(ROOT), tests=str(ROOT / "tests"), work=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["op"] for r in results] == ["save", "async_save", "reshard", "convert", "export"]
    for r in results:
        assert r["error"] and r["error"].startswith("CkptqError: "), r
        assert r["dst"] in r["error"] and "No space left on device" in r["error"], r
        assert r["unchanged"] and r["left"] == [], r

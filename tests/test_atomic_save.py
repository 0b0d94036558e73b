"""``ckptq.io.AtomicFileSystemWriter``: a ``dcp.save`` over an existing checkpoint is complete or
leaves the old one untouched, whether the save fails or the process is killed at a random moment."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptq
from ckptq.checkpoint import CheckpointView
from ckptq.io import AtomicFileSystemWriter
from ckptq.metrics import bit_exact


def _state(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    sd = {f"layers.{i}.weight": ckptq.quantize(torch.randn(512, 512, generator=g), "nvfp4") for i in range(8)}
    sd["version"] = torch.tensor([version])
    return sd


def _same(view: CheckpointView, sd: dict) -> bool:
    for k, v in sd.items():
        got = view.read(k)
        if isinstance(v, ckptq.QuantizedTensor):
            if not all(bit_exact(got.components()[n], c) for n, c in v.components().items()):
                return False
        elif not bit_exact(got, v):
            return False
    return True


def _save(sd, path):
    dcp.save(sd, storage_writer=AtomicFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner())


def test_atomic_save_replaces_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "ck"
    _save(_state(1), path)
    _save(_state(2), path)
    assert _same(CheckpointView(path), _state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


class _FailingPlanner(ckptq.QuantizedSavePlanner):
    """Fails while the data files are being written (after some records are already on disk)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def resolve_data(self, write_item):
        self.calls += 1
        if self.calls > 5:
            raise OSError("disk full (simulated)")
        return super().resolve_data(write_item)


def test_failed_save_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "ck"
    _save(_state(1), path)
    with pytest.raises(BaseException, match="disk full"):
        dcp.save(_state(2), storage_writer=AtomicFileSystemWriter(path), planner=_FailingPlanner())
    assert _same(CheckpointView(path), _state(1))  # the old checkpoint, whole
    _save(_state(3), path)  # the stale staging directory is emptied and reused
    assert _same(CheckpointView(path), _state(3)) and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with CUDA present, DCP's overlapping loader resolves every "
    "item before it opens a file, so this simulated failure never reaches the files",
)
def test_plain_dcp_save_over_a_checkpoint_is_not_atomic(tmp_path):
    """What the writer protects against: plain DCP reuses file names in place."""
    path = tmp_path / "ck"
    dcp.save(_state(1), checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    with pytest.raises(BaseException, match="disk full"):
        dcp.save(_state(2), checkpoint_id=str(path), planner=_FailingPlanner())
    try:  # old .metadata, new partial data files: a storage error, or (same lengths) other bytes
        intact = _same(CheckpointView(path), _state(1))
    except ckptq.CkptqError:
        intact = False
    assert not intact


_CHILD = r"""
import sys, torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, {tests!r})
import ckptq
from ckptq.io import AtomicFileSystemWriter
from test_atomic_save import _state
states = [_state(v) for v in range(2, 6)]  # quantized up front: the loop below only saves
print("ready", flush=True)
for i in range(1000):
    dcp.save(states[i % 4], storage_writer=AtomicFileSystemWriter({path!r}), planner=ckptq.QuantizedSavePlanner())
"""


def test_kill_at_random_moments_never_leaves_a_partial_checkpoint(tmp_path):
    """kill -9 of a process saving over and over at random moments: the checkpoint at ``path`` is
    always one complete version (never a mix), ``CKPTQ_KILLS`` rounds (default 4)."""
    path = tmp_path / "ck"
    _save(_state(1), path)
    rng = random.Random(0)
    mid_save = 0
    for _ in range(int(os.environ.get("CKPTQ_KILLS", "4"))):
        code = _CHILD.format(tests=str(Path(__file__).parent), path=str(path))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        view = CheckpointView(path) if path.exists() else CheckpointView(tmp_path / ".ck.ckptq-old")
        version = int(view.read("version")[0])
        assert _same(view, _state(version)), f"version {version} is not whole"
        mid_save += (tmp_path / ".ck.ckptq-saving").exists()
    print(f"kills: {mid_save} landed while a save was writing its files")


def test_kill_of_reshard_convert_export_never_leaves_an_accepted_partial(tmp_path):
    """``scripts/kill_writes.py`` (the closing-note figures run it with 20 kills per path), one kill
    per offline write path here: the destination is absent or whole (checksums verified, bit-exact
    against a reference output)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import kill_writes
    finally:
        sys.path.pop(0)
    result = kill_writes.run(1, seed=1, mb=8, work=tmp_path, ops=("reshard", "convert", "export"), max_delay=1.0)
    for op, s in result.items():
        assert s["kills"] == 1 and s["partial"] == 0, (op, s)

"""``reshard``/``convert`` spread over processes (gloo on CPU): the same checkpoint as one process,
``.metadata`` only after every process succeeded, nothing complete-looking after a failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_distributed

import ckptq
from ckptq.checksums import checksum_key
from ckptq.contract import read_checksums
from ckptq.distributed import assign
from ckptq.io import read_metadata
from ckptq.reshard import reshard_checkpoint
from ckptq.verify import check_integrity, verify_checkpoints

RULES = ["*.q_proj.weight=col", "*.o_proj.weight=row"]


@pytest.fixture()
def src(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "layers.0.q_proj.weight": ckptq.quantize(torch.randn(512, 256, generator=g), "nvfp4"),
        "layers.0.o_proj.weight": ckptq.quantize(torch.randn(256, 512, generator=g), "mxfp8", columnwise=True),
        "layers.1.q_proj.weight": ckptq.quantize(torch.randn(256, 256, generator=g), "mxfp8"),
        "norm.weight": torch.randn(256, generator=g),
        "step": 5,
    }
    path = tmp_path / "src"
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    return path


def test_assign_balances_bytes():
    assert assign({0: 10, 1: 10, 2: 10, 3: 10}, 2) == [{0, 2}, {1, 3}]
    assert assign({0: 100, 1: 10, 2: 10, 3: 10}, 2) == [{0}, {1, 2, 3}]
    assert assign({0: 5}, 3) == [{0}, set(), set()]


def _worker(rank, world_size, command, src, dst, options, fail_rank):
    import ckptq.reshard as r
    from ckptq.io import writer
    from ckptq.reshard import transform

    if rank == fail_rank:

        def broken(*args, **kwargs):
            raise OSError("No space left on device (injected)")

        writer.CheckpointDirWriter.add_encoded = broken
        writer.CheckpointDirWriter.add_chunk = broken
    counts = _count_work(transform, writer)
    fn = r.reshard_checkpoint  # convert: the options carry to=...
    try:
        out = fn(src, dst, distributed=True, **options)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return ("error", type(e).__name__, str(e))
    return ("ok", out["processes"], out["process_rank"], out["bytes_per_rank"], sorted(out["requantized"]), counts)


def _count_work(transform_module, writer_module) -> dict:
    """Count, in this process, the tensors computed (``transform``) and the tensor records written."""
    counts = {"computed": 0, "records": 0}
    computed, add_entry = transform_module.transform, writer_module.CheckpointDirWriter._add_entry_chunk

    def counted_transform(*args, **kwargs):
        counts["computed"] += 1
        return computed(*args, **kwargs)

    def counted_add_entry(self, *args, **kwargs):
        counts["records"] += 1
        return add_entry(self, *args, **kwargs)

    transform_module.transform = counted_transform
    writer_module.CheckpointDirWriter._add_entry_chunk = counted_add_entry
    return counts


def _one_process_work(fn, src, dst, options) -> dict:
    from ckptq.io import writer
    from ckptq.reshard import transform

    saved = transform.transform, writer.CheckpointDirWriter._add_entry_chunk
    try:
        counts = _count_work(transform, writer)
        return {"report": fn(src, dst, **options), **counts}
    finally:
        transform.transform, writer.CheckpointDirWriter._add_entry_chunk = saved


@pytest.mark.slow
@pytest.mark.parametrize(
    "command,options",
    [
        ("reshard", dict(mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=RULES)),
        ("reshard", dict(mesh="1", plan="replicate")),  # consolidation: both processes write the one file
        ("convert", dict(to="nvfp4", mesh="3", plan="fsdp2")),
        ("convert", dict(to="bfloat16", mesh="2", plan="fsdp2")),
    ],
)
def test_two_processes_write_the_one_process_checkpoint(src, tmp_path, command, options):
    one, two = tmp_path / "one", tmp_path / "two"
    fn = reshard_checkpoint  # convert: the options carry to=...
    single = _one_process_work(fn, src, one, options)
    ref = single["report"]
    results = run_distributed(2, _worker, command, str(src), str(two), options, -1)
    assert [r[:3] for r in results] == [("ok", 2, 0), ("ok", 2, 1)], results
    assert all(r[3] == ref["bytes_per_rank"] and r[4] == sorted(ref["requantized"]) for r in results)
    # The work is split, not repeated: each tensor computed and each record written by one process.
    work = [r[5] for r in results]
    assert sum(w["computed"] for w in work) == single["computed"]
    assert sum(w["records"] for w in work) == single["records"]
    assert all(w["records"] > 0 for w in work), work
    if command == "convert":
        assert single["computed"] > 0 and all(w["computed"] > 0 for w in work), work
    # The same files, byte for byte (records are laid out before anything is written).
    data_files = sorted(f for f in os.listdir(one) if f.endswith(".distcp"))
    assert data_files == sorted(f for f in os.listdir(two) if f.endswith(".distcp"))
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in data_files)
    _check_record_places(read_metadata(two))
    summary = verify_checkpoints(one, two)["summary"]
    assert summary["ok"] and summary["bit_exact"] == summary["compared"]  # the same bytes
    integrity = check_integrity(two)["summary"]
    assert integrity["ok"] and integrity["unverified"] == 0  # every process's checksums reached .metadata
    md_one, md_two = read_metadata(one), read_metadata(two)
    assert set(md_one.storage_data) == set(md_two.storage_data)
    assert {i.relative_path for i in md_two.storage_data.values()} == {
        i.relative_path for i in md_one.storage_data.values()
    }
    assert read_checksums(md_one.planner_data) == read_checksums(md_two.planner_data)
    assert set(read_checksums(md_two.planner_data)) == {checksum_key(i) for i in md_two.storage_data}
    assert sorted(os.listdir(tmp_path)) == ["one", "src", "two"]  # no staging folder left


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_one_failing_process_fails_the_job_and_commits_nothing(src, tmp_path, fail_rank):
    dst = tmp_path / "dst"
    options = dict(mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=RULES)
    results = run_distributed(2, _worker, "reshard", str(src), str(dst), options, fail_rank)
    assert all(r[0] == "error" for r in results), results
    other = results[1 - fail_rank]
    failed = f"rank {fail_rank}: CkptqError: writing {dst} failed: OSError: No space left on device"
    assert other[1] == "CkptqError" and failed in other[2]
    assert "injected" in results[fail_rank][2]
    assert not dst.exists() and sorted(os.listdir(tmp_path)) == ["src"]  # staging removed, nothing committed


@pytest.mark.slow
def test_torchrun_cli_splits_the_work(src, tmp_path):
    """``torchrun --nproc-per-node 2 -m ckptq reshard``: one report (rank 0), the one-process bytes."""
    one, two = tmp_path / "one", tmp_path / "two"
    reshard_checkpoint(src, one, mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=RULES)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ckptq.__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        "CKPTQ_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    rules = sum([["--rule", r] for r in RULES], [])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ckptq",
            "reshard",
            str(src),
            str(two),
            "--mesh",
            "dp_shard=2,tp=2",
            "--plan",
            "fsdp2-tp",
            *rules,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("wrote ") == 1 and "by 2 processes" in proc.stderr
    summary = verify_checkpoints(one, two)["summary"]
    assert summary["ok"] and summary["bit_exact"] == summary["compared"]


def _check_record_places(md) -> None:
    """Records of one file do not overlap, and each run of adjacent records (one tensor's, which
    one process writes) starts at a multiple of RECORD_ALIGN: processes never write one page."""
    from ckptq.io.pipeline import RECORD_ALIGN

    by_file: dict = {}
    for info in md.storage_data.values():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    for spans in by_file.values():
        end = 0
        for start, stop in sorted(spans):
            assert start >= end, (start, end)
            assert start == end or start % RECORD_ALIGN == 0, (start, end)
            end = stop

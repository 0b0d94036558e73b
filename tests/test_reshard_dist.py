"""``reshard``/``convert`` spread over processes (gloo on CPU): the same checkpoint as one process,
``.metadata`` only after every process succeeded, nothing complete-looking after a failure."""

from __future__ import annotations

import json
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
    assert assign({"a": 4, "b": 3}, 2, loads=[5, 0]) == [set(), {"a", "b"}]  # on top of the work they have


def test_file_share_gives_every_target_file_to_its_processes():
    """Every target rank goes to exactly one process (contiguous runs, sizes differing by at most
    one) when there are at least as many files as processes; with fewer, each file to a group of
    processes that numbers its members 0.. (they split the file's work)."""
    from ckptq.distributed import file_share

    for files, processes in ((4, 2), (5, 3), (2048, 64), (7, 7), (1, 3), (2, 3), (3, 8)):
        shares = [file_share(files, processes, p) for p in range(processes)]
        if files >= processes:
            ranks = [r for rs, _, _ in shares for r in rs]
            assert ranks == list(range(files)) and all((part, parts) == (0, 1) for _, part, parts in shares)
            assert max(len(rs) for rs, _, _ in shares) - min(len(rs) for rs, _, _ in shares) <= 1
        else:
            for r in range(files):
                group = [(part, parts) for rs, part, parts in shares if list(rs) == [r]]
                assert sorted(group) == [(i, len(group)) for i in range(len(group))] and group, (files, processes, r)


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


# ---------------------------------------------------------------- each process plans its own target files
@pytest.fixture()
def indexed(tmp_path):
    """A source with a chunk index (ckptq's writer) and component chunks that several target boxes
    share: per-tensor FP8 ``scale_inv``, NVFP4 global ``amax``, grouped 3-D tensors' per-member
    scales; plus replicated and bytes entries."""
    from ckptq.io import ChecksumFileSystemWriter

    g = torch.Generator().manual_seed(3)
    sd = {
        "layers.0.q_proj.weight": ckptq.quantize(torch.randn(256, 128, generator=g), "fp8_tensor"),
        "layers.0.o_proj.weight": ckptq.quantize(torch.randn(128, 256, generator=g), "nvfp4"),
        "layers.0.mlp.weight": ckptq.quantize(torch.randn(256, 128, generator=g), "mxfp8"),
        "experts.w1": ckptq.quantize(torch.randn(4, 64, 128, generator=g), "fp8_tensor"),
        "experts.w2": ckptq.quantize(torch.randn(4, 128, 64, generator=g), "nvfp4"),
        "norm.weight": torch.randn(128, generator=g),
        "step": 7,
    }
    path = tmp_path / "src"
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner())
    return path


def _plan_file(tmp_path) -> str:
    """Placements per mesh dim (dp_shard, tp): 2-D weights FSDP x TP, experts EP on dp_shard, the norm replicated."""
    path = tmp_path / "plan.json"
    path.write_text(
        json.dumps(
            {
                "layers.*": ["Shard(0)", "Shard(1)"],
                "experts.*": ["Shard(0)", "Shard(2)"],
                "norm.weight": ["Replicate()", "Replicate()"],
            }
        )
    )
    return str(path)


def _share_worker(rank, world_size, src, dst, options):
    """Run reshard/convert on this process, recording what it planned and which source entries'
    chunk rows it read (through the index)."""
    import ckptq.reshard.options as o
    import ckptq.reshard.plan as p
    from ckptq.io import writer
    from ckptq.reshard import transform

    seen: dict = {"plans": [], "whole": [], "views": []}
    plan_reshard, whole_jobs, open_indexed = o.plan_reshard, p.ReshardPlan.whole_jobs, o.open_indexed

    def recording_plan(*args, **kwargs):
        plan = plan_reshard(*args, **kwargs)
        seen["plans"].append((plan.ranks, sorted((j.fqn, r) for j in plan.jobs for r, _ in j.owners)))
        return plan

    def recording_whole_jobs(self, view, fqns):
        jobs = whole_jobs(self, view, fqns)
        seen["whole"] += [j.fqn for j in jobs]
        return jobs

    def recording_open(path):
        view = open_indexed(path)
        seen["views"].append(view)
        return view

    o.plan_reshard, p.ReshardPlan.whole_jobs, o.open_indexed = recording_plan, recording_whole_jobs, recording_open
    counts = _count_work(transform, writer)
    try:
        out = o.reshard_checkpoint(src, dst, distributed=True, **options)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return ("error", type(e).__name__, str(e))
    (view,) = seen["views"]
    rows = sorted(view._rows) if view is not None else None
    return ("ok", seen["plans"], sorted(seen["whole"]), rows, counts, out["plan"], out["requantized"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "processes,options",
    [
        (2, dict(mesh="dp_shard=2,tp=2", plan="FILE")),
        (3, dict(mesh="dp_shard=2,tp=2", plan="FILE", to="nvfp4")),  # one process has 2 files, two have 1
        (3, dict(mesh="2", plan="fsdp2", grouped="split", grouped_glob="experts.*")),  # 2 processes share file 0
    ],
)
def test_processes_plan_only_their_files_and_write_the_one_process_checkpoint(indexed, tmp_path, processes, options):
    """torchrun-style (gloo) reshard / convert through the index: every output file, ``.metadata``
    and ``.metadata.index`` included, is byte for byte the one process's; each process planned only
    the target ranks ``file_share`` gives it (their boxes, no other), read the chunk rows only of the
    entries those boxes and the tensors it computes read, and each transformed tensor was planned
    whole and computed by one process."""
    from ckptq.distributed import file_share
    from ckptq.io.index import INDEX_FILE
    from ckptq.parse import parse_mesh, parse_placement_rules
    from ckptq.reshard import ReshardOptions, plan_reshard
    from ckptq.reshard.run import _job_records, _src_key

    if options["plan"] == "FILE":
        options = {**options, "plan": _plan_file(tmp_path)}
    one, many = tmp_path / "one", tmp_path / "many"
    single = _one_process_work(reshard_checkpoint, indexed, one, options)
    results = run_distributed(processes, _share_worker, str(indexed), str(many), options)
    assert all(r[0] == "ok" for r in results), results
    files = sorted(os.listdir(one))
    assert INDEX_FILE in files and files == sorted(os.listdir(many))
    for f in files:
        assert (one / f).read_bytes() == (many / f).read_bytes(), f
    assert all(r[5] == single["report"]["plan"] for r in results)  # the whole plan's summary, merged
    # SQNRs: each tensor's once (its reductions' float order follows the thread count: approx)
    assert all(r[6] == pytest.approx(single["report"]["requantized"], rel=1e-6) for r in results)
    work = [r[4] for r in results]
    assert sum(w["records"] for w in work) == single["records"]
    assert sum(w["computed"] for w in work) == single["computed"]
    # what each process planned: its ranks' boxes of the whole plan, nothing else
    mesh = parse_mesh(options["mesh"])
    o = ReshardOptions(**options)
    view = ckptq.checkpoint.open_indexed(indexed)
    whole = plan_reshard(view, mesh, parse_placement_rules(mesh, o.plan, o.rules), **o.planning())
    transformed = {j.fqn for j in whole.jobs if j.out == "bytes" or j.out_format != (j.sources[0].format or None)}
    transformed |= {j.fqn for j in whole.jobs if len(j.sources) > 1 or j.member is not None}
    computed = [f for r in results for f in r[2]]
    assert sorted(computed) == sorted(transformed)  # each planned whole by one process
    for p, (_, plans, whole_fqns, rows, *_rest) in enumerate(results):
        ranks = tuple(file_share(mesh.world_size, processes, p)[0])
        assert [ranks_ for ranks_, _ in plans] == [ranks], (p, plans)
        assert plans[0][1] == sorted((j.fqn, r) for j in whole.jobs for r, _ in j.owners if r in ranks)
        keys = set()  # the source entries of its records (copied), of the tensors it computes, of its bytes records
        for j in whole.jobs:
            if j.fqn in whole_fqns:
                keys |= {k for s in j.sources for k in (*s.keys.values(), s.fqn)}
            elif j.out == "bytes" and 0 in ranks:  # read for its record's length
                keys.add(j.sources[0].fqn)
            elif j.fqn not in transformed:
                keys |= {_src_key(j, o) for o in _job_records(view, j) if o.rank in ranks}
        keys &= set(view.index.names)
        assert rows == sorted(keys), p
    if "to" not in options and "grouped" not in options:  # rank 0's file alone holds these: one process reads them
        for key in ("norm.weight", "layers.0.q_proj.weight.scale_inv", "layers.0.o_proj.weight.amax"):
            assert sum(key in r[3] for r in results) == 1, key


@pytest.mark.slow
def test_damaged_index_is_a_ckptq_error_and_changes_no_file(indexed, tmp_path):
    """A source whose index fails its checks: reshard (one process, and two) raises
    CheckpointFormatError naming it, writes nothing and leaves the source as it was."""
    from ckptq.io.index import INDEX_FILE

    raw = (indexed / INDEX_FILE).read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    spans = {k: v["data_offsets"] for k, v in json.loads(raw[8:header]).items() if k != "__metadata__"}
    for table, match in (("chunks", "crc32c"), ("entries", "digest")):
        start, end = spans[table]
        damaged = bytearray(raw)
        damaged[header + (start + end) // 2] ^= 0x10
        (indexed / INDEX_FILE).write_bytes(damaged)
        before = {f: (indexed / f).read_bytes() for f in os.listdir(indexed)}
        with pytest.raises(ckptq.CheckpointFormatError, match=match):
            reshard_checkpoint(indexed, tmp_path / "one", mesh="2", plan="fsdp2")
        results = run_distributed(2, _share_worker, str(indexed), str(tmp_path / "two"), dict(mesh="2", plan="fsdp2"))
        assert all(r[0] == "error" and match in r[2] for r in results), results
        assert sorted(os.listdir(tmp_path)) == ["src"]  # no output, no staging folder
        assert {f: (indexed / f).read_bytes() for f in os.listdir(indexed)} == before
    (indexed / INDEX_FILE).write_bytes(raw)
    reshard_checkpoint(indexed, tmp_path / "ok", mesh="2", plan="fsdp2")  # the same source, mended


def _split_decision_worker(rank, world_size, src, dst, key):
    """Process 1 finds ``key``'s chunks not readable by byte range; process 0 finds them readable."""
    from ckptq.checkpoint import CheckpointView, IndexedCheckpointView

    if rank == 1:
        for cls in (CheckpointView, IndexedCheckpointView):
            real = cls.saved_chunks_for
            cls.saved_chunks_for = lambda self, k, boxes, real=real: None if k == key else real(self, k, boxes)
    try:
        reshard_checkpoint(src, dst, distributed=True, mesh="2", plan="fsdp2")
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.slow
def test_processes_disagreeing_on_a_copy_stop_the_run(indexed, tmp_path):
    """A tensor whose chunks one process can copy by byte range and another cannot (it would compute
    it for every file, the first copy its own): refused on every process, nothing written."""
    results = run_distributed(2, _split_decision_worker, str(indexed), str(tmp_path / "dst"), "norm.weight")
    assert all(r[0] == "CheckpointFormatError" and "some target files" in r[1] for r in results), results
    assert sorted(os.listdir(tmp_path)) == ["src"]

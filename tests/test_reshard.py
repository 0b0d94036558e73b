"""Offline ``reshard`` / ``convert`` / ``verify`` (library and CLI), no process group."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _bounds import REENCODE_NVFP4
from typer.testing import CliRunner

import ckptq
from ckptq.checkpoint import CheckpointView
from ckptq.cli import app
from ckptq.io.index import INDEX_FILE
from ckptq.metrics import bit_exact
from ckptq.parse import parse_mesh, parse_placement, parse_placement_rules
from ckptq.placement import rank_boxes
from ckptq.reshard import plan_reshard, run_reshard
from ckptq.verify import verify_checkpoints

runner = CliRunner()


def _same(a, b) -> bool:
    ca, cb = a.components(), b.components()
    return ca.keys() == cb.keys() and all(bit_exact(ca[k], cb[k]) for k in ca)


@pytest.fixture()
def src(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {
            "layers.0.q_proj.weight": ckptq.quantize(torch.randn(512, 256, generator=g), "nvfp4"),
            "layers.0.o_proj.weight": ckptq.quantize(torch.randn(256, 512, generator=g), "mxfp8", columnwise=True),
            "layers.0.mlp.weight": ckptq.quantize(torch.randn(512, 256, generator=g), "fp8_block"),
            "experts.weight0": ckptq.quantize(torch.randn(256, 128, generator=g), "fp8_tensor"),
            "experts.weight1": ckptq.quantize(torch.randn(256, 128, generator=g), "fp8_tensor"),
            "norm.weight": torch.randn(256, generator=g),
        },
        "step": 11,
    }
    path = tmp_path / "src"
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    return path, sd


def _files(path):
    return {p: os.path.getsize(os.path.join(path, p)) for p in os.listdir(path)}


def test_reshard_fsdp2_tp_one_file_per_rank_and_exact(src, tmp_path):
    path, sd = src
    before = _files(path)
    mesh = parse_mesh("dp_shard=2,tp=2")
    rules = parse_placement_rules(mesh, "fsdp2-tp", ["*.q_proj.weight=col", "*.o_proj.weight=row"])
    view = CheckpointView(path)
    plan = plan_reshard(view, mesh, rules)
    dst = tmp_path / "dst"
    run_reshard(view, plan, dst)
    assert _files(path) == before  # the source is never modified
    assert sorted(os.listdir(dst)) == [".metadata", INDEX_FILE] + [f"__{r}_0.distcp" for r in range(4)]
    out = CheckpointView(dst)
    assert out.record["world_size"] == 4 and out.record["mesh"] == "dp_shard=2,tp=2"
    md = out.metadata
    q = "model.layers.0.q_proj.weight"
    # each target rank's chunks live in its own file: the FSDP2 x TP strided boxes of the data
    placements = [parse_placement("SS(0,2)"), parse_placement("S(0)")]
    boxes = rank_boxes((512, 256), mesh, placements)
    infos = {tuple(k.offset): v.relative_path for k, v in md.storage_data.items() if k.fqn == f"{q}.data"}
    for r, (off, _size) in enumerate(boxes):
        assert infos[(off[0], off[1] // 2)] == f"__{r}_0.distcp"
    # reload on one process: every tensor bit-exact, plain entries too
    flat = sd["model"]
    targets = {"model": {k: torch.empty_like(v) for k, v in flat.items()}, "step": 0}
    dcp.load(targets, checkpoint_id=str(dst), planner=ckptq.QuantizedLoadPlanner())
    for k, v in flat.items():
        got = targets["model"][k]
        assert _same(got, v) if isinstance(v, ckptq.QuantizedTensor) else bit_exact(got, v), k
    assert targets["step"] == 11
    report = verify_checkpoints(path, dst)
    assert report["summary"]["ok"] and report["summary"]["bit_exact"] == report["summary"]["compared"]


def test_dry_run_writes_nothing_and_reports_misaligned(src, tmp_path):
    path, _ = src
    dst = tmp_path / "dst"
    res = runner.invoke(app, ["reshard", str(path), str(dst), "--mesh", "3", "--dry-run", "--json"])
    assert res.exit_code == 1, res.output  # 512 / 3 rows: cuts at 171 split 128-blocks and 16x... blocks
    plan = json.loads(res.stdout)
    bad = {t["fqn"] for t in plan["tensors"] if t["problem"]}
    assert "model.layers.0.mlp.weight" in bad  # fp8_block 128x128, cut at row 171
    assert "model.layers.0.o_proj.weight" in bad  # mxfp8 columnwise 32-row blocks, cut at row 86
    assert "model.layers.0.q_proj.weight" not in bad  # nvfp4 1x16 blocks: row cuts are free
    assert not dst.exists()
    res = runner.invoke(app, ["reshard", str(path), str(dst), "--mesh", "3"])
    assert res.exit_code == 1 and "Nothing was written" in res.output and not dst.exists()
    assert not any(p.name.startswith(".dst") for p in tmp_path.iterdir())  # no temporary left behind


def test_reshard_keeps_columnwise_copies(tmp_path):
    """NVFP4 1x16 and FP8-block 1x128 columnwise copies survive N -> M reshards byte for byte; their
    blocks along M (16 and 128 rows) are cuts the plan must respect."""
    g = torch.Generator().manual_seed(5)
    sd = {
        "nv": ckptq.quantize(torch.randn(256, 192, generator=g), "nvfp4", columnwise=True),
        "bk": ckptq.quantize(torch.randn(256, 384, generator=g), "fp8_block", block=(1, 128), columnwise=True),
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "src"), planner=ckptq.QuantizedSavePlanner())
    ckptq.reshard_checkpoint(tmp_path / "src", tmp_path / "two", mesh="2")  # fsdp2: 128-row shards
    ckptq.reshard_checkpoint(tmp_path / "two", tmp_path / "tp", mesh="dp_shard=2,tp=2", plan="fsdp2-tp")
    ckptq.reshard_checkpoint(tmp_path / "tp", tmp_path / "one", mesh="1")
    for ck in ("two", "tp", "one"):
        view = CheckpointView(tmp_path / ck)
        for k, v in sd.items():
            assert any(c.startswith("columnwise") for c in view.entry(k).keys), (ck, k)
            assert _same(view.read(k), v), (ck, k)
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(targets, checkpoint_id=str(tmp_path / "tp"), planner=ckptq.QuantizedLoadPlanner())
    assert all(_same(targets[k], v) for k, v in sd.items())
    mesh = parse_mesh("3")
    plan = plan_reshard(CheckpointView(tmp_path / "src"), mesh, parse_placement_rules(mesh, "fsdp2"))
    problems = {j.fqn: j.problem for j in plan.jobs if j.problem}
    assert set(problems) == {"nv", "bk"}  # rows 0..85: inside a 16-row (nv) and a 128-row (bk) columnwise block
    assert "16" in problems["nv"] and "128" in problems["bk"]


def test_misaligned_high_precision_export(src, tmp_path):
    path, sd = src
    dst = tmp_path / "dst"
    res = runner.invoke(app, ["reshard", str(path), str(dst), "--mesh", "3", "--misaligned", "high-precision"])
    assert res.exit_code == 0, res.output
    out = CheckpointView(dst)
    e = out.entry("model.layers.0.mlp.weight")
    assert e.kind == "tensor" and e.dtype == torch.bfloat16 and e.descriptor.format == "fp8_block"
    assert bit_exact(
        out.read("model.layers.0.mlp.weight"), sd["model"]["layers.0.mlp.weight"].dequantize(torch.bfloat16)
    )


def test_existing_destination_needs_overwrite(src, tmp_path):
    path, _ = src
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    res = runner.invoke(app, ["reshard", str(path), str(dst), "--mesh", "2"])
    assert res.exit_code == 1 and "--overwrite" in res.output
    assert (dst / "keep.txt").read_text() == "mine"
    res = runner.invoke(app, ["reshard", str(path), str(dst), "--mesh", "2", "--overwrite"])
    assert res.exit_code == 0 and not (dst / "keep.txt").exists()
    res = runner.invoke(app, ["reshard", str(path), str(path / "inner"), "--mesh", "2"])
    assert res.exit_code == 1 and "overlaps the source" in res.output


def test_grouped_stack_and_split_round_trip(src, tmp_path):
    path, sd = src
    stacked, split = tmp_path / "stacked", tmp_path / "split"
    assert runner.invoke(app, ["reshard", str(path), str(stacked), "--grouped", "stack", "--mesh", "2"]).exit_code == 0
    e = CheckpointView(stacked).entry("model.experts.weight")
    assert e.kind == "quantized" and e.shape == (2, 256, 128)
    assert e.descriptor.components["scale_inv"].shape == (2,)  # one scale per member
    st = CheckpointView(stacked).read("model.experts.weight")
    for i in range(2):
        assert bit_exact(st.components()["data"][i], sd["model"][f"experts.weight{i}"].components()["data"])
    assert runner.invoke(app, ["reshard", str(stacked), str(split), "--grouped", "split"]).exit_code == 0
    assert verify_checkpoints(path, split)["summary"]["ok"]


def test_convert_and_verify_cli(src, tmp_path):
    path, sd = src
    dst = tmp_path / "conv"
    res = runner.invoke(app, ["convert", str(path), str(dst), "--to", "nvfp4", "--two-d", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    # SQNR of each re-encoded tensor vs its source values (the NVFP4 re-encode floor, tests/_bounds.py)
    assert set(report["requantized"]) == {
        "model.layers.0.o_proj.weight",
        "model.layers.0.mlp.weight",
        "model.experts.weight0",
        "model.experts.weight1",
        "model.layers.0.q_proj.weight",
    }
    assert all(s > REENCODE_NVFP4 for s in report["requantized"].values())
    conv = CheckpointView(dst).read("model.layers.0.mlp.weight")
    ref = ckptq.quantize(sd["model"]["layers.0.mlp.weight"].dequantize(), "nvfp4", two_d=True)
    assert _same(conv, ref)
    res = runner.invoke(app, ["verify", str(path), str(dst), "--min-sqnr", str(REENCODE_NVFP4), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["fqn"]: r for r in json.loads(res.stdout)["tensors"]}
    assert rows["model.norm.weight"]["status"] == "bit_exact"
    assert rows["model.layers.0.mlp.weight"]["status"] == "ok"
    res = runner.invoke(app, ["verify", str(path), str(dst), "--min-sqnr", "40"])
    assert res.exit_code == 1 and "below_threshold" in res.stdout


def test_verify_detects_missing_and_changed(src, tmp_path):
    path, sd = src
    other = tmp_path / "other"
    model = dict(sd["model"])
    model.pop("norm.weight")
    q = model["layers.0.q_proj.weight"]
    comps = q.components()
    data = comps["data"].clone()
    data[0, 0] ^= 1  # flip one bit of one element
    model["layers.0.q_proj.weight"] = type(q)({**comps, "data": data}, q.shape, q.dtype, q.recipe)
    dcp.save({"model": model, "step": 11}, checkpoint_id=str(other), planner=ckptq.QuantizedSavePlanner())
    report = verify_checkpoints(path, other)
    status = {r["fqn"]: r["status"] for r in report["tensors"]}
    assert status["model.norm.weight"] == "missing_in_b"
    assert status["model.layers.0.q_proj.weight"] == "mismatch"
    assert status["model.layers.0.mlp.weight"] == "bit_exact"
    assert not report["summary"]["ok"] and report["summary"]["failed"] == 2


def test_convert_to_high_precision_then_native_again(src, tmp_path):
    path, sd = src
    hp, back = tmp_path / "hp", tmp_path / "back"
    assert runner.invoke(app, ["convert", str(path), str(hp), "--to", "bfloat16"]).exit_code == 0
    e = CheckpointView(hp).entry("model.layers.0.q_proj.weight")
    assert e.kind == "tensor" and e.dtype == torch.bfloat16 and e.descriptor.format == "nvfp4"
    assert runner.invoke(app, ["reshard", str(hp), str(back), "--mode", "native"]).exit_code == 0
    got = CheckpointView(back).read("model.layers.0.q_proj.weight")
    ref = ckptq.quantize(sd["model"]["layers.0.q_proj.weight"].dequantize(torch.bfloat16), "nvfp4")
    assert _same(got, ref)


def test_plan_file_and_bad_arguments(src, tmp_path):
    path, _ = src
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"*.q_proj.weight": ["S(1)"], "*": ["R"]}))
    dst = tmp_path / "dst"
    res = runner.invoke(app, ["reshard", str(path), str(dst), "--mesh", "tp=4", "--plan", str(plan), "--json"])
    assert res.exit_code == 0, res.output
    tensors = {t["fqn"]: t for t in json.loads(res.stdout)["plan"]["tensors"]}
    assert tensors["model.layers.0.q_proj.weight"]["placements"] == "(S(1))"
    assert tensors["model.norm.weight"]["placements"] == "(R)"
    for args in (["--mesh", "dp=two"], ["--plan", "nonsense"], ["--plan", "fsdp2-tp", "--mesh", "4"]):
        res = runner.invoke(app, ["reshard", str(path), str(tmp_path / "x"), *args])
        assert res.exit_code == 2 and "Error:" in res.output, args  # usage errors exit 2
    res = runner.invoke(app, ["convert", str(path), str(tmp_path / "x"), "--to", "mxfp8", "--two-d"])
    assert res.exit_code == 2 and "--two-d" in res.output


@pytest.mark.parametrize(
    "mesh_text,preset,kw",
    [
        ("dp_shard=2,tp=2", "fsdp2-tp", {}),
        ("dp_shard=2,tp=2", "fsdp2-tp", {"grouped": "stack"}),
        ("dp_shard=2,tp=2", "fsdp2-tp", {"to": "mxfp8"}),
        ("3", "fsdp2", {}),  # misaligned: problems of some ranks' boxes
        ("3", "fsdp2", {"misaligned": "high_precision", "mode": "high_precision"}),
    ],
)
def test_per_rank_plan_is_the_slice_of_the_whole_plan(src, mesh_text, preset, kw):
    """plan_reshard(ranks=[r]) plans what target rank r writes: exactly the jobs of the whole plan
    with a box of r, with only r's owners and bytes, plus every job with a problem (the same problems)."""
    path, _ = src
    mesh = parse_mesh(mesh_text)
    rules = parse_placement_rules(
        mesh, preset, ["*.q_proj.weight=col", "*.o_proj.weight=row"] if "tp" in preset else []
    )
    view = CheckpointView(path)
    whole = plan_reshard(view, mesh, rules, **kw)
    for r in range(mesh.world_size):
        part = plan_reshard(view, mesh, rules, ranks=[r], **kw)
        expected = [j for j in whole.jobs if any(rr == r for rr, _ in j.owners) or j.problem]
        assert [j.fqn for j in part.jobs] == [j.fqn for j in expected]
        for got, want in zip(part.jobs, expected, strict=True):
            assert got.owners == [o for o in want.owners if o[0] == r]
            assert got.bytes_per_rank == {k: v for k, v in want.bytes_per_rank.items() if k == r}
            assert (got.out, got.out_format, got.out_recipe, got.out_dtype, got.shape, got.placements) == (
                want.out,
                want.out_format,
                want.out_recipe,
                want.out_dtype,
                want.shape,
                want.placements,
            )
            assert (got.problem, got.note) == (want.problem, want.note)
        assert part.bytes_per_rank() == {r: whole.bytes_per_rank()[r]} and part.problems == whole.problems
    both = plan_reshard(view, mesh, rules, ranks=range(mesh.world_size), **kw)
    assert [(j.fqn, j.owners, j.bytes_per_rank, j.problem) for j in both.jobs] == [
        (j.fqn, j.owners, j.bytes_per_rank, j.problem) for j in whole.jobs
    ]


def _first_owner_records(job):
    """The records of ``job`` by the rule before ``chunks.writes_component_chunk``: a component chunk
    several boxes share goes to the first owner in rank order (a whole-plan rule)."""
    from ckptq import chunks
    from ckptq.contract import component_fqn
    from ckptq.formats import format_class

    cls = format_class(job.out_format)
    out, seen = [], set()
    for rank, box in job.owners:
        for spec in cls.component_specs(job.shape, cls._recipe_from_json(job.out_recipe)):
            cbox = chunks.component_box(spec, job.shape, box)
            key = component_fqn(job.fqn, spec.name)
            if (key, cbox[0]) not in seen and 0 not in cbox[1]:
                seen.add((key, cbox[0]))
                out.append((rank, key, cbox))
    return out


@pytest.mark.parametrize(
    "mesh_text,preset,kw",
    [
        ("dp_shard=2,tp=2", "fsdp2-tp", {"grouped": "stack"}),  # 3-D experts: per-member scale_inv
        ("dp_shard=2,tp=2", "fsdp2-tp", {"to": "nvfp4"}),  # per-tensor amax on every box
        ("tp=4", "file", {}),  # Shard(1): per-tensor scalars shared along the columns
        ("5", "fsdp2", {"grouped": "stack", "misaligned": "high_precision"}),
        ("2", "replicate", {}),
    ],
)
def test_processes_lay_out_their_files_as_the_whole_plan(src, tmp_path, mesh_text, preset, kw):
    """Each of P processes plans only its target files (``file_share``) and lays them out alone:
    together they hold every record of the whole plan's file map once, at the same place, and a
    shared component chunk (per-tensor ``scale_inv`` / ``amax``, per-member scale) is written by one
    box, the one the whole plan's first owner rule named."""
    from ckptq.distributed import file_share
    from ckptq.io.pipeline import assign_offsets
    from ckptq.reshard.run import _file_map, _job_records

    path, _ = src
    mesh = parse_mesh(mesh_text)
    if preset == "file":
        preset = tmp_path / "plan.json"
        preset.write_text(
            json.dumps({"*proj.weight": ["Shard(1)"], "*mlp.weight": ["Shard(1)"], "*weight?": ["Shard(1)"]})
        )
    rules = parse_placement_rules(mesh, preset, ["*.q_proj.weight=col"] if "tp" in str(preset) else [])
    view = CheckpointView(path)
    whole = plan_reshard(view, mesh, rules, **kw)
    jobs = [j for j in whole.jobs if not j.problem]
    records = _file_map(view, jobs)
    for job, outs in zip(jobs, records, strict=True):
        if job.out == "quantized":
            assert [(o.rank, o.key, o.box) for o in outs] == _first_owner_records(job), job.fqn
    want = sorted((o.rank, o.key, o.box, o.at, o.length) for outs in records for o in outs)
    assert len(want) == len(set(want))
    shared = {  # components some boxes of a tensor do not write (another box writes their chunk)
        o.part
        for j, outs in zip(jobs, records, strict=True)
        for o in outs
        if sum(p.part == o.part for p in outs) < len(j.owners)
    }
    assert shared & {"scale_inv", "amax"} or preset == "replicate", shared
    for processes in (2, 3, 7):
        got = []
        for p in range(processes):
            ranks, part, _ = file_share(mesh.world_size, processes, p)
            if part:  # a file shared by processes is laid out alike by each; counted once
                continue
            plan = plan_reshard(view, mesh, rules, ranks=ranks, **kw)
            mine = [[o for o in _job_records(view, j) if o.rank in ranks] for j in plan.jobs if not j.problem]
            assign_offsets(mine)
            got += [(o.rank, o.key, o.box, o.at, o.length) for outs in mine for o in outs]
        assert sorted(got) == want, processes
    with pytest.raises(ckptq.UnsupportedFormatError, match="ranks"):
        plan_reshard(view, mesh, rules, ranks=[mesh.world_size], **kw)


def test_planning_needs_no_tensor_memory():
    """2048-rank plan of a large model from metadata alone (the scale benchmark, tiny here)."""
    mesh = parse_mesh("dp_shard=256,tp=8")
    rules = parse_placement_rules(mesh, "fsdp2-tp", ["*q_proj*=col"])
    boxes = rank_boxes((16384, 16384), mesh, rules.placements("l.q_proj.weight", 2))
    assert len(boxes) == 2048 and boxes[1] == ((2048, 0), (8, 16384))  # tp rank 1 of dp rank 0
    assert sum(s[0] * s[1] for _, s in boxes) == 16384 * 16384


_REPORT_HWM = (
    "import atexit, runpy, sys\n"
    "out = sys.argv[1]\n"
    "def _hwm():\n"
    "    kib = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
    "    open(out, 'w').write(kib)\n"
    "atexit.register(_hwm)\n"
    "sys.argv = ['ckptq'] + sys.argv[2:]\n"
    "runpy.run_module('ckptq', run_name='__main__')\n"
)


def _peak_rss_of_reshard(src, dst, report) -> int:
    """Peak RSS of the ckptq process itself: VmHWM of its own address space, read at its exit
    (wait4's ru_maxrss would include the parent's RSS at fork time)."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "CKPTQ_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(ckptq.__file__)), os.environ.get("PYTHONPATH", "")]
        ),
    }
    subprocess.run(
        [sys.executable, "-c", _REPORT_HWM, str(report), "reshard", str(src), str(dst), "--mesh", "2"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return int(open(report).read()) * 1024


def test_reshard_memory_does_not_grow_with_checkpoint_size(tmp_path):
    """Streaming: 6 vs 30 tensors of 16 MiB each. The stated bound is the process baseline plus
    about 3x the largest tensor (assembled tensor, one saved chunk being read, one target chunk
    being serialized), independent of the count. Holding the tensors would add 24 x 16 = 384 MiB;
    allocator noise between runs was measured up to 4 tensors (64 MiB); the threshold, 8 tensors
    (128 MiB), sits between the two."""
    tensor_bytes = 16 * 2**20
    peaks = []
    for n in (6, 30):
        path = tmp_path / f"src{n}"
        dcp.save({f"w{i}": torch.full((2048, 8192), i, dtype=torch.uint8) for i in range(n)}, checkpoint_id=str(path))
        peaks.append(_peak_rss_of_reshard(path, tmp_path / f"dst{n}", tmp_path / f"hwm{n}"))
    assert peaks[0] > 100 * 2**20  # it measured the ckptq process (torch alone is more than this)
    assert peaks[1] - peaks[0] < 8 * tensor_bytes, [p / 2**20 for p in peaks]


def test_mxfp4_convert_reshard_experts_and_misaligned_k(src, tmp_path):
    """--to mxfp4 --scale-rule rceil equals ckptq.requantize; 3-D mxfp4 experts resharded with the
    experts split (exact bytes); a K cut inside a 32-element block is refused, nothing written."""
    path, sd = src
    dst = tmp_path / "mx4"
    res = runner.invoke(app, ["convert", str(path), str(dst), "--to", "mxfp4", "--scale-rule", "rceil"])
    assert res.exit_code == 0, res.output
    got = CheckpointView(dst).read("model.layers.0.q_proj.weight")
    assert _same(got, ckptq.requantize(sd["model"]["layers.0.q_proj.weight"], "mxfp4", scale_rule="rceil"))
    res = runner.invoke(app, ["convert", str(path), str(tmp_path / "x"), "--to", "nvfp4", "--scale-rule", "rceil"])
    assert res.exit_code == 2 and "--scale-rule" in res.output
    # experts (E, N, K) = (4, 64, 96): split over experts (exact), then over K at 48 (inside a block)
    experts = ckptq.quantize(torch.randn(4, 64, 96, generator=torch.Generator().manual_seed(3)), "mxfp4")
    moe = tmp_path / "moe"
    dcp.save({"experts.w": experts}, checkpoint_id=str(moe), planner=ckptq.QuantizedSavePlanner())
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"experts.w": ["S(0)"]}))
    res = runner.invoke(app, ["reshard", str(moe), str(tmp_path / "ep"), "--mesh", "2", "--plan", str(plan)])
    assert res.exit_code == 0, res.output
    assert _same(CheckpointView(tmp_path / "ep").read("experts.w"), experts)
    plan.write_text(json.dumps({"experts.w": ["S(2)"]}))
    res = runner.invoke(app, ["reshard", str(moe), str(tmp_path / "k48"), "--mesh", "2", "--plan", str(plan)])
    assert res.exit_code != 0 and "experts.w" in res.output and "32" in res.output, res.output
    assert not (tmp_path / "k48").exists()


def test_mxfp4_grouped_stack_and_split(tmp_path):
    """GroupedLinear members weight0..1 in mxfp4 stack into one 3-D (experts, N, K) tensor whose
    components are the members' bytes, and split back exactly."""
    g = torch.Generator().manual_seed(5)
    members = {
        f"gl.weight{i}": ckptq.quantize(torch.randn(64, 96, generator=g), "mxfp4", scale_rule="even") for i in (0, 1)
    }
    path, stacked, split = tmp_path / "src", tmp_path / "stacked", tmp_path / "split"
    dcp.save(dict(members), checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    assert runner.invoke(app, ["reshard", str(path), str(stacked), "--grouped", "stack"]).exit_code == 0
    st = CheckpointView(stacked).read("gl.weight")
    assert st.FORMAT == "mxfp4" and tuple(st.shape) == (2, 64, 96) and st.recipe.scale_rule == "even"
    for i in (0, 1):
        for k, v in members[f"gl.weight{i}"].components().items():
            assert bit_exact(st.components()[k][i], v), (i, k)
    assert runner.invoke(app, ["reshard", str(stacked), str(split), "--grouped", "split"]).exit_code == 0
    for fqn, q in members.items():
        assert _same(CheckpointView(split).read(fqn), q)


@pytest.mark.parametrize("per_tensor", ["global_scale_inv", "global_scale"])
def test_nvfp4_producer_convention_reshard_convert_verify(tmp_path, per_tensor):
    """An NVFP4 tensor in a producer's global-scale convention (as imported from ModelOpt / torchao /
    compressed-tensors) saved natively, resharded to 4 ranks, verified and loaded back: the same
    components (its per-tensor value under its own name, deduplicated), the recipe kept; `convert
    --to nvfp4` requantizes it to ckptq's amax convention (SQNR reported)."""
    g = torch.Generator().manual_seed(4)
    w = ckptq.quantize(torch.randn(2, 64, 128, generator=g), "nvfp4", per_tensor=per_tensor, two_d=True)
    src = tmp_path / "src"
    dcp.save({"w": w}, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
    view = CheckpointView(src)
    assert view.entry("w").descriptor.recipe == {"two_d": True, "per_tensor": per_tensor}
    assert f"w.{per_tensor}" in view.metadata.state_dict_metadata
    mesh = parse_mesh("dp_shard=2,tp=2")
    dst = tmp_path / "dst"
    run_reshard(view, plan_reshard(view, mesh, parse_placement_rules(mesh, "fsdp2-tp")), dst)
    target = {"w": w.new_empty(w.shape)}
    dcp.load(target, checkpoint_id=str(dst), planner=ckptq.QuantizedLoadPlanner())
    assert _same(target["w"], w)
    report = verify_checkpoints(src, dst)
    assert report["summary"]["ok"] and report["summary"]["bit_exact"] == report["summary"]["compared"]
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "amax"), "--to", "nvfp4", "--two-d"])
    assert r.exit_code == 0, r.output
    back = CheckpointView(tmp_path / "amax").read("w")
    assert back.recipe.per_tensor == "amax" and set(back.components()) == {"data", "scale", "amax"}

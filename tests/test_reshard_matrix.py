"""Load-time resharding, the full matrix (gloo on CPU, up to 4 processes).

Layouts: 1 rank unsharded; FSDP2 ``Shard(0)`` on 2, 3, 4 ranks (TP column-parallel ``Shard(0)`` has the
same boxes); TP row-parallel ``Shard(1)`` on 2 and 4; a (dp_shard=2, tp=2) mesh with FSDP2 over TP:
``(_StridedShard(0, 2), Shard(0))`` (column-parallel) and ``(Shard(0), Shard(1))`` (row-parallel).
Shapes: (1536, 512), where every cut of every layout is block-aligned for every format, and the
uneven (1000, 384), where many are not.

Every saved shard is the aligned narrow of one global quantized tensor, so every target shard must
equal the same narrow of it, byte for byte. Whether a cut is aligned is decided by this file's own
block table (not by ckptq's geometry code): aligned pairs must load bit-exact, misaligned targets
must raise ShardingError before any data moves, misaligned sources must refuse to save.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from _dist import run_distributed

pytestmark = pytest.mark.slow

SHAPES = {"even": (1536, 512), "uneven": (1000, 384)}
# (format, recipe, block along M, block along K) -- the cut granularity (docs/formats.md, "9. Cuts and block alignment")
CASES = [
    ("fp8_tensor", {}, 1, 1),
    ("fp8_tensor", {"fp8_dtype": torch.float8_e5m2}, 1, 1),
    ("fp8_block", {}, 128, 128),
    ("fp8_block", {"block": (1, 128)}, 1, 128),
    ("mxfp8", {}, 1, 32),
    ("mxfp8", {"columnwise": True}, 32, 32),
    ("nvfp4", {}, 1, 16),
    ("nvfp4", {"two_d": True}, 16, 16),
    ("mxfp4", {}, 1, 32),
]
# name -> (mesh shape, placements as strings)
LAYOUTS = {
    "single": ((1,), None),
    "fsdp2_x2": ((2,), ["S(0)"]),
    "fsdp2_x3": ((3,), ["S(0)"]),
    "fsdp2_x4": ((4,), ["S(0)"]),
    "tp_row_x2": ((2,), ["S(1)"]),
    "tp_row_x4": ((4,), ["S(1)"]),
    "fsdp2_tp_col": ((2, 2), ["SS(0,2)", "S(0)"]),
    "fsdp2_tp_row": ((2, 2), ["S(0)", "S(1)"]),
}


def _ws(layout: str) -> int:
    import math

    return math.prod(LAYOUTS[layout][0])


@functools.cache
def _global(shape_name: str, i: int):
    import ckptq

    fmt, recipe, _, _ = CASES[i]
    x = torch.randn(SHAPES[shape_name], generator=torch.Generator().manual_seed(7 + i)) * (1 + i)
    return ckptq.quantize(x, fmt, **recipe)


def _rank_box(shape, layout: str, rank: int):
    from ckptq.parse import parse_placement
    from ckptq.placement import MeshSpec, shard_box

    mesh_shape, pl = LAYOUTS[layout]
    if pl is None:
        return (0, 0), tuple(shape)
    mesh = MeshSpec(tuple(f"d{i}" for i in range(len(mesh_shape))), mesh_shape)
    return shard_box(shape, mesh_shape, mesh.coordinate(rank), [parse_placement(p) for p in pl])


def _aligned(shape, layout: str, i: int, ws: int) -> bool:
    """This test's own rule: every cut is a multiple of the block along its dim, or the dim end."""
    _, _, bm, bk = CASES[i]
    for r in range(ws):
        (o0, o1), (s0, s1) = _rank_box(shape, layout, r)
        for off, size, b, n in ((o0, s0, bm, shape[0]), (o1, s1, bk, shape[1])):
            if size and any(c % b and c != n for c in (off, off + size)):
                return False
    return True


@functools.cache
def _mesh(mesh_shape: tuple[int, ...]):
    """One device mesh per mesh shape in a rank, as a job has one. A 2-D mesh makes a gloo group for
    each of its rows and columns (``new_group``: every rank takes part, connecting through the
    store); made again for each tensor of each load, they were most of this file's time."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", mesh_shape)


def _dtensor(local, shape, layout: str):
    from torch.distributed.tensor import DTensor

    from ckptq.parse import parse_placement

    mesh_shape, pl = LAYOUTS[layout]
    if pl is None:
        return local
    return DTensor.from_local(
        local,
        _mesh(mesh_shape),
        [parse_placement(p) for p in pl],
        run_check=False,
        shape=torch.Size(shape),
        stride=(shape[1], 1),
    )


def _save_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq
    from ckptq.formats.base import slice_box

    refused = []
    for layout in LAYOUTS:
        if _ws(layout) != ws:
            continue
        for sname, shape in SHAPES.items():
            box = _rank_box(shape, layout, rank)
            sd = {}
            for i in range(len(CASES)):
                if _aligned(shape, layout, i, ws):
                    sd[f"w{i}"] = _dtensor(slice_box(_global(sname, i), box), shape, layout)
                    continue
                # a misaligned source: shards quantized locally (with the global amax) must not save
                x = torch.randn(shape, generator=torch.Generator().manual_seed(7 + i))
                part = x[box[0][0] : box[0][0] + box[1][0], box[0][1] : box[0][1] + box[1][1]]
                fmt, recipe, _, _ = CASES[i]
                kw = {"amax": x.abs().max()} if fmt in ("nvfp4", "fp8_tensor") else {}
                local = ckptq.quantize(part.contiguous(), fmt, **recipe, **kw)
                try:
                    dcp.save(
                        {"w": _dtensor(local, shape, layout)},
                        checkpoint_id=os.path.join(root, "refused"),
                        planner=ckptq.QuantizedSavePlanner(),
                    )
                    refused.append((layout, sname, i, "saved"))
                except CheckpointException as e:
                    refused.append((layout, sname, i, "ShardingError" in str(e)))
            dcp.save(sd, checkpoint_id=os.path.join(root, f"{sname}-{layout}"), planner=ckptq.QuantizedSavePlanner())
    return refused


def _load_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq
    from ckptq.formats.base import slice_box
    from ckptq.metrics import bit_exact

    failures, exact, refused = [], 0, 0
    for layout in LAYOUTS:
        if _ws(layout) != ws:
            continue
        for sname, shape in SHAPES.items():
            box = _rank_box(shape, layout, rank)
            want = {i: slice_box(_global(sname, i), box) for i in range(len(CASES)) if _aligned(shape, layout, i, ws)}
            for src in LAYOUTS:
                saved = [i for i in range(len(CASES)) if _aligned(shape, src, i, _ws(src))]
                sd = {f"w{i}": _dtensor(torch.empty_like(want[i]), shape, layout) for i in saved if i in want}
                dcp.load(sd, checkpoint_id=os.path.join(root, f"{sname}-{src}"), planner=ckptq.QuantizedLoadPlanner())
                for key, t in sd.items():
                    got = t.to_local() if hasattr(t, "to_local") else t
                    for c, v in want[int(key[1:])].components().items():
                        if bit_exact(v, got.components()[c]):
                            exact += 1
                        else:
                            failures.append((sname, src, layout, CASES[int(key[1:])][:2], c))
            # misaligned targets raise before any data moves (the target side does not depend on
            # the source, so one source suffices)
            for i in range(len(CASES)):
                if i in want:
                    continue
                (o0, o1), (s0, s1) = box
                fmt, recipe, _, _ = CASES[i]
                target = ckptq.quantize(torch.zeros(s0, s1), fmt, **recipe)
                before = {k: v.clone() for k, v in target.components().items()}
                try:
                    dcp.load(
                        {f"w{i}": _dtensor(target, shape, layout)},
                        checkpoint_id=os.path.join(root, f"{sname}-single"),
                        planner=ckptq.QuantizedLoadPlanner(),
                    )
                    failures.append((sname, "single", layout, CASES[i][:2], "loaded a misaligned target"))
                except CheckpointException as e:
                    untouched = all(bit_exact(before[k], v) for k, v in target.components().items())
                    if "ShardingError" in str(e) and untouched:
                        refused += 1
                    else:
                        failures.append((sname, layout, CASES[i][:2], str(e)[-300:]))
    return failures, exact, refused


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("matrix"))
    refusals = []
    for ws in (1, 2, 3, 4):
        for per_rank in run_distributed(ws, _save_worker, root):
            refusals += per_rank
    return root, refusals


def test_misaligned_sources_refuse_to_save(saved):
    _, refusals = saved
    assert refusals, "the uneven shape must produce misaligned source layouts"
    assert all(ok is True for *_, ok in refusals), [r for r in refusals if r[-1] is not True]


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_every_pair_bit_exact_or_refused(saved, ws):
    root, _ = saved
    total_exact = total_refused = 0
    for failures, exact, refused in run_distributed(ws, _load_worker, root):
        assert failures == []
        total_exact += exact
        total_refused += refused
    assert total_exact > 0
    if ws > 1:
        assert total_refused > 0


def test_plain_dcp_sees_ordinary_tensors(saved):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, _ = saved
    out = os.path.join(root, "fsdp2_tp_col.pt")
    dcp_to_torch_save(os.path.join(root, "even-fsdp2_tp_col"), out)
    sd = torch.load(out, weights_only=True)
    q = _global("even", 6)  # nvfp4
    assert set(sd) >= {"w6.data", "w6.scale", "w6.amax"}
    for k, v in q.components().items():
        assert torch.equal(sd[f"w6.{k}"].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------- real FSDP2 + TP on a small model
def _fsdp_tp_worker(rank, ws, root, fmt, recipe):
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import ckptq
    from ckptq.formats.base import slice_box
    from ckptq.metrics import bit_exact
    from ckptq.placement import dtensor_box, format_placements

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.Linear(1024, 512, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    sd, placements, same = {}, {}, []
    for name, p in model.state_dict().items():
        placements[name] = format_placements(p.placements)
        full = p.full_tensor()  # collective
        ref = ckptq.quantize(full, fmt, **recipe)
        kw = {"amax": full.abs().max()} if fmt in ("nvfp4", "fp8_tensor") else {}
        local = ckptq.quantize(p.to_local(), fmt, **recipe, **kw)  # what a training step would hold
        want = slice_box(ref, dtensor_box(p, fqn=name))
        same.append(all(bit_exact(v, local.components()[k]) for k, v in want.components().items()))
        sd[name] = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    dcp.save(sd, checkpoint_id=root, planner=ckptq.QuantizedSavePlanner())
    return placements, same


@pytest.mark.parametrize("fmt,recipe", [("nvfp4", {"two_d": True}), ("fp8_block", {})])
def test_fully_shard_over_parallelize_module(tmp_path, fmt, recipe):
    """Real FSDP2 over TP: column-parallel weights get (_StridedShard(0, 2), Shard(0))."""
    import torch.distributed.checkpoint as dcp
    from torch import nn

    import ckptq
    from ckptq.metrics import bit_exact

    results = run_distributed(4, _fsdp_tp_worker, str(tmp_path), fmt, recipe)
    placements, same = results[0]
    assert placements == {"0.weight": "(SS(0,2), S(0))", "1.weight": "(S(0), S(1))"}
    assert all(all(s) for _, s in results)  # our boxes match FSDP2's real local shards
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.Linear(1024, 512, bias=False))
    refs = {k: ckptq.quantize(v, fmt, **recipe) for k, v in model.state_dict().items()}
    targets = {k: torch.empty_like(v) for k, v in refs.items()}
    dcp.load(targets, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    for k, ref in refs.items():
        assert all(bit_exact(v, targets[k].components()[c]) for c, v in ref.components().items()), k

"""Meshes, placements and per-rank boxes (ckptq.placement) against DTensor's own semantics."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import ckptq
from ckptq.parse import parse_mesh, parse_placement, parse_placement_rules
from ckptq.placement import MeshSpec, first_owner_boxes, format_placements, rank_boxes, shard_box


def _random_case(rng: random.Random):
    ndim = rng.choice([1, 2, 3])
    shape = tuple(rng.randint(1, 70) for _ in range(ndim))
    mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2])))
    placements = []
    for _m in mesh:
        kind = rng.choice(["R", "S", "S"])
        placements.append(Replicate() if kind == "R" else Shard(rng.randrange(ndim)))
    # FSDP2 over TP: (_StridedShard(d, tp), Shard(d)) -- the contiguous strided order
    if len(mesh) == 2 and rng.random() < 0.4:
        d = rng.randrange(ndim)
        placements = [_StridedShard(d, split_factor=mesh[1]), Shard(d)]
    return shape, mesh, placements


def _dtensor_indices(n: int, d: int, mesh, coord, placements) -> torch.Tensor:
    """Indices of dim ``d`` held at ``coord``, by DTensor's own splitting code (``_split_tensor`` of
    each placement, left to right): the ground truth, independent of ckptq.placement."""
    idx = torch.arange(n)
    for m, c, p in zip(mesh, coord, placements, strict=False):
        if isinstance(p, (Shard, _StridedShard)) and p.dim == d:
            parts, _ = p._split_tensor(idx.reshape([1] * d + [-1]), m, with_padding=False)
            idx = parts[c].reshape(-1) if c < len(parts) else idx[:0]
    return idx


def test_boxes_match_dtensor_semantics_on_random_placements():
    """Every case against DTensor's own splitting: a contiguous shard gives exactly that box (and
    the box DCP's _compute_local_shape_and_global_offset stores); a non-contiguous one raises
    ShardingError (DCP's function returns a wrong box for those, e.g. uneven strided splits)."""
    rng = random.Random(0)
    contiguous = refused = 0
    for _ in range(400):
        shape, mesh, placements = _random_case(rng)
        spec = MeshSpec(tuple(f"m{i}" for i in range(len(mesh))), mesh)
        truth = {}
        for r in range(spec.world_size):
            coord = spec.coordinate(r)
            ok, box_off, box_size = True, [], []
            for d, n in enumerate(shape):
                idx = _dtensor_indices(n, d, mesh, coord, placements)
                if idx.numel() and not torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + idx.numel())):
                    ok = False
                box_off.append(int(idx[0]) if idx.numel() else n)
                box_size.append(idx.numel())
            truth[coord] = (tuple(box_off), tuple(box_size)) if ok else None
        if any(v is None for v in truth.values()):
            with pytest.raises(ckptq.ShardingError, match="not one contiguous box"):
                rank_boxes(shape, spec, placements)
            refused += 1
            continue
        boxes = rank_boxes(shape, spec, placements)
        for r, coord in enumerate(spec.coordinates):
            size, off = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            dcp_box = (tuple(o if s else n for o, s, n in zip(off, size, shape, strict=False)), tuple(size))
            assert boxes[r] == shard_box(shape, mesh, coord, placements) == truth[coord] == dcp_box
            contiguous += 1
    assert contiguous > 1000 and refused > 0


def test_boxes_cover_the_tensor_exactly_once():
    rng = random.Random(1)
    for _ in range(200):
        shape, mesh, placements = _random_case(rng)
        spec = MeshSpec(tuple(f"m{i}" for i in range(len(mesh))), mesh)
        try:
            boxes = rank_boxes(shape, spec, placements)
        except ckptq.ShardingError:
            continue  # non-contiguous placements: see the test above
        seen = torch.zeros(shape, dtype=torch.int32)
        for box in set(boxes):
            region = seen
            for d, (o, s) in enumerate(zip(*box, strict=False)):
                region = region.narrow(d, min(o, shape[d]), s)
            region += 1
        assert torch.all(seen == 1), (shape, mesh, placements)


def test_first_owner_boxes_is_the_whole_owner_list_restricted():
    """One rank's owned box alone (the per-rank plan) equals the first-rank-of-each-distinct-box
    list of every rank's boxes, for random meshes, placements and shapes (empty tensors too)."""
    rng = random.Random(7)
    checked = 0
    for i in range(300):
        shape, mesh, placements = _random_case(rng)
        if i % 10 == 0:
            shape = (0,) + shape[1:]
        spec = MeshSpec(tuple(f"m{i}" for i in range(len(mesh))), mesh)
        try:
            boxes = rank_boxes(shape, spec, placements)
        except ckptq.ShardingError:
            with pytest.raises(ckptq.ShardingError):
                first_owner_boxes(shape, spec, placements, [0])
            continue
        owners, seen = [], set()
        for r, b in enumerate(boxes):
            if b not in seen and all(b[1]):
                seen.add(b)
                owners.append((r, b))
        owners = owners or [(0, boxes[0])]
        assert first_owner_boxes(shape, spec, placements, range(spec.world_size)) == owners
        for r in range(spec.world_size):
            assert first_owner_boxes(shape, spec, placements, [r]) == [o for o in owners if o[0] == r]
        checked += 1
    assert checked > 150


def test_non_contiguous_order_raises():
    # (Shard(0), _StridedShard(0, 2)) puts rows 1 and 3 on one rank: DCP saves overlapping chunks and
    # loads this silently wrong; ckptq refuses it.
    with pytest.raises(ckptq.ShardingError, match=r"holds indices 1..1, 3..3 of dim 0, not one contiguous box"):
        shard_box((8, 8), (2, 2), (0, 1), [Shard(0), _StridedShard(0, split_factor=2)], fqn="w")
    with pytest.raises(ckptq.ShardingError, match="'w'"):
        rank_boxes((8, 8), MeshSpec(("a", "b"), (2, 2)), [Shard(0), _StridedShard(0, split_factor=2)], fqn="w")


def test_mesh_and_placement_parsing():
    m = parse_mesh("dp_shard=4,tp=2")
    assert m.world_size == 8 and m.coordinate(5) == (2, 1) and str(m) == "dp_shard=4,tp=2"
    assert parse_mesh("8").names == ("dp_shard",)
    for bad in ("dp=0", "dp=2,dp=2", "x", "tp=two"):
        with pytest.raises(ckptq.UsageError, match="--mesh"):  # a typo is a usage error (was UnsupportedFormatError)
            parse_mesh(bad)
    assert isinstance(parse_placement("R"), Replicate)
    assert parse_placement("Shard(1)") == Shard(1)
    ss = parse_placement("_StridedShard(0, sf=2)")
    assert isinstance(ss, _StridedShard) and ss.split_factor == 2
    assert format_placements([parse_placement("SS(0,4)"), parse_placement("S(1)"), Replicate()]) == "(SS(0,4), S(1), R)"


def test_presets_follow_fsdp2_and_tp_conventions():
    mesh = parse_mesh("dp_shard=2,tp=4")
    plan = parse_placement_rules(mesh, "fsdp2-tp", ["*.q_proj.weight=col", "*.o_proj.weight=row", "*.experts.w1=col"])
    fmt = lambda fqn, nd: format_placements(plan.placements(fqn, nd))  # noqa: E731
    assert fmt("l.q_proj.weight", 2) == "(SS(0,4), S(0))"  # FSDP2 over column-parallel TP
    assert fmt("l.o_proj.weight", 2) == "(S(0), S(1))"  # row-parallel
    assert fmt("l.norm.weight", 1) == "(S(0), R)"
    assert fmt("l.experts.w1", 3) == "(S(0), S(1))"  # grouped (N, out, in): column-parallel is dim 1
    assert format_placements(parse_placement_rules(parse_mesh("4"), "fsdp2").placements("x", 2)) == "(S(0))"


def test_shard_tables_computed_on_lookup_equal_the_built_tables():
    """Plain ``Shard`` cuts of a dim are looked up (placement._ShardTable), not built: the same
    (offset, size) per coordinate, iteration order and values as the built table, and the same
    :func:`dim_intervals` as every rank's box gives (meshes of up to 3 dims cutting one dim)."""
    from ckptq.placement import _dim_table, _merge_runs, _ShardTable, dim_intervals

    rng = random.Random(11)
    for _ in range(300):
        n = rng.choice([0, 1, 2, 3, 5, 7, 13, 64, 100])
        sizes = tuple(rng.choice([1, 2, 3, 4, 5, 8]) for _ in range(rng.randint(0, 3)))
        built = {}
        for k, runs in _dim_table(n, [(m, None) for m in sizes]).items():
            merged = _merge_runs(runs)
            assert len(merged) <= 1
            built[k] = (merged[0][0], merged[0][1] - merged[0][0]) if merged else (n, 0)
        table = _ShardTable(n, sizes)
        assert dict(table) == built and list(table) == list(built) and table.values() == list(built.values())
        if not sizes:
            continue
        spec = MeshSpec(tuple(f"m{i}" for i in range(len(sizes))), sizes)
        shape, placements = (n, 3), [Shard(0)] * len(sizes)
        assert dim_intervals(shape, spec, placements) == [
            {(o[d], s[d]) for o, s in rank_boxes(shape, spec, placements) if s[d]} for d in range(2)
        ]

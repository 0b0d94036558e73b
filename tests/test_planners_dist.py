"""Multi-process DCP tests (gloo on CPU; NCCL where there are 2 GPUs): quantized DTensors saved on N
ranks, loaded on M ranks.

Every saved shard is the block-aligned narrow of one global quantized tensor, so the expected bytes
of any target shard are the same narrow of that global tensor: loads are checked bit for bit.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from _bounds import REENCODE_E4M3
from _dist import NCCL, run_distributed, two_gpus

pytestmark = pytest.mark.slow

SHAPE = (512, 512)  # for the async test: cuts at multiples of 128 for 2 ranks on dim 0
CASES = [
    ("fp8_tensor", {}),
    ("fp8_tensor", {"fp8_dtype": torch.float8_e5m2}),
    ("fp8_block", {}),
    ("fp8_block", {"block": (1, 128)}),
    ("mxfp8", {"columnwise": True}),
    ("nvfp4", {}),
    ("nvfp4", {"two_d": True}),
    ("mxfp4", {"scale_rule": "even"}),
]


@functools.cache
def _global(i: int):
    import ckptq

    fmt, recipe = CASES[i]
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(SHAPE, generator=g) * (1 + i)
    return ckptq.quantize(x, fmt, **recipe)


def _box(rank: int, ws: int, dim):
    n = SHAPE[dim] // ws
    off = [0, 0]
    size = list(SHAPE)
    off[dim], size[dim] = rank * n, n
    return tuple(off), tuple(size)


def _wrap(local, dim, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(local.device.type, (ws,))
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(SHAPE), stride=(SHAPE[1], 1))


def _local(qt, box):
    from ckptq.formats.base import slice_box

    return slice_box(qt, box)


# ------------------------------------------------------------------ errors before data moves
def _unaligned_save_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq

    # MXFP8, K = 96 split over 2 ranks: the cut at column 48 is inside a 32-wide block.
    local = ckptq.quantize(torch.randn(64, 48), "mxfp8")
    dt = _wrap_any(local, 1, ws, (64, 96))
    path = os.path.join(root, "unaligned")
    try:
        dcp.save({"w": dt}, checkpoint_id=path, planner=ckptq.QuantizedSavePlanner())
    except CheckpointException as e:
        return str(e), os.path.exists(os.path.join(path, ".metadata")), _files(path)
    return "no error", True, _files(path)


def _files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".distcp")) if os.path.isdir(path) else []


def _wrap_any(local, dim, ws, shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ws,))
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=(shape[1], 1))


def test_unaligned_save_raises_before_writing(tmp_path):
    results = run_distributed(2, _unaligned_save_worker, str(tmp_path))
    for msg, wrote_metadata, files in results:
        assert "ShardingError" in msg and "'w'" in msg and "dim 1" in msg
        assert "element 48" in msg and "block size 32" in msg
        assert not wrote_metadata and files == []


def _unaligned_load_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq

    target = _wrap_any(torch.empty_like(ckptq.quantize(torch.zeros(64, 48), "mxfp8")), 1, ws, (64, 96))
    before = [v.clone() for v in target.to_local().components().values()]
    try:
        dcp.load({"w": target}, checkpoint_id=root, planner=ckptq.QuantizedLoadPlanner())
    except CheckpointException as e:
        after = list(target.to_local().components().values())
        untouched = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after, strict=False)
        )
        return str(e), untouched
    return "no error", False


def test_unaligned_load_raises_before_reading(tmp_path):
    import torch.distributed.checkpoint as dcp

    import ckptq

    dcp.save(
        {"w": ckptq.quantize(torch.randn(64, 96), "mxfp8")},
        checkpoint_id=str(tmp_path),
        planner=ckptq.QuantizedSavePlanner(),
    )
    for msg, untouched in run_distributed(2, _unaligned_load_worker, str(tmp_path)):
        assert "ShardingError" in msg and "'w'" in msg and "element 48" in msg and "block size 32" in msg
        assert untouched


def _scalar_worker(rank, ws, root, shared_amax):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq

    full = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    rows = full[rank * 32 : (rank + 1) * 32]
    out = []
    for fmt in ("nvfp4", "fp8_tensor"):
        kw = {"amax": full.abs().max()} if shared_amax else {}
        local = ckptq.quantize(rows, fmt, **kw)
        dt = _wrap_any(local, 0, ws, (64, 64))
        try:
            dcp.save(
                {"w": dt}, checkpoint_id=os.path.join(root, f"{fmt}{shared_amax}"), planner=ckptq.QuantizedSavePlanner()
            )
            out.append("saved")
        except CheckpointException as e:
            out.append(str(e))
    return out


def test_per_tensor_values_must_agree(tmp_path):
    for msgs in run_distributed(2, _scalar_worker, str(tmp_path), False):
        for msg, comp in zip(msgs, ("amax", "scale_inv"), strict=False):
            assert "InconsistentScaleError" in msg
            assert f"tensor 'w': per-tensor '{comp}' differs between shards: rank 0" in msg
            assert "rank 1" in msg
    # quantized with the reduced global amax, the same shards save fine
    for msgs in run_distributed(2, _scalar_worker, str(tmp_path), True):
        assert msgs == ["saved", "saved"]


def _async_worker(rank, ws, root, device_type="cpu"):
    """Per case: Shard(0) shards (on GPU ``rank`` for "cuda") saved with ``dcp.async_save``, loaded
    into the same placement and into Shard(1) targets; [same layout bit-exact, Shard(1) bit-exact]."""
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.metrics import bit_exact

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    ok = []
    for i in range(len(CASES)):
        ref = _local(_global(i), _box(rank, ws, 0)).to(device)
        path = os.path.join(root, f"async{i}")
        fut = dcp.async_save({"w": _wrap(ref, 0, ws)}, checkpoint_id=path, planner=ckptq.QuantizedSavePlanner())
        fut.result()
        got = []
        for dim in (0, 1):
            want = _local(_global(i), _box(rank, ws, dim)).to(device)
            tgt = {"w": _wrap(torch.empty_like(want), dim, ws)}
            dcp.load(tgt, checkpoint_id=path, planner=ckptq.QuantizedLoadPlanner())
            local = tgt["w"].to_local()
            got.append(
                local.device == device
                and all(bit_exact(v, local.components()[k]) for k, v in want.components().items())
            )
        ok.append(got)
    return ok


def test_async_save_two_ranks_bit_exact(tmp_path):
    for ok in run_distributed(2, _async_worker, str(tmp_path)):
        assert ok == [[True, True]] * len(CASES)


@pytest.mark.cuda
@two_gpus
def test_async_save_two_gpus_bit_exact(tmp_path):
    """CUDA-resident quantized shards on 2 GPUs (NCCL): async_save, reload in both placements."""
    for ok in run_distributed(2, _async_worker, str(tmp_path), "cuda", backend=NCCL):
        assert ok == [[True, True]] * len(CASES)


# ------------------------------------------------------------------ grouped views under sharding
def _members(n=2):
    import ckptq

    g = torch.Generator().manual_seed(3)
    return [ckptq.quantize(torch.randn(256, 128, generator=g), "nvfp4") for _ in range(n)]


def _grouped_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptq
    from ckptq.formats.base import slice_box
    from ckptq.metrics import bit_exact

    mesh = init_device_mesh("cpu", (ws,))
    members = _members()
    names = [f"experts.weight{i}" for i in range(2)]
    stack = type(members[0])(
        {k: torch.stack([m.components()[k] for m in members]) for k in members[0].components()},
        (2, 256, 128),
        torch.float32,
        members[0].recipe,
    )

    def dt(local, placement, shape):
        stride = tuple(int(torch.tensor(shape[i + 1 :]).prod()) for i in range(len(shape)))
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride)

    # members saved FSDP2-style Shard(0) (rows), loaded as the stack with Shard(1) (= member Shard(0))
    sd = {
        n: dt(slice_box(m, ((128 * rank, 0), (128, 128))), Shard(0), (256, 128))
        for n, m in zip(names, members, strict=False)
    }
    dcp.save(sd, checkpoint_id=os.path.join(root, "members"), planner=ckptq.QuantizedSavePlanner())
    box3 = ((0, 128 * rank, 0), (2, 128, 128))
    target = dt(torch.empty_like(slice_box(stack, box3)), Shard(1), (2, 256, 128))
    dcp.load(
        {"experts.weight": target},
        checkpoint_id=os.path.join(root, "members"),
        planner=ckptq.QuantizedLoadPlanner(grouped={"experts.weight": names}),
    )
    ok_stack = all(
        bit_exact(v, target.to_local().components()[k]) for k, v in slice_box(stack, box3).components().items()
    )
    # the stack saved expert-parallel (Shard(0) over experts), loaded as members with Shard(1) (columns)
    dcp.save(
        {"experts.weight": dt(slice_box(stack, ((rank, 0, 0), (1, 256, 128))), Shard(0), (2, 256, 128))},
        checkpoint_id=os.path.join(root, "stack"),
        planner=ckptq.QuantizedSavePlanner(),
    )
    box2 = ((0, 64 * rank), (256, 64))
    tg = {
        n: dt(torch.empty_like(slice_box(m, box2)), Shard(1), (256, 128)) for n, m in zip(names, members, strict=False)
    }
    dcp.load(
        tg,
        checkpoint_id=os.path.join(root, "stack"),
        planner=ckptq.QuantizedLoadPlanner(grouped={"experts.weight": names}),
    )
    ok_split = all(
        bit_exact(v, tg[n].to_local().components()[k])
        for n, m in zip(names, members, strict=False)
        for k, v in slice_box(m, box2).components().items()
    )
    return ok_stack, ok_split


def test_grouped_stack_and_split_at_load_time(tmp_path):
    for ok_stack, ok_split in run_distributed(2, _grouped_worker, str(tmp_path)):
        assert ok_stack and ok_split


def _requantize_misaligned_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.metrics import bit_exact

    src = ckptq.quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(4)), "mxfp8")
    target = _wrap_any(torch.empty_like(ckptq.quantize(torch.zeros(64, 48), "mxfp8")), 1, ws, (64, 96))
    planner = ckptq.QuantizedLoadPlanner(requantize_misaligned=True)
    dcp.load({"w": target}, checkpoint_id=root, planner=planner)
    # the shard is re-encoded from the source values of its 48 columns as a local tensor
    want = ckptq.quantize(src.dequantize()[:, 48 * rank : 48 * rank + 48].contiguous(), "mxfp8")
    got = target.to_local()
    return all(bit_exact(v, got.components()[k]) for k, v in want.components().items()), planner.requantized


def test_requantize_misaligned_opt_in_reports_sqnr(tmp_path):
    import torch.distributed.checkpoint as dcp

    import ckptq

    src = ckptq.quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(4)), "mxfp8")
    dcp.save({"w": src}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    for exact, requantized in run_distributed(2, _requantize_misaligned_worker, str(tmp_path)):
        assert exact
        # re-encoding MXFP8 values with other block boundaries (tests/_bounds.py)
        assert set(requantized) == {"w"} and requantized["w"] > REENCODE_E4M3


# ------------------------------------------------------------------ checks DCP does not make
def _strided_wrong_order_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import ckptq

    mesh = init_device_mesh("cpu", (2, 2))
    out = []
    for name, local in (
        ("plain", torch.zeros(2, 8)),
        ("quantized", torch.empty_like(ckptq.quantize(torch.zeros(2, 8), "fp8_tensor"))),
    ):
        # (Shard(0), _StridedShard(0, 2)): each rank holds two non-adjacent rows of the 8
        target = DTensor.from_local(
            local,
            mesh,
            [Shard(0), _StridedShard(0, split_factor=2)],
            run_check=False,
            shape=torch.Size((8, 8)),
            stride=(8, 1),
        )
        try:
            dcp.load({name: target}, checkpoint_id=root, planner=ckptq.QuantizedLoadPlanner())
            out.append("loaded")
        except CheckpointException as e:
            out.append("ShardingError" in str(e) and "not one contiguous box" in str(e) and f"'{name}'" in str(e))
    return out


def test_non_contiguous_target_raises_instead_of_silent_corruption(tmp_path):
    """Plain DCP loads (Shard(0), _StridedShard(0, 2)) targets silently wrong (dcp-internals 3.3)."""
    import torch.distributed.checkpoint as dcp

    import ckptq

    x = torch.arange(64.0).reshape(8, 8)
    dcp.save(
        {"plain": x, "quantized": ckptq.quantize(x, "fp8_tensor")},
        checkpoint_id=str(tmp_path),
        planner=ckptq.QuantizedSavePlanner(),
    )
    for out in run_distributed(4, _strided_wrong_order_worker, str(tmp_path)):
        assert out == [True, True]


def _per_rank_save_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp

    import ckptq

    full = torch.arange(64.0).reshape(8, 8)
    q = ckptq.quantize(full, "fp8_tensor")
    box = ((4 * rank, 0), (4, 8))
    sd = {
        "plain": _wrap_any(full[4 * rank : 4 * rank + 4].clone(), 0, ws, (8, 8)),
        "quantized": _wrap_any(_local(q, box), 0, ws, (8, 8)),
    }
    dcp.save(sd, checkpoint_id=root, planner=ckptq.QuantizedSavePlanner(), use_collectives=False)
    return sorted(os.listdir(root))


def _per_rank_load_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq

    out = []
    for name, local in (
        ("plain", torch.zeros(8, 4)),
        ("quantized", torch.empty_like(ckptq.quantize(torch.zeros(8, 4), "fp8_tensor"))),
    ):
        try:
            dcp.load({name: _wrap_any(local, 1, ws, (8, 8))}, checkpoint_id=root, planner=ckptq.QuantizedLoadPlanner())
            out.append("loaded")
        except CheckpointException as e:
            out.append("ShardingError" in str(e) and "cover" in str(e) and f"'{name}" in str(e))
    return out


def test_incomplete_coverage_raises(tmp_path):
    """use_collectives=False writes per-rank metadata that lists only that rank's chunks; loading it
    into another layout would leave half of each target untouched with plain DCP."""
    files = run_distributed(2, _per_rank_save_worker, str(tmp_path))[0]
    assert "__0.metadata" in files and ".metadata" not in files
    for out in run_distributed(2, _per_rank_load_worker, str(tmp_path)):
        assert out == [True, True]

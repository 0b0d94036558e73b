"""Multi-process DCP tests (gloo on CPU): quantized DTensors saved on N ranks, loaded on M ranks.

Every saved shard is the block-aligned narrow of one global quantized tensor, so the expected bytes
of any target shard are the same narrow of that global tensor: loads are checked bit for bit.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from _dist import run_distributed

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
]


@functools.lru_cache(maxsize=None)
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

    mesh = init_device_mesh("cpu", (ws,))
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(SHAPE),
                              stride=(SHAPE[1], 1))


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
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                              stride=(shape[1], 1))


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
        untouched = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))
        return str(e), untouched
    return "no error", False


def test_unaligned_load_raises_before_reading(tmp_path):
    import torch.distributed.checkpoint as dcp

    import ckptq

    dcp.save({"w": ckptq.quantize(torch.randn(64, 96), "mxfp8")}, checkpoint_id=str(tmp_path),
             planner=ckptq.QuantizedSavePlanner())
    for msg, untouched in run_distributed(2, _unaligned_load_worker, str(tmp_path)):
        assert "ShardingError" in msg and "'w'" in msg and "element 48" in msg and "block size 32" in msg
        assert untouched


def _scalar_worker(rank, ws, root, shared_amax):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq

    full = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    rows = full[rank * 32:(rank + 1) * 32]
    out = []
    for fmt in ("nvfp4", "fp8_tensor"):
        kw = {"amax": full.abs().max()} if shared_amax else {}
        local = ckptq.quantize(rows, fmt, **kw)
        dt = _wrap_any(local, 0, ws, (64, 64))
        try:
            dcp.save({"w": dt}, checkpoint_id=os.path.join(root, f"{fmt}{shared_amax}"),
                     planner=ckptq.QuantizedSavePlanner())
            out.append("saved")
        except CheckpointException as e:
            out.append(str(e))
    return out


def test_per_tensor_values_must_agree(tmp_path):
    for msgs in run_distributed(2, _scalar_worker, str(tmp_path), False):
        for msg, comp in zip(msgs, ("amax", "scale_inv")):
            assert "InconsistentScaleError" in msg
            assert f"tensor 'w': per-tensor '{comp}' differs between shards: rank 0" in msg
            assert "rank 1" in msg
    # quantized with the reduced global amax, the same shards save fine
    for msgs in run_distributed(2, _scalar_worker, str(tmp_path), True):
        assert msgs == ["saved", "saved"]


def _async_worker(rank, ws, root):
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.metrics import bit_exact

    ok = []
    for i in range(len(CASES)):
        box = _box(rank, ws, 0)
        ref = _local(_global(i), box)
        path = os.path.join(root, f"async{i}")
        fut = dcp.async_save({"w": _wrap(ref, 0, ws)}, checkpoint_id=path,
                             planner=ckptq.QuantizedSavePlanner())
        fut.result()
        tgt = {"w": _wrap(torch.empty_like(ref), 0, ws)}
        dcp.load(tgt, checkpoint_id=path, planner=ckptq.QuantizedLoadPlanner())
        got = tgt["w"].to_local()
        ok.append(all(bit_exact(v, got.components()[k]) for k, v in ref.components().items()))
    return ok


def test_async_save_two_ranks_bit_exact(tmp_path):
    for ok in run_distributed(2, _async_worker, str(tmp_path)):
        assert ok == [True] * len(CASES)

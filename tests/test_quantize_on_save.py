"""Quantize on save: plain bf16/fp32 shards quantized by ``QuantizedSavePlanner(quantize=...)`` (or
``ckptq.quantize_state_dict`` before ``dcp.async_save``) give, byte for byte, ``ckptq.quantize`` of
the whole tensor on one process; 1 process, 2 gloo ranks (FSDP2 ``Shard(0)``, TP ``Shard(1)``) and,
where there are 2 GPUs, 2 NCCL ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import NCCL, run_distributed, two_gpus
from _helpers import requires_cuda

import ckptq
from ckptq.checkpoint import CheckpointView
from ckptq.metrics import bit_exact

# fqn -> (shape, placement dim, format, recipe)
TENSORS = {
    "layers.0.mlp.up.weight": ((256, 256), 0, "nvfp4", {}),
    "layers.0.mlp.down.weight": ((256, 256), 1, "nvfp4", {"two_d": True}),
    "layers.0.attn.q.weight": ((128, 256), 1, "mxfp8", {"columnwise": True}),
    "layers.0.attn.o.weight": ((256, 128), 0, "fp8_block", {}),
    "layers.0.fp8.weight": ((96, 64), 0, "fp8_tensor", {"fp8_dtype": torch.float8_e5m2}),
    "layers.0.experts.w1": ((4, 64, 128), 2, "mxfp4", {"scale_rule": "rceil"}),
}
RULES = {
    "*.mlp.up.*": "nvfp4",
    "*.mlp.down.*": {"format": "nvfp4", "two_d": True},
    "*.attn.q.*": {"format": "mxfp8", "columnwise": True},
    "*.attn.o.*": "fp8_block",
    "*.fp8.*": {"format": "fp8_tensor", "fp8_dtype": torch.float8_e5m2},
    "*.experts.*": {"format": "mxfp4", "scale_rule": "rceil"},
    "*.bias": "nvfp4",  # matches 1-D tensors: saved as they are
}


def _full(fqn, dtype=torch.bfloat16):
    shape = TENSORS[fqn][0]
    g = torch.Generator().manual_seed(sum(map(ord, fqn)))
    return (torch.randn(shape, generator=g) * 2).to(dtype)


def _check(path):
    view = CheckpointView(path)
    for fqn, (_, _, fmt, recipe) in TENSORS.items():
        got, want = view.read(fqn), ckptq.quantize(_full(fqn), fmt, **recipe)
        assert got.FORMAT == fmt and got.recipe == want.recipe, fqn
        cg, cw = got.components(), want.components()
        assert cg.keys() == cw.keys() and all(bit_exact(cg[k], cw[k]) for k in cw), fqn
    assert bit_exact(view.read("layers.0.bias"), torch.arange(8.0))


def test_quantize_on_save_one_process(tmp_path):
    sd = {fqn: _full(fqn) for fqn in TENSORS}
    sd["layers.0.bias"] = torch.arange(8.0)
    sd["step"] = 3
    dcp.save(sd, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner(quantize=RULES))
    _check(tmp_path)
    assert isinstance(sd["layers.0.mlp.up.weight"], torch.Tensor)  # the caller's dict is untouched
    assert not isinstance(sd["layers.0.mlp.up.weight"], ckptq.QuantizedTensor)


def test_bad_rules_are_refused_at_construction():
    with pytest.raises(ckptq.UnsupportedFormatError, match=r"rule '\*': unknown format 'int3'"):
        ckptq.QuantizedSavePlanner(quantize={"*": "int3"})
    with pytest.raises(ckptq.UnsupportedFormatError, match="no 'format'"):
        ckptq.QuantizedSavePlanner(quantize={"*": {"block": (1, 128)}})


def _save_sharded(rank, ws, root, use_async, device_type="cpu"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptq

    mesh = init_device_mesh(device_type, (ws,))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    sd = {}
    for fqn, (_shape, dim, _, _) in TENSORS.items():
        full = _full(fqn)
        local = full.chunk(ws, dim=dim)[rank].contiguous().to(device)
        sd[fqn] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())
    sd["layers.0.bias"] = torch.arange(8.0)
    if use_async:
        staged = ckptq.quantize_state_dict(sd, RULES)  # quantized before staging: compact bytes staged
        assert all(isinstance(staged[f]._local_tensor, ckptq.QuantizedTensor) for f in TENSORS)
        assert all(staged[f]._local_tensor.device == device for f in TENSORS)  # quantized on its device
        dcp.async_save(staged, checkpoint_id=root, planner=ckptq.QuantizedSavePlanner()).result()
    else:
        dcp.save(sd, checkpoint_id=root, planner=ckptq.QuantizedSavePlanner(quantize=RULES))


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_quantize_on_save_two_ranks_equals_whole_tensor(tmp_path, use_async):
    run_distributed(2, _save_sharded, str(tmp_path / "ck"), use_async)
    _check(tmp_path / "ck")


@pytest.mark.cuda
@pytest.mark.slow
@two_gpus
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_quantize_on_save_two_gpus_equals_whole_tensor(tmp_path, use_async):
    """The same on 2 GPUs (NCCL): shards quantized by the CUDA kernels on their own GPU, the
    per-tensor amax all-reduced over NCCL; the bytes equal the CPU quantization of the whole tensor."""
    run_distributed(2, _save_sharded, str(tmp_path / "ck"), use_async, "cuda", backend=NCCL)
    _check(tmp_path / "ck")


def _save_misaligned(rank, ws, root):
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ckptq.io import dcp_failure

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.randn(192, 128).to(torch.bfloat16)  # 96-row shards: cut inside a 128x128 block
    sd = {
        "w": DTensor.from_local(
            full.chunk(ws)[rank].contiguous(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    }
    try:
        dcp.save(sd, checkpoint_id=root, planner=ckptq.QuantizedSavePlanner(quantize={"w": "fp8_block"}))
    except CheckpointException as e:
        err = dcp_failure(e, root)
        return type(err).__name__, str(err)
    return None


@pytest.mark.slow
def test_quantize_on_save_misaligned_shard_is_refused(tmp_path):
    results = run_distributed(2, _save_misaligned, str(tmp_path / "ck"))
    assert all(r is not None and r[0] == "ShardingError" and "'w'" in r[1] and "128" in r[1] for r in results)


@pytest.mark.cuda
@requires_cuda
def test_quantize_on_save_cuda(tmp_path):
    """CUDA-resident bf16 weights quantized on their device (CUDA kernels) while saving."""
    sd = {fqn: _full(fqn).cuda() for fqn in TENSORS}
    sd["layers.0.bias"] = torch.arange(8.0)
    dcp.save(sd, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner(quantize=RULES))
    _check(tmp_path)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_odd_k_names_the_tensor_and_writes_nothing(tmp_path, fmt):
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptq.io import dcp_failure

    root = tmp_path / "ck"
    with pytest.raises((ckptq.QuantizationError, CheckpointException)) as ei:
        dcp.save(
            {"w.odd": torch.randn(4, 33)},
            checkpoint_id=str(root),
            planner=ckptq.QuantizedSavePlanner(quantize={"w.*": fmt}),
        )
    err = ei.value if isinstance(ei.value, ckptq.QuantizationError) else dcp_failure(ei.value, str(root))
    assert isinstance(err, ckptq.QuantizationError) and "'w.odd'" in str(err) and "odd" in str(err) and fmt in str(err)
    assert not root.exists()

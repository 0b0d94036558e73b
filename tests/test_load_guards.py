"""Load-path casts: quantized entries refused into plain integer/bool/float8 targets, plain entries
refused into quantized targets unless float, and what strict_dtype still allows (docs/design.md,
"Loading")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import ckptq
from ckptq.io import dcp_failure
from ckptq.planners.load import DECODE_TARGET_DTYPES

FORMATS = [
    ("fp8_tensor", {}),
    ("fp8_block", {}),
    ("mxfp8", {}),
    ("nvfp4", {}),
    ("mxfp4", {}),
]
REFUSED = [torch.int32, torch.uint8, torch.int64, torch.bool, torch.float8_e4m3fn]
X = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))


def _save(path, sd, mode="native"):
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner(mode=mode))


def _load_error(path, target, **kw) -> BaseException:
    with pytest.raises(CheckpointException) as ei:
        dcp.load(target, checkpoint_id=str(path), planner=ckptq.QuantizedLoadPlanner(**kw))
    return dcp_failure(ei.value, str(path))


@pytest.mark.parametrize("mode", ["native", "high_precision"])
@pytest.mark.parametrize("fmt,recipe", FORMATS, ids=[f for f, _ in FORMATS])
def test_quantized_entry_refused_into_int_bool_float8_plain_target(tmp_path, fmt, recipe, mode):
    _save(tmp_path, {"layer.w": ckptq.quantize(X, fmt, **recipe)}, mode)
    for dtype in REFUSED:
        for strict in (True, False):
            target = torch.full((32, 64), 7).to(dtype)
            before = target.clone()
            err = _load_error(tmp_path, {"layer.w": target}, strict_dtype=strict)
            assert isinstance(err, ckptq.UnsupportedFormatError), err
            msg = str(err)
            assert "'layer.w'" in msg and str(dtype) in msg and fmt in msg and "(32, 64)" in msg, msg
            assert "float32" in msg and "bfloat16" in msg and "quantized tensor" in msg, msg
            assert torch.equal(target.view(torch.uint8), before.view(torch.uint8))  # nothing written


@pytest.mark.parametrize("mode", ["native", "high_precision"])
def test_quantized_entry_into_float_targets_decodes(tmp_path, mode):
    q = ckptq.quantize(X, "nvfp4")
    _save(tmp_path, {"w": q}, mode)
    ref = q.dequantize(torch.float32)  # native: the float32 decode, rounded by copy_ into the target
    if mode == "high_precision":  # the stored values (strict_dtype=False: rounded by copy_ likewise)
        md = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["w"]
        ref = {"w": torch.empty(32, 64, dtype=md.properties.dtype)}
        dcp.load(ref, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
        ref = ref["w"]
    for dtype in DECODE_TARGET_DTYPES:
        out = {"w": torch.empty(32, 64, dtype=dtype)}
        planner = ckptq.QuantizedLoadPlanner(strict_dtype=mode == "native" or dtype == ref.dtype)
        dcp.load(out, checkpoint_id=str(tmp_path), planner=planner)
        assert torch.equal(out["w"], ref.to(dtype)), dtype


def test_plain_int_bool_float8_entry_refused_into_quantized_target(tmp_path):
    ones = torch.ones(32, 64)
    sd = {"i": ones.to(torch.int32), "b": ones.to(torch.bool), "f8": ones.to(torch.float8_e4m3fn)}
    _save(tmp_path, sd)
    for k, dtype in (("i", "torch.int32"), ("b", "torch.bool"), ("f8", "torch.float8_e4m3fn")):
        err = _load_error(tmp_path, {k: ckptq.quantize(X, "mxfp8")})
        assert isinstance(err, ckptq.UnsupportedFormatError) and f"'{k}'" in str(err) and dtype in str(err)


def test_plain_entry_cast_into_float8_plain_target_refused_even_unstrict(tmp_path):
    _save(tmp_path, {"w": X * 1000})
    err = _load_error(tmp_path, {"w": torch.zeros(32, 64, dtype=torch.float8_e4m3fn)}, strict_dtype=False)
    assert isinstance(err, ckptq.UnsupportedFormatError) and "'w'" in str(err) and "no scale" in str(err)
    # the same dtype loads as is
    f8 = X.to(torch.float8_e5m2)
    _save(tmp_path / "f8", {"w": f8})
    out = {"w": torch.zeros(32, 64, dtype=torch.float8_e5m2)}
    dcp.load(out, checkpoint_id=str(tmp_path / "f8"), planner=ckptq.QuantizedLoadPlanner())
    assert torch.equal(out["w"].view(torch.uint8), f8.view(torch.uint8))


def test_strict_dtype_plain_casts(tmp_path):
    # plain entries: strict_dtype (default) refuses any dtype change; strict_dtype=False casts as DCP does
    _save(tmp_path, {"w": X, "n": torch.arange(6, dtype=torch.int64)})
    err = _load_error(tmp_path, {"w": torch.zeros(32, 64, dtype=torch.int32)})
    assert isinstance(err, ckptq.CheckpointFormatError) and "strict_dtype=False" in str(err)
    out = {"w": torch.zeros(32, 64, dtype=torch.int32), "n": torch.zeros(6, dtype=torch.float32)}
    dcp.load(out, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner(strict_dtype=False))
    assert torch.equal(out["w"], X.to(torch.int32)) and torch.equal(out["n"], torch.arange(6.0))

"""Parsing of user-supplied option text (ckptq.parse): every mistake is a UsageError naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import ckptq
from ckptq import parse
from ckptq.placement import MeshSpec, PlacementRules, format_placements


def test_usage_error_is_a_ckptq_value_error():
    assert issubclass(ckptq.UsageError, ckptq.CkptqError) and issubclass(ckptq.UsageError, ValueError)


@pytest.mark.parametrize("bad", ["dp_shard=x", "dp=0", "0", "dp=2,dp=2", "x", "tp=two", ""])
def test_mesh_typos_are_usage_errors(bad):
    with pytest.raises(ckptq.UsageError, match="--mesh"):
        parse.parse_mesh(bad)


def test_mesh_and_placements():
    assert parse.parse_mesh(" dp_shard = 4 , tp=2 ") == MeshSpec(("dp_shard", "tp"), (4, 2))
    assert parse.parse_mesh("8") == MeshSpec(("dp_shard",), (8,))
    m = MeshSpec(("a",), (2,))
    assert parse.parse_mesh(m) is m
    assert isinstance(parse.parse_placement("Replicate()"), Replicate)
    assert parse.parse_placement("S(1)") == Shard(1)
    ss = parse.parse_placement("SS(0, split_factor=3)")
    assert isinstance(ss, _StridedShard) and (ss.dim, ss.split_factor) == (0, 3)
    with pytest.raises(ckptq.UsageError, match="placement 'S1'"):
        parse.parse_placement("S1")


def test_plans(tmp_path):
    mesh = parse.parse_mesh("dp_shard=2,tp=2")
    plan = parse.parse_placement_rules(mesh, "fsdp2-tp", ["*.q=col", "*.o = row"])
    assert format_placements(plan.placements("l.q", 2)) == "(SS(0,2), S(0))"
    assert format_placements(plan.placements("l.o", 2)) == "(S(0), S(1))"
    assert parse.parse_placement_rules(mesh, plan) is plan
    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"*.q": ["S(1)", "R"]}))
    assert format_placements(parse.parse_placement_rules(mesh, str(f)).placements("l.q", 2)) == "(S(1), R)"
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    for args, match in [
        (("fsdp2-tp", ["*.q"]), "--rule \\*.q: expected GLOB=col"),
        (("fsdp2-tp", ["*.q=diag"]), "--rule \\*.q=diag: expected col or row"),
        (("nonsense",), "--plan nonsense: neither a preset"),
        ((str(bad_json),), "cannot parse"),
    ]:
        with pytest.raises(ckptq.UsageError, match=match):
            parse.parse_placement_rules(mesh, *args)
    f.write_text(json.dumps({"*.q": ["S(1)"]}))  # one placement for a 2-D mesh
    with pytest.raises(ckptq.UsageError, match="one per dim"):
        parse.parse_placement_rules(mesh, str(f))
    with pytest.raises(ckptq.UsageError, match="'tp'"):
        PlacementRules(parse.parse_mesh("4"), "fsdp2-tp")
    assert parse.parse_placement_rules(mesh, "replicate").placements("x", 2) == (Replicate(), Replicate())


def test_targets_dtypes_and_choices():
    assert parse.parse_target("nvfp4") == "nvfp4" and parse.parse_target("bf16") == "bf16"
    with pytest.raises(ckptq.UsageError) as ei:
        parse.parse_target("int3")
    assert str(ei.value) == (
        "--to int3: expected native (keep each tensor's format), a format (fp8_block, "
        "fp8_tensor, mxfp4, mxfp8, nvfp4) or a high-precision dtype (bfloat16, float16, float32, "
        "bf16, fp16, fp32)"
    )
    assert parse.parse_hp_dtype("fp16") is torch.float16 and parse.parse_hp_dtype(torch.float32) is torch.float32
    with pytest.raises(ckptq.UsageError, match="--dtype int8"):
        parse.parse_hp_dtype("int8")
    assert parse.parse_choice("--mode", "high-precision", ("native", "high-precision")) == "high_precision"
    assert parse.parse_choice("--mode", None, ("native",)) is None
    with pytest.raises(ckptq.UsageError, match=r"--grouped stacks: expected one of \['stack', 'split'\]"):
        parse.parse_choice("--grouped", "stacks", ("stack", "split"))


def test_recipe_options():
    assert parse.parse_block("1x128") == (1, 128) and parse.parse_block("128,128") == (128, 128)
    assert parse.parse_block(None) is None and parse.parse_block((1, 128)) == (1, 128)
    with pytest.raises(ckptq.UsageError, match="--block 1x"):
        parse.parse_block("1x")
    assert parse.parse_fp8_dtype("e5m2") is torch.float8_e5m2
    with pytest.raises(ckptq.UsageError, match="--fp8-dtype e3m4"):
        parse.parse_fp8_dtype("e3m4")
    assert parse.parse_recipe("fp8_block", block="1x128", fp8_dtype="e4m3", two_d=None) == {
        "block": (1, 128),
        "fp8_dtype": torch.float8_e4m3fn,
    }
    assert parse.parse_recipe("bfloat16", block=None, pow2=None) == {}
    with pytest.raises(ckptq.UsageError, match="--to mxfp8 does not take --two-d"):
        parse.parse_recipe("mxfp8", two_d=True)
    with pytest.raises(ckptq.UsageError, match="apply only to quantized formats"):
        parse.parse_recipe("float32", pow2=True)

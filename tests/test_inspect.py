"""ckptq.inspect.inspect_checkpoint on plain DCP and real ckptq checkpoints (all formats, both modes)."""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptq
from ckptq.errors import CheckpointFormatError
from ckptq.inspect import inspect_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")

SHAPE = (256, 384)
NUMEL = 256 * 384
# Hand-computed stored bytes of one (256, 384) tensor per format (component tables of docs/formats.md).
EXPECTED_NATIVE_BYTES = {
    "nv": 49152 + 6144 + 4,  # data u8 (256, 192), scale e4m3 (256, 24), amax f32 ()
    "nv2d": 49152 + 16 * 24 + 4,  # 16x16 blocks: scale (16, 24)
    "mx": 98304 + 256 * 12,  # data e4m3 (256, 384), scale u8 (256, 12)
    "mxc": 2 * 98304 + 256 * 12 + 8 * 384,  # + columnwise data and scale (8, 384)
    "fb": 98304 + 2 * 3 * 4,  # data e4m3, scale_inv f32 (2, 3)
    "ft": 98304 + 4,  # data e4m3, scale_inv f32 ()
    "m4": 49152 + 256 * 12,  # data u8 (256, 192), scale u8 (256, 12)
}
FORMATS = {
    "nv": "nvfp4",
    "nv2d": "nvfp4",
    "mx": "mxfp8",
    "mxc": "mxfp8",
    "fb": "fp8_block",
    "ft": "fp8_tensor",
    "m4": "mxfp4",
}


def _quantized() -> dict:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SHAPE, generator=g) * 3
    return {
        "nv": ckptq.quantize(x, "nvfp4"),
        "nv2d": ckptq.quantize(x * 2, "nvfp4", two_d=True),
        "mx": ckptq.quantize(x, "mxfp8"),
        "mxc": ckptq.quantize(x / 5, "mxfp8", columnwise=True),
        "fb": ckptq.quantize(x, "fp8_block"),
        "ft": ckptq.quantize(x.bfloat16(), "fp8_tensor"),
        "m4": ckptq.quantize(x.bfloat16(), "mxfp4", scale_rule="rceil"),
    }


@pytest.fixture(scope="module")
def qts():
    return _quantized()


def _save(path, qts, mode):
    sd = {
        "model": dict(qts),
        "norm": torch.tensor([1.0, float("nan"), float("inf"), -2.0]).bfloat16(),
        "ids": torch.tensor([3, -1, 9]),
        "step": 7,
    }
    dcp.save(sd, checkpoint_id=path, planner=ckptq.QuantizedSavePlanner(mode=mode))
    return path


@pytest.fixture(scope="module")
def native_ckpt(tmp_path_factory, qts):
    return _save(tmp_path_factory.mktemp("native"), qts, "native")


@pytest.fixture(scope="module")
def hp_ckpt(tmp_path_factory, qts):
    return _save(tmp_path_factory.mktemp("hp"), qts, "high_precision")


def _rows(report):
    return {r["fqn"]: r for r in report["tensors"]}


def test_native_rows_fold_components(native_ckpt, qts):
    report = inspect_checkpoint(native_ckpt)
    rows = _rows(report)
    assert set(rows) == {f"model.{k}" for k in qts} | {"norm", "ids", "step"}  # no component rows
    for k, nbytes in EXPECTED_NATIVE_BYTES.items():
        r = rows[f"model.{k}"]
        assert (r["format"], r["mode"], r["shape"], r["chunks"]) == (FORMATS[k], "native", list(SHAPE), 1)
        assert r["bytes"] == nbytes, k
        assert r["bits_per_element"] == pytest.approx(nbytes * 8 / NUMEL)
        assert sorted(r["components"]) == sorted(qts[k].components())
        assert sum(c["bytes"] for c in r["components"].values()) == nbytes
    nv = rows["model.nv"]
    assert nv["bytes"] == 55300 and nv["bits_per_element"] == pytest.approx(4.5003255)
    assert nv["components"]["data"] == {
        "fqn": "model.nv.data",
        "dtype": "uint8",
        "shape": [256, 192],
        "bytes": 49152,
        "chunks": 1,
    }
    assert nv["components"]["amax"]["shape"] == [] and nv["recipe"] == {"two_d": False}
    assert rows["model.ft"]["dtype"] == "bfloat16" and rows["model.nv"]["dtype"] == "float32"
    assert (rows["norm"]["format"], rows["norm"]["mode"], rows["norm"]["bytes"]) == ("bfloat16", "plain", 8)
    assert (rows["ids"]["format"], rows["ids"]["bits_per_element"]) == ("int64", 64.0)
    step = rows["step"]
    assert (step["format"], step["mode"], step["shape"], step["bits_per_element"]) == ("bytes", "bytes", None, None)
    assert step["bytes"] > 0


def test_native_summary(native_ckpt):
    s = inspect_checkpoint(native_ckpt)["summary"]
    total = sum(EXPECTED_NATIVE_BYTES.values()) + 8 + 24
    assert s["tensors"] == 9 and s["objects"] == 1
    assert s["total_bytes"] == total
    assert s["bf16_bytes"] == 2 * (7 * NUMEL + 4 + 3)
    assert s["ratio_vs_bf16"] == pytest.approx(total / s["bf16_bytes"])
    assert s["formats"] == {
        "bfloat16": 1,
        "bytes": 1,
        "fp8_block": 1,
        "fp8_tensor": 1,
        "int64": 1,
        "mxfp4": 1,
        "mxfp8": 2,
        "nvfp4": 2,
    }
    assert (s["world_size"], s["world_size_source"], s["ckptq_version"], s["dcp_version"]) == (1, "ckptq", 1, "1.0.0")


def test_high_precision_rows(hp_ckpt, qts):
    rows = _rows(inspect_checkpoint(hp_ckpt))
    for k in qts:
        r = rows[f"model.{k}"]
        assert (r["format"], r["mode"], r["stored_dtype"], r["components"]) == (
            FORMATS[k],
            "high_precision",
            "bfloat16",
            None,
        )
        assert (r["bytes"], r["bits_per_element"], r["shape"]) == (2 * NUMEL, 16.0, list(SHAPE))


def _decoded_scales(qt) -> torch.Tensor:
    c = qt.components()
    if "scale_inv" in c:
        return c["scale_inv"].float()
    if qt.FORMAT in ("mxfp8", "mxfp4"):
        return torch.pow(2.0, c["scale"].double() - 127)  # independent of ckptq's decoder
    return c["scale"].float()


def test_stats_match_in_memory_tensors(native_ckpt, qts):
    rows = _rows(inspect_checkpoint(native_ckpt, stats=True))
    for k, qt in qts.items():
        st = rows[f"model.{k}"]["stats"]
        deq = qt.dequantize(torch.float32)
        assert (st["min"], st["max"]) == (deq.min().item(), deq.max().item()), k
        assert (st["nan"], st["inf"]) == (0, 0)
        sc = _decoded_scales(qt)
        assert (st["scale_min"], st["scale_max"]) == (sc.min().item(), sc.max().item()), k
        if qt.FORMAT == "nvfp4":
            assert st["amax"] == qt.components()["amax"].item() > 0
        else:
            assert "amax" not in st
    assert rows["model.mx"]["stats"]["scale_min"] < rows["model.mx"]["stats"]["scale_max"]
    norm = rows["norm"]["stats"]
    assert norm == {"min": -2.0, "max": math.inf, "nan": 1, "inf": 1}
    assert rows["ids"]["stats"] == {"min": -1, "max": 9, "nan": 0, "inf": 0}
    assert rows["step"]["stats"] is None


def test_stats_high_precision(hp_ckpt, qts):
    rows = _rows(inspect_checkpoint(hp_ckpt, stats=True))
    for k, qt in qts.items():
        deq = qt.dequantize(torch.bfloat16).float()
        st = rows[f"model.{k}"]["stats"]
        assert (st["min"], st["max"], st["nan"]) == (deq.min().item(), deq.max().item(), 0)


def test_stats_count_nan_of_dequantized_values(tmp_path):
    x = torch.randn(4, 256)
    x[1, 3] = float("nan")
    x[2, 5] = float("nan")
    qt = ckptq.quantize(x, "mxfp8")
    expected = int(torch.isnan(qt.dequantize()).sum())
    assert expected >= 2  # NaN propagates (a NaN block scale makes its whole block NaN)
    dcp.save({"w": qt}, checkpoint_id=tmp_path, planner=ckptq.QuantizedSavePlanner())
    st = inspect_checkpoint(tmp_path, stats=True)["tensors"][0]["stats"]
    assert st["nan"] == expected
    assert st["scale_nan"] == int((qt.components()["scale"] == 255).sum()) > 0
    assert not math.isnan(st["min"])  # min/max ignore NaN


def test_plain_dcp_checkpoint(tmp_path):
    sd = {
        "model": {"a": torch.randn(64, 32), "b": torch.arange(10, dtype=torch.int32)},
        "step": 3,
        "extra": {"lr": 0.1},
    }
    dcp.save(sd, checkpoint_id=tmp_path)
    report = inspect_checkpoint(tmp_path)
    rows = _rows(report)
    assert list(rows) == ["model.a", "model.b", "step", "extra.lr"]
    assert (rows["model.a"]["bytes"], rows["model.a"]["bits_per_element"]) == (64 * 32 * 4, 32.0)
    assert rows["model.b"]["format"] == "int32"
    s = report["summary"]
    assert (s["tensors"], s["objects"], s["ckptq_version"]) == (2, 2, None)
    assert (s["world_size"], s["world_size_source"]) == (1, "files")
    assert s["total_bytes"] == 64 * 32 * 4 + 40 and s["bf16_bytes"] == 2 * (64 * 32 + 10)


def test_non_tensor_entries_are_never_loaded(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch '{marker}'",))

    ck = tmp_path / "ck"
    dcp.save({"w": torch.ones(3), "evil": Payload()}, checkpoint_id=ck)
    rows = _rows(inspect_checkpoint(ck, stats=True))
    assert rows["evil"]["format"] == "bytes" and rows["evil"]["stats"] is None
    assert rows["w"]["stats"]["max"] == 1.0
    assert not marker.exists()


def _edit_metadata(path, fn):
    md = pickle.loads((path / ".metadata").read_bytes())
    fn(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def test_hand_made_descriptor(tmp_path):
    # A ckptq contract checkpoint written without the planner: the components as plain entries + a descriptor.
    qt = ckptq.quantize(torch.randn(32, 64), "nvfp4")
    dcp.save({f"w.{k}": v for k, v in qt.components().items()}, checkpoint_id=tmp_path)
    desc = qt.descriptor()
    desc["mode"] = "native"
    for name in desc["components"]:
        desc["components"][name]["fqn"] = f"w.{name}"

    def add(md):
        md.planner_data["__ckptq__"] = {"version": 1, "world_size": 3, "tensors": {"w": desc}}

    _edit_metadata(tmp_path, add)
    report = inspect_checkpoint(tmp_path, stats=True)
    (row,) = report["tensors"]
    assert (row["fqn"], row["format"], row["bytes"]) == ("w", "nvfp4", 32 * 32 + 32 * 4 + 4)
    assert row["stats"]["amax"] == qt.components()["amax"].item()
    assert report["summary"]["world_size"] == 3


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d["tensors"]["model.nv"]["components"]["scale"].update(fqn="model.nv.nope"), "no such entry"),
        (lambda d: d["tensors"]["model.nv"]["components"]["data"].update(shape=[256, 384]), "descriptor says"),
        (lambda d: d["tensors"]["model.nv"].pop("format"), "malformed"),
        (lambda d: d["tensors"]["model.nv"].update(mode="weird"), "unknown mode"),
        (lambda d: d.update(version=99), "newer ckptq"),
    ],
)
def test_inconsistent_descriptor_is_a_format_error(tmp_path, native_ckpt, edit, match):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(native_ckpt, ck)
    _edit_metadata(ck, lambda md: edit(md.planner_data["__ckptq__"]))
    with pytest.raises(CheckpointFormatError, match=match):
        inspect_checkpoint(ck)


def test_corrupt_data_is_a_format_error(tmp_path):
    dcp.save({"w": torch.randn(4096)}, checkpoint_id=tmp_path)
    f = tmp_path / "__0_0.distcp"
    blob = bytearray(f.read_bytes())
    blob[:64] = b"\0" * 64  # same length: passes the size check, fails when read
    f.write_bytes(bytes(blob))
    inspect_checkpoint(tmp_path)  # metadata alone is fine
    with pytest.raises(CheckpointFormatError, match="corrupt"):
        inspect_checkpoint(tmp_path, stats=True)


# ------------------------------------------------------------------ a real 2-rank sharded save
def _save_two_ranks(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptq
    from ckptq.formats.base import slice_box

    mesh = init_device_mesh("cpu", (ws,))
    qts = _quantized()
    sd = {}
    for k, dim in (("nv", 1), ("mx", 0)):
        off, size = [0, 0], list(SHAPE)
        size[dim] //= ws
        off[dim] = rank * size[dim]
        local = slice_box(qts[k], (tuple(off), tuple(size)))
        sd[k] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(SHAPE), stride=(SHAPE[1], 1)
        )
    dcp.save(sd, checkpoint_id=root, planner=ckptq.QuantizedSavePlanner())
    return True


@pytest.mark.slow
def test_two_rank_sharded_checkpoint(tmp_path, qts):
    from _dist import run_distributed

    run_distributed(2, _save_two_ranks, str(tmp_path))
    report = inspect_checkpoint(tmp_path, stats=True)
    rows = _rows(report)
    nv, mx = rows["nv"], rows["mx"]
    assert (nv["chunks"], nv["bytes"], nv["components"]["amax"]["chunks"]) == (2, 55300, 1)
    assert (mx["chunks"], mx["bytes"]) == (2, EXPECTED_NATIVE_BYTES["mx"])
    assert report["summary"]["world_size"] == 2 and report["summary"]["files"] == 2
    for k in ("nv", "mx"):
        deq = qts[k].dequantize()
        assert (rows[k]["stats"]["min"], rows[k]["stats"]["max"]) == (deq.min().item(), deq.max().item())

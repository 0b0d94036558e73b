"""Single-process tests of QuantizedSavePlanner / QuantizedLoadPlanner (no process group)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import ckptq
from ckptq.contract import CKPTQ_KEY
from ckptq.metrics import bit_exact

CASES = [
    ("fp8_tensor", {}),
    ("fp8_block", {}),
    ("fp8_block", {"block": (1, 128)}),
    ("mxfp8", {}),
    ("mxfp8", {"columnwise": True}),
    ("nvfp4", {}),
    ("nvfp4", {"two_d": True}),
    ("mxfp4", {}),
    ("mxfp4", {"scale_rule": "rceil"}),
]
IDS = [f"{f}-{'-'.join(f'{k}={v}' for k, v in r.items()) or 'default'}" for f, r in CASES]


def _qt(fmt, recipe, shape=(96, 160), seed=0, dtype=torch.float32):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return ckptq.quantize(x, fmt, **recipe)


def _same_bytes(a: ckptq.QuantizedTensor, b: ckptq.QuantizedTensor) -> bool:
    ca, cb = a.components(), b.components()
    return ca.keys() == cb.keys() and all(bit_exact(ca[k], cb[k]) for k in ca)


def _metadata(path):
    return FileSystemReader(path).read_metadata()


@pytest.mark.parametrize("fmt,recipe", CASES, ids=IDS)
def test_native_round_trip_ragged_and_batched(tmp_path, fmt, recipe):
    # Ragged (96 x 160: not multiples of 128) and 3-D batch (experts) tensors, bf16 logical dtype.
    sd = {"a": _qt(fmt, recipe), "b": _qt(fmt, recipe, shape=(3, 64, 96), seed=1, dtype=torch.bfloat16)}
    dcp.save(sd, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    md = _metadata(str(tmp_path))
    desc = md.planner_data[CKPTQ_KEY]["tensors"]
    assert desc["b"]["shape"] == [3, 64, 96] and desc["b"]["dtype"] == "bfloat16"
    assert desc["a"]["mode"] == "native" and md.planner_data[CKPTQ_KEY]["world_size"] == 1
    for _name, c in desc["a"]["components"].items():
        assert tuple(md.state_dict_metadata[c["fqn"]].size) == tuple(c["shape"])
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(out, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    for k in sd:
        assert type(out[k]) is type(sd[k]) and out[k].dtype == sd[k].dtype
        assert _same_bytes(out[k], sd[k])


@pytest.mark.parametrize("fmt,recipe", CASES, ids=IDS)
def test_high_precision_mode(tmp_path, fmt, recipe):
    q = _qt(fmt, recipe)
    dcp.save(
        {"w": q},
        checkpoint_id=str(tmp_path),
        planner=ckptq.QuantizedSavePlanner(mode="high_precision", dtype=torch.bfloat16),
    )
    md = _metadata(str(tmp_path))
    assert md.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    assert md.planner_data[CKPTQ_KEY]["tensors"]["w"]["stored_dtype"] == "bfloat16"
    # any PyTorch user reads it with plain DCP
    plain = {"w": torch.zeros(q.shape, dtype=torch.bfloat16)}
    dcp.load(plain, checkpoint_id=str(tmp_path))
    hp = q.dequantize(torch.bfloat16)
    assert bit_exact(plain["w"], hp)
    # into a quantized target: quantized with the target's recipe from the stored values
    target = torch.empty_like(_qt("nvfp4", {"two_d": True}, seed=9))
    dcp.load({"w": target}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    assert _same_bytes(target, ckptq.quantize(hp, "nvfp4", two_d=True))


def test_high_precision_dequantizes_lazily_per_item(tmp_path, monkeypatch):
    calls = []
    orig = ckptq.QuantizedTensor.dequantize

    def spy(self, dtype=torch.float32):
        calls.append(tuple(self.shape))
        return orig(self, dtype)

    monkeypatch.setattr(ckptq.QuantizedTensor, "dequantize", spy)
    planner = ckptq.QuantizedSavePlanner(mode="high_precision")
    sd = {f"w{i}": _qt("mxfp8", {}, seed=i) for i in range(3)}
    planner.set_up_planner(sd, None, True)
    planner.create_local_plan()
    assert calls == []  # planning allocates nothing
    dcp.save(sd, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner(mode="high_precision"))
    assert calls == [(96, 160)] * 3  # one dequantize per write item, done by the writer's request


def test_rules_mix_modes(tmp_path):
    sd = {"layers.0.attn.weight": _qt("nvfp4", {}), "layers.0.mlp.weight": _qt("nvfp4", {}, seed=1)}
    planner = ckptq.QuantizedSavePlanner(rules={"*.mlp.*": "high_precision"})
    dcp.save(sd, checkpoint_id=str(tmp_path), planner=planner)
    md = _metadata(str(tmp_path))
    keys = set(md.state_dict_metadata)
    assert {
        "layers.0.attn.weight.data",
        "layers.0.attn.weight.scale",
        "layers.0.attn.weight.amax",
        "layers.0.mlp.weight",
    } == keys
    tensors = md.planner_data[CKPTQ_KEY]["tensors"]
    assert tensors["layers.0.mlp.weight"]["mode"] == "high_precision"
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(out, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    assert _same_bytes(out["layers.0.attn.weight"], sd["layers.0.attn.weight"])
    hp = sd["layers.0.mlp.weight"].dequantize(torch.bfloat16)
    assert _same_bytes(out["layers.0.mlp.weight"], ckptq.quantize(hp, "nvfp4"))


def test_cross_format_load_requantizes_and_logs_once(tmp_path, caplog):
    q = _qt("mxfp8", {})
    dcp.save({"w": q, "v": _qt("mxfp8", {}, seed=2)}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    target = {"w": torch.empty_like(_qt("fp8_block", {})), "v": torch.empty_like(q)}
    with caplog.at_level(logging.INFO, logger="ckptq"):
        dcp.load(target, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    assert _same_bytes(target["w"], ckptq.quantize(q.dequantize(), "fp8_block"))
    msgs = [r.getMessage() for r in caplog.records if "re-encoded" in r.getMessage()]
    assert len(msgs) == 1 and "'w'" in msgs[0] and "mxfp8" in msgs[0] and "fp8_block" in msgs[0]


def _staged_pairs(original, staged):
    assert type(staged) is type(original)
    return _same_bytes(staged, original)


@pytest.mark.parametrize("fmt,recipe", CASES, ids=IDS)
def test_async_staging_copies_raw_bytes(fmt, recipe):
    """Both of DCP's stagers produce quantized CPU copies with the original bytes (TE#2721)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    q = _qt(fmt, recipe)
    sd = {"w": q, "b": torch.arange(4.0)}
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = stager.stage(sd)
    stager.close()
    assert _staged_pairs(q, staged["w"]) and staged["w"] is not q
    assert all(
        a.data_ptr() != b.data_ptr()
        for a, b in zip(q.components().values(), staged["w"].components().values(), strict=False)
    )
    staged2 = FileSystemWriter("/tmp/unused-ckptq-stage").stage(sd)  # BlockingAsyncStager path
    assert _staged_pairs(q, staged2["w"])


def test_async_save_single_process(tmp_path):
    sd = {f"w{i}": _qt(f, r, seed=i) for i, (f, r) in enumerate(CASES)}
    fut = dcp.async_save(sd, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    fut.result()
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(out, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    assert all(_same_bytes(out[k], sd[k]) for k in sd)


# ------------------------------------------------------------------ errors
def _load_error(state_dict, path, **kw) -> str:
    with pytest.raises((CheckpointException, ckptq.CkptqError)) as ei:
        dcp.load(state_dict, checkpoint_id=path, planner=ckptq.QuantizedLoadPlanner(**kw))
    return str(ei.value)


def test_missing_component_is_reported(tmp_path):
    q = _qt("nvfp4", {})
    dcp.save({"w": q}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    # drop the scale entry from the metadata, as a truncated or hand-edited checkpoint would
    import pickle

    meta = os.path.join(tmp_path, ".metadata")
    md = _metadata(str(tmp_path))
    del md.state_dict_metadata["w.scale"]
    from ckptq.contract import with_digest

    with_digest(md)  # re-sealed, so that the missing entry, not the digest, is what the load reports
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    msg = _load_error({"w": torch.empty_like(q)}, str(tmp_path))
    assert "CheckpointFormatError" in msg and "'w'" in msg and "'w.scale' is missing" in msg


def test_shape_mismatch_and_missing_target(tmp_path):
    q = _qt("fp8_block", {})
    dcp.save({"w": q}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    msg = _load_error({"w": torch.empty_like(_qt("fp8_block", {}, shape=(64, 160)))}, str(tmp_path))
    assert "Size mismatch between saved torch.Size([96, 160]) and current: torch.Size([64, 160]) for w" in msg
    msg = _load_error({"w": torch.empty_like(q), "x": torch.empty_like(q)}, str(tmp_path))
    assert "Missing key in checkpoint state_dict: x." in msg and "allow_partial_load=True" in msg
    out = {"w": torch.empty_like(q), "x": torch.empty_like(q)}
    dcp.load(out, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner(allow_partial_load=True))
    assert _same_bytes(out["w"], q)


def test_component_key_collision(tmp_path):
    q = _qt("fp8_tensor", {})
    with pytest.raises((CheckpointException, ckptq.CkptqError)) as ei:
        dcp.save({"w": q, "w.data": torch.zeros(2)}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    assert "collides" in str(ei.value) and "'w.data'" in str(ei.value)


def test_bad_mode():
    with pytest.raises(ckptq.UnsupportedFormatError, match="mode 'fast'"):
        ckptq.QuantizedSavePlanner(mode="fast")
    with pytest.raises(ckptq.UnsupportedFormatError, match=r"rule '\*'"):
        ckptq.QuantizedSavePlanner(rules={"*": "lossy"})


def test_bytes_entries_are_loaded_without_running_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    dcp.save(
        {"w": _qt("fp8_tensor", {}), "obj": Evil()}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner()
    )
    msg = _load_error({"w": torch.empty_like(_qt("fp8_tensor", {})), "obj": None}, str(tmp_path))
    assert "UnsafePickledObjectError" in msg and "posix.system" in msg and "trust_pickled_objects=True" in msg
    assert not (tmp_path / "pwned").exists()


def test_plain_dtype_mismatch_raises_unless_allowed(tmp_path):
    dcp.save({"b": torch.arange(4.0)}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    msg = _load_error({"b": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path))
    assert "'b'" in msg and "torch.float32" in msg and "torch.bfloat16" in msg
    out = {"b": torch.zeros(4, dtype=torch.bfloat16)}
    dcp.load(out, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner(strict_dtype=False))
    assert torch.equal(out["b"], torch.arange(4.0, dtype=torch.bfloat16))

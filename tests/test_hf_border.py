"""The Hugging Face border: every FP8 scale convention producers write is read exactly and written back
as it was; ``export`` finds the model config or refuses; the consumer's default decode is checked.

Folders here are written by hand in the layouts' conventions (fast, no optional dependency);
tests/test_border_matrix.py builds them with compressed-tensors' own code and loads the exports with
transformers' ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import ckptq
from ckptq.checkpoint import open_checkpoint
from ckptq.cli import app
from ckptq.errors import CheckpointFormatError, UnsupportedFormatError, UsageError
from ckptq.export import export_checkpoint
from ckptq.reshard import ReshardOptions, reshard_checkpoint

E4M3 = torch.float8_e4m3fn
M, K = 256, 384  # whole 128 x 128 blocks (transformers' DeepSeek loader needs them), 32-multiples


def _ct_config(strategy: str, dtype: str) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    return {
        "model_type": "llama",
        "dtype": dtype,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        },
    }


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 of ``w / scale`` (scale broadcast over rows / blocks / the matrix)."""
    s = scale.float()
    if s.dim() == 2 and s.shape[-1] == 1:  # per row
        full = s
    elif s.dim() == 2:  # 128 x 128 blocks
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        full = s.reshape(())
    return (w / full).to(E4M3)


CONVENTIONS = {
    # name: (strategy, scale shape)
    "tensor (1,)": ("tensor", (1,)),
    "tensor ()": ("tensor", ()),
    "block 128x128": ("block", (M // 128, K // 128)),
    "row (M, 1)": ("channel", (M, 1)),
}


def _ct_folder(folder: Path, convention: str, scale_dtype: torch.dtype, model_dtype: str) -> dict:
    strategy, shape = CONVENTIONS[convention]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(M, K, generator=g)
    # a scale of the producer's dtype that is not a power of two (the interesting case)
    scale = (torch.rand(shape, generator=g) * 0.01 + 0.003).to(scale_dtype)
    tensors = {
        "model.layers.0.mlp.down_proj.weight": _fp8(w, scale),
        "model.layers.0.mlp.down_proj.weight_scale": scale,
        "lm_head.weight": torch.randn(64, K, generator=g).to(getattr(torch, model_dtype)),
    }
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_ct_config(strategy, model_dtype)))
    return tensors


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_every_scale_convention_imports_exactly_and_exports_back_byte_for_byte(tmp_path, convention, scale_dtype):
    model_dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[scale_dtype]
    src = tmp_path / "ct"
    tensors = _ct_folder(src, convention, scale_dtype, model_dtype)
    view = open_checkpoint(src)
    e = view.entry("model.layers.0.mlp.down_proj.weight")
    fmt = "fp8_tensor" if convention.startswith("tensor") else "fp8_block"
    assert e.kind == "quantized" and e.format == fmt
    if convention.startswith("row"):
        assert tuple(e.descriptor.recipe["block"]) == (1, K)
    stored = e.descriptor.producer["stored"]["weight_scale"]
    assert stored == {"dtype": model_dtype, "shape": list(CONVENTIONS[convention][1])}  # what was there
    qt = view.read("model.layers.0.mlp.down_proj.weight")
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    # the value is exact: the producer's scale widened to fp32, the data its bytes
    assert_same_bytes(qt.components()["scale_inv"].reshape(-1), scale.float().reshape(-1))
    assert_same_bytes(qt.components()["data"], tensors["model.layers.0.mlp.down_proj.weight"])
    # into a native DCP checkpoint and back out to compressed-tensors: the source bytes
    native = tmp_path / "native"
    reshard_checkpoint(src, native, ReshardOptions(to="native"))
    assert open_checkpoint(native).entry(e.fqn).descriptor.producer["stored"]["weight_scale"] == stored
    out = tmp_path / "back"
    res = export_checkpoint(native, out, layout="compressed-tensors", config=src / "config.json")
    assert res["consumer"]["differs"] == {} and res["consumer"]["unloadable"] == {}
    back = load_file(str(next(out.glob("*.safetensors"))))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert_same_bytes(back[name], t, name)


def test_unknown_scale_dtypes_are_refused_naming_what_was_found(tmp_path):
    src = tmp_path / "ct"
    _ct_folder(src, "tensor (1,)", torch.float32, "bfloat16")
    bad = tmp_path / "bad"
    bad.mkdir()
    t = load_file(str(src / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.weight_scale"] = t["model.layers.0.mlp.down_proj.weight_scale"].double()
    save_file(t, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(UnsupportedFormatError) as ei:
        open_checkpoint(bad)
    msg = str(ei.value)
    assert "model.layers.0.mlp.down_proj.weight_scale' is float64" in msg
    assert "float32, bfloat16, float16" in msg and "disagree" not in msg
    # a missing tensor is a different problem, said as such
    del t["model.layers.0.mlp.down_proj.weight"]
    t["model.layers.0.mlp.down_proj.weight_scale"] = t["model.layers.0.mlp.down_proj.weight_scale"].float()
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="missing or extra"):
        open_checkpoint(bad)


# ----------------------------------------------------------------------------- the model config
def _native(folder: Path, weights: dict) -> Path:
    dcp.save(weights, checkpoint_id=str(folder), planner=ckptq.QuantizedSavePlanner())
    return folder


def test_export_finds_the_model_config_or_refuses(tmp_path):
    g = torch.Generator().manual_seed(0)
    run = tmp_path / "run"
    run.mkdir()
    src = _native(run / "step-10", {"a.weight": ckptq.quantize(torch.randn(128, 128, generator=g), "fp8_block")})
    dst = tmp_path / "out"
    with pytest.raises(UsageError, match=r"--config PATH.*--no-model-config"):
        export_checkpoint(src, dst, layout="compressed-tensors")
    assert not dst.exists()
    (run / "config.json").write_text(json.dumps({"quantization_config": {}}))  # beside it, but not a model's
    with pytest.raises(UsageError, match="has no model_type"):
        export_checkpoint(src, dst, layout="compressed-tensors")
    with pytest.raises(UsageError, match="no 'model_type'"):
        export_checkpoint(src, dst, layout="compressed-tensors", config=run / "config.json")
    (run / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float16", "hidden_size": 128}))
    res = export_checkpoint(src, dst, layout="compressed-tensors")  # found beside the checkpoint
    cfg = json.loads((dst / "config.json").read_text())
    assert res["config_from"] == str(run / "config.json")
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 128 and cfg["dtype"] == "float16"
    # the explicit opt-out: only the quantization config, said so
    r = CliRunner().invoke(
        app, ["export", str(src), str(tmp_path / "q"), "--layout", "deepseek-fp8", "--no-model-config"]
    )
    assert r.exit_code == 0, r.output
    assert set(json.loads((tmp_path / "q" / "config.json").read_text())) == {
        "quantization_config",
        "dtype",
        "torch_dtype",
    }
    r = CliRunner().invoke(
        app, ["export", str(src), str(tmp_path / "q2"), "--layout", "deepseek-fp8", "--config", "x.json"]
    )
    assert r.exit_code != 0 and "x.json" in r.output and not (tmp_path / "q2").exists()


# ----------------------------------------------------------------------------- the consumer's decode
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_consumer_dtype_check_refuses_then_offers_exact_choices(tmp_path):
    """A fp32 per-tensor scale that is not a bf16 value: transformers' default load (a bf16 model)
    rounds it; export refuses with the numbers, and each choice it offers is exact."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(M, K, generator=g)
    q = ckptq.quantize(w, "fp8_tensor")  # default recipe: amax / 448, not a power of two
    s = q.components()["scale_inv"]
    assert not torch.equal(s.bfloat16().float(), s)
    src = _native(tmp_path / "ck", {"m.weight": q, "pow2.weight": ckptq.quantize(w, "fp8_tensor", pow2=True)})
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    # the consumer's decode, written out here: the scale cast to bf16, one rounding of the product
    data = q.components()["data"].float()
    theirs = (data * s.bfloat16().float()).bfloat16()
    ours = q.dequantize(torch.bfloat16)
    n = int((_bits(theirs) != _bits(ours)).sum())
    assert n > 0
    with pytest.raises(UnsupportedFormatError) as ei:
        export_checkpoint(src, tmp_path / "out", layout="compressed-tensors")
    msg = str(ei.value)
    assert "1 tensor(s)" in msg and f"({n} values" in msg and "'m.weight'" in msg
    assert "--on-inexact float32" in msg and "--on-inexact requantize" in msg and "dB" in msg
    assert not (tmp_path / "out").exists()
    keep = export_checkpoint(src, tmp_path / "keep", layout="compressed-tensors", on_inexact="keep")
    assert keep["consumer"]["differs"]["m.weight"]["elements"] == n
    assert "pow2.weight" not in keep["consumer"]["differs"]  # a power-of-two scale is a bf16 value
    f32 = export_checkpoint(src, tmp_path / "f32", layout="compressed-tensors", on_inexact="float32")
    cfg = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32" and f32["consumer"]["differs"] == {}
    rq = export_checkpoint(src, tmp_path / "rq", layout="compressed-tensors", on_inexact="requantize")
    written = load_file(str(next((tmp_path / "rq").glob("*.safetensors"))))["m.weight_scale"]
    assert torch.equal(written.bfloat16().float(), written) and rq["consumer"]["differs"] == {}
    assert rq["consumer"]["requantized_sqnr_db"]["m.weight"] > 25  # pow2 scales cost < 1 bit of range


def test_consumer_check_mxfp8_and_deepseek(tmp_path):
    g = torch.Generator().manual_seed(2)
    src = _native(tmp_path / "ck", {"m.weight": ckptq.quantize(torch.randn(M, K, generator=g), "mxfp8")})
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float16"}))
    with pytest.raises(UnsupportedFormatError, match="decodes MXFP8 to bfloat16"):
        export_checkpoint(src, tmp_path / "out", layout="compressed-tensors")
    res = export_checkpoint(src, tmp_path / "mo", layout="modelopt")  # no transformers loader: not checked
    assert res["consumer"]["unloadable"] == {}
    ragged = _native(tmp_path / "rg", {"m.weight": ckptq.quantize(torch.randn(200, 256, generator=g), "fp8_block")})
    (ragged / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedFormatError, match="200 x 256"):
        export_checkpoint(ragged, tmp_path / "ds", layout="deepseek-fp8")

"""Hugging Face safetensors export/import (ModelOpt, compressed-tensors, DeepSeek FP8).

Checked three ways: the files as the layouts specify them (names, dtypes, shapes, config); the
import back into ckptq (components bit-exact); and the consumers' own decode, i.e. compressed-tensors'
own decompression when it is installed, and the ModelOpt / DeepSeek reference formulas written
independently here from their documented decodes (docs/producers.md, "4.1 Tensor layouts").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes, assert_same_components
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import ckptq
from ckptq.checkpoint import open_checkpoint
from ckptq.cli import app
from ckptq.errors import CheckpointFormatError, CkptqError, UnsupportedFormatError, UsageError
from ckptq.export import export_checkpoint, parse_size

E4M3 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
E2M1 = torch.cat([E2M1, -E2M1])


def _linear_weights(g):
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 512, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(130, 256, generator=g) * 1e-3,  # ragged rows
        "model.layers.0.mlp.down_proj.weight": torch.randn(300, 384, generator=g) * 40,
    }


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A ckptq native checkpoint: one tensor per format, plus plain tensors that stay bf16."""
    g = torch.Generator().manual_seed(0)
    w = _linear_weights(g)
    sd = {
        "model.layers.0.self_attn.q_proj.weight": ckptq.quantize(w["model.layers.0.self_attn.q_proj.weight"], "nvfp4"),
        "model.layers.0.self_attn.k_proj.weight": ckptq.quantize(w["model.layers.0.self_attn.k_proj.weight"], "mxfp8"),
        "model.layers.0.mlp.down_proj.weight": ckptq.quantize(w["model.layers.0.mlp.down_proj.weight"], "fp8_block"),
        "model.layers.0.self_attn.o_proj.weight": ckptq.quantize(torch.randn(64, 256, generator=g), "fp8_tensor"),
        "model.layers.0.mlp.up_proj.weight": ckptq.quantize(torch.randn(48, 64, generator=g), "nvfp4", two_d=True),
        "model.embed_tokens.weight": torch.randn(100, 64, generator=g),
        "model.norm.weight": torch.ones(64),
        "lm_head.weight": ckptq.quantize(torch.randn(100, 64, generator=g), "nvfp4"),
    }
    path = tmp_path_factory.mktemp("native")
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    _model_config(path)
    return path, sd


def _model_config(folder: Path) -> None:
    """The model's config.json saved into the checkpoint folder, where ``export`` finds it."""
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A high-precision checkpoint (what --format quantizes)."""
    g = torch.Generator().manual_seed(1)
    sd = {**_linear_weights(g), "model.norm.weight": torch.ones(64), "lm_head.weight": torch.randn(32, 64, generator=g)}
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    path = tmp_path_factory.mktemp("plain")
    dcp.save(sd, checkpoint_id=str(path))
    _model_config(path)
    return path, sd


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(idx["weight_map"].values())):
        out.update(load_file(str(folder / f)))
    assert set(out) == set(idx["weight_map"])
    return out


# Expected HF tensors of a (M, K) weight per layout and format: suffix -> (dtype, shape)
def _expected(layout, fmt, m, k, recipe=None):
    c16, c32, c128 = -(-k // 16), -(-k // 32), -(-k // 128)
    table = {
        ("modelopt", "nvfp4"): {
            "weight": (torch.uint8, (m, k // 2)),
            "weight_scale": (E4M3, (m, c16)),
            "weight_scale_2": (torch.float32, ()),
        },
        ("modelopt", "mxfp8"): {"weight": (E4M3, (m, k)), "weight_scale": (torch.uint8, (m, c32))},
        ("modelopt", "fp8_tensor"): {"weight": (E4M3, (m, k)), "weight_scale": (torch.float32, ())},
        ("compressed-tensors", "nvfp4"): {
            "weight_packed": (torch.uint8, (m, k // 2)),
            "weight_scale": (E4M3, (m, c16)),
            "weight_global_scale": (torch.float32, (1,)),
        },
        ("compressed-tensors", "mxfp8"): {"weight": (E4M3, (m, k)), "weight_scale": (torch.uint8, (m, c32))},
        ("compressed-tensors", "fp8_block"): {
            "weight": (E4M3, (m, k)),
            "weight_scale": (torch.float32, (-(-m // 128), c128)),
        },
        ("compressed-tensors", "fp8_tensor"): {"weight": (E4M3, (m, k)), "weight_scale": (torch.float32, (1,))},
        ("deepseek-fp8", "fp8_block"): {
            "weight": (E4M3, (m, k)),
            "weight_scale_inv": (torch.float32, (-(-m // 128), c128)),
        },
    }
    return table[(layout, fmt)]


PAIRS = [
    ("modelopt", "nvfp4"),
    ("modelopt", "mxfp8"),
    ("modelopt", "fp8_tensor"),
    ("compressed-tensors", "nvfp4"),
    ("compressed-tensors", "mxfp8"),
    ("compressed-tensors", "fp8_block"),
    ("compressed-tensors", "fp8_tensor"),
    ("deepseek-fp8", "fp8_block"),
]
QUANTIZED = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    ok = ~torch.isnan(a)
    return int((a[ok].view(torch.int32).long() - b[ok].view(torch.int32).long()).abs().max()) if ok.any() else 0


@pytest.fixture(scope="module")
def exports(plain, tmp_path_factory):
    """Each (layout, format) export of the plain checkpoint (small shards, to get several)."""
    out = {}
    for layout, fmt in PAIRS:
        dst = tmp_path_factory.mktemp("exp") / f"{layout}-{fmt}"
        # keep: fp8_tensor's fp32 scales load rounded into a bf16 model (test_consumer_dtype_check)
        res = export_checkpoint(plain[0], dst, layout=layout, format=fmt, max_shard_size="40KB", on_inexact="keep")
        out[(layout, fmt)] = (dst, res)
    return out


@pytest.mark.parametrize("layout,fmt", PAIRS)
def test_export_files_names_dtypes_config(plain, exports, layout, fmt):
    dst, res = exports[(layout, fmt)]
    sd = plain[1]
    files = sorted(p.name for p in dst.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    assert n >= 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not [p for p in dst.parent.iterdir() if "ckptq-tmp" in p.name]
    tensors = _read_all(dst)
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    for fqn in QUANTIZED:
        module = fqn[: -len(".weight")]
        m, k = sd[fqn].shape
        exp = _expected(layout, fmt, m, k)
        for suffix, (dtype, shape) in exp.items():
            t = tensors[f"{module}.{suffix}"]
            assert t.dtype == dtype and tuple(t.shape) == shape, (fqn, suffix, t.dtype, t.shape)
        assert len({idx["weight_map"][f"{module}.{s}"] for s in exp}) == 1  # one weight's tensors in one shard
        assert res["quantized"][fqn] == fmt
    # ignored / 1-D tensors stay bf16 under their names
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and tensors["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["lm_head.weight"], sd["lm_head.weight"])
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    if layout == "compressed-tensors":
        from_fmt = {
            "nvfp4": "nvfp4-pack-quantized",
            "mxfp8": "mxfp8-quantized",
            "fp8_block": "float-quantized",
            "fp8_tensor": "float-quantized",
        }
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == from_fmt[fmt]
        assert qc["quantization_status"] == "compressed" and "lm_head" in qc["ignore"]
        pytest.importorskip("compressed_tensors")
        from compressed_tensors.quantization import QuantizationConfig

        QuantizationConfig.model_validate(qc)  # the consumer's own schema
    elif layout == "modelopt":
        hq = json.loads((dst / "hf_quant_config.json").read_text())
        algo = {"nvfp4": "NVFP4", "mxfp8": "MXFP8", "fp8_tensor": "FP8"}[fmt]
        assert hq["producer"]["name"] == "modelopt" and hq["quantization"]["quant_algo"] == algo
        assert "lm_head" in hq["quantization"]["exclude_modules"]
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == algo
        if fmt == "nvfp4":
            assert hq["quantization"]["group_size"] == 16
    else:
        assert qc == {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.norm"],
        }


@pytest.mark.parametrize("layout,fmt", PAIRS)
def test_import_back_bit_exact(plain, exports, layout, fmt):
    """The folder opens as a ckptq source; each weight equals ckptq's own quantization byte for byte."""
    dst, res = exports[(layout, fmt)]
    view = open_checkpoint(dst)
    assert view.source == f"safetensors ({layout})"
    for fqn in QUANTIZED:
        e = view.entry(fqn)
        assert e.kind == "quantized" and e.format == fmt
        assert e.descriptor.producer["layout"] == layout
        want = ckptq.requantize(plain[1][fqn], fmt)
        assert_same_components(view.read(fqn), want, fqn)
    assert view.entry("lm_head.weight").kind == "tensor"


def test_native_export_keeps_bytes_and_converts_back(native, tmp_path):
    """No --format: each tensor keeps its format; a 16x16 NVFP4 scale grid is repeated over rows
    (same values); `ckptq convert --to native` of the export gives the source components back."""
    src, sd = native
    dst = tmp_path / "ct"
    res = export_checkpoint(src, dst, layout="compressed-tensors", on_inexact="keep")
    assert res["requantized"] == [] and "lm_head.weight" in res["high_precision"]
    # the one fp8_tensor weight has a fp32 scale a bf16 model rounds: reported, kept as asked
    assert list(res["consumer"]["differs"]) == ["model.layers.0.self_attn.o_proj.weight"]
    view = open_checkpoint(dst)
    for fqn, t in sd.items():
        if not isinstance(t, ckptq.QuantizedTensor) or fqn == "lm_head.weight":
            continue
        back = view.read(fqn)
        if fqn.endswith("up_proj.weight"):  # two_d -> the layouts' 1x16 grid, same decoded values
            assert torch.equal(back.dequantize(torch.float32), t.dequantize(torch.float32))
            assert_same_bytes(back.components()["data"], t.components()["data"])
        else:
            assert_same_components(back, t, fqn)
    # mixed formats: one config group per format, targeted by name
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 4
    # convert to a native DCP checkpoint through the public command
    out = tmp_path / "native"
    r = CliRunner().invoke(app, ["convert", str(dst), str(out), "--to", "native"])
    assert r.exit_code == 0, r.output
    cv = open_checkpoint(out)
    assert_same_components(cv.read("model.layers.0.mlp.down_proj.weight"), sd["model.layers.0.mlp.down_proj.weight"])
    assert cv.entry("model.layers.0.self_attn.q_proj.weight").descriptor.producer["layout"] == "compressed-tensors"
    # inspect reads the folder
    r = CliRunner().invoke(app, ["inspect", str(dst), "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["fqn"]: row for row in json.loads(r.stdout)["tensors"]}
    assert rows["model.layers.0.self_attn.q_proj.weight"]["format"] == "nvfp4"
    assert "compressed-tensors" in rows["model.layers.0.self_attn.q_proj.weight"]["producer"]


# ----------------------------------------------------------------------------- consumers
def _modelopt_nvfp4_reference(t):
    """ModelOpt NVFP4QTensor dequantize: nibble_lut[q] * (weight_scale.float() * weight_scale_2), 1x16 blocks."""
    w, s, s2 = t["weight"], t["weight_scale"], t["weight_scale_2"]
    lo, hi = (w & 0xF).long(), (w >> 4).long()
    q = torch.stack([E2M1[lo], E2M1[hi]], -1).reshape(w.shape[0], -1)
    return q * (s.float() * s2).repeat_interleave(16, -1)[:, : q.shape[1]]


def _block_reference(w, s, bm, bk):
    """DeepSeek weight_dequant / HF FP8 dequantizer: w.float() * s[i // 128, j // 128]."""
    return w.float() * s.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]


@pytest.mark.parametrize("layout,fmt", PAIRS)
def test_consumer_reference_formulas(plain, exports, layout, fmt):
    """The layouts' own decode formulas (docs/producers.md 4.1), written here, against ckptq's dequantize."""
    dst, res = exports[(layout, fmt)]
    tensors = _read_all(dst)
    for fqn in QUANTIZED:
        module = fqn[: -len(".weight")]
        t = {k[len(module) + 1 :]: v for k, v in tensors.items() if k.startswith(module + ".")}
        ours = ckptq.requantize(plain[1][fqn], fmt).dequantize(torch.float32)
        if fmt == "nvfp4" and layout == "modelopt":
            theirs = _modelopt_nvfp4_reference(t)
        elif fmt == "nvfp4":  # compressed-tensors: fp4 * (weight_scale / weight_global_scale)
            w = t["weight_packed"]
            q = torch.stack([E2M1[(w & 0xF).long()], E2M1[(w >> 4).long()]], -1).reshape(w.shape[0], -1)
            theirs = q * (t["weight_scale"].float() / t["weight_global_scale"]).repeat_interleave(16, -1)
        elif fmt == "mxfp8":  # q * 2^(u8 - 127)
            theirs = (
                t["weight"].float()
                * torch.exp2(t["weight_scale"].float() - 127).repeat_interleave(32, -1)[:, : t["weight"].shape[1]]
            )
        elif fmt == "fp8_tensor":
            theirs = t["weight"].float() * t["weight_scale"].reshape(())
        else:
            theirs = _block_reference(
                t["weight"], t["weight_scale_inv" if layout == "deepseek-fp8" else "weight_scale"], 128, 128
            )
        u = _ulps(theirs, ours)
        if fmt == "nvfp4":
            # two fp32 roundings in ckptq ((s*amax)*(1/2688)) vs one global scale in the layout: the
            # exporter picks the fp32 global scale closest to ckptq's decode; reported, and <= 2 ulps
            assert u == res["numerics"][fqn] and u <= 2, (fqn, u)
            assert torch.equal(theirs.bfloat16(), ours.bfloat16()) or u > 0
        else:
            assert u == 0, (fqn, u)  # same math: bit-exact


def _ct_dequantize(folder):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    deq = CompressedTensorsDequantizer(str(folder), dtype=torch.float32)
    return deq.validate(_read_all(folder)), ct


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8_block", "fp8_tensor"])
def test_compressed_tensors_decompresses_our_export(plain, exports, fmt):
    """compressed-tensors 0.20's own dequantizer (config.json parsed by its QuantizationConfig,
    each module decompressed by its registered compressor) equals ckptq's dequantized values."""
    dst, res = exports[("compressed-tensors", fmt)]
    out, ct = _ct_dequantize(dst)
    assert ct.__version__.startswith("0.20")
    for fqn in QUANTIZED:
        ours = ckptq.requantize(plain[1][fqn], fmt).dequantize(torch.float32)
        theirs = out[fqn]
        if fmt == "nvfp4":
            # their NVFP4 path decodes in bf16 (unpack_fp4_from_uint8 -> bf16; scale / global_scale in
            # fp32; product rounded to bf16): equal to ckptq's fp32 value rounded to bf16 where the
            # fp32 values agree; otherwise at most 1 bf16 ulp apart
            assert _ulps(theirs.bfloat16().float(), ours.bfloat16().float()) <= 1
            if res["numerics"][fqn] == 0:
                assert torch.equal(theirs.bfloat16(), ours.bfloat16())
        else:
            assert torch.equal(theirs, ours), fqn


def test_compressed_tensors_modelopt_converter_chain(plain, exports, tmp_path):
    """compressed-tensors' ModelOpt NVFP4 converter (weight_scale_2 -> 1/x) then its decompression,
    applied to our ModelOpt export: the values agree with ckptq's within 1 bf16 ulp."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    dst, res = exports[("modelopt", "nvfp4")]
    tensors = _read_all(dst)
    conv = ModelOptNvfp4Converter(targets=["re:.*(q|k)_proj$", "re:.*down_proj$"])
    converted = conv.process(dict(tensors))
    for fqn in QUANTIZED:
        module = fqn[: -len(".weight")]
        assert converted[f"{module}.weight_packed"].dtype == torch.uint8
        gs = converted[f"{module}.weight_global_scale"]
        assert torch.equal(gs.reshape(()), 1 / tensors[f"{module}.weight_scale_2"])


def test_deepseek_fp8_block_dequantizer(plain, exports):
    """compressed-tensors' FP8BlockDequantizer (the DeepSeek weight + weight_scale_inv reader) equals ckptq."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    dst, _ = exports[("deepseek-fp8", "fp8_block")]
    out = FP8BlockDequantizer(targets=["re:.*proj$"], dtype=torch.float32).process(_read_all(dst))
    for fqn in QUANTIZED:
        assert torch.equal(out[fqn].float(), ckptq.requantize(plain[1][fqn], "fp8_block").dequantize(torch.float32))


def test_rename_rules(plain, tmp_path):
    dst = tmp_path / "renamed"
    export_checkpoint(
        plain[0],
        dst,
        layout="deepseek-fp8",
        format="fp8_block",
        names=["model.layers.*=layers.*", "lm_head.weight=output.weight"],
        on_inexact="keep",  # ragged dims: transformers' DeepSeek loader would decode wrong blocks
    )
    names = set(_read_all(dst))
    assert "layers.0.mlp.down_proj.weight_scale_inv" in names and "output.weight" in names
    from ckptq.io.safetensors import SafetensorsView

    view = SafetensorsView(dst, names=["model.layers.*=layers.*", "lm_head.weight=output.weight"])
    assert "model.layers.0.mlp.down_proj.weight" in view and "lm_head.weight" in view
    with pytest.raises(UsageError):
        export_checkpoint(plain[0], tmp_path / "x", layout="deepseek-fp8", names=["a*=b"])


# ----------------------------------------------------------------------------- bad input
def _nothing_written(dst: Path):
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if "ckptq-tmp" in p.name]


def test_refusals(native, plain, tmp_path):
    src, _ = native
    dst = tmp_path / "out"
    with pytest.raises(UsageError, match="unknown layout"):
        export_checkpoint(src, dst, layout="gguf")
    with pytest.raises(UsageError, match="holds"):
        export_checkpoint(src, dst, layout="deepseek-fp8", format="nvfp4")
    with pytest.raises(UsageError):
        export_checkpoint(src, dst, layout="modelopt", max_shard_size="lots")
    # DeepSeek holds only 128x128 FP8 blocks: an NVFP4 tensor is refused, naming it and the fix
    with pytest.raises(UnsupportedFormatError, match="is nvfp4, which layout .deepseek-fp8. cannot hold.*--format"):
        export_checkpoint(src, dst, layout="deepseek-fp8")
    _nothing_written(dst)
    # FP4 cannot pack an odd K / the consumers need K % 16 == 0
    odd = tmp_path / "odd"
    dcp.save(
        {"a.weight": torch.randn(8, 33, dtype=torch.bfloat16), "b.weight": torch.randn(8, 40)}, checkpoint_id=str(odd)
    )
    with pytest.raises(UnsupportedFormatError, match=r"a\.weight.*K = 33.*--ignore"):
        export_checkpoint(odd, dst, layout="compressed-tensors", format="nvfp4", config=False)
    with pytest.raises(UnsupportedFormatError, match=r"b\.weight.*multiple of 16"):
        export_checkpoint(odd, dst, layout="modelopt", format="nvfp4", ignore=["a*"], config=False)
    _nothing_written(dst)
    with pytest.raises(CkptqError, match="exists"):
        export_checkpoint(src, tmp_path, layout="compressed-tensors")
    with pytest.raises(ckptq.QuantizationError):
        ckptq.quantize(torch.randn(8, 33), "nvfp4")


def test_bad_folders(plain, exports, tmp_path):
    import shutil

    dst, _ = exports[("deepseek-fp8", "fp8_block")]
    # config says compressed-tensors, tensors are DeepSeek's
    bad = tmp_path / "bad_cfg"
    shutil.copytree(dst, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointFormatError, match="weight_scale_inv.*fix quantization_config"):
        open_checkpoint(bad)
    # unknown quant_method
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFormatError, match="gptq"):
        open_checkpoint(bad)
    # a missing shard: named, with the fix
    miss = tmp_path / "missing"
    shutil.copytree(dst, miss)
    victim = sorted(miss.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointFormatError, match=f"{victim.name}.*missing.*copy the missing shard"):
        open_checkpoint(miss)
    # a scale of the wrong shape (config block size disagrees with the tensors)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file(
        {"m.weight": torch.zeros(256, 256).to(E4M3), "m.weight_scale_inv": torch.ones(4, 4)},
        str(wrong / "model.safetensors"),
    )
    with pytest.raises(CheckpointFormatError, match=r"m\.weight_scale_inv.*\[4, 4\].*needs \[2, 2\]"):
        open_checkpoint(wrong)
    # CLI: usage error exits 2, a refused export exits 1, nothing written
    r = CliRunner().invoke(app, ["export", str(plain[0]), str(tmp_path / "cli"), "--layout", "nope"])
    assert r.exit_code == 2 and "unknown layout" in r.output
    r = CliRunner().invoke(app, ["export", str(bad), str(tmp_path / "cli"), "--layout", "modelopt"])
    assert r.exit_code == 1 and "gptq" in r.output
    _nothing_written(tmp_path / "cli")


def test_single_file_and_cli_export(plain, tmp_path):
    """A single .safetensors file (no config) is detected from its names; the CLI maps flags to one call."""
    out = tmp_path / "cli"
    r = CliRunner().invoke(
        app,
        [
            "export",
            str(plain[0]),
            str(out),
            "--layout",
            "modelopt",
            "--format",
            "nvfp4",
            "--ignore",
            "*lm_head*",
            "--ignore",
            "*down_proj*",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert "model.layers.0.mlp.down_proj.weight" in res["high_precision"]
    single = tmp_path / "one.safetensors"
    shard = sorted(out.glob("model-*.safetensors"))[0]
    os.link(shard, single) if False else single.write_bytes(shard.read_bytes())
    view = open_checkpoint(single)
    assert view.source == "safetensors (modelopt)"
    assert view.entry("model.layers.0.self_attn.q_proj.weight").format == "nvfp4"
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20


# ----------------------------------------------------------------------------- a third-party folder
def _modelopt_quantize(x):
    """NVFP4 as ModelOpt's NVFP4QTensor does it (``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``
    at a2fbac7; docs/producers.md 4.1 and 5), written here independently:
    ws2 = amax/2688; ws = e4m3(clamp(blk_amax / (6 * ws2), 2^-9, 448)); q = e2m1(x / (ws * ws2))."""
    m, k = x.shape
    ws2 = x.abs().amax() / 2688.0
    xb = x.reshape(m, k // 16, 16)
    ws = (xb.abs().amax(-1) / (6 * ws2)).clamp(2**-9, 448).to(E4M3)
    scaled = xb / (ws.float() * ws2)[..., None]
    idx = torch.bucketize(scaled.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]), right=False)
    code = (idx | ((scaled < 0).long() << 3)).reshape(m, k).to(torch.uint8)
    return {"weight": code[:, 0::2] | (code[:, 1::2] << 4), "weight_scale": ws, "weight_scale_2": ws2}


def test_import_third_party_modelopt_folder(tmp_path):
    """A ModelOpt-style NVFP4 folder not written by ckptq (no recorded amax, with input_scale):
    detected from its configs, imported byte for byte in ModelOpt's convention (weight_scale_2 as
    global_scale_inv), decoded exactly as ModelOpt's formula; re-exported as ModelOpt byte for byte,
    and as compressed-tensors with input_global_scale = 1/input_scale."""
    g = torch.Generator().manual_seed(5)
    folder = tmp_path / "mo"
    folder.mkdir()
    tensors = {}
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"):
        q = _modelopt_quantize(torch.randn(64, 128, generator=g) * 3)
        tensors.update({f"{name}.{k}": v for k, v in q.items()})
        tensors[f"{name}.input_scale"] = torch.tensor(0.01171875)
    tensors["model.embed_tokens.weight"] = torch.randn(10, 128, generator=g).bfloat16()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "torch_dtype": "bfloat16",
                "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
            }
        )
    )
    (folder / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt", "version": "0.40"},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16},
            }
        )
    )
    view = open_checkpoint(folder)
    assert view.source == "safetensors (modelopt)"
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"):
        e = view.entry(f"{name}.weight")
        assert e.format == "nvfp4" and e.descriptor.producer["name"] == e.descriptor.producer["layout"] == "modelopt"
        qt = view.read(f"{name}.weight")
        assert_same_bytes(qt.components()["data"], tensors[f"{name}.weight"])
        assert_same_bytes(qt.components()["scale"], tensors[f"{name}.weight_scale"])
        assert e.descriptor.recipe["per_tensor"] == "global_scale_inv"
        assert_same_bytes(qt.components()["global_scale_inv"], tensors[f"{name}.weight_scale_2"])
        ref = _modelopt_nvfp4_reference(
            {k: tensors[f"{name}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
        )
        assert_same_bytes(qt.dequantize(torch.float32), ref)
        assert_same_bytes(qt.dequantize(torch.bfloat16), ref.bfloat16())
    assert view.entry("model.layers.0.mlp.up_proj.input_scale").kind == "tensor"
    same = tmp_path / "mo-again"
    res = export_checkpoint(folder, same, layout="modelopt")
    assert res["numerics"] == {}
    again = _read_all(same)
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"):
        for k in ("weight", "weight_scale", "weight_scale_2"):
            assert_same_bytes(again[f"{name}.{k}"], tensors[f"{name}.{k}"])
    out = tmp_path / "ct"
    export_checkpoint(folder, out, layout="compressed-tensors")
    t = _read_all(out)
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"):
        assert_same_bytes(t[f"{name}.weight_packed"], tensors[f"{name}.weight"])
        assert_same_bytes(t[f"{name}.weight_scale"], tensors[f"{name}.weight_scale"])
        assert torch.equal(t[f"{name}.input_global_scale"], (1 / tensors[f"{name}.input_scale"]).reshape(1))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # and the round trip back to ModelOpt gives the original weight_scale_2 (same decode as ckptq)
    back = tmp_path / "mo2"
    export_checkpoint(out, back, layout="modelopt")
    t2 = _read_all(back)
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"):
        assert_same_bytes(t2[f"{name}.weight"], tensors[f"{name}.weight"])
        ref = _modelopt_nvfp4_reference(
            {k: tensors[f"{name}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
        )
        mine = _modelopt_nvfp4_reference({k: t2[f"{name}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")})
        assert _ulps(mine, ref) <= 2


# ----------------------------------------------------------------------------- compressed-tensors' own NVFP4
def _ct_nvfp4_folder(folder: Path, dtype: torch.dtype, g) -> tuple[dict, dict]:
    """An NVFP4 folder made by compressed-tensors 0.20's own functions from a model of ``dtype``:
    ``generate_gparam`` (weight_global_scale), ``calculate_qparams`` per 16-group (weight_scale) and
    ``NVFP4PackedCompressor.compress`` (weight_packed). Returns (its tensors, {module: weight})."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = NVFP4["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors, weights = {}, {}
    for i, (m, k, mag) in enumerate([(64, 128, 1.0), (48, 64, 3e-3), (32, 256, 70.0)]):
        module = f"model.layers.{i}.mlp.down_proj"
        w = (torch.randn(m, k, generator=g) * mag).to(dtype)
        gs = generate_gparam(w.min(), w.max())
        groups = w.reshape(m, k // 16, 16)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
        out = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        tensors.update({f"{module}.{n}": t for n, t in out.items()})
        weights[module] = w
    tensors["model.embed_tokens.weight"] = torch.randn(8, 64, generator=g).to(dtype)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    group = {"targets": ["Linear"], "weights": args.model_dump(mode="json"), "format": "nvfp4-pack-quantized"}
    qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": group}}
    (folder / "config.json").write_text(json.dumps({"torch_dtype": str(dtype)[6:], "quantization_config": qc}))
    return tensors, weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compressed_tensors_nvfp4_kept_exactly(tmp_path, dtype):
    """A compressed-tensors NVFP4 folder (its own API, a bf16/fp16/fp32 model): imported with the
    global scale as stored (``per_tensor="global_scale"``), exported back byte for byte, and ckptq's
    dequantize equals compressed-tensors' own decode bit for bit: its decompress (bf16 output) and
    its ``dequantize`` in fp32 (``scale / global_scale``, then the product)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import NVFP4

    args = NVFP4["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    src = tmp_path / "ct"
    tensors, weights = _ct_nvfp4_folder(src, dtype, torch.Generator().manual_seed(7))
    view = open_checkpoint(src)
    for module in weights:
        e = view.entry(f"{module}.weight")
        assert e.format == "nvfp4" and e.descriptor.recipe["per_tensor"] == "global_scale"
        qt = view.read(f"{module}.weight")
        stored = {n: tensors[f"{module}.{n}"] for n in ("weight_packed", "weight_scale", "weight_global_scale")}
        assert_same_bytes(qt.components()["global_scale"], stored["weight_global_scale"].reshape(()))
        theirs = NVFP4PackedCompressor.decompress(dict(stored), scheme)["weight"]
        assert theirs.dtype == torch.bfloat16
        assert_same_bytes(qt.dequantize(torch.bfloat16), theirs)
        m, n = stored["weight_packed"].shape
        codes = unpack_fp4_from_uint8(stored["weight_packed"], m, n * 2, dtype=torch.float32)
        fp32 = dequantize(codes, stored["weight_scale"].float(), args=args, global_scale=stored["weight_global_scale"])
        assert fp32.dtype == torch.float32
        assert_same_bytes(qt.dequantize(torch.float32), fp32)
    dst = tmp_path / "ct-again"
    res = export_checkpoint(src, dst, layout="compressed-tensors", config=False)
    assert res["numerics"] == {} and res["requantized"] == []
    again = _read_all(dst)
    for module in weights:
        for n in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert_same_bytes(again[f"{module}.{n}"], tensors[f"{module}.{n}"])
    # and to ModelOpt's convention: the closest weight_scale_2, its decode difference reported
    mo = tmp_path / "mo"
    res = export_checkpoint(src, mo, layout="modelopt", config=False)
    t = _read_all(mo)
    for module in weights:
        ref = view.read(f"{module}.weight").dequantize(torch.float32)
        mine = _modelopt_nvfp4_reference({k: t[f"{module}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")})
        assert _ulps(mine, ref) == res["numerics"][f"{module}.weight"] <= 2

"""MXFP4 producers and consumers (docs/producers.md, "7. MXFP4").

* gpt-oss (transformers 5.24 ``Mxfp4Config``): a small gpt-oss-shaped folder (4 experts, 2 layers)
  goes import -> native DCP -> reshard to 2 ranks with the experts split -> export ``gpt-oss``; the
  exported ``_blocks`` / ``_scales`` are the source's bytes and transformers' own CPU dequantizer
  (``Mxfp4Config(dequantize=True)``) gives ckptq's decode of the source, transposed, bit for bit.
* compressed-tensors 0.20 ``mxfp4-pack-quantized`` both ways, judged by its own decompressor.
* DeepSeek-V4-style mixed folders (MXFP4 experts + 128x128 E8M0-scaled FP8, a scale in another
  shard than its weight): inspect shows both formats, convert and export keep each exactly; a tiny
  transformers ``DeepseekV4ForCausalLM`` folder imports byte for byte and ckptq's export of it loads
  in transformers' own loader (``from_pretrained``, CPU) to ckptq's decode, bit for bit.
* 3-D expert weights in every HF layout, and the bad inputs of the issue (nothing written).

torchao ``MXTensor`` FP4 (live, DCP, ``torch.save``) is covered by tests/test_torchao.py's cases.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import ckptq
from ckptq.checkpoint import CheckpointView, open_checkpoint
from ckptq.cli import app
from ckptq.errors import CheckpointFormatError, CkptqError, UnsupportedFormatError
from ckptq.export import export_checkpoint
from ckptq.io.safetensors import check_safetensors_records
from ckptq.reshard import reshard_checkpoint

warnings.filterwarnings("ignore", message=".*Enum subclass.*")

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 64, 64
PROJ = ("gate_up_proj", "down_proj")


def _index(folder: Path, tensors_by_file: dict[str, dict[str, torch.Tensor]], config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for fname, tensors in tensors_by_file.items():
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(idx["weight_map"].values())):
        out.update(load_file(str(folder / f)))
    return out


# ============================================================================ gpt-oss
def _gpt_oss_config():
    from transformers import GptOssConfig

    return GptOssConfig(
        num_hidden_layers=LAYERS,
        num_local_experts=EXPERTS,
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A gpt-oss MXFP4 folder as transformers reads it: ``*_blocks`` (E, N, K/32, 16) and
    ``*_scales`` (E, N, K/32) of every expert projection (scales in a second shard), every other
    tensor bf16, ``quantization_config: {quant_method: mxfp4, modules_to_not_convert}``.
    Scale bytes include 0 (subnormal products) and 254 (6 * 2^127 overflows to inf)."""
    pytest.importorskip("transformers")
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    cfg = _gpt_oss_config()
    model = GptOssForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    blocks, scales, plain = {}, {}, {}
    for k, v in model.state_dict().items():
        if k.endswith(PROJ):
            e, k_in, n_out = v.shape  # the module's (experts, in, out); the checkpoint is (experts, out, in)
            blocks[k + "_blocks"] = torch.randint(0, 256, (e, n_out, k_in // 32, 16), dtype=torch.uint8, generator=g)
            s = torch.randint(112, 136, (e, n_out, k_in // 32), dtype=torch.uint8, generator=g)
            s.view(-1)[:3] = torch.tensor([0, 254, 1], dtype=torch.uint8)
            scales[k + "_scales"] = s
        else:
            plain[k] = v.detach().to(torch.bfloat16).contiguous()
    config = {
        **cfg.to_dict(),
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
        },
    }
    folder = tmp_path_factory.mktemp("gptoss") / "src"
    _index(
        folder,
        {"model-00001-of-00002.safetensors": {**blocks, **plain}, "model-00002-of-00002.safetensors": scales},
        config,
    )
    return folder, {**blocks, **scales}, plain


def _transformers_dequantized(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = GptOssForCausalLM.from_pretrained(
        str(folder), quantization_config=Mxfp4Config(dequantize=True), dtype=dtype
    )
    return {k: v.detach() for k, v in model.named_parameters()}


def _expert_fqns():
    return [f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS) for p in PROJ]


def test_gpt_oss_import_matches_transformers_dequantize(gpt_oss):
    """ckptq reads the folder as ``mxfp4`` (E, out, in) tensors holding the stored bytes; their
    decode, transposed to the module's (E, in, out), is transformers' own dequantized parameter,
    bit for bit, in fp32 and bf16."""
    folder, stored, plain = gpt_oss
    view = open_checkpoint(folder)
    assert view.source == "safetensors (gpt-oss)"
    for fqn in _expert_fqns():
        e = view.entry(fqn)
        n_out = 2 * INTER if fqn.endswith("gate_up_proj") else HIDDEN
        k_in = HIDDEN if fqn.endswith("gate_up_proj") else INTER
        assert e.kind == "quantized" and e.format == "mxfp4" and tuple(e.shape) == (EXPERTS, n_out, k_in)
        assert e.descriptor.producer["layout"] == "gpt-oss"
        c = view.read(fqn).components()
        assert_same_bytes(c["data"], stored[fqn + "_blocks"].reshape(EXPERTS, n_out, k_in // 2), fqn)
        assert_same_bytes(c["scale"], stored[fqn + "_scales"], fqn)
    assert view.entry("model.layers.0.mlp.experts.gate_up_proj_bias").kind == "tensor"
    r = CliRunner().invoke(app, ["inspect", str(folder), "--json"])  # not plain uint8 any more
    assert r.exit_code == 0, r.output
    rows = {row["fqn"]: row for row in json.loads(r.stdout)["tensors"]}
    assert {rows[f]["format"] for f in _expert_fqns()} == {"mxfp4"}
    for dtype in (torch.float32, torch.bfloat16):
        theirs = _transformers_dequantized(folder, dtype)
        for fqn in _expert_fqns():
            ours = view.read(fqn).dequantize(dtype).transpose(1, 2).contiguous()
            assert_same_bytes(theirs[fqn], ours, f"{fqn} {dtype}")
        assert torch.isinf(theirs[_expert_fqns()[0]]).any()  # the 254 scale bytes: 6 * 2^127 overflows


def test_gpt_oss_round_trip_native_two_ranks_export(gpt_oss, tmp_path):
    """import -> native DCP -> 2 ranks with the experts split (Shard(0) of (E, out, in)) -> export
    gpt-oss: the blocks and scales are the source's bytes, the other tensors too, and transformers'
    dequantize of the export equals ckptq's decode of the source."""
    folder, stored, plain = gpt_oss
    native, two, out = tmp_path / "native", tmp_path / "two", tmp_path / "out"
    reshard_checkpoint(folder, native, to="native")
    reshard_checkpoint(native, two, mesh="2", plan="fsdp2")
    v2 = CheckpointView(two)
    assert v2.world_size == 2
    fqn = _expert_fqns()[0]
    boxes = sorted((tuple(c.box[0]), tuple(c.box[1])) for c in v2.saved_chunks(f"{fqn}.data"))
    assert boxes == [((0, 0, 0), (2, 2 * INTER, HIDDEN // 2)), ((2, 0, 0), (2, 2 * INTER, HIDDEN // 2))]
    r = CliRunner().invoke(
        app, ["export", str(two), str(out), "--layout", "gpt-oss", "--config", str(folder / "config.json"), "--json"]
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["requantized"] == [] and set(res["quantized"]) == set(_expert_fqns())
    got = _read_all(out)
    for name, t in {**stored, **plain}.items():
        assert_same_bytes(got[name], t, name)
    assert set(got) == set(stored) | set(plain)
    problems, verified, _ = check_safetensors_records(out)  # the crc32c table ckptq export writes
    assert problems == [] and verified == len(got)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4" and isinstance(qc["modules_to_not_convert"], list)
    src = open_checkpoint(folder)
    theirs = _transformers_dequantized(out, torch.float32)
    for f in _expert_fqns():
        assert_same_bytes(theirs[f], src.read(f).dequantize(torch.float32).transpose(1, 2).contiguous(), f)


def test_gpt_oss_refusals(gpt_oss, tmp_path):
    """A 2-D tensor or a K that is not a multiple of 32 cannot be a gpt-oss expert tensor; a
    scale byte 255 (NaN for ckptq, 2^128 for transformers) is refused both ways; nothing written."""
    sd = {"w2d": ckptq.quantize(torch.randn(64, 64), "mxfp4"), "w3d": ckptq.quantize(torch.randn(2, 8, 48), "mxfp4")}
    for name, t in sd.items():
        src = tmp_path / f"src-{name}"
        dcp.save({name: t}, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
        with pytest.raises(UnsupportedFormatError, match=rf"'{name}'.*(3-D|multiple of 32)"):
            export_checkpoint(src, tmp_path / f"out-{name}", layout="gpt-oss", config=False)
        assert not (tmp_path / f"out-{name}").exists()
    nan = ckptq.quantize(torch.randn(2, 8, 64), "mxfp4")
    c = nan.components()
    c["scale"][1, 3, 0] = 255
    src = tmp_path / "src-nan"
    dcp.save({"e.gate_up_proj": nan}, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
    with pytest.raises(CheckpointFormatError, match=r"e\.gate_up_proj_scales.*255"):
        export_checkpoint(src, tmp_path / "out-nan", layout="gpt-oss", config=False)
    assert not (tmp_path / "out-nan").exists()
    folder, stored, plain = gpt_oss
    bad = tmp_path / "bad-nan"
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors = {**stored, **plain}
    s = tensors[name].clone()
    s[0, 0, 0] = 255
    _index(bad, {"model.safetensors": {**tensors, name: s}}, json.loads((folder / "config.json").read_text()))
    with pytest.raises(CheckpointFormatError, match=rf"{name}.*255"):
        open_checkpoint(bad).read("model.layers.0.mlp.experts.down_proj")


@pytest.mark.parametrize(
    "case",
    ["blocks_vs_scales", "blocks_last_dim", "missing_scale_shard", "blocks_without_scales"],
)
def test_gpt_oss_bad_folders(gpt_oss, tmp_path, case):
    """Each bad folder is a CheckpointFormatError naming the tensor (and file) and the fix."""
    folder, stored, plain = gpt_oss
    config = json.loads((folder / "config.json").read_text())
    bad = tmp_path / case
    tensors = {**stored, **plain}
    name = "model.layers.1.mlp.experts.gate_up_proj"
    if case == "blocks_vs_scales":
        tensors[name + "_scales"] = tensors[name + "_scales"][:, :-1].contiguous()
        want = rf"{name}_scales.*shape"
    elif case == "blocks_last_dim":
        b = tensors[name + "_blocks"]
        tensors[name + "_blocks"] = b.reshape(*b.shape[:-2], b.shape[-2] * 2, 8).contiguous()
        want = rf"{name}_blocks.*\(\.\.\., N, K/32, 16\)"
    elif case == "blocks_without_scales":
        del tensors[name + "_scales"]
        want = rf"{name}_blocks.*no scale tensor '{name}_scales'"
    if case == "missing_scale_shard":
        scales = {k: v for k, v in tensors.items() if k.endswith("_scales")}
        rest = {k: v for k, v in tensors.items() if k not in scales}
        _index(bad, {"a.safetensors": rest, "b.safetensors": scales}, config)
        (bad / "b.safetensors").unlink()
        want = r"b\.safetensors.*missing"
    else:
        _index(bad, {"model.safetensors": tensors}, config)
    with pytest.raises(CheckpointFormatError, match=want):
        open_checkpoint(bad)


# ============================================================================ compressed-tensors
def test_compressed_tensors_mxfp4_both_ways(tmp_path):
    """ckptq -> compressed-tensors ``mxfp4-pack-quantized``: its own dequantizer (config parsed by
    its QuantizationConfig, each module decompressed by its registered MXFP4 compressor) equals
    ckptq's decode, and the bytes are ckptq's. compressed-tensors -> ckptq: a folder its compressor
    wrote (scales from its generate_mx_scales) imports with its bytes and its decompressed values."""
    ct = pytest.importorskip("compressed_tensors")
    assert ct.__version__.startswith("0.20")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    g = torch.Generator().manual_seed(3)
    w = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 128, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(40, 64, generator=g) * 1e-3,
    }
    sd = {k: ckptq.quantize(v, "mxfp4", scale_rule="even") for k, v in w.items()}
    src = tmp_path / "native"
    dcp.save({**sd, "model.norm.weight": torch.ones(64)}, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
    out = tmp_path / "ct"
    res = export_checkpoint(src, out, layout="compressed-tensors", config=False)
    assert res["requantized"] == []
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"
    tensors = _read_all(out)
    theirs = CompressedTensorsDequantizer(str(out), dtype=torch.float32).validate(dict(tensors))
    for fqn, t in sd.items():
        m = fqn[: -len(".weight")]
        assert_same_bytes(tensors[m + ".weight_packed"], t.components()["data"], fqn)
        assert_same_bytes(tensors[m + ".weight_scale"], t.components()["scale"], fqn)
        assert_same_bytes(theirs[fqn].float(), t.dequantize(torch.float32), fqn)
    # the other way: compressed-tensors compresses, ckptq imports
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    comp = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    folder = tmp_path / "from-ct"
    written, want = {}, {}
    for fqn, x in w.items():
        m = fqn[: -len(".weight")]
        xb = x.to(torch.bfloat16)
        amax = xb.float().abs().reshape(x.shape[0], -1, 32).amax(-1).to(torch.bfloat16)
        scale = torch.exp2(generate_mx_scales(amax, 4).float() - 127).to(torch.bfloat16)
        packed = comp.compress({"weight": xb, "weight_scale": scale}, scheme)
        written.update({f"{m}.{k}": v.contiguous() for k, v in packed.items()})
        want[fqn] = comp.decompress(dict(packed), scheme)["weight"]
    config = {
        "torch_dtype": "bfloat16",
        "quantization_config": QuantizationConfig(
            config_groups={"group_0": scheme}, format="mxfp4-pack-quantized", quantization_status="compressed"
        ).model_dump(mode="json"),
    }
    _index(folder, {"model.safetensors": written}, config)
    view = open_checkpoint(folder)
    for fqn in w:
        m = fqn[: -len(".weight")]
        q = view.read(fqn)
        assert q.FORMAT == "mxfp4" and q.recipe.scale_rule == "even"
        assert_same_bytes(q.components()["data"], written[m + ".weight_packed"], fqn)
        assert_same_bytes(q.components()["scale"], written[m + ".weight_scale"], fqn)
        assert_same_bytes(q.dequantize(torch.bfloat16), want[fqn], fqn)


# ============================================================================ DeepSeek-V4
def _deepseek_v4_folder(folder: Path, *, scale_shard: bool = True) -> dict[str, torch.Tensor]:
    """A DeepSeek-V4-style folder: routed experts MXFP4 (I8 weight, F8_E8M0 scale), attention and
    shared experts FP8 128x128 with E8M0 scales, one expert's scale in another shard than its weight."""
    g = torch.Generator().manual_seed(7)
    t: dict[str, torch.Tensor] = {}
    for e in range(2):
        for w, (n, k) in {"w1": (64, 96), "w2": (96, 64), "w3": (64, 96)}.items():
            q = ckptq.quantize(torch.randn(n, k, generator=g), "mxfp4")
            t[f"layers.0.ffn.experts.{e}.{w}.weight"] = q.components()["data"].view(torch.int8)
            t[f"layers.0.ffn.experts.{e}.{w}.scale"] = q.components()["scale"].view(torch.float8_e8m0fnu)
    for name, (n, k) in {"layers.0.attn.wq_a": (200, 256), "layers.0.ffn.shared_experts.w1": (128, 96)}.items():
        q = ckptq.quantize(torch.randn(n, k, generator=g), "fp8_block", pow2=True)
        t[f"{name}.weight"] = q.components()["data"]
        s = q.components()["scale_inv"]
        t[f"{name}.scale"] = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)
    t["layers.0.attn_norm.weight"] = torch.ones(256, dtype=torch.bfloat16)
    t["layers.0.attn.attn_sink"] = torch.randn(4, generator=g)  # fp32 in DeepSeek-V4: kept fp32 on export
    t["layers.0.attn.compressor.wkv.weight"] = torch.randn(16, 256, generator=g)
    t["layers.0.ffn.gate.tid2eid"] = torch.randint(0, 2, (32, 2), generator=g)
    t["embed.weight"] = torch.randn(32, 256, generator=g).to(torch.bfloat16)
    config = {
        "model_type": "deepseek_v4",  # as every Hugging Face config.json has (export refuses one without)
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }
    moved = "layers.0.ffn.experts.1.w2.scale"
    if scale_shard:
        _index(
            folder,
            {"a.safetensors": {k: v for k, v in t.items() if k != moved}, "b.safetensors": {moved: t[moved]}},
            config,
        )
    else:
        _index(folder, {"a.safetensors": t}, config)
    return t


def _e8m0(b: torch.Tensor) -> torch.Tensor:
    """Reference E8M0 decode written here: 2^(b - 127) in float64, then fp32 (exact for 0..254)."""
    return torch.pow(2.0, b.view(torch.uint8).double() - 127).float()


def test_deepseek_v4_inspect_convert_export_keep_each_format(tmp_path):
    src = tmp_path / "v4"
    t = _deepseek_v4_folder(src)
    view = open_checkpoint(src)
    assert view.source == "safetensors (deepseek-v4)"
    fmts = {e.fqn: e.format for e in view.entries() if e.kind == "quantized"}
    assert fmts["layers.0.ffn.experts.1.w2.weight"] == "mxfp4" and fmts["layers.0.attn.wq_a.weight"] == "fp8_block"
    r = CliRunner().invoke(app, ["inspect", str(src), "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["fqn"]: row for row in json.loads(r.stdout)["tensors"]}
    assert {rows[f]["format"] for f in fmts} == {"mxfp4", "fp8_block"}
    for fqn, fmt in fmts.items():  # the consumer's decode, written here from the layout
        m = fqn[: -len(".weight")]
        q = view.read(fqn)
        if fmt == "mxfp4":
            assert_same_bytes(q.components()["data"], t[fqn].view(torch.uint8), fqn)
            lut = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
            b = t[fqn].view(torch.uint8)
            v = torch.stack([lut[(b & 15).long()], lut[(b >> 4).long()]], -1).reshape(b.shape[0], -1)
            ref = v * _e8m0(t[m + ".scale"]).repeat_interleave(32, -1)[:, : v.shape[1]]
        else:
            assert q.recipe.block == (128, 128) and q.recipe.pow2
            s = _e8m0(t[m + ".scale"]).repeat_interleave(128, 0).repeat_interleave(128, 1)
            ref = t[fqn].float() * s[: t[fqn].shape[0], : t[fqn].shape[1]]
        assert_same_bytes(q.dequantize(torch.float32), ref, fqn)
    native = tmp_path / "native"
    reshard_checkpoint(src, native, to="native")
    out = tmp_path / "out"
    # wq_a is 200 x 256: transformers' loader would take 100-row blocks (consumer_decode), so keep is needed
    res = export_checkpoint(native, out, layout="deepseek-v4", config=src / "config.json", on_inexact="keep")
    assert res["requantized"] == [] and list(res["consumer"]["unloadable"]) == ["layers.0.attn.wq_a.weight"]
    got = _read_all(out)
    for name, x in t.items():
        assert_same_bytes(got[name], x, name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["scale_fmt"] == "ue8m0"


def test_deepseek_v4_bad_input(tmp_path):
    """A missing scale shard, an FP4 weight without its scale, and an fp8_block tensor whose scales
    are no powers of two (not E8M0-representable) exported to deepseek-v4: errors, nothing written."""
    src = tmp_path / "v4"
    _deepseek_v4_folder(src)
    (src / "b.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match=r"b\.safetensors.*missing.*layers\.0\.ffn\.experts\.1\.w2\.scale"):
        open_checkpoint(src)
    src2 = tmp_path / "v4b"
    t = _deepseek_v4_folder(src2, scale_shard=False)
    del t["layers.0.ffn.experts.0.w1.scale"]
    _index(src2, {"a.safetensors": t}, json.loads((src2 / "config.json").read_text()))
    with pytest.raises(CheckpointFormatError, match=r"layers\.0\.ffn\.experts\.0\.w1\.weight.*no scale"):
        open_checkpoint(src2)
    nat = tmp_path / "nat"
    dcp.save(
        {"x.weight": ckptq.quantize(torch.randn(128, 128), "fp8_block", pow2=False)},
        checkpoint_id=str(nat),
        planner=ckptq.QuantizedSavePlanner(),
    )
    with pytest.raises(UnsupportedFormatError, match=r"'x\.weight'.*pow2"):
        export_checkpoint(nat, tmp_path / "o", layout="deepseek-v4", config=False)
    assert not (tmp_path / "o").exists()


# ============================================================================ 3-D experts, every layout
LAYOUT_FORMATS = [
    ("modelopt", "nvfp4"),
    ("modelopt", "mxfp8"),
    ("modelopt", "fp8_tensor"),
    ("compressed-tensors", "nvfp4"),
    ("compressed-tensors", "mxfp4"),
    ("compressed-tensors", "mxfp8"),
    ("compressed-tensors", "fp8_block"),
    ("compressed-tensors", "fp8_tensor"),
    ("deepseek-fp8", "fp8_block"),
    ("deepseek-v4", "mxfp4"),
    ("deepseek-v4", "fp8_block"),
    ("gpt-oss", "mxfp4"),
]


@pytest.mark.parametrize("layout,fmt", LAYOUT_FORMATS)
def test_3d_expert_weights_round_trip_every_layout(tmp_path, layout, fmt):
    """A stacked (E, out, in) expert weight (E = 3, ragged out for the block formats) is written
    in the layout's names with the experts leading and read back bit-exact; each expert's slice of
    the exported tensors is that expert's own 2-D quantization (no transpose, no reinterleave)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 136, 256, generator=g) * torch.tensor([1.0, 1e-3, 40.0])[:, None, None]
    opts = {"pow2": True} if (layout, fmt) == ("deepseek-v4", "fp8_block") else {}
    q = ckptq.quantize(x, fmt, **opts)
    fqn = "model.layers.0.mlp.experts.gate_up_proj" + ("" if layout == "gpt-oss" else ".weight")
    src = tmp_path / "src"
    dcp.save({fqn: q}, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
    out = tmp_path / "out"
    export_checkpoint(src, out, layout=layout, config=False, on_inexact="keep")
    back = open_checkpoint(out).read(fqn)
    assert back.FORMAT == fmt and tuple(back.shape) == (3, 136, 256)
    if fmt == "nvfp4":  # the global scale: amax recorded in the shard, re-import exact
        assert_same_bytes(back.components()["amax"], q.components()["amax"])
    assert_same_bytes(back.components()["data"], q.components()["data"])
    assert_same_bytes(back.dequantize(torch.float32), q.dequantize(torch.float32))
    for e in range(3):  # expert e of the stack is the 2-D quantization of x[e]
        one = ckptq.quantize(x[e], fmt, **opts)
        assert_same_bytes(back.components()["data"][e], one.components()["data"], f"expert {e}")
    if (layout, fmt) == ("compressed-tensors", "mxfp4") and _has("compressed_tensors"):
        # compressed-tensors' decompressors are 2-D (one Linear): its MXFP4 compressor decodes each
        # expert's slice of the stacked tensors to ckptq's values
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

        comp = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
        t = _read_all(out)
        m = fqn[: -len(".weight")]
        for e in range(3):
            sd = {"weight_packed": t[m + ".weight_packed"][e], "weight_scale": t[m + ".weight_scale"][e]}
            w = comp.decompress(sd, preset_name_to_scheme("MXFP4A16", ["Linear"]))["weight"]
            assert_same_bytes(w, q.dequantize(torch.bfloat16)[e], f"expert {e}")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_ckptq_mxfp4_into_torchao_fp4_targets():
    """A tensor ckptq quantized (each scale rule) written into torchao FP4 ``MXTensor`` targets,
    plain and swizzled, 2-D and 3-D: torchao's fields hold ckptq's bytes and its own dequantize()
    gives ckptq's values bit for bit."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    from ckptq import adapters

    g = torch.Generator().manual_seed(5)
    for shape in ((136, 256), (2, 128, 64)):
        x = torch.randn(shape, generator=g) * 5
        for rule in ("floor", "even", "ceil", "rceil"):
            q = ckptq.quantize(x, "mxfp4", scale_rule=rule)
            for swizzled in (False, True):
                target = MXTensor.to_mx(
                    torch.zeros(shape, dtype=torch.bfloat16), torch.float4_e2m1fn_x2, 32, is_swizzled_scales=swizzled
                )
                assert adapters.adapter_for(target).insert(target, q, "w") is None
                assert_same_bytes(target.qdata, q.components()["data"], f"{shape} {rule}")
                assert_same_bytes(target.dequantize(torch.float32), q.dequantize(torch.float32), f"{shape} {rule}")


def test_bad_k_is_refused_before_writing(tmp_path):
    """Odd K cannot be packed; K not a multiple of 32 cannot be a 32-block layout tensor."""
    with pytest.raises(CkptqError, match="odd"):
        ckptq.quantize(torch.randn(4, 63), "mxfp4")
    src = tmp_path / "src"
    dcp.save(
        {"w.weight": ckptq.quantize(torch.randn(8, 48), "mxfp4")},
        checkpoint_id=str(src),
        planner=ckptq.QuantizedSavePlanner(),
    )
    for layout in ("compressed-tensors", "deepseek-v4"):
        with pytest.raises(UnsupportedFormatError, match=r"'w\.weight'.*multiple of 32"):
            export_checkpoint(src, tmp_path / layout, layout=layout, config=False)
        assert not (tmp_path / layout).exists()


# ============================================================================ DeepSeek-V4 in transformers
def _tiny_deepseek_v4_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=64,
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=64,
        q_lora_rank=64,
        n_routed_experts=2,
        num_experts_per_tok=1,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=4,
        sliding_window=8,
        hc_mult=2,
        max_position_embeddings=256,
        mlp_layer_types=["moe", "moe"],
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    )


def test_deepseek_v4_export_loads_in_transformers_bit_exact(tmp_path, monkeypatch):
    """transformers 5.24's own DeepSeek-V4 (``DeepseekV4ForCausalLM``) reads the layout: a tiny model
    saved by transformers (which writes DeepSeek's original names, ``layers.L.ffn.experts.E.w1.weight``)
    has its routed experts replaced by MXFP4 (I8 + F8_E8M0 ``.scale``) and its attention / shared-expert
    Linears by 128x128 FP8 with E8M0 ``.scale``; ckptq imports that folder byte for byte, takes it to
    native DCP, exports ``deepseek-v4``, and transformers' ``from_pretrained`` on CPU (FineGrainedFP8,
    dequantize on load) gives ckptq's dequantization in bf16, bit for bit, for every expert slice of
    the merged ``experts.gate_up_proj`` / ``down_proj`` and every FP8 Linear."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    plain = tmp_path / "plain"
    DeepseekV4ForCausalLM(_tiny_deepseek_v4_config()).save_pretrained(plain)
    t = load_file(str(plain / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    quantized = {}
    for name, w in list(t.items()):
        if ".ffn.experts." in name:  # routed experts: MXFP4, scale bytes 0 and 254 included
            q = ckptq.quantize(w * 8, "mxfp4")
            s = q.components()["scale"].clone()
            s.view(-1)[:2] = torch.tensor([0, 254], dtype=torch.uint8)
            q = ckptq.from_components(q.descriptor(), {"data": q.components()["data"], "scale": s})
            t[name] = q.components()["data"].view(torch.int8)
            t[name[: -len("weight")] + "scale"] = s.view(torch.float8_e8m0fnu)
        elif re.search(r"\.attn\.w[a-z_]+\.weight$|\.shared_experts\.w\d\.weight$", name):
            q = ckptq.quantize(w * torch.rand((), generator=g) * 100, "fp8_block", pow2=True)
            t[name] = q.components()["data"]
            e = (q.components()["scale_inv"].view(torch.int32) >> 23) & 0xFF
            t[name[: -len("weight")] + "scale"] = e.to(torch.uint8).view(torch.float8_e8m0fnu)
        else:
            continue
        quantized[name] = q
    assert len(quantized) == 2 * (6 + 5 + 3)
    config = json.loads((plain / "config.json").read_text())
    config["expert_dtype"] = "fp4"
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    src = tmp_path / "src"
    _index(src, {"model.safetensors": t}, config)
    view = open_checkpoint(src)  # the folder in transformers' form imports exactly
    for name, q in quantized.items():
        got = view.read(name)
        assert got.FORMAT == q.FORMAT, name
        for c, v in q.components().items():
            assert_same_bytes(got.components()[c], v, f"{name} {c}")
    native = tmp_path / "native"
    reshard_checkpoint(src, native, to="native")
    out = tmp_path / "out"
    export_checkpoint(native, out, layout="deepseek-v4", config=src / "config.json")
    back = _read_all(out)
    for name, x in t.items():
        assert_same_bytes(back[name], x, name)

    pytest.importorskip("accelerate")  # transformers' FP8 quantizer requires it (import and export above ran)
    # transformers 5.24 dequantizes on load by default only where there is no GPU
    # (quantizers/quantizer_finegrained_fp8.py validate_environment); on a GPU machine it keeps the FP8 /
    # FP4 parameters. The test judges that CPU default, so the loader is shown a machine without CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, info = DeepseekV4ForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched key
    params = dict(model.named_parameters())
    bf16 = {n: q.dequantize(torch.bfloat16) for n, q in quantized.items()}
    for layer in range(2):
        p = f"model.layers.{layer}.ffn.experts"
        for e in range(2):
            gate_up = torch.cat([bf16[f"{p}.{e}.w1.weight"], bf16[f"{p}.{e}.w3.weight"]])
            mlp = f"model.layers.{layer}.mlp.experts"
            assert_same_bytes(params[f"{mlp}.gate_up_proj"][e].detach(), gate_up, f"{mlp} {e}")
            assert_same_bytes(params[f"{mlp}.down_proj"][e].detach(), bf16[f"{p}.{e}.w2.weight"], f"{mlp} {e}")
    renamed = {".attn.": ".self_attn.", ".ffn.": ".mlp.", "wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj"}
    renamed |= {"wo_a": "o_a_proj", "wo_b": "o_b_proj", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    checked = 0
    for name, v in bf16.items():
        if ".experts." in name and ".shared_experts." not in name:
            continue
        theirs = name
        for a, b in renamed.items():
            theirs = theirs.replace(a, b)
        assert_same_bytes(params[theirs].detach(), v, theirs)
        checked += 1
    assert checked == 2 * (5 + 3)

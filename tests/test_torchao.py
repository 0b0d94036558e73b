"""torchao 0.18 tensors through ckptq, checked against the real library.

* live ``NVFP4Tensor`` / ``MXTensor`` (E4M3 and FP4) / ``Float8Tensor`` (per-tensor, per-row, 128x128) with
  swizzled and plain scales -> canonical ckptq tensors: components equal torchao's bytes (scales
  unswizzled with torchao's own ``from_blocked``), values equal torchao's ``dequantize()`` bit for bit,
  except NVFP4 with a global scale: within the stated bound (``ckptq/adapters/torchao.py``);
* ``QuantizedSavePlanner`` -> native checkpoint -> ``QuantizedLoadPlanner`` into fresh zeroed torchao
  tensors in place: every field byte-equal; 2 gloo ranks with DTensor ``Shard(0)`` locals;
* checkpoints written by DCP's default planner (records are pickled torchao tensors) and
  ``torch.save`` files: inspect, convert, load, without torchao's classes (checked in a subprocess
  that never imports torchao);
* pickled globals, refusals, a malicious pickle (nothing runs).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

pytest.importorskip("torchao")
warnings.filterwarnings("ignore", message=".*Enum subclass.*")

import torch.distributed.checkpoint as dcp  # noqa: E402
from _dist import run_distributed  # noqa: E402
from torchao.float8.inference import Float8MMConfig  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor, QuantizeTensorToMXKwargs  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: E402
    NVFP4Tensor,
    QuantizeTensorToNVFP4Kwargs,
    per_tensor_amax_to_scale,
)
from torchao.prototype.mx_formats.utils import from_blocked  # noqa: E402
from torchao.quantization import Float8Tensor  # noqa: E402
from torchao.quantization.granularity import PerBlock, PerRow, PerTensor  # noqa: E402
from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs  # noqa: E402

import ckptq  # noqa: E402
from ckptq import adapters  # noqa: E402
from ckptq.adapters import torchao as ao  # noqa: E402
from ckptq.checkpoint import CheckpointView, open_checkpoint  # noqa: E402
from ckptq.inspect import inspect_checkpoint  # noqa: E402
from ckptq.io import SafeFileSystemReader  # noqa: E402
from ckptq.metrics import bit_exact  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _x(seed=0, shape=(200, 256)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)


def _pts(x):
    return per_tensor_amax_to_scale(x.float().abs().max())


def _nv(x, swizzled, pts=True):
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=_pts(x) if pts else None, is_swizzled_scales=swizzled)


def _nv3(x):  # 3-D, per-expert global scales (E, 1, 1)
    return NVFP4Tensor.to_nvfp4(
        x,
        per_tensor_scale=_pts(x)
        .new_tensor([per_tensor_amax_to_scale(x[e].float().abs().max()).item() for e in range(x.shape[0])])
        .view(-1, 1, 1),
    )


# name -> (factory(x), input shape, ckptq format, dequantize exact in fp32?)
CASES = {
    "nvfp4_swizzled": (lambda x: _nv(x, True), (200, 256), "nvfp4", False),  # ragged M: swizzle padding
    "nvfp4_plain": (lambda x: _nv(x, False), (200, 256), "nvfp4", False),
    "nvfp4_no_global": (lambda x: _nv(x, True, pts=False), (200, 256), "nvfp4", True),
    "nvfp4_experts": (_nv3, (3, 64, 128), "nvfp4", False),
    "mxfp8_swizzled": (
        lambda x: MXTensor.to_mx(x, torch.float8_e4m3fn, 32, is_swizzled_scales=True),
        (200, 256),
        "mxfp8",
        True,
    ),
    "mxfp8_plain": (lambda x: MXTensor.to_mx(x, torch.float8_e4m3fn, 32), (200, 96), "mxfp8", True),
    "fp8_tensor": (lambda x: Float8Tensor.from_hp(x, granularity=PerTensor()), (200, 96), "fp8_tensor", True),
    "fp8_tensor_e5m2": (
        lambda x: Float8Tensor.from_hp(x, float8_dtype=torch.float8_e5m2, granularity=PerTensor()),
        (72, 40),
        "fp8_tensor",
        True,
    ),
    "fp8_row": (lambda x: Float8Tensor.from_hp(x, granularity=PerRow()), (200, 96), "fp8_block", True),
    "fp8_block": (lambda x: Float8Tensor.from_hp(x, granularity=PerBlock([128, 128])), (256, 384), "fp8_block", True),
    # 3-D (experts): one scale shared by all (ckptq holds it per matrix), blocks, a swizzle over E*M rows
    "fp8_tensor_3d": (lambda x: Float8Tensor.from_hp(x, granularity=PerTensor()), (2, 64, 96), "fp8_tensor", True),
    "fp8_block_3d": (
        lambda x: Float8Tensor.from_hp(x, granularity=PerBlock([1, 128, 128])),
        (2, 128, 256),
        "fp8_block",
        True,
    ),
    "mxfp8_3d_swizzled": (
        lambda x: MXTensor.to_mx(x, torch.float8_e4m3fn, 32, is_swizzled_scales=True),
        (2, 128, 256),
        "mxfp8",
        True,
    ),
    # MXFP4: FP4 elements (uint8 qdata, two codes per byte), every torchao scale mode stores E8M0 bytes
    "mxfp4_swizzled": (
        lambda x: MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, is_swizzled_scales=True),
        (200, 256),
        "mxfp4",
        True,
    ),
    "mxfp4_plain_rceil": (
        lambda x: MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.RCEIL),
        (200, 96),
        "mxfp4",
        True,
    ),
    "mxfp4_3d_swizzled": (
        lambda x: MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, is_swizzled_scales=True),
        (2, 128, 256),
        "mxfp4",
        True,
    ),
    # what inference configs attach: activation kwargs (dataclasses, enums, granularities), mm_config
    "mxfp8_act_kwargs": (
        lambda x: MXTensor.to_mx(
            x,
            torch.float8_e4m3fn,
            32,
            scaling_mode=ScaleCalculationMode.RCEIL,
            is_swizzled_scales=True,
            act_quant_kwargs=QuantizeTensorToMXKwargs(scaling_mode=ScaleCalculationMode.RCEIL, is_swizzled_scales=True),
        ),
        (128, 128),
        "mxfp8",
        True,
    ),
    "fp8_row_act_kwargs": (
        lambda x: Float8Tensor.from_hp(
            x,
            granularity=PerRow(),
            mm_config=Float8MMConfig(use_fast_accum=True),
            act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerRow()),
        ),
        (128, 64),
        "fp8_block",
        True,
    ),
    "nvfp4_act_kwargs": (
        lambda x: NVFP4Tensor.to_nvfp4(
            x,
            per_tensor_scale=_pts(x),
            act_per_tensor_scale=_pts(x * 2),
            is_swizzled_scales=True,
            act_quant_kwargs=QuantizeTensorToNVFP4Kwargs(is_swizzled_scales=True),
        ),
        (128, 64),
        "nvfp4",
        False,
    ),
}
NV_ULP = 2  # the documented bound (fp32 ulp) for NVFP4 with a global scale


def _make(name, seed=0):
    fn, shape, _, _ = CASES[name]
    return fn(_x(seed, shape))


def _zeros_like(t):
    """A fresh torchao tensor of ``t``'s class and attributes, every field zero."""
    names, attrs = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__({n: torch.zeros_like(getattr(t, n)) for n in names}, attrs, None, None)


def _fields(t) -> dict:
    """The weight's fields (NVFP4's act_per_tensor_scale, an activation calibration value that is
    no part of the weight's values, is kept in the producer record, not in the canonical tensor)."""
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names if n != "act_per_tensor_scale"}


def _canonical(t, fqn="w"):
    return adapters.adapter_for(t).to_canonical(t, fqn)


def _same_components(a, b) -> bool:
    ca, cb = a.components(), b.components()
    return ca.keys() == cb.keys() and all(bit_exact(ca[k], cb[k]) for k in ca)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in ulp between same-sign fp32 (or bf16) values."""
    it = torch.int32 if a.dtype == torch.float32 else torch.int16
    return int((a.view(it).long() - b.view(it).long()).abs().max())


def _compact_scales(t, per):
    """torchao's own view of the compact scales (its from_blocked for swizzled ones)."""
    s = t.scale
    if not t.is_swizzled_scales:
        return s
    *lead, m, k = t.shape
    return from_blocked(s, int(torch.tensor(lead).prod()) * m if lead else m, k // per).view(*lead, m, k // per)


# ------------------------------------------------------------------ canonical form and exactness
@pytest.mark.parametrize("name", list(CASES))
def test_canonical_components_and_values(name):
    t = _make(name)
    qt, producer = _canonical(t)
    assert qt.FORMAT == CASES[name][2] and tuple(qt.shape) == tuple(t.shape)
    assert producer["name"] == "torchao" and producer["class"] == type(t).__name__
    c = qt.components()
    assert bit_exact(c["data"].view(torch.uint8), t.qdata.view(torch.uint8))
    if isinstance(t, NVFP4Tensor):
        assert bit_exact(c["scale"], _compact_scales(t, 16))
        assert qt.recipe.per_tensor == "global_scale_inv"
        pts = t.per_tensor_scale
        if pts is None:  # single-level: a global scale of 1 decodes the same values
            assert bool((c["global_scale_inv"] == 1.0).all())
        else:  # torchao's per_tensor_scale bytes, kept
            assert bit_exact(c["global_scale_inv"].reshape(-1)[: pts.numel()], pts.reshape(-1))
    elif isinstance(t, MXTensor):
        assert bit_exact(c["scale"], _compact_scales(t, 32).view(torch.uint8))
    else:
        assert bit_exact(c["scale_inv"].reshape(-1)[: t.scale.numel()], t.scale.reshape(-1))
    # torchao's own dequantize, bit for bit, NVFP4 with a global scale included
    assert bit_exact(qt.dequantize(torch.float32), t.dequantize(torch.float32))
    assert bit_exact(qt.dequantize(torch.bfloat16), t.dequantize(torch.bfloat16))


def test_nvfp4_any_per_tensor_scale_is_kept_exactly():
    """Any fp32 per_tensor_scale, also one torchao's amax / 2688 never gives (mantissa gaps above
    1.524), is stored as it is and decodes as torchao decodes it."""
    x = _x(2)
    t = _nv(x, True)
    for p in (1.9000001, 3.0517578e-05, 7.1e-12):
        t.per_tensor_scale = torch.tensor(p, dtype=torch.float32)
        qt, _ = _canonical(t)
        assert bit_exact(qt.components()["global_scale_inv"], t.per_tensor_scale)
        assert bit_exact(qt.dequantize(torch.float32), t.dequantize(torch.float32))


@pytest.mark.parametrize("elem", [torch.float8_e5m2, "fp6_e2m3"], ids=["mxfp8_e5m2", "mxfp6"])
def test_other_mx_element_types_are_refused(elem):
    t = MXTensor.to_mx(_x(shape=(64, 64)), elem, 32)
    with pytest.raises(ckptq.UnsupportedFormatError, match=r"(?s)'w'.*MXTensor.*elem_dtype"):
        _canonical(t)


@pytest.mark.parametrize("name", ["nvfp4_plain", "fp8_tensor"])
def test_transposed_tensors_are_refused(name):
    t = _make(name).t()  # a column-major view (what a linear's weight.t() gives)
    with pytest.raises(ckptq.UnsupportedFormatError, match=rf"(?s)'w'.*{type(t).__name__}.*qdata.*transposed"):
        _canonical(t)


# ------------------------------------------------------------------ native save, load in place
@pytest.mark.parametrize("name", list(CASES))
def test_native_save_and_load_into_torchao_in_place(tmp_path, name):
    src = _make(name)
    dcp.save({"w": src, "b": torch.arange(4.0)}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    (row,) = [r for r in inspect_checkpoint(tmp_path)["tensors"] if r["fqn"] == "w"]
    assert (row["format"], row["mode"], row["producer"]) == (CASES[name][2], "native", f"torchao {type(src).__name__}")
    assert _same_components(CheckpointView(tmp_path).read("w"), _canonical(src)[0])
    target = _zeros_like(src)
    dcp.load({"w": target, "b": torch.empty(4)}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    want, got = _fields(src), _fields(target)
    assert want.keys() == got.keys()
    for k in want:
        assert bit_exact(got[k], want[k]), k
    assert bit_exact(target.dequantize(torch.float32), src.dequantize(torch.float32))
    act = getattr(src, "act_per_tensor_scale", None)
    if act is not None:  # recorded (float hex), left as the target holds it
        desc = CheckpointView(tmp_path).entry("w").descriptor
        assert desc.producer["act_per_tensor_scale"] == [act.item().hex()]
        assert bool((target.act_per_tensor_scale == 0).all())


def test_ckptq_nvfp4_into_torchao_targets():
    """A tensor ckptq quantized (ckptq's amax convention) written into torchao targets: the codes and
    block scales as they are, the per_tensor_scale whose decode is closest to ckptq's (its difference
    as with_per_tensor reports it, within the bound); a target without per_tensor_scale is refused."""
    x = _x(3)
    qt = ckptq.quantize(x, "nvfp4")
    target = _zeros_like(_nv(x, True))
    assert adapters.adapter_for(target).insert(target, qt, "w") is None
    converted, ulps = qt.with_per_tensor("global_scale_inv")
    assert bit_exact(target.per_tensor_scale, converted.components()["global_scale_inv"])
    assert 0 <= ulps <= NV_ULP
    assert _ulps(target.dequantize(torch.float32), qt.dequantize(torch.float32)) == ulps
    with pytest.raises(ckptq.CheckpointFormatError, match="per_tensor_scale"):
        adapters.adapter_for(target).insert(_zeros_like(_nv(x, False, pts=False)), qt, "w")


# ------------------------------------------------------------------ foreign checkpoints and files
def _state(seed=0):
    sd = {f"layers.{i}.{name}.weight": _make(name, seed + i) for i, name in enumerate(CASES)}
    sd["layers.0.bias"] = torch.randn(16)
    return sd


@pytest.fixture(scope="module")
def ao_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ao") / "ckpt"
    sd = _state()
    dcp.save(sd, checkpoint_id=str(path))  # DCP's default planner: each record a pickled torchao tensor
    return path, sd


def _run_without_torchao(code: str) -> str:
    """Run ``code`` in a fresh interpreter that never imports torchao (asserted at the end)."""
    code += "\nimport sys\nassert not any(m.split('.')[0] == 'torchao' for m in sys.modules), 'torchao imported'\n"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_dcp_checkpoint_records_are_torchao_pickles(ao_ckpt):
    path, _ = ao_ckpt
    blob = (path / "__0_0.distcp").read_bytes()
    assert b"torchao.prototype.mx_formats.nvfp4_tensor" in blob
    assert b"torchao" in [m for a in adapters.registered() for m in a.pickle_markers]


def test_inspect_and_convert_dcp_checkpoint(ao_ckpt, tmp_path):
    path, sd = ao_ckpt
    rows = {r["fqn"]: r for r in inspect_checkpoint(path)["tensors"]}
    for fqn, t in sd.items():
        if fqn.endswith("bias"):
            assert rows[fqn]["mode"] == "plain"
            continue
        name = fqn.split(".")[2]
        assert (rows[fqn]["format"], rows[fqn]["mode"]) == (CASES[name][2], "native"), fqn
        assert rows[fqn]["producer"] == f"torchao {type(t).__name__}"
    ckptq.reshard_checkpoint(path, tmp_path / "native", to="native")
    native = CheckpointView(tmp_path / "native")
    for fqn, t in sd.items():
        if fqn.endswith("bias"):
            assert bit_exact(native.read(fqn), t)
        else:
            assert _same_components(native.read(fqn), _canonical(t, fqn)[0]), fqn
            assert native.entry(fqn).descriptor.producer["class"] == type(t).__name__


def test_dcp_load_into_plain_ckptq_and_torchao_targets(ao_ckpt):
    path, sd = ao_ckpt
    weights = {k: v for k, v in sd.items() if k.endswith("weight")}
    plain = {k: torch.empty(v.shape) for k, v in weights.items()}
    ours = {k: _canonical(v, k)[0].new_empty(v.shape) for k, v in weights.items()}
    theirs = {k: _zeros_like(v) for k, v in weights.items()}
    for target in (plain, ours, theirs):
        dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=ckptq.QuantizedLoadPlanner())
    for k, v in weights.items():
        qt = _canonical(v, k)[0]
        assert bit_exact(plain[k], qt.dequantize(torch.float32)), k
        assert _same_components(ours[k], qt), k
        want, got = _fields(v), _fields(theirs[k])
        assert all(bit_exact(got[f], want[f]) for f in want), k


def test_torch_save_file_inspect_convert_and_cli(tmp_path):
    sd = _state(10)
    f = tmp_path / "model.pt"
    torch.save({"model": sd, "epoch": 3}, f)
    view = open_checkpoint(f)
    assert view.skipped == ["epoch"]
    for fqn, t in sd.items():
        key = f"model.{fqn}"
        if fqn.endswith("bias"):
            assert view.entry(key).kind == "tensor" and bit_exact(view.read(key), t)
        else:
            assert view.entry(key).kind == "quantized" and _same_components(view.read(key), _canonical(t)[0]), key
    with pytest.raises(ckptq.CheckpointFormatError):
        view.read_raw_bytes("epoch")
    from typer.testing import CliRunner

    from ckptq.cli import app

    r = CliRunner().invoke(app, ["inspect", str(f)])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("model.layers.4.mxfp8_swizzled.weight"))
    assert "mxfp8" in line and "torchao MXTensor" in line
    r = CliRunner().invoke(app, ["convert", str(f), str(tmp_path / "native"), "--to", "native"])
    assert r.exit_code == 0, r.output
    native = CheckpointView(tmp_path / "native")
    for fqn, t in sd.items():
        if not fqn.endswith("bias"):
            assert _same_components(native.read(f"model.{fqn}"), _canonical(t)[0]), fqn
    r = CliRunner().invoke(app, ["verify", str(f), str(tmp_path / "native")])  # the file's view vs its copy
    assert r.exit_code == 0 and f"{len(sd)} compared, {len(sd)} bit-exact, 0 failed" in r.stdout, r.output


def test_reading_needs_no_torchao(ao_ckpt, tmp_path):
    """inspect / convert of the DCP checkpoint and of a torch.save file in a process that never
    imports torchao: the same canonical bytes as computed here with the live tensors."""
    path, sd = ao_ckpt
    f = tmp_path / "m.pt"
    torch.save(sd, f)
    torch.save(
        {k: _canonical(v, k)[0].components() for k, v in sd.items() if k.endswith("weight")}, tmp_path / "want.pt"
    )
    producers = {k: {**_canonical(v, k)[1], "version": None} for k, v in sd.items() if k.endswith("weight")}
    (tmp_path / "producers.json").write_text(json.dumps(producers))
    out = _run_without_torchao(f"""
import torch, ckptq
from ckptq.checkpoint import CheckpointView, open_checkpoint
from ckptq.inspect import inspect_checkpoint
from ckptq.metrics import bit_exact
want = torch.load({str(tmp_path / "want.pt")!r})
ckptq.reshard_checkpoint({str(path)!r}, {str(tmp_path / "n1")!r}, to="native")
ckptq.reshard_checkpoint({str(f)!r}, {str(tmp_path / "n2")!r}, to="native")
inspect_checkpoint({str(f)!r}); inspect_checkpoint({str(path)!r})
import json
producers = json.loads(open({str(tmp_path / "producers.json")!r}).read())
for root in ({str(tmp_path / "n1")!r}, {str(tmp_path / "n2")!r}):
    v = CheckpointView(root)
    for k, comps in want.items():
        got = v.read(k).components()
        assert got.keys() == comps.keys() and all(bit_exact(got[c], comps[c]) for c in comps), (root, k)
        assert v.entry(k).descriptor.producer == producers[k], (v.entry(k).descriptor.producer, producers[k])
print("ok", len(want))
""")
    assert out.strip() == f"ok {len(CASES)}"


# ------------------------------------------------------------------ pickles
def _globals(obj) -> set[tuple[str, str]]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    return {tuple(arg.split(" ", 1)) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def test_pickle_globals_are_exactly_those_torchao_pickles_use():
    from torchao.prototype.mx_formats.inference_workflow import MXDynamicActivationMXWeightConfig, NVFP4WeightOnlyConfig
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    objs = [_make(n) for n in CASES]
    for cfg in (NVFP4WeightOnlyConfig(), MXDynamicActivationMXWeightConfig(), Float8WeightOnlyConfig()):
        m = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False)).to(torch.bfloat16)
        quantize_(m, cfg)
        objs.append(m.state_dict())
    for g, a in ((PerTensor(), PerTensor()), (PerRow(), PerRow()), (PerBlock([128, 128]), PerBlock([1, 128]))):
        objs.append(
            Float8Tensor.from_hp(
                _x(shape=(256, 256)),
                granularity=g,
                mm_config=Float8MMConfig(),
                act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=a),
            )
        )
    objs.append(
        NVFP4Tensor.to_nvfp4(
            _x(),
            per_tensor_scale=_pts(_x()),
            act_per_tensor_scale=_pts(_x()),
            act_quant_kwargs=QuantizeTensorToNVFP4Kwargs(),
        )
    )
    seen = set().union(*(_globals(o) for o in objs))
    foreign = {g for g in seen if g[0].split(".")[0] == "torchao"}
    mapped = set(ao.PICKLE_GLOBALS)
    assert foreign <= mapped, foreign - mapped
    # every mapped name occurs (the Float8Tensor file-module spelling is the class's real home)
    assert mapped - foreign == {(ao._FLOAT8_MODULE, "Float8Tensor")}
    for o in objs:  # and each reads back through ckptq's restricted unpickler
        from ckptq.io.foreign import load_record

        buf = io.BytesIO()
        torch.save(o, buf)
        load_record(buf.getvalue(), source="test")


def _evil() -> bytes:
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch pwned-by-ckptq-test  # torchao.prototype.mx_formats",))

    buf = io.BytesIO()
    torch.save({"w": _make("fp8_tensor"), "x": Evil()}, buf)
    assert b"torchao" in buf.getvalue() and b"system" in buf.getvalue()
    return buf.getvalue()


def test_malicious_pickles_are_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = _evil()
    (tmp_path / "evil.pt").write_bytes(evil)
    with pytest.raises(ckptq.UnsafeCheckpointError, match="system"):
        open_checkpoint(tmp_path / "evil.pt")
    ck = tmp_path / "ck"  # the same as a DCP record
    dcp.save({"w": _make("fp8_tensor")}, checkpoint_id=str(ck))
    md = pickle.loads((ck / ".metadata").read_bytes())
    (ck / "__0_0.distcp").write_bytes(evil)
    for info in md.storage_data.values():
        info.offset, info.length = 0, len(evil)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ckptq.UnsafeCheckpointError, match="system") as ei:
        inspect_checkpoint(ck)
    assert "torchao 0.18.0" in str(ei.value)
    assert not (tmp_path / "pwned-by-ckptq-test").exists()


# ------------------------------------------------------------------ 2 gloo ranks, DTensor locals
ROWS = 256
DIST = ("nvfp4_swizzled", "mxfp8_plain", "fp8_tensor", "fp8_block")


def _global_ref(name):
    x = _x(21, (ROWS, 256))
    if name == "nvfp4_swizzled":
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=_pts(x), is_swizzled_scales=True)
    if name == "mxfp8_plain":
        return MXTensor.to_mx(x, torch.float8_e4m3fn, 32)
    if name == "fp8_tensor":
        return Float8Tensor.from_hp(x, granularity=PerTensor())
    return Float8Tensor.from_hp(x, granularity=PerBlock([128, 128]))


def _save_dtensors(rank, ws, root_native, root_pickles):
    """Each rank quantizes its Shard(0) rows with torchao, per-tensor values from the global amax
    (NVFP4 per_tensor_scale; Float8 clamps the amax to the global one), and saves the DTensors
    natively and with DCP's default planner."""
    import warnings

    warnings.simplefilter("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ws,))
    x = _x(21, (ROWS, 256))
    amax = x.float().abs().max()
    local_x = x.chunk(ws)[rank].contiguous()
    locals_ = {
        "nvfp4_swizzled": NVFP4Tensor.to_nvfp4(
            local_x, per_tensor_scale=per_tensor_amax_to_scale(amax), is_swizzled_scales=True
        ),
        "mxfp8_plain": MXTensor.to_mx(local_x, torch.float8_e4m3fn, 32),
        "fp8_tensor": Float8Tensor.from_hp(
            local_x, granularity=PerTensor(), hp_value_lb=amax.item(), hp_value_ub=amax.item()
        ),
        "fp8_block": Float8Tensor.from_hp(local_x, granularity=PerBlock([128, 128])),
    }
    sd = {
        k: DTensor.from_local(v, mesh, (Shard(0),), run_check=False, shape=torch.Size((ROWS, 256)), stride=(256, 1))
        for k, v in locals_.items()
    }
    dcp.save(sd, checkpoint_id=root_native, planner=ckptq.QuantizedSavePlanner())
    dcp.save(sd, checkpoint_id=root_pickles)


@pytest.mark.slow
def test_two_rank_dtensor_shards_read_as_one_tensor(tmp_path):
    run_distributed(2, _save_dtensors, str(tmp_path / "native"), str(tmp_path / "pickles"))
    for root in ("native", "pickles"):
        view = CheckpointView(tmp_path / root)
        for name in DIST:
            want = _global_ref(name)
            assert view.entry(name).kind == "quantized", (root, name)
            assert _same_components(view.read(name), _canonical(want, name)[0]), (root, name)
            target = _zeros_like(want)
            dcp.load(
                {name: target},
                storage_reader=SafeFileSystemReader(tmp_path / root),
                planner=ckptq.QuantizedLoadPlanner(),
            )
            assert all(
                bit_exact(a, b) for a, b in zip(_fields(target).values(), _fields(want).values(), strict=False)
            ), name


def test_torch_save_source_reads_any_adapter(tmp_path):
    """The torch.save source is producer-agnostic: TransformerEngine tensors (the stand-in) too."""
    from _te import standin

    te = standin()
    x = _x(4, (160, 96))
    sd = {"a": te.make_te_tensor(x, "mxfp8"), "b": te.make_te_tensor(x, "nvfp4", two_d=True)}
    torch.save(sd, tmp_path / "te.pt")
    view = open_checkpoint(tmp_path / "te.pt")
    for k, t in sd.items():
        assert view.entry(k).descriptor.producer["name"] == "transformer_engine"
        assert _same_components(view.read(k), _canonical(t, k)[0]), k


# ------------------------------------------------------------------ torchao's safetensors form
def _ao_unflatten(folder):
    """torchao 0.18's own reader of its safetensors form: every file through
    ``unflatten_tensor_state_dict``; returns its tensors by name."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata()
        got, leftover = unflatten_tensor_state_dict(load_file(str(f)), meta)
        assert leftover == {}, sorted(leftover)
        out.update(got)
    return out


def _ao_folder(tmp_path, sd):
    """A folder written by torchao 0.18's own flatten_tensor_state_dict (+ safetensors save_file)."""
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    data, meta = flatten_tensor_state_dict(sd)
    folder = tmp_path / "ao-st"
    folder.mkdir()
    save_file(data, str(folder / "model.safetensors"), metadata=meta)
    return folder


def test_torchao_safetensors_read_inspect_convert(tmp_path):
    """A folder torchao's flatten wrote: every quantized tensor read as the same canonical tensor as
    the live object (bytes, recipe), inspect lists them with their producer, convert --to native
    keeps them; torchao's own unflatten reads ckptq's export of it back to the same values."""
    sd = _state()
    folder = _ao_folder(tmp_path, sd)
    view = open_checkpoint(folder)
    assert view.source == "safetensors (torchao)"
    rows = {r["fqn"]: r for r in inspect_checkpoint(folder)["tensors"]}
    for fqn, t in sd.items():
        got = view.read(fqn)
        if fqn.endswith("bias"):
            assert rows[fqn]["mode"] == "plain" and bit_exact(got, t)
            continue
        want, _ = _canonical(t, fqn)
        assert _same_components(got, want) and got.recipe == want.recipe, fqn
        assert (rows[fqn]["format"], rows[fqn]["producer"]) == (want.FORMAT, f"torchao {type(t).__name__}")
    ckptq.reshard_checkpoint(folder, tmp_path / "native", to="native")
    native = CheckpointView(tmp_path / "native")
    for fqn, t in sd.items():
        if not fqn.endswith("bias"):
            assert _same_components(native.read(fqn), _canonical(t, fqn)[0]), fqn
    # ckptq export --layout torchao of that folder, read by torchao's own unflatten
    from typer.testing import CliRunner

    from ckptq.cli import app

    out = tmp_path / "back"
    r = CliRunner().invoke(app, ["export", str(folder), str(out), "--layout", "torchao"])
    assert r.exit_code == 0, r.output
    theirs = _ao_unflatten(out)
    assert set(theirs) == set(sd)
    for fqn, t in sd.items():
        if fqn.endswith("bias"):
            assert bit_exact(theirs[fqn], t)
            continue
        assert type(theirs[fqn]) is type(t) and theirs[fqn].dtype == t.dtype, fqn
        assert _same_components(_canonical(theirs[fqn], fqn)[0], _canonical(t, fqn)[0]), fqn
        for dt in (torch.float32, torch.bfloat16):
            assert bit_exact(theirs[fqn].dequantize(dt), t.dequantize(dt)), fqn
        if not getattr(t, "is_swizzled_scales", False):  # compact scales: the same bytes as torchao wrote
            for f in ("qdata", "scale", "per_tensor_scale"):
                if getattr(t, f, None) is not None:
                    assert bit_exact(getattr(theirs[fqn], f), getattr(t, f)), (fqn, f)


def test_export_ckptq_tensors_as_torchao_safetensors(tmp_path):
    """ckptq's own tensors (NVFP4 in ckptq's amax convention, 1x16 and 16x16; MXFP8; FP8 per-tensor,
    per-row, 128x128 blocks) exported with --layout torchao: torchao's unflatten gives NVFP4Tensor /
    MXTensor / Float8Tensor whose qdata and scale bytes are ckptq's, and whose dequantize equals
    ckptq's (NVFP4: within the ulps export reports for the global scale's change of convention);
    ckptq reads the folder back to the same canonical tensors (NVFP4 as global_scale_inv)."""
    from ckptq.export import export_checkpoint

    g = torch.Generator().manual_seed(9)
    sd = {
        "a.weight": ckptq.quantize(torch.randn(64, 128, generator=g), "nvfp4"),
        "b.weight": ckptq.quantize(torch.randn(2, 32, 64, generator=g) * 7, "nvfp4", two_d=True),
        "c.weight": ckptq.quantize(torch.randn(64, 96, generator=g), "mxfp8"),
        "d.weight": ckptq.quantize(torch.randn(48, 64, generator=g).bfloat16(), "fp8_tensor"),
        "e.weight": ckptq.quantize(torch.randn(32, 64, generator=g), "fp8_block", block=(1, 64)),
        "f.weight": ckptq.quantize(torch.randn(256, 128, generator=g), "fp8_block"),
        "norm.weight": torch.randn(64, generator=g),
    }
    src = tmp_path / "src"
    dcp.save(sd, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
    res = export_checkpoint(src, tmp_path / "ao", layout="torchao")
    assert set(res["numerics"]) <= {"a.weight", "b.weight"} and all(0 <= u <= NV_ULP for u in res["numerics"].values())
    theirs = _ao_unflatten(tmp_path / "ao")
    kinds = {"nvfp4": NVFP4Tensor, "mxfp8": MXTensor, "fp8_tensor": Float8Tensor, "fp8_block": Float8Tensor}
    back = open_checkpoint(tmp_path / "ao")
    for fqn, qt in sd.items():
        if not isinstance(qt, ckptq.QuantizedTensor):
            assert bit_exact(theirs[fqn], qt)
            continue
        t = theirs[fqn]
        assert type(t) is kinds[qt.FORMAT] and t.dtype == qt.dtype, fqn
        c = qt.components()
        assert bit_exact(t.qdata.view(torch.uint8), c["data"].view(torch.uint8)), fqn
        if qt.FORMAT == "nvfp4":
            conv, u = qt.with_per_tensor("global_scale_inv")
            want_scale = c["scale"].repeat_interleave(16, -2)[..., : qt.shape[-2], :] if qt.recipe.two_d else c["scale"]
            assert bit_exact(t.scale, want_scale)
            assert bit_exact(
                t.per_tensor_scale.reshape(-1),
                conv.components()["global_scale_inv"].reshape(-1)[: t.per_tensor_scale.numel()],
            )
            assert bit_exact(t.dequantize(torch.float32), conv.dequantize(torch.float32))
            assert _ulps(t.dequantize(torch.float32), qt.dequantize(torch.float32)) <= res["numerics"].get(fqn, 0)
            got = back.read(fqn)
            assert got.recipe.per_tensor == "global_scale_inv" and bit_exact(got.dequantize(), conv.dequantize())
        else:
            if qt.FORMAT == "mxfp8":
                assert bit_exact(t.scale.view(torch.uint8), c["scale"])
            else:
                assert bit_exact(t.scale.reshape(-1), c["scale_inv"].reshape(-1))
            assert bit_exact(t.dequantize(torch.float32), qt.dequantize(torch.float32)), fqn
            assert _same_components(back.read(fqn), qt), fqn


def test_torchao_safetensors_refusals(tmp_path):
    """A torchao class ckptq does not hold is refused naming the tensor; another tool's
    'tensor_names' metadata is not torchao's and the folder reads as plain tensors; an fp8_block
    whose block does not divide the shape cannot be a torchao Float8Tensor (nothing written)."""
    from safetensors.torch import save_file

    from ckptq.export import export_checkpoint

    int8 = tmp_path / "int8"
    int8.mkdir()
    record = {"_type": "Int8Tensor", "_data": {}, "_tensor_data_names": ["qdata", "scale"]}
    meta = {"l.weight": json.dumps(record), "tensor_names": json.dumps(["l.weight"])}
    save_file(
        {"l._weight_qdata": torch.zeros(4, 4, dtype=torch.int8), "l._weight_scale": torch.ones(4)},
        str(int8 / "model.safetensors"),
        metadata=meta,
    )
    with pytest.raises(ckptq.UnsupportedFormatError, match=r"'l\.weight' is a torchao Int8Tensor"):
        open_checkpoint(int8)
    other = tmp_path / "other"
    other.mkdir()
    save_file({"w": torch.ones(2, 2)}, str(other / "model.safetensors"), metadata={"tensor_names": "w,b"})
    assert open_checkpoint(other).entry("w").kind == "tensor"
    src = tmp_path / "ragged"
    w = ckptq.quantize(torch.randn(200, 256), "fp8_block")  # 200 rows: a ragged 128-row block
    dcp.save({"w": w}, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
    with pytest.raises(ckptq.UnsupportedFormatError, match=r"'w' \(fp8_block\).*must divide the shape"):
        export_checkpoint(src, tmp_path / "out", layout="torchao")
    assert not (tmp_path / "out").exists()


def test_dcp_load_of_ckptq_nvfp4_into_torchao_target_keeps_codes(tmp_path):
    """A checkpoint of ckptq's own NVFP4 (amax convention) loaded by QuantizedLoadPlanner into a live
    torchao NVFP4Tensor (torchao's convention): the codes and block scales are ckptq's bytes and the
    per_tensor_scale is the closest one (with_per_tensor), not a requantization (whose
    per_tensor_scale would be amax / 2688: for this tensor not the closest, so the check can fail)."""
    x = _x(4) * 1.140625
    qt = ckptq.quantize(x, "nvfp4")
    assert not bit_exact(
        qt.with_per_tensor("global_scale_inv")[0].components()["global_scale_inv"], qt.components()["amax"] / 2688.0
    )
    dcp.save({"w": qt}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    target = _zeros_like(_nv(x, True))
    dcp.load({"w": target}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    conv, ulps = qt.with_per_tensor("global_scale_inv")
    assert bit_exact(target.qdata, qt.components()["data"])
    assert bit_exact(_compact_scales(target, 16), qt.components()["scale"])
    assert bit_exact(target.per_tensor_scale, conv.components()["global_scale_inv"])
    assert _ulps(target.dequantize(torch.float32), qt.dequantize(torch.float32)) <= ulps <= NV_ULP

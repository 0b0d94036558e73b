"""Write the golden checkpoints of ``tests/golden/`` (ckptq's compatibility promise).

Every checkpoint written here by today's ckptq must be read bit-exact by every later version
(``tests/test_golden.py``): through ``dcp.load`` with ``QuantizedLoadPlanner``, through
``ckptq.checkpoint.open_checkpoint`` / ``CheckpointView`` and through ``ckptq verify``. Do not
regenerate them to make a failing test pass: a change of what an old checkpoint reads as is a
break of the promise (docs/design.md, "Compatibility"). Add a new golden checkpoint (a new folder
name) for a new format, recipe, layout or descriptor version instead.

Checkpoints (tiny tensors: 32x32, 64x32, 16x128 or 32x128; all from fixed seeds):

* ``native-atomic``, ``native-dcp``: every format x recipe of :data:`CASES` saved natively by
  ``QuantizedSavePlanner``, with ckptq's ``AtomicFileSystemWriter`` (checksums) and DCP's own
  ``FileSystemWriter`` (none); plus a plain float32 tensor and a non-tensor (bytes) entry.
* ``high_precision-atomic``, ``high_precision-dcp``: the same in ``mode="high_precision"`` (bf16).
* ``native-2rank``: 2 gloo ranks, each tensor a ``DTensor`` ``Shard(0)`` of a quantized tensor.
* ``te-standin``: TransformerEngine tensors (the test stand-in ``tests/te_standin``) saved natively.
* ``hf-compressed-tensors``: a Hugging Face compressed-tensors folder written by ``ckptq export``.
* ``torchao-dcp``, ``torchao-pickle``: torchao 0.18 tensors (NVFP4Tensor, MXTensor MXFP8/MXFP4,
  Float8Tensor) saved natively by ``dcp.save`` + ``QuantizedSavePlanner``, and as a ``torch.save``
  file (``model.pt``); expected: their canonical ckptq forms (the torchao adapter's ``to_canonical``).

``tests/golden/manifest.json`` records, per checkpoint, the sha256 of every file and, per entry,
the format, recipe, mode, logical shape/dtype and the sha256 of each component's bytes (elements
row-major, little-endian, as stored), computed from the tensors that were saved (not read back),
except for the HF export, whose expected components are those ckptq read from it when generated
(its conversion to the layout's conventions is the exporter's, not a reader's, business).

Run: ``python scripts/make_golden.py [--out tests/golden]`` (CPU only, a few seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

#: (entry name, format, recipe options); one entry per format x recipe x producer convention.
CASES = [
    ("fp8_tensor_e4m3", "fp8_tensor", {}),
    ("fp8_tensor_e5m2", "fp8_tensor", {"fp8_dtype": torch.float8_e5m2}),
    ("fp8_block_128x128", "fp8_block", {}),
    ("fp8_block_1x128_col", "fp8_block", {"block": (1, 128), "columnwise": True}),
    ("mxfp8", "mxfp8", {}),
    ("mxfp8_col", "mxfp8", {"columnwise": True}),
    ("nvfp4_1x16", "nvfp4", {}),
    ("nvfp4_16x16", "nvfp4", {"two_d": True}),
    ("nvfp4_gsi", "nvfp4", {"per_tensor": "global_scale_inv"}),
    ("nvfp4_gs", "nvfp4", {"per_tensor": "global_scale"}),
    ("mxfp4_floor", "mxfp4", {}),
    ("mxfp4_rceil", "mxfp4", {"scale_rule": "rceil"}),
]
#: the 2-rank checkpoint: Shard(0) over 2 ranks needs block-aligned row cuts (32 rows each)
CASES_2RANK = [
    ("fp8_tensor_e4m3", "fp8_tensor", {}),
    ("fp8_block_1x128", "fp8_block", {"block": (1, 128)}),
    ("mxfp8_col", "mxfp8", {"columnwise": True}),
    ("nvfp4_1x16", "nvfp4", {}),
    ("mxfp4_floor", "mxfp4", {}),
]
#: TE stand-in tensors: (entry name, TE kind, factory options)
TE_CASES = [
    ("te_fp8_e4m3", "float8", {"fp8_dtype": "E4M3"}),
    ("te_mxfp8", "mxfp8", {}),
    ("te_nvfp4_1x16", "nvfp4", {}),
    ("te_fp8_block_1x128", "float8_blockwise", {"block_scaling_dim": 1}),
]


def values(i: int, shape) -> torch.Tensor:
    """Fixed-seed test values: N(0, 1) scaled by ``1 + i``, float32 (rounded to bf16)."""
    g = torch.Generator().manual_seed(2300 + i)
    return (torch.randn(shape, generator=g) * (1 + i)).to(torch.bfloat16).float()


def shape_of(fmt: str, recipe: dict, two_rank: bool = False) -> tuple[int, int]:
    if recipe.get("block") == (1, 128):
        return (32, 128) if two_rank else (16, 128)
    return (64, 32) if two_rank else (32, 32)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements row-major as the little-endian bytes of its dtype."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def describe(obj) -> dict:
    """The manifest record of a saved value: a QuantizedTensor's format, recipe, logical shape and
    dtype and its components' dtype/shape/sha256; a plain tensor's dtype/shape/sha256."""
    from ckptq.formats.base import QuantizedTensor, dtype_to_str

    def plain(t):
        return {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "sha256": sha256(t)}

    if isinstance(obj, QuantizedTensor):
        return {
            "format": obj.FORMAT,
            "recipe": type(obj)._recipe_to_json(obj.recipe, every_option=True),
            "shape": list(obj.shape),
            "dtype": dtype_to_str(obj.dtype),
            "components": {k: plain(v) for k, v in obj.components().items()},
        }
    return plain(obj)


def quantized(cases, two_rank=False) -> dict:
    import ckptq

    return {n: ckptq.quantize(values(i, shape_of(f, r, two_rank)), f, **r) for i, (n, f, r) in enumerate(cases)}


def extras() -> dict:
    return {"bias": values(99, (32,)), "step": {"epoch": 3, "lr": 0.5}}


def save(sd: dict, path: Path, mode: str, writer: str) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.io import AtomicFileSystemWriter

    w = AtomicFileSystemWriter(path) if writer == "atomic" else dcp.FileSystemWriter(str(path))
    dcp.save(sd, storage_writer=w, planner=ckptq.QuantizedSavePlanner(mode=mode))


def entries_of(sd: dict, mode: str) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            rec = describe(v)
            if mode == "high_precision" and "format" in rec:  # stored: the bf16 dequantization
                rec = {**rec, "mode": mode, "values": describe(v.dequantize(torch.bfloat16))}
                del rec["components"]
            elif "format" in rec:
                rec["mode"] = "native"
            out[k] = rec
        else:
            out[k] = {"object": repr(v)}
    return out


def _two_rank_worker(rank: int, ws: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptq
    from ckptq.formats.base import slice_box

    mesh = init_device_mesh("cpu", (ws,))
    sd = {}
    for name, qt in quantized(CASES_2RANK, two_rank=True).items():
        rows = qt.shape[0] // ws
        local = slice_box(qt, ((rank * rows, 0), (rows, qt.shape[1])))
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=qt.shape, stride=(qt.shape[1], 1))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), planner=ckptq.QuantizedSavePlanner())


def te_state_dict() -> tuple[dict, dict]:
    """TE stand-in tensors, and their canonical ckptq forms (what a reader must give back)."""
    from _te import standin

    from ckptq import adapters

    te = standin()
    sd, canon = {}, {}
    for i, (name, kind, opts) in enumerate(TE_CASES):
        x = values(50 + i, (32, 128)).to(torch.bfloat16)
        sd[name] = te.make_te_tensor(x, kind, **opts)
        canon[name] = adapters.adapter_for(sd[name]).to_canonical(sd[name], name)[0]
    return sd, canon


def torchao_state_dict() -> tuple[dict, dict]:
    """torchao 0.18 tensors, and their canonical ckptq forms."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerTensor

    from ckptq import adapters

    x = [values(80 + i, (32, 64)).to(torch.bfloat16) for i in range(4)]
    sd = {
        "ao_nvfp4": NVFP4Tensor.to_nvfp4(x[0], per_tensor_scale=per_tensor_amax_to_scale(x[0].float().abs().max())),
        "ao_mxfp8": MXTensor.to_mx(x[1], torch.float8_e4m3fn, 32),
        "ao_mxfp4_rceil": MXTensor.to_mx(x[2], torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.RCEIL),
        "ao_fp8_tensor": Float8Tensor.from_hp(x[3], granularity=PerTensor()),
    }
    canon = {k: adapters.adapter_for(v).to_canonical(v, k)[0] for k, v in sd.items()}
    return sd, canon


def hf_export(root: Path) -> dict:
    """A compressed-tensors folder exported from a small native checkpoint; expected entries as read."""
    import ckptq
    from ckptq.checkpoint import open_checkpoint
    from ckptq.export import export_checkpoint

    sd = {
        "model.layers.0.mlp.down_proj.weight": ckptq.quantize(values(70, (32, 32)), "nvfp4"),
        "model.layers.0.mlp.up_proj.weight": ckptq.quantize(values(71, (32, 32)), "fp8_tensor"),
        "model.norm.weight": values(72, (32,)),
    }
    with tempfile.TemporaryDirectory() as d:
        save(sd, Path(d) / "src", "native", "atomic")
        export_checkpoint(Path(d) / "src", root, layout="compressed-tensors", config=False, on_inexact="keep")
    src = open_checkpoint(root)
    out = {}
    for e in src.entries():
        fqn = e.fqn
        out[fqn] = describe(src.read(fqn))
        if "format" in out[fqn]:
            out[fqn]["mode"] = "native"
    return out


def file_hashes(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    from _dist import run_distributed

    import ckptq

    manifest = {
        "generated_by": "scripts/make_golden.py",
        "ckptq_version": ckptq.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "checkpoints": {},
    }
    for mode in ("native", "high_precision"):
        for writer in ("atomic", "dcp"):
            name = f"{mode}-{writer}"
            sd = {**quantized(CASES), **extras()}
            save(sd, out / name, mode, writer)
            manifest["checkpoints"][name] = {"kind": "dcp", "mode": mode, "writer": writer, "ranks": 1}
            manifest["checkpoints"][name]["entries"] = entries_of(sd, mode)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(2, _two_rank_worker, str(out / "native-2rank"))
    manifest["checkpoints"]["native-2rank"] = {
        "kind": "dcp",
        "mode": "native",
        "writer": "dcp",
        "ranks": 2,
        "entries": entries_of(quantized(CASES_2RANK, two_rank=True), "native"),
    }

    te_sd, canon = te_state_dict()
    save(te_sd, out / "te-standin", "native", "atomic")
    manifest["checkpoints"]["te-standin"] = {
        "kind": "dcp",
        "mode": "native",
        "writer": "atomic",
        "ranks": 1,
        "producer": "transformer_engine (stand-in)",
        "entries": entries_of(canon, "native"),
    }

    ao_sd, ao_canon = torchao_state_dict()
    save(ao_sd, out / "torchao-dcp", "native", "atomic")
    (out / "torchao-pickle").mkdir()
    torch.save(ao_sd, out / "torchao-pickle" / "model.pt")
    for name, kind, writer in (("torchao-dcp", "dcp", "atomic"), ("torchao-pickle", "file", "torch.save")):
        manifest["checkpoints"][name] = {
            "kind": kind,
            "mode": "native",
            "writer": writer,
            "producer": "torchao 0.18",
            "entries": entries_of(ao_canon, "native"),
        }
    manifest["checkpoints"]["torchao-pickle"]["file"] = "model.pt"

    manifest["checkpoints"]["hf-compressed-tensors"] = {
        "kind": "hf",
        "layout": "compressed-tensors",
        "entries": hf_export(out / "hf-compressed-tensors"),
    }
    for name, rec in manifest["checkpoints"].items():
        rec["files"] = file_hashes(out / name)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(manifest['checkpoints'])} golden checkpoints to {out} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()

"""The compatibility promise: the golden checkpoints of ``tests/golden`` (written by
``scripts/make_golden.py``) read bit-exact through every reader path -- ``dcp.load`` with
``QuantizedLoadPlanner``, ``open_checkpoint`` / ``CheckpointView`` and ``ckptq verify`` -- in this
and every later version of ckptq. Never regenerate them to get this green (docs/design.md,
"Compatibility")."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

import ckptq
from ckptq.checkpoint import open_checkpoint
from ckptq.cli import app
from ckptq.formats import format_class
from ckptq.formats.base import QuantizedTensor, dtype_to_str, str_to_dtype

GOLDEN = Path(__file__).parent / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
CKPTS = MANIFEST["checkpoints"]
DCP = [n for n, c in CKPTS.items() if c["kind"] == "dcp"]


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _check_plain(t: torch.Tensor, rec: dict, what: str) -> None:
    assert isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor), what
    assert (dtype_to_str(t.dtype), list(t.shape)) == (rec["dtype"], rec["shape"]), what
    assert hashlib.sha256(_bytes(t)).hexdigest() == rec["sha256"], f"{what}: bytes differ from the golden ones"


def _check_quantized(q, rec: dict, what: str) -> None:
    assert isinstance(q, QuantizedTensor) and q.FORMAT == rec["format"], what
    assert type(q)._recipe_to_json(q.recipe, every_option=True) == rec["recipe"], what
    assert (list(q.shape), dtype_to_str(q.dtype)) == (rec["shape"], rec["dtype"]), what
    comps = q.components()
    assert sorted(comps) == sorted(rec["components"]), what
    for name, c in rec["components"].items():
        _check_plain(comps[name], c, f"{what} component '{name}'")


def _path(name: str) -> Path:
    return GOLDEN / name / CKPTS[name].get("file", "")


def _target(rec: dict):
    """An empty load target of the entry's saved type (zeros: every byte must come from the file)."""
    if "format" not in rec:
        return torch.zeros(rec["shape"], dtype=str_to_dtype(rec["dtype"]))
    if rec["mode"] == "high_precision":
        return _target(rec["values"])
    cls = format_class(rec["format"])
    comps = {k: _target(c) for k, c in rec["components"].items()}
    return cls.from_components(comps, rec["shape"], str_to_dtype(rec["dtype"]), cls._recipe_from_json(rec["recipe"]))


@pytest.mark.parametrize("name", sorted(CKPTS))
def test_golden_files_unchanged(name):
    folder = GOLDEN / name
    found = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert found == set(CKPTS[name]["files"]), f"{name}: files added or removed"
    for rel, digest in CKPTS[name]["files"].items():
        assert hashlib.sha256((folder / rel).read_bytes()).hexdigest() == digest, f"{name}/{rel} changed"


@pytest.mark.parametrize("name", sorted(CKPTS))
def test_golden_reads_through_open_checkpoint(name):
    src = open_checkpoint(_path(name))
    tensors = {k: r for k, r in CKPTS[name]["entries"].items() if "object" not in r}
    assert {e.fqn for e in src.entries() if e.kind != "bytes"} == set(tensors)
    for fqn, rec in tensors.items():
        what = f"{name}: '{fqn}'"
        e = src.entry(fqn)
        if "format" in rec:
            d, cls = e.descriptor, format_class(rec["format"])
            assert (d.format, d.mode, list(d.shape)) == (rec["format"], rec["mode"], rec["shape"]), what
            assert cls._recipe_to_json(cls._recipe_from_json(d.recipe), every_option=True) == rec["recipe"], what
        got = src.read(fqn)
        if "format" not in rec:
            _check_plain(got, rec, what)
        elif rec["mode"] == "high_precision":
            _check_plain(got, rec["values"], what)
        else:
            _check_quantized(got, rec, what)


@pytest.mark.parametrize("name", DCP)
def test_golden_reads_through_dcp_load(name):
    entries = CKPTS[name]["entries"]
    sd = {k: _target(r) for k, r in entries.items() if "object" not in r}
    if "step" in entries:
        sd["step"] = {"epoch": 0, "lr": 0.0}
    dcp.load(sd, checkpoint_id=str(GOLDEN / name), planner=ckptq.QuantizedLoadPlanner())
    for fqn, rec in entries.items():
        what = f"{name}: '{fqn}' (dcp.load)"
        if "object" in rec:
            assert repr(sd[fqn]) == rec["object"], what
        elif "format" not in rec:
            _check_plain(sd[fqn], rec, what)
        elif rec["mode"] == "high_precision":
            _check_plain(sd[fqn], rec["values"], what)
        else:
            _check_quantized(sd[fqn], rec, what)


@pytest.mark.parametrize("name", sorted(CKPTS))
def test_golden_passes_ckptq_verify(name):
    res = CliRunner().invoke(app, ["verify", str(_path(name)), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)["summary"]
    # DCP's own writer records no checksums (records checked for structure); ckptq's writers and export
    # do, and a torch.save file's records are checked against its zip CRC-32s
    checked = "unverified" if CKPTS[name].get("writer") == "dcp" else "verified"
    assert summary["failed"] == 0 and summary["records"] == summary[checked] > 0, summary


@pytest.mark.parametrize(("a", "b"), [("native-atomic", "native-dcp"), ("high_precision-atomic", "high_precision-dcp")])
def test_golden_writers_agree_through_ckptq_verify(a, b):
    res = CliRunner().invoke(app, ["verify", str(GOLDEN / a), str(GOLDEN / b), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["tensors"]
    assert {r["fqn"] for r in rows} >= {k for k, r in CKPTS[a]["entries"].items() if "object" not in r}
    assert all(r["bit_exact"] for r in rows), rows


def test_golden_covers_every_format_in_both_modes():
    # a new format needs its golden checkpoints (scripts/make_golden.py CASES; new folders, old ones kept)
    from ckptq.formats import FORMATS

    for mode in ("native", "high_precision"):
        seen = {r["format"] for c in CKPTS.values() for r in c["entries"].values() if r.get("mode") == mode}
        assert seen == set(FORMATS), (mode, seen)

"""Malformed checkpoints are ckptq errors on every reader path.

* a bounded deterministic run of ``scripts/fuzz_checkpoints.py`` (every format, 1 and 2 ranks, native
  and high precision, a TE-shaped checkpoint): no uncaught error, hang, code execution, large
  allocation or silent wrong result, and every structural mutant is a ckptq error;
* one explicit test per malformation of the issue: truncated and missing files, storage offsets and
  lengths, chunk geometry (negative, absurd, outside the entry, overlapping, missing), dtypes that
  disagree with the records, malformed descriptors, unknown format or version, corrupt records; a
  metadata claiming a 2^40-element tensor is refused without allocating it;
* ``dcp.load`` wraps these in ``CheckpointException``: :func:`ckptq.io.dcp_failure` gets them back.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import ckptq
from ckptq.checkpoint import CheckpointView
from ckptq.contract import with_digest
from ckptq.errors import CheckpointFormatError, CkptqError, UnsafeCheckpointError
from ckptq.inspect import inspect_checkpoint
from ckptq.io import SafeFileSystemReader, check_storage, dcp_failure, read_metadata
from ckptq.verify import verify_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


# ------------------------------------------------------------------------ the fuzz harness, bounded
@pytest.fixture(scope="module")
def fuzz_run():
    sys.path.insert(0, str(SCRIPTS))  # the spawned workers import the script by name too
    try:
        import fuzz_checkpoints

        # every base but the two saved by dcp.save on 2 gloo ranks (a process group costs CI time;
        # the full run of the script covers them)
        return fuzz_checkpoints.fuzz(70, seed=20261123, workers=2, timeout=60, bases_filter=CI_BASES)
    finally:
        sys.path.remove(str(SCRIPTS))


CI_BASES = ["native1", "native2", "hp1", "hp2", "dcp_native1", "dcp_hp1", "te1"]


def test_fuzz_subset_finds_nothing_bad(fuzz_run):
    counts = fuzz_run["counts"]
    assert len(fuzz_run["cases"]) == 70
    assert {c["base"] for c in fuzz_run["cases"]} == set(CI_BASES)
    assert not fuzz_run["canary"]
    bad = [
        c for c in fuzz_run["cases"] if c["class"] in ("CODE_EXECUTED", "HANG", "BIG_ALLOC", "UNCAUGHT", "SILENT_WRONG")
    ]
    assert not bad, bad
    assert counts["CKPTQ_ERROR"] >= 30  # most mutants are malformed, and said so


def test_fuzz_subset_changed_values_of_checksummed_checkpoints_are_detected(fuzz_run):
    import fuzz_checkpoints as fc

    data = [c for c in fuzz_run["cases"] if c["kind"] == "data" and c["base"] in fc.PLANNED]
    assert len(data) >= 3
    assert all(c["class"] in ("CKPTQ_ERROR", "SAME") for c in data), data
    assert any(c["class"] == "CKPTQ_ERROR" and "ChecksumMismatchError" in str(c["errors"]) for c in data)


def test_fuzz_subset_dcp_writer_bases_read_right_or_fail(fuzz_run):
    """Checkpoints saved by DCP's own FileSystemWriter + QuantizedSavePlanner (checksums in the
    planner's per-rank files): every mutant reads the saved values or is a ckptq error."""
    dcp_cases = [c for c in fuzz_run["cases"] if c["base"] in ("dcp_native1", "dcp_hp1")]
    assert len(dcp_cases) == 20
    assert all(c["class"] in ("CKPTQ_ERROR", "SAME", "RECORD_REMOVED") for c in dcp_cases), dcp_cases
    assert sum(c["class"] == "CKPTQ_ERROR" for c in dcp_cases) >= 15


def test_fuzz_subset_structural_mutants_are_ckptq_errors(fuzz_run):
    structural = [c for c in fuzz_run["cases"] if c["kind"] in ("structure", "evil")]
    assert len(structural) >= 25
    wrong = [c for c in structural if c["class"] != "CKPTQ_ERROR"]
    assert not wrong, wrong
    for c in structural:  # every reader path refused it or (only read_metadata) had nothing to read
        assert set(c["paths"].values()) <= {"ckptq", "ok"}
        assert "ckptq" in c["paths"].values()


def test_fuzz_sigterm_writes_a_partial_summary(tmp_path):
    """A running fuzz flushes a partial summary while it runs (what a SIGKILL would leave) and, on
    SIGTERM, stops its workers and writes the summary of the cases done, marked partial."""
    import json
    import signal
    import subprocess

    out, md = tmp_path / "fuzz.json", tmp_path / "fuzz.md"
    cmd = [sys.executable, str(SCRIPTS / "fuzz_checkpoints.py"), "--bases", "native1", "--n", "100000"]
    cmd += ["--jobs", "1", "--seed", "5", "--json", str(out), "--md", str(md), "--flush-every", "0.3"]
    log_file = (tmp_path / "fuzz.log").open("w")  # a file, not a pipe nobody reads while it runs
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        flushed = None
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                flushed = json.loads(out.read_text())["summary"]
                if flushed["mutants"] >= 2:
                    break
            time.sleep(0.2)
        assert flushed is not None and flushed["mutants"] >= 2, proc.poll()
        assert flushed["partial"] and flushed["stopped_by"] == "running"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        log_file.close()
    log = (tmp_path / "fuzz.log").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, log
    assert time.monotonic() - sent < 20, log
    got = json.loads(out.read_text())["summary"]
    assert got["partial"] and got["stopped_by"] == "SIGTERM", got
    assert got["mutants"] >= flushed["mutants"] and got["requested"] == 100000
    assert sum(got["counts"].values()) == got["mutants"] and got["bad"] == 0
    assert "**Partial**: written on SIGTERM" in md.read_text()


def test_fuzz_budget_is_a_hard_bound():
    """No mutant starts after the budget (counted from the call, corpus build included); the run
    then ends within --timeout plus the time to stop the workers."""
    fc = _fuzz_module()
    budget, timeout = 12.0, 3.0
    sys.path.insert(0, str(SCRIPTS))  # the spawned workers import the script by name too
    try:
        t = time.monotonic()
        got = fc.fuzz(10**6, seed=2, workers=1, timeout=timeout, budget=budget, bases_filter=["native1"])
        took = time.monotonic() - t
    finally:
        sys.path.remove(str(SCRIPTS))
    assert got["stopped_by"] == "budget" and not got["partial"], {k: v for k, v in got.items() if k != "cases"}
    assert len(got["cases"]) < 10**6 and not got["unfinished"]
    assert took < budget + timeout + 5, took


def test_fuzz_worker_ties_stray_messages_to_the_case():
    """What CPython prints outside any result (PyErr_Print -> sys.excepthook, e.g. the deallocator's
    'deallocated bytearray object has exported buffers'; unraisable exceptions) is collected, with
    the code that was running, so the fuzz reports it against the mutant."""
    fc = _fuzz_module()

    class RaisesInDel:
        def __del__(self):
            raise ValueError("from __del__")

    before = sys.excepthook, sys.unraisablehook
    with fc.StrayMessages() as stray:
        RaisesInDel()
        sys.excepthook(SystemError, SystemError("deallocated bytearray object has exported buffers"), None)
    assert (sys.excepthook, sys.unraisablehook) == before
    got = stray.take()
    assert len(got) == 2 and not stray.take()
    assert got[0].startswith("ValueError: from __del__") and "test_fuzz_worker_ties_stray" in got[0]
    assert got[1].startswith("SystemError: deallocated bytearray object has exported buffers")


# ------------------------------------------------------------------------ explicit malformations
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzbase") / "ck"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g)
    sd = {
        "w": ckptq.quantize(x, "mxfp8"),
        "n": ckptq.quantize(x, "nvfp4"),
        "m4": ckptq.quantize(x, "mxfp4"),
        "b": torch.randn(64, generator=g),
        "step": 3,
    }
    dcp.save(sd, checkpoint_id=str(root), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    return root


@pytest.fixture()
def ck(tmp_path, base):
    d = tmp_path / "ck"
    shutil.copytree(base, d)
    return d


def _edit(path: Path, fn, *, reseal: bool = True) -> None:
    """Apply ``fn`` to ``.metadata``. ``reseal``: store the digest of the edited metadata (as a
    deliberate editor could), so the checks behind the digest are what the test reaches; the
    digest itself is tested in tests/test_planner_checksums.py."""
    md = pickle.loads((path / ".metadata").read_bytes())
    fn(md)
    if reseal:
        try:
            with_digest(md)
        except Exception:  # values no digest can be made of: the structural checks refuse them first
            pass
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _load(path: Path, sd: dict) -> None:
    try:
        dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        raise dcp_failure(e, str(path)) from None


def _targets() -> dict:
    q = ckptq.quantize(torch.zeros(64, 64), "mxfp8")
    return {"w": q.new_empty(q.shape), "b": torch.zeros(64)}


def _all_paths_fail(path: Path, match: str, *, exc=CheckpointFormatError, metadata_only=True, targets=None) -> None:
    """read_metadata, CheckpointView, inspect, verify and dcp.load all raise ``exc`` matching ``match``."""
    targets = targets or _targets
    calls = [
        lambda: read_metadata(path),
        lambda: CheckpointView(path),
        lambda: inspect_checkpoint(path),
        lambda: verify_checkpoints(path, path),
        lambda: _load(path, targets()),
    ]
    if not metadata_only:  # the damage is in the data: only the reads see it
        calls = [
            lambda: [CheckpointView(path).read(e.fqn) for e in CheckpointView(path).entries() if e.kind != "bytes"],
            lambda: inspect_checkpoint(path, stats=True),
            lambda: _load(path, targets()),
        ]
    for call in calls:
        with pytest.raises(exc, match=match):
            call()


def _storage(md, fqn, offsets=None):
    key = next(k for k in md.storage_data if k.fqn == fqn and (offsets is None or list(k.offset) == offsets))
    return md.storage_data[key]


def test_truncated_and_missing_data_file(ck):
    f = ck / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    _all_paths_fail(ck, "truncated")
    f.unlink()
    _all_paths_fail(ck, "missing")


def test_missing_and_truncated_metadata(ck):
    m = ck / ".metadata"
    m.write_bytes(m.read_bytes()[:200])
    _all_paths_fail(ck, "truncated or corrupt")
    m.unlink()
    _all_paths_fail(ck, "interrupted")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("offset", -5, "malformed storage location"),
        ("length", -1, "malformed storage location"),
        ("offset", 10**9, "truncated"),
        ("length", 10**12, "truncated|overlap"),
        ("offset", 0, "overlap"),
        ("relative_path", "__7_0.distcp", "missing"),
    ],
)
def test_wrong_storage_offsets_and_lengths(ck, field, value, match):
    _edit(ck, lambda md: setattr(_storage(md, "b"), field, value))
    _all_paths_fail(ck, match)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c, e: setattr(c, "sizes", torch.Size([-64])), "outside the tensor"),
        (lambda c, e: setattr(c, "sizes", torch.Size([2**40])), "outside the tensor"),
        (lambda c, e: setattr(c, "sizes", torch.Size([32])), "cover 32 of its 64"),
        (lambda c, e: setattr(c, "sizes", [64, 1]), "malformed chunk"),
        (lambda c, e: setattr(c, "sizes", "64"), "malformed chunk"),
        (lambda c, e: e.chunks.append(ChunkStorageMetadata(torch.Size([0]), torch.Size([64]))), "no storage|overlap"),
        (lambda c, e: e.chunks.clear(), "cover 0 of its 64"),
        (lambda c, e: setattr(e, "size", torch.Size([128])), "cover 64 of its 128"),
        (lambda c, e: setattr(e, "size", [-1]), "malformed size"),
    ],
)
def test_chunk_geometry(ck, edit, match):
    def fn(md):
        e = md.state_dict_metadata["b"]
        edit(e.chunks[0] if e.chunks else None, e)

    _edit(ck, fn)
    _all_paths_fail(ck, match)


def test_overlapping_chunks_of_a_two_rank_layout(tmp_path, base):
    two = tmp_path / "two"
    ckptq.reshard_checkpoint(base, two, mesh="2")
    read_metadata(two)

    def fn(md):  # rank 1's half of 'b' moved up by 8 rows: overlaps rank 0's, leaves 8 uncovered
        e = md.state_dict_metadata["b"]
        c = e.chunks[1]
        info = md.storage_data.pop(MetadataIndex("b", c.offsets))
        c.offsets = torch.Size([24])
        md.storage_data[MetadataIndex("b", c.offsets)] = info

    _edit(two, fn)
    _all_paths_fail(two, "overlap")


def test_absurd_size_is_refused_without_allocating(ck):
    """A metadata claiming a 2^40-element tensor (4 TiB of float32) is refused by comparing the claim
    with the record's bytes, before anything is allocated."""

    def fn(md):
        e = md.state_dict_metadata["b"]
        e.size = torch.Size([2**40])
        e.chunks[0].sizes = torch.Size([2**40])

    _edit(ck, fn)
    tracemalloc.start()
    try:
        for call in (
            lambda: read_metadata(ck),
            lambda: CheckpointView(ck),
            lambda: inspect_checkpoint(ck, stats=True),
            lambda: verify_checkpoints(ck, ck),
            lambda: _load(ck, {"b": torch.zeros(64)}),
        ):
            with pytest.raises(
                CheckpointFormatError, match=r"needs at least 4398046511104 bytes.*'b'|'b'.*needs at least"
            ):
                call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak  # Python-side peak; the refusal precedes any torch.empty


def test_absurd_size_is_refused_without_allocating_rss(ck):
    import resource

    def fn(md):
        e = md.state_dict_metadata["w.data"]
        e.size = torch.Size([2**20, 2**20])
        e.chunks[0].sizes = torch.Size([2**20, 2**20])

    _edit(ck, fn)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointFormatError, match="'w.data'"):
        CheckpointView(ck)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB


@pytest.mark.parametrize("opcode,width", [(b"\x96", 8), (b"\x8e", 8), (b"\x8d", 8), (b"B", 4), (b"X", 4)])
def test_pickle_data_length_past_the_metadata_end_is_refused_before_unpickling(ck, monkeypatch, capfd, opcode, width):
    """A flipped byte of ``.metadata`` can make an opcode ``BYTEARRAY8`` (or another with a length:
    ``BINBYTES8``, ``BINUNICODE8``, ``BINBYTES``, ``BINUNICODE``) whose length the C unpickler
    allocates before reading. It is refused by that length, before anything is unpickled: else a
    failed allocation (MemoryError), and for ``BYTEARRAY8`` CPython's spurious ``SystemError:
    deallocated bytearray object has exported buffers`` on stderr (the 2026-11-26 fuzz run's)."""
    from ckptq.io import safe_pickle

    m = ck / ".metadata"
    data = m.read_bytes()
    assert data[:1] == b"\x80"  # PROTO n: the inserted opcode is the pickle's second
    length = 2**50 if width == 8 else 2**32 - 16
    m.write_bytes(data[:2] + opcode + length.to_bytes(width, "little") + data[2:])
    monkeypatch.setattr(safe_pickle.SafeUnpickler, "load", lambda self: pytest.fail("the pickle was unpickled"))
    _all_paths_fail(ck, rf"a pickle opcode at byte 2 declares {length} bytes of data in a {len(data) + 1 + width}-byte")
    assert "exported buffers" not in capfd.readouterr().err


def test_record_window_read_never_allocates_past_its_end(tmp_path):
    """``zipfile`` and torch's reader ask a record's window for sizes taken from the record's own zip
    directory; ``io.RawIOBase.read`` would allocate all of a corrupt one before reading."""
    from ckptq.io.record_check import Window
    from ckptq.io.records import _Sparse

    f = tmp_path / "f"
    f.write_bytes(bytes(range(16)))
    with open(f, "rb", buffering=0) as fh:
        w = Window(fh, 3, 10)
        assert w.read(2**62) == bytes(range(3, 13))
        assert w.read(2**62) == b"" and w.read() == b""
        w.seek(8)
        assert w.read(None) == bytes(range(11, 13))
    assert _Sparse(b"ab", 2, b"cd").read(2**62) == b"ab\x00\x00cd"


def test_dtype_that_disagrees_with_the_record(ck):
    # bfloat16 needs fewer bytes than the float32 record holds: only the record check sees it
    _edit(ck, lambda md: setattr(md.state_dict_metadata["b"].properties, "dtype", torch.bfloat16))
    read_metadata(ck)  # the metadata alone is consistent
    _all_paths_fail(
        ck,
        r"record holds a float32 tensor of shape \[64\], but the metadata gives this chunk "
        r"bfloat16 \[64\]",
        metadata_only=False,
        targets=lambda: {"b": torch.zeros(64, dtype=torch.bfloat16)},
    )


def test_record_of_another_shape(ck):
    def fn(md):
        f = ck / _storage(md, "b").relative_path
        buf = __import__("io").BytesIO()
        torch.save(torch.zeros(80), buf)
        info = _storage(md, "b")
        info.offset, info.length = f.stat().st_size, len(buf.getvalue())
        with open(f, "ab") as fh:
            fh.write(buf.getvalue())

    _edit(ck, fn)
    _all_paths_fail(ck, r"holds a float32 tensor of shape \[80\]", metadata_only=False)


def test_corrupt_record_names_file_range_and_entry(ck):
    md = pickle.loads((ck / ".metadata").read_bytes())
    info = _storage(md, "b")
    f = ck / info.relative_path
    blob = bytearray(f.read_bytes())
    blob[info.offset : info.offset + 30] = b"\xff" * 30  # the zip header of the record
    f.write_bytes(bytes(blob))
    _all_paths_fail(
        ck,
        rf"'b' \(chunk at offsets \[0\]\), record '__0_0.distcp' bytes {info.offset}\.\."
        rf"{info.offset + info.length}: the record is truncated or corrupt",
        metadata_only=False,
    )


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d["tensors"]["w"].update(shape=[-64, 64]), "malformed descriptor"),
        (lambda d: d["tensors"]["w"].update(shape=[2**40, 64]), "descriptor says|do not match"),
        (lambda d: d["tensors"]["w"].update(format=["mxfp8"]), "malformed descriptor"),
        (lambda d: d["tensors"]["w"].update(dtype="float128"), "malformed descriptor"),
        (lambda d: d["tensors"]["w"].update(dtype="float8_e4m3fn"), "malformed descriptor"),
        (lambda d: d["tensors"]["w"].update(recipe={"columnwise": "yes"}), "invalid recipe"),
        (lambda d: d["tensors"]["m4"].update(recipe={"scale_rule": "round_up"}), "invalid recipe"),
        (lambda d: d["tensors"]["m4"]["components"]["data"].update(shape=[64, 64]), "descriptor says|do not match"),
        (lambda d: d["tensors"]["w"].update(recipe={"columnwise": False, "new_option": 1}), "unknown to this ckptq"),
        (lambda d: d["tensors"]["w"].update(recipe=[1]), "malformed descriptor"),
        (lambda d: d["tensors"]["w"]["components"]["data"].update(dtype="uint8"), "descriptor says"),
        (lambda d: d["tensors"]["w"]["components"]["data"].update(fqn="n.data"), "claimed by|descriptor says"),
        (lambda d: d["tensors"]["w"].update(components=None), "malformed descriptor"),
        (lambda d: d["tensors"].update(w="mxfp8"), "malformed descriptor"),
        (lambda d: d["tensors"]["w"].update(version=99), "newer than this ckptq"),
        (lambda d: d.update(version="1"), "not a contract version"),
        (lambda d: d.update(version=2), "newer ckptq"),
        (lambda d: d.update(world_size=-2), "world_size"),
        (lambda d: d.update(tensors={1: {}}), "not a string"),
    ],
)
def test_malformed_descriptors(ck, edit, match):
    _edit(ck, lambda md: edit(md.planner_data["__ckptq__"]))
    _all_paths_fail(ck, match)


def _twin(md, src: str, dst: str, *, high_precision: bool = False) -> None:
    """Add ``dst`` to ``md``: ``src``'s descriptor with its own entries (copies of ``src``'s),
    optionally as a high-precision entry stored as float32 (an entry named ``dst``)."""
    import copy

    sdm, tensors = md.state_dict_metadata, md.planner_data["__ckptq__"]["tensors"]
    desc = copy.deepcopy(tensors[src])
    if high_precision:
        desc.update(mode="high_precision", stored_dtype="float32")
        del desc["components"]
        sdm[dst] = copy.deepcopy(sdm["b"])
        sdm[dst].size = torch.Size(desc["shape"])
    else:
        for name, c in desc["components"].items():
            sdm[f"{dst}.{name}"] = copy.deepcopy(sdm[c["fqn"]])
            c["fqn"] = f"{dst}.{name}"
    tensors[dst] = desc


def _drop(key):
    return lambda md: md.state_dict_metadata.pop(key)


def _set_dtype(key):
    return lambda md: setattr(md.state_dict_metadata[key].properties, "dtype", torch.float16)


def _set_size(key):
    return lambda md: setattr(md.state_dict_metadata[key], "size", torch.Size([64, 3]))


@pytest.mark.parametrize(
    "edit,match",
    [
        (_drop("w3.data"), r"tensor 'w3' \(mxfp8\): component 'data': tensor entry 'w3.data' is missing"),
        (_set_dtype("w3.scale"), r"tensor 'w3' \(mxfp8\): component 'scale' \('w3.scale'\) is stored as float16"),
        (_set_size("w3.data"), r"tensor 'w3' \(mxfp8\): component 'data' \('w3.data'\) is stored as .* \[64, 3\]"),
        (_drop("h3"), r"tensor 'h3' \(mxfp8, high_precision\) has no tensor entry 'h3'"),
        (_set_dtype("h3"), r"tensor 'h3' \(mxfp8, high_precision\): stored as float16"),
        (_set_size("h3"), r"tensor 'h3' \(mxfp8, high_precision\): stored shape \[64, 3\]"),
    ],
)
def test_descriptors_alike_are_checked_once_and_each_tensors_entries_every_time(base, edit, match):
    """fold_entries checks what a descriptor decides alone once per descriptor that differs only in
    its component FQNs (contract._TEMPLATES); each tensor's own entries (present, dtype, global
    shape) are still checked: tensors alike to one that passed fail as the whole check fails them."""
    from ckptq.contract import _TEMPLATES, Descriptor, _template_key, fold_entries

    md = pickle.loads((base / ".metadata").read_bytes())
    for dst in ("w2", "w3"):
        _twin(md, "w", dst)
    for dst in ("h2", "h3"):
        _twin(md, "w", dst, high_precision=True)
    tensors = md.planner_data["__ckptq__"]["tensors"]
    entries = fold_entries(md)  # w2 and h2 pass the whole check: w3 and h3 reuse their verdicts
    assert _template_key(tensors["w3"]) in _TEMPLATES and _template_key(tensors["h3"]) in _TEMPLATES
    for fqn in ("w2", "w3", "h2", "h3"):
        assert entries[fqn].descriptor == Descriptor.from_dict(tensors[fqn])
    assert entries["w3"].keys == {name: c["fqn"] for name, c in tensors["w3"]["components"].items()}
    assert entries["h3"].kind == "tensor" and entries["h3"].keys == {"h3": "h3"}
    edit(md)
    with pytest.raises(CheckpointFormatError, match=match):
        fold_entries(md)


def test_template_key_tells_values_of_other_types_apart():
    """Descriptors share a template key only when they are equal value for value and type for
    type, leaving out their component FQNs; one marshal cannot write is checked whole (no key)."""
    from ckptq.contract import _template_key

    def desc(**kw):
        d = {"format": "fp8_tensor", "version": 1, "shape": [4, 4], "dtype": "bfloat16", "recipe": {}}
        d["components"] = {"data": {"dtype": "float8_e4m3fn", "shape": [4, 4], "fqn": kw.pop("fqn", "w.data")}}
        return {**d, **kw, "mode": "native"}

    assert _template_key(desc()) == _template_key(desc(fqn="v.data"))
    keys = [_template_key(desc(version=v)) for v in (1, 1.0, True)]
    keys += [_template_key(desc(shape=s)) for s in ((4, 4), [4, 4.0])]
    assert len(set(keys)) == len(keys) and None not in keys
    assert _template_key(desc(recipe={"x": object()})) is None and _template_key(desc(fqn=3)) is None


def test_unknown_format_is_a_ckptq_error_where_its_values_are_needed(ck):
    _edit(ck, lambda md: md.planner_data["__ckptq__"]["tensors"]["w"].update(format="int3"))
    rows = {r["fqn"]: r for r in inspect_checkpoint(ck)["tensors"]}  # the metadata lists it
    assert rows["w"]["format"] == "int3"
    for call in (
        lambda: CheckpointView(ck).read("w"),
        lambda: inspect_checkpoint(ck, stats=True),
        lambda: _load(ck, _targets()),
    ):
        with pytest.raises(CkptqError, match="unknown format 'int3'"):
            call()


def test_removed_entry_leaves_orphan_locations(ck):
    _edit(ck, lambda md: md.state_dict_metadata.pop("b"))
    _all_paths_fail(ck, "belongs to no entry")


def test_malformed_metadata_values(ck):
    _edit(ck, lambda md: setattr(md, "planner_data", 7))
    _all_paths_fail(ck, "planner_data is a int")


def test_evil_record_runs_nothing(ck, tmp_path):
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    def fn(md):
        buf = __import__("io").BytesIO()
        torch.save({"x": Evil()}, buf)
        info = _storage(md, "b")
        f = ck / info.relative_path
        info.offset, info.length = f.stat().st_size, len(buf.getvalue())
        with open(f, "ab") as fh:
            fh.write(buf.getvalue())

    _edit(ck, fn)
    _all_paths_fail(ck, "could run code", exc=UnsafeCheckpointError, metadata_only=False)
    assert not canary.exists()


def test_dcp_failure_recovers_the_ckptq_error_of_a_metadata_read(ck):
    """DCP turns a failed metadata read into AssertionError("metadata is None; ...") inside
    CheckpointException; dcp_failure returns the reader's own error."""
    (ck / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointException) as ei:
        dcp.load(
            _targets(), storage_reader=SafeFileSystemReader(ck), planner=ckptq.QuantizedLoadPlanner(), no_dist=True
        )
    err = dcp_failure(ei.value, str(ck))
    assert isinstance(err, CheckpointFormatError) and "data file '__0_0.distcp'" in str(err)
    assert not isinstance(ei.value, Exception)  # why `except Exception` misses it


def test_check_storage_is_one_function(ck):
    md = read_metadata(ck)
    check_storage(md, ck)
    md.state_dict_metadata["b"].chunks[0].sizes = torch.Size([65])
    with pytest.raises(CheckpointFormatError, match="outside the tensor"):
        check_storage(md, ck, files=False)


# ------------------------------------------------ DCP's writer + ckptq's planner: the checksum file
def _fuzz_module():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import fuzz_checkpoints

        return fuzz_checkpoints
    finally:
        sys.path.remove(str(SCRIPTS))


def test_dcp_writer_checksum_file_missing_or_short_is_an_error(ck):
    """``base`` was saved by DCP's FileSystemWriter: its checksums are in ``__0_0.ckptq-crc32c``,
    which the record lists. Without it, or with a record's row gone, the checkpoint must not read
    as one without checksums."""
    import json

    side = ck / "__0_0.ckptq-crc32c"
    doc = json.loads(side.read_bytes())
    side.unlink()
    _all_paths_fail(ck, "missing; the checkpoint's metadata says rank 0 wrote")
    dropped = next(r for r in doc["chunks"] if r[0] == "w.scale")
    side.write_text(json.dumps({**doc, "chunks": [r for r in doc["chunks"] if r is not dropped]}))
    _all_paths_fail(ck, r"hold no checksum for 'w.scale' \(chunk at offsets \[0, 0\]\)")
    side.write_text(json.dumps({**doc, "chunks": doc["chunks"] + [[*dropped[:2], dropped[2] ^ 1]]}))
    _all_paths_fail(ck, "malformed checksum file")


def test_removing_the_checksum_table_is_a_digest_mismatch(ck):
    """The metadata digest covers whether the record has checksums: an edit that drops them (the
    per-rank file list of a DCP-writer save) does not leave a checkpoint that reads unverified."""
    from ckptq.contract import CKPTQ_KEY

    _edit(ck, lambda md: md.planner_data[CKPTQ_KEY].pop("checksums"), reseal=False)
    _all_paths_fail(ck, "digest")


def test_damaged_key_in_the_checksum_table_is_an_error(tmp_path):
    """A checkpoint whose checksum table is in the record (ckptq's writer) lost one record's row
    (a flipped byte in its key: the fuzz found this read unverified with every path OK): every
    record the metadata locates must have its checksum."""
    from ckptq.contract import CKPTQ_KEY
    from ckptq.io import ChecksumFileSystemWriter

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    path = tmp_path / "ck"
    sd = {"w": ckptq.quantize(x, "mxfp8"), "b": torch.randn(64)}
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)

    def damage(md):
        chunks = md.planner_data[CKPTQ_KEY]["checksums"]["chunks"]
        chunks["w.scalE"] = chunks.pop("w.scale")

    _edit(path, damage, reseal=False)
    _all_paths_fail(path, r"holds no checksum for 'w.scale' \(chunk at offsets \[0, 0\]\)")


@pytest.mark.parametrize("component", ["w.scale", "n.scale", "n.amax", "m4.data"])
def test_dcp_writer_payload_flip_is_a_checksum_mismatch(ck, component):
    """One flipped bit in a stored value (scales included) of a DCP-writer save is a
    ChecksumMismatchError naming the entry, on every path that reads values."""
    from ckptq.errors import ChecksumMismatchError

    file, start, end, _ = next(r for r in _fuzz_module().payload_ranges(ck) if r[3] == component)
    blob = bytearray((ck / file).read_bytes())
    blob[(start + end) // 2] ^= 0x10
    (ck / file).write_bytes(bytes(blob))
    _all_paths_fail(
        ck, f"'{component}'.*checksum mismatch", exc=ChecksumMismatchError, metadata_only=False, targets=_all_targets
    )


def _all_targets() -> dict:
    """Targets for every tensor of ``base``, in its formats."""
    x = torch.zeros(64, 64)
    out = {k: ckptq.quantize(x, f) for k, f in (("w", "mxfp8"), ("n", "nvfp4"), ("m4", "mxfp4"))}
    return {**{k: q.new_empty(q.shape) for k, q in out.items()}, "b": torch.zeros(64)}


@pytest.mark.parametrize(
    "variant,same",
    [
        (lambda t: t.t().contiguous().t(), True),  # a transposed view of the same values
        (lambda t: t.clone(), True),  # re-pickled
        (lambda t: t.t().contiguous().reshape(t.shape), False),  # the transpose's bytes
        (lambda t: t.flip(0), False),
    ],
)
def test_dcp_writer_replaced_record_reads_its_values_or_fails(ck, base, variant, same):
    """A record replaced by another ``torch.save`` of the chunk's dtype and shape: the same values
    in another storage layout read the saved values; other values are a ChecksumMismatchError."""
    import io

    from ckptq.errors import ChecksumMismatchError

    md = pickle.loads((ck / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if k.fqn == "w.data")
    info = md.storage_data[key]
    t = torch.load(io.BytesIO((ck / info.relative_path).read_bytes()[info.offset : info.offset + info.length]))
    buf = io.BytesIO()
    torch.save(variant(t), buf)
    with open(ck / info.relative_path, "ab") as f:
        info.offset, info.length = f.tell(), len(buf.getvalue())
        f.write(buf.getvalue())
    (ck / ".metadata").write_bytes(pickle.dumps(md))  # the storage locations are outside the digest
    if same:
        got, want = _targets(), _targets()
        _load(ck, got)
        _load(base, want)
        for a, b in ((got["w"], want["w"]), (CheckpointView(ck).read("w"), CheckpointView(base).read("w"))):
            assert_same_bytes(a.components()["data"], b.components()["data"], "w.data")
    else:
        _all_paths_fail(ck, "'w.data'.*checksum mismatch", exc=ChecksumMismatchError, metadata_only=False)


def test_valid_checkpoints_still_read(base, tmp_path):
    """The checks refuse nothing DCP and ckptq write: plain, native, high precision, resharded, TE."""
    ckptq.reshard_checkpoint(base, tmp_path / "r3", mesh="2")
    dcp.save(
        {"a": torch.zeros(0), "s": torch.tensor(2.0), "c": torch.randn(3, 5).to(torch.complex64)},
        checkpoint_id=str(tmp_path / "plain"),
        no_dist=True,
    )
    for p in (base, tmp_path / "r3", tmp_path / "plain"):
        inspect_checkpoint(p, stats=True)
        assert verify_checkpoints(p, p)["summary"]["ok"]


# ------------------------------------------------------------------------ geometry, property-based
def test_chunk_geometry_matches_brute_force():
    """check_storage accepts a chunk list exactly when the chunks lie inside the tensor, do not
    overlap and cover it (brute force over every element), for random small 1-3 d layouts."""
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    @st.composite
    def layouts(draw):
        ndim = draw(st.integers(1, 3))
        size = [draw(st.integers(0, 5)) for _ in range(ndim)]
        boxes = draw(
            st.lists(
                st.tuples(
                    st.lists(st.integers(-1, 6), min_size=ndim, max_size=ndim),
                    st.lists(st.integers(-1, 6), min_size=ndim, max_size=ndim),
                ),
                max_size=5,
            )
        )
        return size, boxes

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(layouts())
    def check(layout):
        import itertools

        size, boxes = layout
        chunks = [
            ChunkStorageMetadata(torch.Size([max(o, 0) for o in off]), torch.Size([max(s, 0) for s in sz]))
            if all(v >= 0 for v in off + sz)
            else ChunkStorageMetadata(off, sz)
            for off, sz in boxes
        ]
        md = Metadata(
            {"t": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(size), chunks)}, storage_data={}
        )
        inside = all(
            all(o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(off, sz, size, strict=False)) for off, sz in boxes
        )
        counts = {}
        if inside:
            for off, sz in boxes:
                for p in itertools.product(*[range(o, o + s) for o, s in zip(off, sz, strict=False)]):
                    counts[p] = counts.get(p, 0) + 1
        numel = 1
        for d in size:
            numel *= d
        valid = inside and all(c == 1 for c in counts.values()) and len(counts) == numel
        try:
            check_storage(md, "/nonexistent", files=False)
            ok = True
        except CheckpointFormatError:
            ok = False
        assert ok == valid, (size, boxes)

    check()

"""Fuzz ckptq's reader paths with mutated real checkpoints.

Builds real checkpoints (every format, 1 and 2 ranks, native and high precision, a
TransformerEngine-shaped one through the stand-in in ``tests/te_standin``), mutates copies of them
and runs every reader path on each mutant, in worker processes with a time limit per case:

* ``read_metadata``: :func:`ckptq.io.read_metadata`;
* ``view``: :func:`ckptq.checkpoint.open_checkpoint` + ``read`` of every tensor (``load_entries``)
  and ``read_raw_bytes`` of every non-tensor entry;
* ``inspect``: :func:`ckptq.inspect.inspect_checkpoint` with ``stats=True``;
* ``verify``: :func:`ckptq.verify.verify_checkpoints` of the original against the mutant;
* ``integrity``: :func:`ckptq.verify.check_integrity` of the mutant alone (``ckptq verify PATH``);
* ``load``: ``dcp.load`` with :class:`ckptq.io.SafeFileSystemReader` + ``QuantizedLoadPlanner``,
  into targets of the saved formats and into plain float32 targets (the decode route); a
  ``CheckpointException`` counts as a ckptq error only when what it wraps is one
  (:func:`ckptq.io.dcp_failure`).

Mutations: byte flips in ``.distcp`` and ``.metadata`` files, zeroed ranges, truncation, deleted
files, garbage appended; edits of the unpickled ``Metadata`` (entry sizes and dtypes, chunk offsets
and sizes, dropped or duplicated chunks, storage offsets, lengths and files, descriptors and the
ckptq record) re-pickled; foreign records (a tensor of another dtype or shape, a pickle that runs
code) appended and pointed at; a ``.metadata`` carrying a code-running pickle. Code-running pickles
``touch`` a canary file: if it ever exists, code ran.

Each mutant is classified (worst first):

* ``CODE_EXECUTED``: the canary exists;
* ``HANG``: the case ran past ``--timeout``;
* ``BIG_ALLOC``: a reader path raised the worker's peak memory by more than ``--max-alloc-mb``;
* ``UNCAUGHT``: a path raised something other than a ckptq error;
* ``SILENT_WRONG``: a path returned a different result from the original's without an error;
* ``DATA_FLIP``: the same, for a mutation that only changed stored values (tensor payload bytes,
  or the record of a non-tensor entry, which ``read_raw_bytes`` copies verbatim) of a base
  *without* checksums (``plain1``, saved with DCP's own writer, and the TE-written ``te1``):
  undetectable there, counted apart. On the checksummed bases (``native1``/``hp1`` saved with
  :class:`ckptq.io.ChecksumFileSystemWriter`, ``native2``/``hp2`` written by ``ckptq reshard``)
  such a mutant is ``SILENT_WRONG`` unless a path reports it;
* ``METADATA_VALID``: an edit of the ckptq record or a descriptor (``planner_data``), or a byte
  flip in ``.metadata``, that leaves another valid checkpoint over the same files (the logical
  dtype, an encoder-only recipe option such as ``eps``, no ckptq record at all: a plain DCP
  checkpoint of the components; an entry renamed consistently): the paths report the edited
  description faithfully and ``load`` reads the stored bytes or refuses a target that no longer
  fits (it never returns other values silently); undetectable without a checksum of the metadata
  itself, counted apart;
* ``CKPTQ_ERROR`` (good): at least one path raised a ckptq error, none returned a different result;
* ``SAME`` (good): every path returned the original's result (e.g. a flip in unused bytes).

Usage::

    python scripts/fuzz_checkpoints.py --n 2000 --seed 0 [--workers 2] [--timeout 60]

Each case is reproducible from ``(seed, index)``: ``--only INDEX`` reruns one and prints its paths.
"""

from __future__ import annotations

import argparse
import collections
import copy
import hashlib
import io
import json
import multiprocessing as mp
import os
import pickle
import random
import resource
import shutil
import struct
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLASSES = [
    "CODE_EXECUTED",
    "HANG",
    "BIG_ALLOC",
    "UNCAUGHT",
    "SILENT_WRONG",
    "DATA_FLIP",
    "METADATA_VALID",
    "CKPTQ_ERROR",
    "SAME",
]
GOOD = {"CKPTQ_ERROR", "SAME"}
PATHS = ["read_metadata", "view", "inspect", "verify", "load"]
SHAPE = (256, 128)  # 2 rank cuts at row 128: on every format's block grid (fp8_block: 128)


# ----------------------------------------------------------------------------------- corpus
def _quantized_state() -> dict:
    import torch

    import ckptq

    g = torch.Generator().manual_seed(11)
    x = torch.randn(SHAPE, generator=g) * 3
    return {
        "layers.0.nv": ckptq.quantize(x, "nvfp4"),
        "layers.0.nv2d": ckptq.quantize(x * 2, "nvfp4", two_d=True),
        "layers.0.mx": ckptq.quantize(x, "mxfp8"),
        "layers.0.mxc": ckptq.quantize(x / 5, "mxfp8", columnwise=True),
        "layers.0.fb": ckptq.quantize(x, "fp8_block"),
        "layers.0.ft": ckptq.quantize(x.bfloat16(), "fp8_tensor"),
        "layers.0.m4": ckptq.quantize(x, "mxfp4", scale_rule="rceil"),
        "layers.0.norm": torch.randn(SHAPE[1], generator=g).bfloat16(),
        "layers.0.ids": torch.arange(12, dtype=torch.int64) - 3,
        "step": 7,
    }


def _te_state() -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from _te import standin

    te = standin()
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(SHAPE, generator=g) * 3).to(torch.bfloat16)
    return {
        "te.fp8": te.make_te_tensor(x, "float8", fp8_dtype="E4M3"),
        "te.mx": te.make_te_tensor(x, "mxfp8", swizzled=True),
        "te.nv": te.make_te_tensor(x, "nvfp4", two_d=True),
        "te.bias": torch.randn(SHAPE[0], generator=g),
    }


def build_corpus(root: Path) -> dict[str, Path]:
    """The base checkpoints: name -> directory."""
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.io import ChecksumFileSystemWriter

    warnings.filterwarnings("ignore")
    bases = {}
    for mode, name in (("native", "native1"), ("high_precision", "hp1")):
        bases[name] = root / name
        dcp.save(
            _quantized_state(),
            storage_writer=ChecksumFileSystemWriter(bases[name]),
            planner=ckptq.QuantizedSavePlanner(mode=mode),
            no_dist=True,
        )
    bases["plain1"] = root / "plain1"  # DCP's own writer: no checksums (data flips load unverified)
    dcp.save(_quantized_state(), checkpoint_id=str(bases["plain1"]), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    for src, name in (("native1", "native2"), ("hp1", "hp2")):
        bases[name] = root / name
        ckptq.reshard_checkpoint(bases[src], bases[name], mesh="2")
    bases["te1"] = root / "te1"
    dcp.save(_te_state(), checkpoint_id=str(bases["te1"]), no_dist=True)  # DCP's planner: pickled TE records
    return bases


# ----------------------------------------------------------------------------------- regions
def payload_ranges(base: Path) -> list[tuple[str, int, int]]:
    """``(file, start, end)`` of the tensor payload bytes (the storages inside each record)."""
    md = pickle.loads((base / ".metadata").read_bytes())  # our own corpus: a plain unpickle is fine
    out = []
    for index, info in md.storage_data.items():
        if index.offset is None:  # a non-tensor entry's record: copied verbatim by read_raw_bytes
            out.append((str(info.relative_path), info.offset, info.offset + info.length))
            continue
        blob = (base / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            for zi in z.infolist():
                if "/data/" not in zi.filename or zi.filename.endswith(".pkl"):
                    continue
                h = zi.header_offset
                nlen, xlen = struct.unpack("<HH", blob[h + 26 : h + 30])
                start = info.offset + h + 30 + nlen + xlen
                out.append((str(info.relative_path), start, start + zi.file_size))
    return out


# ----------------------------------------------------------------------------------- mutations
class _Payload:
    """Runs ``touch CANARY`` when unpickled by plain pickle / torch.load(weights_only=False)."""

    def __init__(self, canary: str):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch '{self.canary}'  # transformer_engine",))


JUNK = [None, -1, 0, 1, 2**40, 2**63, -(2**31), 3.5, "x", "", [], {}, [1, -1], ["a"], True, ("t",), b"\x00"]


def _big_or_bad(rng: random.Random, v: int) -> Any:
    return rng.choice([-1, 0, v + 1, max(v - 1, 0), 2**40, 2**31 - 1, 2**62, -(2**40), v * 2 + 1, 1])


def _metadata_edit(rng: random.Random, md: Any, ck: Path) -> str:
    """Edit ``md`` in place; returns a description."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    sdm = md.state_dict_metadata
    tensors = [k for k, v in sdm.items() if isinstance(v, TensorStorageMetadata)]
    op = rng.choice(
        [
            "size",
            "chunk_offset",
            "chunk_size",
            "drop_chunk",
            "dup_chunk",
            "dtype",
            "st_offset",
            "st_length",
            "st_file",
            "st_swap_len",
            "drop_entry",
            "drop_storage",
            "descriptor",
            "descriptor",
            "descriptor",
            "record",
            "planner_data",
            "chunks_junk",
            "size_junk",
        ]
    )
    fqn = rng.choice(tensors)
    e = sdm[fqn]
    if op == "size" and len(e.size):
        d = rng.randrange(len(e.size))
        s = list(e.size)
        s[d] = _big_or_bad(rng, s[d])
        e.size = torch.Size(s) if all(v >= 0 for v in s) else s
        return f"{op} {fqn} dim {d} -> {s[d]}"
    if op in ("chunk_offset", "chunk_size") and e.chunks and len(e.size):
        c = rng.choice(e.chunks)
        d = rng.randrange(len(e.size))
        field = "offsets" if op == "chunk_offset" else "sizes"
        v = list(getattr(c, field))
        v[d] = _big_or_bad(rng, v[d])
        v = torch.Size(v) if all(x >= 0 for x in v) else v
        # keep the storage key in step with a moved chunk, as a consistent forger would
        old = copy.copy(c)
        setattr(c, field, v)
        if op == "chunk_offset":
            from torch.distributed.checkpoint.metadata import MetadataIndex

            info = md.storage_data.pop(MetadataIndex(fqn, old.offsets), None)
            if info is not None:
                md.storage_data[MetadataIndex(fqn, v)] = info
        return f"{op} {fqn} dim {d} -> {v[d]}"
    if op == "drop_chunk" and e.chunks:
        c = e.chunks.pop(rng.randrange(len(e.chunks)))
        return f"{op} {fqn} at {list(c.offsets)}"
    if op == "dup_chunk" and e.chunks:
        c = rng.choice(e.chunks)
        e.chunks.append(ChunkStorageMetadata(c.offsets, c.sizes))
        return f"{op} {fqn}"
    if op == "dtype":
        choices = [
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.uint8,
            torch.int8,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.int64,
            torch.float64,
            torch.bool,
            torch.complex64,
        ]
        new = rng.choice([d for d in choices if d != e.properties.dtype])
        e.properties.dtype = new
        return f"{op} {fqn} -> {new}"
    if op.startswith("st_") and md.storage_data:
        key = rng.choice(list(md.storage_data))
        info = md.storage_data[key]
        if op == "st_offset":
            info.offset = _big_or_bad(rng, info.offset)
            return f"{op} {key.fqn} -> {info.offset}"
        if op == "st_length":
            info.length = _big_or_bad(rng, info.length)
            return f"{op} {key.fqn} -> {info.length}"
        if op == "st_file":
            info.relative_path = rng.choice(
                ["__9_0.distcp", "../x.distcp", "/etc/passwd", "", ".metadata", "__0_0.distcp", "__1_0.distcp"]
            )
            return f"{op} {key.fqn} -> {info.relative_path}"
        other = md.storage_data[rng.choice(list(md.storage_data))]
        info.offset, info.length = other.offset, other.length
        info.relative_path = other.relative_path
        return f"{op} {key.fqn} -> another record"
    if op == "drop_entry":
        del sdm[fqn]
        return f"{op} {fqn}"
    if op == "drop_storage" and md.storage_data:
        key = rng.choice(list(md.storage_data))
        del md.storage_data[key]
        return f"{op} {key.fqn}"
    if op == "chunks_junk":
        e.chunks = rng.choice(JUNK)
        return f"{op} {fqn} -> {e.chunks!r}"
    if op == "size_junk":
        e.size = rng.choice(JUNK)
        return f"{op} {fqn} -> {e.size!r}"
    rec = (md.planner_data or {}).get("__ckptq__")
    if op == "planner_data":
        md.planner_data = rng.choice(JUNK + [{"__ckptq__": rng.choice(JUNK)}])
        return f"{op} -> {md.planner_data!r}"
    if op == "record" and rec is not None:
        field = rng.choice(["version", "world_size", "tensors", "mesh", "checksums", "checksums"])
        table = rec.get("checksums")
        if field == "checksums" and isinstance(table, dict) and table.get("chunks") and rng.random() < 0.6:
            fqn = rng.choice(sorted(table["chunks"]))
            offsets = rng.choice(list(table["chunks"][fqn]))
            table["chunks"][fqn][offsets] ^= 1 << rng.randrange(32)  # a wrong checksum: must be a mismatch
            return f"{op} checksum of {fqn} {offsets} changed"
        rec[field] = rng.choice(JUNK + [99, 2, "1"])
        return f"{op} {field} -> {rec[field]!r}"
    if rec is not None and rec.get("tensors"):
        name = rng.choice(list(rec["tensors"]))
        desc = rec["tensors"][name]
        target, path = desc, [name]
        if "components" in desc and rng.random() < 0.5:
            comp = rng.choice(list(desc["components"]))
            target, path = desc["components"][comp], [name, comp]
        field = rng.choice(list(target))
        how = rng.random()
        if how < 0.25:
            del target[field]
            return f"descriptor {path} del {field}"
        if field == "shape" and how < 0.6:
            v = list(target["shape"])
            if v:
                d = rng.randrange(len(v))
                v[d] = _big_or_bad(rng, v[d])
            target["shape"] = v
        elif field == "format" and how < 0.6:
            target["format"] = rng.choice(["nvfp4", "mxfp8", "mxfp4", "fp8_block", "fp8_tensor", "int4", ""])
        elif field in ("dtype", "stored_dtype") and how < 0.6:
            target[field] = rng.choice(["float32", "bfloat16", "float16", "uint8", "float8_e4m3fn", "int64", "bogus"])
        elif field == "recipe" and how < 0.6 and target["recipe"]:
            k = rng.choice(list(target["recipe"]))
            target["recipe"][k] = rng.choice(JUNK + [[16, 16], [0, 0], [1, 128], 32, "float8_e5m2", "rceil", "up"])
        elif field == "mode" and how < 0.6:
            target["mode"] = "native" if target["mode"] == "high_precision" else "high_precision"
        elif field == "fqn" and how < 0.6:
            target["fqn"] = rng.choice(tensors)
        else:
            target[field] = rng.choice(JUNK)
        return f"descriptor {path} {field} -> {target[field]!r}"
    e.size = rng.choice(JUNK)
    return f"size_junk {fqn} -> {e.size!r}"


def _append_record(ck: Path, md: Any, rng: random.Random, blob: bytes) -> tuple[str, bool]:
    """Append ``blob`` to a data file and point a random location at it; ``(fqn, non-tensor?)``."""
    key = rng.choice(list(md.storage_data))
    info = md.storage_data[key]
    f = ck / info.relative_path
    info.offset = f.stat().st_size
    info.length = len(blob)
    with open(f, "ab") as fh:
        fh.write(blob)
    return key.fqn, key.offset is None


def mutate(base: Path, ck: Path, rng: random.Random, canary: str, payload: list) -> tuple[str, str]:
    """Copy ``base`` to ``ck`` and mutate it; returns ``(kind, description)``. ``kind`` is
    ``"data"`` for a change of tensor payload bytes only, else ``"structure"``/``"bytes"``/``"evil"``."""
    import torch

    shutil.copytree(base, ck)
    files = sorted(p.name for p in ck.iterdir())
    op = rng.choices(
        [
            "flip",
            "flip_payload",
            "zero",
            "truncate",
            "delete",
            "append",
            "metadata",
            "bad_record",
            "evil_record",
            "evil_metadata",
        ],
        weights=[20, 8, 6, 8, 3, 2, 40, 6, 3, 2],
    )[0]
    if op in ("flip", "zero", "flip_payload"):
        if op == "flip_payload" and payload:
            name, a, b = rng.choice(payload)
            pos, n = rng.randrange(a, b), 1
        else:
            name = rng.choice(files)
            size = (ck / name).stat().st_size
            pos = rng.randrange(size)
            n = 1 if op != "zero" else min(rng.randint(1, 256), size - pos)
        blob = bytearray((ck / name).read_bytes())
        for i in range(pos, pos + n):
            blob[i] = blob[i] ^ rng.randrange(1, 256) if op != "zero" else 0
        (ck / name).write_bytes(bytes(blob))
        if name == ".metadata":  # what it changed is judged like a metadata edit
            return "metadata_bytes", f"{op} {name} @{pos}+{n}"
        # bytes of stored values changed: zip readers skip local headers, so a range that
        # straddles one changes values only
        inside = any(name == f and pos < b and a < pos + n for f, a, b in payload)
        return ("data" if inside else "bytes"), f"{op} {name} @{pos}+{n}"
    if op == "truncate":
        name = rng.choice(files)
        size = (ck / name).stat().st_size
        cut = rng.randrange(size)
        with open(ck / name, "r+b") as fh:
            fh.truncate(cut)
        return "structure", f"truncate {name} {size} -> {cut}"
    if op == "delete":
        name = rng.choice(files)
        (ck / name).unlink()
        return "structure", f"delete {name}"
    if op == "append":
        name = rng.choice(files)
        with open(ck / name, "ab") as fh:
            fh.write(os.urandom(rng.randint(1, 64)))
        return "bytes", f"append {name}"
    md = pickle.loads((ck / ".metadata").read_bytes())
    if op == "metadata":
        before = copy.deepcopy(md)
        what = _metadata_edit(rng, md, ck)
        kind = "descriptor" if what.startswith(("descriptor", "record", "planner_data")) else "structure"
        try:
            if md == before:
                kind = "noop"  # e.g. an offset set to the value it had
        except Exception:  # noqa: BLE001 - junk values that do not compare
            pass
    elif op == "bad_record":  # a real tensor record of another dtype or shape, pointed at
        t = rng.choice(
            [
                torch.zeros(3),
                torch.zeros(SHAPE, dtype=torch.float64),
                torch.zeros(SHAPE[0], SHAPE[1] // 2, dtype=torch.uint8),
                torch.zeros(7, dtype=torch.float8_e4m3fn),
                {"a": torch.ones(2)},
            ]
        )
        buf = io.BytesIO()
        torch.save(t, buf)
        fqn, raw = _append_record(ck, md, rng, buf.getvalue())
        entry = md.state_dict_metadata.get(fqn)
        fits = (
            isinstance(t, torch.Tensor)
            and getattr(entry, "properties", None) is not None
            and t.dtype == entry.properties.dtype
            and any(tuple(c.sizes) == tuple(t.shape) for c in entry.chunks)
        )
        # a record of the chunk's own dtype and shape is a change of stored values only
        what, kind = f"bad_record for {fqn}", "data" if raw or fits else "structure"
    elif op == "evil_record":
        buf = io.BytesIO()
        torch.save({"x": _Payload(canary)}, buf)
        fqn, raw = _append_record(ck, md, rng, buf.getvalue())
        what, kind = f"evil_record for {fqn}", "data" if raw else "evil"
    else:
        md.planner_data = dict(md.planner_data or {})
        md.planner_data["__ckptq__evil"] = _Payload(canary)
        what, kind = "evil_metadata", "evil"
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    return kind, f"{op}: {what}"


# ----------------------------------------------------------------------------------- readers
def _digest(x: Any) -> str:
    import torch

    from ckptq.formats.base import QuantizedTensor

    h = hashlib.sha1()
    if isinstance(x, QuantizedTensor):
        h.update(f"{x.FORMAT} {x.recipe} {x.dtype} {tuple(x.shape)}".encode())
        for k, v in sorted(x.components().items()):
            h.update(k.encode())
            h.update(_digest(v).encode())
    elif isinstance(x, torch.Tensor):
        h.update(f"{x.dtype} {tuple(x.shape)}".encode())
        h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(x).encode())
    return h.hexdigest()[:16]


def _strip(report: Any, path: str) -> str:
    return json.dumps(report, sort_keys=True, default=str).replace(path, "<path>")


def path_read_metadata(ck: Path, orig: Path) -> str:
    from ckptq.io import read_metadata

    read_metadata(ck)
    return "read"  # what it lists is compared through inspect and view


def path_view(ck: Path, orig: Path) -> str:
    from ckptq.checkpoint import open_checkpoint

    view = open_checkpoint(ck)
    out = []
    for e in view.entries():
        out.append(
            (e.fqn, view.read_raw_bytes(e.fqn)[0].hex()[:64] if e.kind == "bytes" else _digest(view.read(e.fqn)))
        )
    return repr(out)


def path_inspect(ck: Path, orig: Path) -> str:
    from ckptq.inspect import inspect_checkpoint

    return _strip(inspect_checkpoint(ck, stats=True), str(ck))


def path_verify(ck: Path, orig: Path) -> str:
    from ckptq.verify import verify_checkpoints

    report = verify_checkpoints(orig, ck)
    if not report["summary"]["ok"]:  # verify's job: the difference is reported, not silent
        raise VerifyDetected(f"{report['summary']['failed']} tensors differ")
    return _strip(report, str(ck))


def path_integrity(ck: Path, orig: Path) -> str:
    from ckptq.verify import check_integrity

    report = check_integrity(ck)
    if not report["summary"]["ok"]:  # ckptq verify PATH: what failed is reported, exit 1
        raise VerifyDetected(f"{report['summary']['failed']} records failed the integrity check")
    return _strip(report, str(ck))


class VerifyDetected(Exception):
    """verify_checkpoints reported a difference (counts like a ckptq error: nothing silent)."""


_TARGETS: dict[str, tuple] = {}


def _targets(orig: Path) -> tuple[dict, dict]:
    """Targets a user would load into: the saved formats, and plain float32 tensors."""
    import torch

    from ckptq.checkpoint import CheckpointView

    if str(orig) not in _TARGETS:
        view = CheckpointView(orig)
        same, plain = {}, {}
        for e in view.entries():
            if e.kind == "bytes":
                same[e.fqn] = None  # dcp.load puts the unpickled object (weights_only) here
                continue
            x = view.read(e.fqn)
            same[e.fqn] = x.new_empty(x.shape) if e.kind == "quantized" else torch.empty_like(x)
            plain[e.fqn] = torch.empty(tuple(x.shape), dtype=torch.float32)
        _TARGETS[str(orig)] = (same, plain)
    same, plain = _TARGETS[str(orig)]
    import torch as _t

    def fresh(d):
        return {
            k: (None if v is None else v.new_empty(v.shape) if hasattr(v, "FORMAT") else _t.full_like(v, 0))
            for k, v in d.items()
        }

    return fresh(same), fresh(plain)


class WrappedCheckpointError(Exception):
    """A CheckpointException whose failures are not all ckptq errors."""


def path_load(ck: Path, orig: Path) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq
    from ckptq.io import SafeFileSystemReader, dcp_failure

    out = []
    for sd in _targets(orig):
        try:
            dcp.load(
                sd,
                storage_reader=SafeFileSystemReader(ck),
                planner=ckptq.QuantizedLoadPlanner(strict_dtype=False),
                no_dist=True,
            )
        except CheckpointException as e:
            # the documented way to get the ckptq error; it counts only if ckptq raised it (not
            # dcp_failure's fallback wrapping of a foreign exception)
            from ckptq.io.reader import _LAST_METADATA_ERROR

            causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            err = dcp_failure(e, str(ck))
            if any(err is c for c in causes) or err is getattr(_LAST_METADATA_ERROR, "error", None):
                raise err from None
            c = causes[0]
            raise WrappedCheckpointError(f"wrapped {type(c).__name__}: {c}") from c
        out.append(repr(sorted((k, _digest(v)) for k, v in sd.items())))
    return "\n".join(out)


READERS = {
    "read_metadata": path_read_metadata,
    "view": path_view,
    "inspect": path_inspect,
    "verify": path_verify,
    "integrity": path_integrity,
    "load": path_load,
}

#: bases whose chunks carry checksums: a changed stored value must be detected there.
CHECKSUMMED = {"native1", "native2", "hp1", "hp2"}


def run_paths(ck: Path, orig: Path) -> dict[str, tuple[str, str]]:
    """``path -> ("ok", fingerprint)`` or ``("ckptq"|"uncaught"|"alloc", "Type: message")``."""
    from ckptq.errors import CkptqError

    out = {}
    for name, fn in READERS.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name] = ("ok", fn(ck, orig))
        except (CkptqError, VerifyDetected) as e:
            out[name] = ("ckptq", f"{type(e).__name__}: {str(e)[:300]}")
        except BaseException as e:  # noqa: BLE001 - everything else is a finding
            if isinstance(e, KeyboardInterrupt):
                raise
            out[name] = ("uncaught", f"{type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-1500:]}")
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss: KiB
        if grew > _MAX_ALLOC_MB:
            out[name] = ("alloc", f"peak memory grew by {grew:.0f} MiB; was {out[name][0]}: {out[name][1][:200]}")
    return out


_MAX_ALLOC_MB = 512.0


def classify(kind: str, results: dict, reference: dict, canary_hit: bool, checksummed: bool = False) -> str:
    if canary_hit:
        return "CODE_EXECUTED"
    statuses = [s for s, _ in results.values()]
    if "alloc" in statuses:
        return "BIG_ALLOC"
    if "uncaught" in statuses:
        return "UNCAUGHT"
    differs = [p for p, (s, v) in results.items() if s == "ok" and v != reference[p][1]]
    if differs:
        if kind == "data":
            return "SILENT_WRONG" if checksummed else "DATA_FLIP"
        if kind in ("descriptor", "metadata_bytes") and "load" not in differs:
            return "METADATA_VALID"
        return "SILENT_WRONG"
    return "CKPTQ_ERROR" if "ckptq" in statuses else "SAME"


# ----------------------------------------------------------------------------------- workers
def _worker(conn, bases: dict, payloads: dict, scratch: str, canary: str, max_alloc_mb: float) -> None:
    global _MAX_ALLOC_MB
    _MAX_ALLOC_MB = max_alloc_mb
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.CRITICAL)
    references: dict[str, dict] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        index, seed, base = msg
        orig = Path(bases[base])
        if base not in references:
            references[base] = run_paths(orig, orig)
            bad = {p: r for p, r in references[base].items() if r[0] != "ok"}
            if bad:
                conn.send(("fatal", f"reader paths fail on the unmutated '{base}': {bad}"))
                return
        rng = random.Random(f"{seed}:{index}")
        ck = Path(scratch) / f"case{index}"
        try:
            kind, what = mutate(orig, ck, rng, canary, payloads[base])
            results = run_paths(ck, orig)
            hit = os.path.exists(canary)
            cls = classify(kind, results, references[base], hit, base in CHECKSUMMED)
            conn.send(
                (
                    "done",
                    {
                        "index": index,
                        "base": base,
                        "kind": kind,
                        "mutation": what,
                        "class": cls,
                        "paths": {p: r[0] for p, r in results.items()},
                        "detail": {
                            p: r[1]
                            for p, r in results.items()
                            if r[0] in ("uncaught", "alloc") or (r[0] == "ok" and r[1] != references[base][p][1])
                        },
                        "errors": {p: r[1][:160] for p, r in results.items() if r[0] == "ckptq"},
                    },
                )
            )
        finally:
            shutil.rmtree(ck, ignore_errors=True)


class _Pool:
    def __init__(self, n: int, args: tuple):
        self.ctx = mp.get_context("spawn")
        self.args = args
        self.slots = [self._start() for _ in range(n)]

    def _start(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child,) + self.args, daemon=True)
        p.start()
        return {"proc": p, "conn": parent, "case": None, "since": 0.0}

    def restart(self, i: int) -> None:
        self.slots[i]["proc"].kill()
        self.slots[i]["proc"].join(5)
        self.slots[i] = self._start()

    def close(self) -> None:
        for s in self.slots:
            try:
                s["conn"].send(None)
            except (OSError, BrokenPipeError):
                pass
            s["proc"].join(5)
            if s["proc"].is_alive():
                s["proc"].kill()


def fuzz(
    n: int,
    seed: int,
    *,
    workers: int = 2,
    timeout: float = 60.0,
    budget: float | None = None,
    max_alloc_mb: float = 512.0,
    bases_filter: list | None = None,
    verbose: bool = False,
    work: Path | None = None,
) -> dict:
    """Run ``n`` mutants (or until ``budget`` seconds); returns ``{"cases": [...], "counts": {...}}``."""
    tmp = Path(tempfile.mkdtemp(prefix="ckptq-fuzz-", dir=work))
    canary = str(tmp / "CANARY-code-ran")
    try:
        corpus = build_corpus(tmp / "corpus")
        if bases_filter:
            corpus = {k: v for k, v in corpus.items() if k in bases_filter}
        payloads = {k: payload_ranges(v) for k, v in corpus.items()}
        names = sorted(corpus)
        scratch = tmp / "scratch"
        scratch.mkdir()
        pool = _Pool(workers, ({k: str(v) for k, v in corpus.items()}, payloads, str(scratch), canary, max_alloc_mb))
        queue = collections.deque((i, seed, names[i % len(names)]) for i in range(n))
        cases, start = [], time.monotonic()
        try:
            while queue or any(s["case"] for s in pool.slots):
                out_of_time = budget is not None and time.monotonic() - start > budget
                for i, s in enumerate(pool.slots):
                    if s["case"] is None and queue and not out_of_time:
                        s["case"], s["since"] = queue.popleft(), time.monotonic()
                        s["conn"].send(s["case"])
                    if s["case"] is None:
                        continue
                    if s["conn"].poll(0.01):
                        try:
                            tag, payload = s["conn"].recv()
                        except EOFError:
                            tag, payload = "died", None
                        if tag == "fatal":
                            raise RuntimeError(payload)
                        if tag == "died":
                            cases.append(
                                {
                                    "index": s["case"][0],
                                    "base": s["case"][2],
                                    "class": "UNCAUGHT",
                                    "mutation": "?",
                                    "kind": "?",
                                    "detail": {"worker": "died"},
                                }
                            )
                            pool.restart(i)
                        else:
                            cases.append(payload)
                            if verbose or payload["class"] not in GOOD:
                                print(
                                    f"[{payload['index']}] {payload['class']:13s} {payload['base']:8s} "
                                    f"{payload['mutation'][:110]}",
                                    flush=True,
                                )
                        s["case"] = None
                    elif not s["proc"].is_alive():
                        cases.append(
                            {
                                "index": s["case"][0],
                                "base": s["case"][2],
                                "class": "UNCAUGHT",
                                "mutation": "?",
                                "kind": "?",
                                "detail": {"worker": "died"},
                            }
                        )
                        s["case"] = None
                        pool.restart(i)
                    elif time.monotonic() - s["since"] > timeout:
                        cases.append(
                            {
                                "index": s["case"][0],
                                "base": s["case"][2],
                                "class": "HANG",
                                "mutation": "?",
                                "kind": "?",
                                "detail": {},
                            }
                        )
                        print(f"[{s['case'][0]}] HANG          {s['case'][2]}", flush=True)
                        s["case"] = None
                        pool.restart(i)
                if out_of_time and not any(s["case"] for s in pool.slots):
                    break
        finally:
            pool.close()
        if os.path.exists(canary):  # a payload that ran late still counts
            for c in cases:
                c.setdefault("late_canary", True)
        counts = collections.Counter(c["class"] for c in cases)
        return {
            "cases": sorted(cases, key=lambda c: c["index"]),
            "counts": counts,
            "seconds": time.monotonic() - start,
            "canary": os.path.exists(canary),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summary_table(result: dict) -> str:
    cases = result["cases"]
    bases = sorted({c["base"] for c in cases})
    rows = [["class"] + bases + ["total"]]
    for cls in CLASSES:
        rows.append(
            [cls]
            + [str(sum(1 for c in cases if c["class"] == cls and c["base"] == b)) for b in bases]
            + [str(result["counts"].get(cls, 0))]
        )
    rows.append(["mutants"] + [str(sum(1 for c in cases if c["base"] == b)) for b in bases] + [str(len(cases))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths, strict=False)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    ops = collections.Counter(c["mutation"].split(":")[0].split(" ")[0] for c in cases)
    lines.append("")
    lines.append("mutations: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
    lines.append(
        "DATA_FLIP = stored values changed (tensor payload, a non-tensor record) and read without error, "
        "in a base without checksums (plain1, te1); on checksummed bases that is SILENT_WRONG"
    )
    lines.append(
        "METADATA_VALID = .metadata edited into another valid description, reported faithfully: "
        "undetectable without a checksum of the metadata itself"
    )
    lines.append(f"{len(cases)} mutants in {result['seconds']:.0f} s; code executed: {result['canary']}")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=2000, help="mutants to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per mutant (all reader paths) before HANG")
    ap.add_argument("--budget", type=float, default=None, help="stop starting mutants after this many seconds")
    ap.add_argument(
        "--max-alloc-mb", type=float, default=512.0, help="peak-memory growth of one path that counts as BIG_ALLOC"
    )
    ap.add_argument("--json", type=Path, default=None, help="write every case here")
    ap.add_argument("--verbose", action="store_true", help="print every case, not only bad ones")
    args = ap.parse_args(argv)
    result = fuzz(
        args.n,
        args.seed,
        workers=args.workers,
        timeout=args.timeout,
        budget=args.budget,
        max_alloc_mb=args.max_alloc_mb,
        verbose=args.verbose,
    )
    print(summary_table(result))
    if args.json:
        args.json.write_text(json.dumps({**result, "counts": dict(result["counts"])}, indent=1, default=str))
    bad = sum(result["counts"].get(c, 0) for c in CLASSES if c not in GOOD | {"DATA_FLIP"})
    return 1 if bad or result["canary"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fuzz ckptq's reader paths with mutated real checkpoints.

Builds real checkpoints (:data:`BASES`: every format, 1 and 2 ranks, native and high precision,
saved by ckptq's ``ChecksumFileSystemWriter``, by ``ckptq reshard``, and by DCP's own
``FileSystemWriter`` + ``QuantizedSavePlanner`` with the planner's per-rank checksum files; and a
TransformerEngine-shaped one through the stand-in in ``tests/te_standin``, saved with DCP's planner),
checks that the bases of one mode read the same values as the quantized source
(:func:`check_ground_truth`), mutates copies of them and runs every reader path on each mutant, in
worker processes (``--jobs``) with a time limit per case:

* ``read_metadata``: :func:`ckptq.io.read_metadata`;
* ``view``: :func:`ckptq.checkpoint.open_checkpoint` + ``read`` of every tensor (``load_entries``)
  and ``read_raw_bytes`` of every non-tensor entry;
* ``indexed``: the same reads from :func:`ckptq.checkpoint.open_indexed` (the chunk index
  ``.metadata.index``), through ``open_checkpoint`` where it says there is no index to use;
* ``inspect``: :func:`ckptq.inspect.inspect_checkpoint` with ``stats=True``;
* ``verify``: :func:`ckptq.verify.verify_checkpoints` of the original against the mutant;
* ``integrity``: :func:`ckptq.verify.check_integrity` of the mutant alone (``ckptq verify PATH``);
* ``load``: ``dcp.load`` with :class:`ckptq.io.SafeFileSystemReader` + ``QuantizedLoadPlanner``,
  into targets of the saved formats and into plain float32 targets (the decode route); a
  ``CheckpointException`` counts as a ckptq error only when what it wraps is one
  (:func:`ckptq.io.dcp_failure`).

Mutations: byte flips anywhere, in tensor payloads, in scale components; zeroed ranges,
truncation, deleted files, garbage appended; records replaced by another ``torch.save`` of the
chunk (a transposed or strided view of the same values, re-pickled, the legacy format, or other
values: the transpose's bytes, reversed, a bit flipped); edits of the unpickled ``Metadata`` (entry
sizes and dtypes, chunk offsets and sizes, dropped or duplicated chunks, storage offsets, lengths
and files, descriptors and the ckptq record) re-pickled; edits that leave a structurally valid
checkpoint (a descriptor's version, dtype or mode, a component's dtype in its descriptor and entry
together, the ckptq record removed); per-rank checksum files deleted, emptied, flipped or edited
(a checksum, a row dropped or doubled, the rank, the algorithm, a row's key); foreign records (a
tensor of another dtype or shape, a pickle that runs code) appended and pointed at; a
``.metadata`` carrying a code-running pickle. Code-running pickles ``touch`` a canary file: if it
ever exists, code ran.

Each mutant is classified (worst first); the result a path returns is compared with the unmutated
base's (the ground truth):

* ``CODE_EXECUTED``: the canary exists;
* ``HANG``: the case ran past ``--timeout``;
* ``BIG_ALLOC``: a reader path raised the worker's peak memory by more than ``--max-alloc-mb``;
* ``UNCAUGHT``: a path raised something other than a ckptq error;
* ``SILENT_WRONG``: a path returned a different result from the original's without an error (on
  the bases ckptq planned, :data:`PLANNED`, whatever was mutated);
* ``DATA_FLIP``: the same, on ``te1`` (not planned by ckptq: no checksums), for a mutation that only
  changed stored values: undetectable there, counted apart;
* ``METADATA_VALID``: the same, on ``te1`` (no metadata digest), for an edit of ``.metadata`` into
  another valid description that ``load`` does not read differently: counted apart;
* ``RECORD_REMOVED``: on a planned base, a ``.metadata`` that no longer has a ckptq record at all: it
  then describes a plain DCP checkpoint of the stored components, which the paths report; counted
  apart when ``load`` (of the saved state_dict) returns nothing different;
* ``CKPTQ_ERROR`` (good): at least one path raised a ckptq error, none returned a different result;
* ``SAME`` (good): every path returned the original's result (e.g. a flip in unused bytes).

Whatever CPython prints outside any result while a worker reads a mutant (``sys.excepthook``, e.g.
a deallocator's ``SystemError``, and unraisable exceptions) is returned with that case and printed
as ``STRAY`` (:class:`StrayMessages`); a run with any exits 1.

Usage::

    python scripts/fuzz_checkpoints.py --n 2000 --seed 0 [--jobs 2] [--timeout 60] [--budget S] [--json F] [--md F]

``--budget`` bounds the whole run (corpus build included): no mutant starts after it, one in
flight gets at most ``--timeout``, then the summary is written. SIGTERM / SIGINT stop the run and
write the summary so far, marked partial (exit 128 + signal); ``--flush-every`` (30 s) writes one
periodically while it runs, so a SIGKILL leaves one (docs/testing.md, "The fuzz of mutated
checkpoints"). Each case is reproducible from ``(seed, index)`` (and ``--bases``): ``--only I,J``
reruns cases and prints their paths.
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
    "RECORD_REMOVED",
    "CKPTQ_ERROR",
    "SAME",
]
GOOD = {"CKPTQ_ERROR", "SAME"}
#: classes that are no defect (counted apart): see the module docstring.
APART = {"DATA_FLIP", "METADATA_VALID", "RECORD_REMOVED"}
PATHS = ["read_metadata", "view", "indexed", "inspect", "verify", "load"]
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


def _quantized_state_2rank(rank: int, world: int) -> dict:
    """Rank ``rank``'s share of :func:`_quantized_state` on a 1-D mesh of ``world`` CPU ranks: the
    matrices (and ``ids``) as DTensors sharded on dim 0, quantized per shard by
    ``ckptq.quantize_state_dict`` (which equals, byte for byte, the box of the whole tensor's
    quantization), ``norm`` and ``step`` replicated plain values."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptq

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SHAPE, generator=g) * 3
    full = {
        "layers.0.nv": (x, "nvfp4"),
        "layers.0.nv2d": (x * 2, {"format": "nvfp4", "two_d": True}),
        "layers.0.mx": (x, "mxfp8"),
        "layers.0.mxc": (x / 5, {"format": "mxfp8", "columnwise": True}),
        "layers.0.fb": (x, "fp8_block"),
        "layers.0.ft": (x.bfloat16(), "fp8_tensor"),
        "layers.0.m4": (x, {"format": "mxfp4", "scale_rule": "rceil"}),
    }
    sd = ckptq.quantize_state_dict(
        {k: distribute_tensor(v, mesh, [Shard(0)]) for k, (v, _) in full.items()},
        {k: rule for k, (_, rule) in full.items()},
    )
    sd["layers.0.norm"] = torch.randn(SHAPE[1], generator=g).bfloat16()
    sd["layers.0.ids"] = distribute_tensor(torch.arange(12, dtype=torch.int64) - 3, mesh, [Shard(0)])
    sd["step"] = 7
    return sd


def _save_2rank(rank: int, world: int, store: str, targets: list, errors: Any) -> None:
    """On rank ``rank`` of a gloo group: ``dcp.save`` with DCP's own ``FileSystemWriter`` +
    ``QuantizedSavePlanner(mode)``, for each ``(mode, directory)`` of ``targets``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        import ckptq

        warnings.filterwarnings("ignore")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            for mode, path in targets:
                sd = _quantized_state_2rank(rank, world)
                dcp.save(sd, checkpoint_id=path, planner=ckptq.QuantizedSavePlanner(mode=mode))
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _run_2rank(targets: list) -> None:
    """:func:`_save_2rank` on 2 spawned processes (gloo, a FileStore in a temporary directory)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=_save_2rank, args=(r, 2, os.path.join(d, "store"), targets, errors)) for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise RuntimeError("the 2-rank dcp.save failed: " + (errors.get(timeout=5) if not errors.empty() else "?"))


#: every base checkpoint: name -> how it was written.
BASES = {
    "native1": "dcp.save, ChecksumFileSystemWriter + QuantizedSavePlanner(native), 1 rank",
    "hp1": "dcp.save, ChecksumFileSystemWriter + QuantizedSavePlanner(high_precision), 1 rank",
    "native2": "ckptq reshard of native1 to 2 ranks (ckptq's writer)",
    "hp2": "ckptq reshard of hp1 to 2 ranks (ckptq's writer)",
    "dcp_native1": "dcp.save, DCP's FileSystemWriter + QuantizedSavePlanner(native), 1 rank (checksum file)",
    "dcp_hp1": "dcp.save, DCP's FileSystemWriter + QuantizedSavePlanner(high_precision), 1 rank (checksum file)",
    "dcp_native2": "dcp.save on 2 gloo ranks, DCP's FileSystemWriter + QuantizedSavePlanner(native) (2 checksum files)",
    "dcp_hp2": "dcp.save on 2 gloo ranks, DCP's FileSystemWriter + QuantizedSavePlanner(high_precision) "
    "(2 checksum files)",
    "te1": "dcp.save with DCP's planner and writer of TransformerEngine-shaped tensors (not planned by ckptq)",
}
#: the bases ckptq's planner planned (every one but the TE-written): a changed stored value, or a
#: .metadata that reads as another checkpoint, must be detected there.
PLANNED = {k for k in BASES if k != "te1"}


def build_corpus(root: Path, names: list | None = None) -> dict[str, Path]:
    """The base checkpoints (:data:`BASES`, or those of ``names``): name -> directory. The bases
    of one mode hold the same values: checked here (:func:`check_ground_truth`)."""
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.io import ChecksumFileSystemWriter

    warnings.filterwarnings("ignore")
    want = set(names or BASES)
    need = want | {src for src, name in (("native1", "native2"), ("hp1", "hp2")) if name in want}  # reshard sources
    bases = {}
    # ckptq's writer (checksums in the record) and DCP's own writer (the planner writes the checksum
    # file __0_0.ckptq-crc32c)
    for mode, name, ckptq_writer in (
        ("native", "native1", True),
        ("high_precision", "hp1", True),
        ("native", "dcp_native1", False),
        ("high_precision", "dcp_hp1", False),
    ):
        if name in need:
            bases[name] = root / name
            where = (
                {"storage_writer": ChecksumFileSystemWriter(bases[name])}
                if ckptq_writer
                else {"checkpoint_id": str(bases[name])}
            )
            dcp.save(_quantized_state(), planner=ckptq.QuantizedSavePlanner(mode=mode), no_dist=True, **where)
    two = [(mode, name) for mode, name in (("native", "dcp_native2"), ("high_precision", "dcp_hp2")) if name in need]
    if two:
        for _, name in two:
            bases[name] = root / name
        _run_2rank([(mode, str(bases[name])) for mode, name in two])
    for src, name in (("native1", "native2"), ("hp1", "hp2")):
        if name in need:
            bases[name] = root / name
            ckptq.reshard_checkpoint(bases[src], bases[name], mesh="2")
    if "te1" in need:
        bases["te1"] = root / "te1"
        dcp.save(_te_state(), checkpoint_id=str(bases["te1"]), no_dist=True)  # DCP's planner: pickled TE records
    check_ground_truth(bases)
    return {k: v for k, v in bases.items() if k in want}


def check_ground_truth(bases: dict) -> None:
    """The unmutated bases of one mode read (``view``: every tensor and non-tensor entry) the same
    values as each other, and the native ones as ``ckptq.quantize`` of the source in memory: the
    reference each mutant is compared with is the truth, not just what the base happens to read.

    Raises:
        RuntimeError: a base reads other values.
    """
    from ckptq.checkpoint import open_checkpoint

    truth = {fqn: _digest(v) for fqn, v in _quantized_state().items() if fqn != "step"}
    groups: dict[str, dict] = {}
    for name, path in bases.items():
        if name == "te1":
            continue
        view = open_checkpoint(path)
        got = {
            e.fqn: (view.read_raw_bytes(e.fqn)[0] if e.kind == "bytes" else _digest(view.read(e.fqn)))
            for e in view.entries()
        }
        mode = "hp" if "hp" in name else "native"
        if mode == "native" and {k: v for k, v in got.items() if k != "step"} != truth:
            raise RuntimeError(f"base '{name}' does not read the quantized source's values")
        if groups.setdefault(mode, got) != got:
            raise RuntimeError(f"base '{name}' reads other values than the other {mode} bases")


# ----------------------------------------------------------------------------------- regions
def payload_ranges(base: Path) -> list[tuple[str, int, int, str]]:
    """``(file, start, end, fqn)`` of the tensor payload bytes (the storages inside each record)."""
    md = pickle.loads((base / ".metadata").read_bytes())  # our own corpus: a plain unpickle is fine
    out = []
    for index, info in md.storage_data.items():
        if index.offset is None:  # a non-tensor entry's record: copied verbatim by read_raw_bytes
            out.append((str(info.relative_path), info.offset, info.offset + info.length, index.fqn))
            continue
        blob = (base / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            for zi in z.infolist():
                if "/data/" not in zi.filename or zi.filename.endswith(".pkl"):
                    continue
                h = zi.header_offset
                nlen, xlen = struct.unpack("<HH", blob[h + 26 : h + 30])
                start = info.offset + h + 30 + nlen + xlen
                out.append((str(info.relative_path), start, start + zi.file_size, index.fqn))
    return out


def _is_scale(fqn: str) -> bool:
    """A scale-like component (scale, scale_inv, columnwise_scale, amax) of a native entry."""
    last = fqn.rsplit(".", 1)[-1]
    return "scale" in last or last == "amax"


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
    _append_at(ck, md, key, blob)
    return key.fqn, key.offset is None


def _append_at(ck: Path, md: Any, key: Any, blob: bytes) -> None:
    """Append ``blob`` to the data file of location ``key`` and point ``key`` at it."""
    info = md.storage_data[key]
    f = ck / info.relative_path
    info.offset = f.stat().st_size
    info.length = len(blob)
    with open(f, "ab") as fh:
        fh.write(blob)


def _record_variant(rng: random.Random, t: Any) -> tuple[Any, str, bool]:
    """A tensor to store in place of record tensor ``t``: ``(tensor, how, same values?)``.

    Same values, other storage: a transposed view (``t.T.contiguous().T``: column-major strides),
    a strided view into a larger storage, the record re-pickled (a fresh ``torch.save``, or the
    legacy non-zip format). Other values: the transpose's bytes read as ``t``'s shape (a reader
    that ignored strides would see these), the elements reversed, one bit of one element flipped
    and re-pickled."""
    import torch

    how = rng.choice(["transposed_view", "strided_view", "repickle", "repickle_legacy", "transposed_bytes", "bitflip"])
    if how == "transposed_view" and t.dim() == 2:
        return t.t().contiguous().t(), how, True
    if how == "strided_view" and t.numel():
        big = torch.zeros(t.numel() * 2 + 1, dtype=t.dtype)
        big[1::2] = t.reshape(-1)
        strides = [1] * t.dim()
        for d in range(t.dim() - 2, -1, -1):
            strides[d] = strides[d + 1] * t.shape[d + 1]
        return big.as_strided(t.shape, [2 * x for x in strides], 1), how, True
    if how == "transposed_bytes" and t.dim() == 2:
        return t.t().contiguous().reshape(t.shape), how, False
    if how == "bitflip" and t.numel():
        u = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).reshape(-1).view(torch.uint8)
        u[rng.randrange(u.numel())] ^= 1 << rng.randrange(8)
        return u.view(t.dtype).reshape(t.shape), how, False
    if how == "repickle_legacy":
        return t.clone(), how, True
    if t.dim() >= 1 and t.shape[0] > 1 and rng.random() < 0.3:
        return t.flip(0), "reversed", False
    return t.clone(), "repickle", True


def _replace_record(ck: Path, md: Any, rng: random.Random) -> tuple[str, str] | None:
    """Store another record in place of a tensor record (appended, its location pointed at it);
    ``(kind, description)``, or None when the base's records are not plain tensors (TE-written)."""
    import torch

    keys = [k for k in md.storage_data if k.offset is not None]
    if not keys:
        return None
    key = rng.choice(keys)
    info = md.storage_data[key]
    raw = (ck / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    try:
        t = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception:  # noqa: BLE001 - a pickled foreign tensor (te1): not a plain record
        return None
    if not isinstance(t, torch.Tensor):
        return None
    v, how, same = _record_variant(rng, t)
    buf = io.BytesIO()
    if how == "repickle_legacy":
        torch.save(v, buf, _use_new_zipfile_serialization=False)
    else:
        torch.save(v, buf)
    _append_at(ck, md, key, buf.getvalue())
    # a fresh contiguous copy: a 1-element view may keep a stride != 1 that .view(uint8) refuses
    flat = [
        torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x).reshape(-1).view(torch.uint8)
        for x in (v, t)
    ]
    same = same and torch.equal(*flat)
    return ("bytes" if same else "data"), f"record {how} for {key.fqn} {list(key.offset)}"


def _valid_metadata_edit(rng: random.Random, md: Any) -> str | None:
    """An edit of ``.metadata`` that leaves a checkpoint every structural check accepts: a
    descriptor's version, logical dtype or mode; a component's dtype changed in its descriptor and
    its entry together (to one of the same element size); the ckptq record removed (the
    components then read as a plain DCP checkpoint). None when the base has no ckptq record."""
    import torch

    from ckptq.contract import CKPTQ_KEY
    from ckptq.formats.base import dtype_to_str, str_to_dtype

    rec = (md.planner_data or {}).get(CKPTQ_KEY)
    if not rec or not rec.get("tensors"):
        return None
    name = rng.choice(sorted(rec["tensors"]))
    desc = rec["tensors"][name]
    op = rng.choice(["version", "dtype", "mode", "component_dtype", "component_dtype", "no_record"])
    if op == "version":
        desc["version"] = rng.choice([0, 2, 99])
        return f"valid_edit {name} version -> {desc['version']}"
    if op == "dtype":
        desc["dtype"] = rng.choice([d for d in ("float32", "bfloat16", "float16") if d != desc.get("dtype")])
        return f"valid_edit {name} dtype -> {desc['dtype']}"
    if op == "mode":
        desc["mode"] = "native" if desc.get("mode") == "high_precision" else "high_precision"
        return f"valid_edit {name} mode -> {desc['mode']}"
    if op == "component_dtype" and desc.get("components"):
        comp = rng.choice(sorted(desc["components"]))
        cd = desc["components"][comp]
        old = str_to_dtype(cd["dtype"])
        same_size = [
            d
            for d in (
                torch.uint8,
                torch.int8,
                torch.float8_e4m3fn,
                torch.float8_e5m2,
                torch.float8_e8m0fnu,
                torch.float16,
                torch.bfloat16,
                torch.int16,
                torch.float32,
                torch.int32,
            )
            if d != old and d.itemsize == old.itemsize
        ]
        new = rng.choice(same_size)
        cd["dtype"] = dtype_to_str(new)
        entry = md.state_dict_metadata.get(cd.get("fqn") or f"{name}.{comp}")
        if entry is not None and hasattr(entry, "properties"):
            entry.properties.dtype = new
        return f"valid_edit {name}.{comp} component dtype -> {cd['dtype']}"
    md.planner_data = {k: v for k, v in md.planner_data.items() if k != CKPTQ_KEY}
    return "valid_edit no_record"


def _sidecar_edit(rng: random.Random, ck: Path, names: list) -> str:
    """Edit a per-rank checksum file (``__{rank}_0.ckptq-crc32c``): delete it, empty it, flip a
    byte, or change its JSON (a checksum, a row dropped or duplicated with another value, the rank,
    the algorithm, a row's key)."""
    name = rng.choice(names)
    f = ck / name
    op = rng.choice(["delete", "empty", "flip", "value", "drop_row", "dup_row", "rank", "algorithm", "key"])
    if op == "delete":
        f.unlink()
        return f"sidecar delete {name}"
    if op == "empty":
        f.write_bytes(b"")
        return f"sidecar empty {name}"
    if op == "flip":
        blob = bytearray(f.read_bytes())
        pos = rng.randrange(len(blob))
        blob[pos] ^= rng.randrange(1, 256)
        f.write_bytes(bytes(blob))
        return f"sidecar flip {name} @{pos}"
    doc = json.loads(f.read_bytes())
    rows = doc["chunks"]
    i = rng.randrange(len(rows))
    if op == "value":
        rows[i][2] ^= 1 << rng.randrange(32)
    elif op == "drop_row":
        del rows[i]
    elif op == "dup_row":
        rows.append([rows[i][0], rows[i][1], rows[i][2] ^ 1])
    elif op == "rank":
        doc["rank"] = rng.choice([doc["rank"] + 1, -1, "0", None])
    elif op == "algorithm":
        doc["algorithm"] = rng.choice(["xxh64", "", None, "CRC32C"])
    else:
        rows[i][0] = rng.choice([r[0] for r in rows])
        rows[i][1] = rng.choice([r[1] for r in rows])
    f.write_text(json.dumps(doc))
    return f"sidecar {op} {name} row {i}"


def mutate(base: Path, ck: Path, rng: random.Random, canary: str, payload: list) -> tuple[str, str]:
    """Copy ``base`` to ``ck`` and mutate it; returns ``(kind, description)``. ``kind``:
    ``"data"`` for a change of stored values only (tensor payload bytes, a record of the chunk's
    dtype and shape with other values, a non-tensor record), ``"bytes"`` for other bytes that
    hold the same values, ``"metadata_bytes"`` / ``"descriptor"`` for ``.metadata`` changes that
    may still describe a valid checkpoint, ``"checksums"`` for a checksum file's, else
    ``"structure"`` / ``"evil"`` / ``"noop"``."""
    import torch

    shutil.copytree(base, ck)
    files = sorted(p.name for p in ck.iterdir())
    sidecars = [f for f in files if f.endswith(".ckptq-crc32c")]
    op = rng.choices(
        [
            "flip",
            "flip_payload",
            "flip_scale",
            "zero",
            "truncate",
            "delete",
            "append",
            "metadata",
            "valid_edit",
            "record",
            "sidecar",
            "bad_record",
            "evil_record",
            "evil_metadata",
        ],
        weights=[16, 8, 4, 5, 6, 3, 2, 30, 6, 6, 6 if sidecars else 0, 5, 2, 1],
    )[0]
    if op == "flip_scale":
        scales = [r for r in payload if _is_scale(r[3])]
        if not scales:
            op = "flip_payload"
    if op in ("flip", "zero", "flip_payload", "flip_scale"):
        if op in ("flip_payload", "flip_scale") and payload:
            name, a, b, _ = rng.choice(scales if op == "flip_scale" else payload)
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
        if name in sidecars:
            return "checksums", f"{op} {name} @{pos}+{n}"
        # bytes of stored values changed: zip readers skip local headers, so a range that
        # straddles one changes values only
        inside = any(name == f and pos < b and a < pos + n for f, a, b, _ in payload)
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
    if op == "sidecar":
        return "checksums", _sidecar_edit(rng, ck, sidecars)
    md = pickle.loads((ck / ".metadata").read_bytes())
    if op == "record":
        done = _replace_record(ck, md, rng)
        if done is None:
            op = "metadata"
        else:
            kind, what = done
    if op == "valid_edit":
        what = _valid_metadata_edit(rng, md)
        kind = "descriptor"
        if what is None:
            op = "metadata"
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
    elif op == "evil_metadata":
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
        h.update(
            torch.empty_like(x, memory_format=torch.contiguous_format)
            .copy_(x)
            .reshape(-1)
            .view(torch.uint8)
            .numpy()
            .tobytes()
        )
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

    return _view_fingerprint(open_checkpoint(ck))


def _view_fingerprint(view) -> str:
    out = []
    for e in view.entries():
        out.append(
            (e.fqn, view.read_raw_bytes(e.fqn)[0].hex()[:64] if e.kind == "bytes" else _digest(view.read(e.fqn)))
        )
    return repr(out)


def path_indexed(ck: Path, orig: Path) -> str:
    """The view opened from the chunk index (``open_indexed``), or through ``.metadata`` where it says
    there is none to use, as its docstring tells a caller to do."""
    from ckptq.checkpoint import open_checkpoint, open_indexed

    return _view_fingerprint(open_indexed(ck) or open_checkpoint(ck))


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
    report["summary"].pop("bytes", None)  # the records' lengths: not a claim about the values
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
    "indexed": path_indexed,
    "inspect": path_inspect,
    "verify": path_verify,
    "integrity": path_integrity,
    "load": path_load,
}


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


def has_record(ck: Path) -> bool | None:
    """Whether ``ck/.metadata`` (read through ckptq's allow-list unpickler) holds a ckptq record;
    None when it cannot be read that way (every path then fails on it too)."""
    from ckptq.contract import has_record as _has
    from ckptq.io.safe_pickle import safe_loads

    try:
        data = (ck / ".metadata").read_bytes()
        # safe_loads first checks memo indices and data lengths: no allocation of a corrupt length
        return bool(_has(safe_loads(data, source=str(ck)).planner_data))
    except Exception:  # noqa: BLE001 - unreadable: judged by the paths
        return None


def classify(
    kind: str, results: dict, reference: dict, canary_hit: bool, planned: bool = False, record_lost: bool = False
) -> str:
    """The class of one mutant (see the module docstring). ``planned``: the base was planned by
    ckptq's planner; ``record_lost``: the mutant's ``.metadata`` has no ckptq record any more."""
    if canary_hit:
        return "CODE_EXECUTED"
    statuses = [s for s, _ in results.values()]
    if "alloc" in statuses:
        return "BIG_ALLOC"
    if "uncaught" in statuses:
        return "UNCAUGHT"
    differs = [p for p, (s, v) in results.items() if s == "ok" and v != reference[p][1]]
    if differs:
        if planned:
            # a planned checkpoint must read its saved values or fail; the one exception is a
            # .metadata that no longer carries the ckptq record at all: it then describes (and the
            # paths report) a plain DCP checkpoint of the stored components, and no load of the
            # saved state_dict succeeds (load must not be among the differing paths)
            if record_lost and "load" not in differs:
                return "RECORD_REMOVED"
            return "SILENT_WRONG"
        if kind == "data":
            return "DATA_FLIP"
        if kind in ("descriptor", "metadata_bytes") and "load" not in differs:
            return "METADATA_VALID"
        return "SILENT_WRONG"
    return "CKPTQ_ERROR" if "ckptq" in statuses else "SAME"


# ----------------------------------------------------------------------------------- workers
class StrayMessages:
    """Collects what CPython reports outside any call's result while it is installed: what
    ``PyErr_Print`` hands ``sys.excepthook`` (e.g. ``SystemError: deallocated bytearray object has
    exported buffers``, printed by the deallocator itself) and unraisable exceptions (a ``__del__``
    or a finalizer that raised; ``sys.unraisablehook``), each with the Python stack it came from, so
    that a worker ties them to the mutant it was reading instead of leaving a bare line on stderr."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def __enter__(self) -> StrayMessages:
        self._saved = sys.excepthook, sys.unraisablehook
        sys.excepthook, sys.unraisablehook = self._except, self._unraisable
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.excepthook, sys.unraisablehook = self._saved

    def _except(self, typ: type, value: BaseException, tb: Any) -> None:
        self._add(f"{typ.__name__}: {value}")

    def _unraisable(self, u: Any) -> None:
        self._add(f"{u.exc_type.__name__}: {u.exc_value} ({u.err_msg or 'Exception ignored in'} {u.object!r})")

    def _add(self, what: str) -> None:
        where = "".join(traceback.format_stack(limit=10)[:-2])  # the code that was running
        self.messages.append(f"{what}\n{where}")

    def take(self) -> list[str]:
        out, self.messages = self.messages, []
        return out


def _detach_from_signals() -> None:
    """A worker leaves SIGINT / SIGTERM to the parent (which stops it and writes the summary; a
    Ctrl-C or ``timeout`` signals the whole process group) and dies with it (Linux
    ``PR_SET_PDEATHSIG``), so a killed parent leaves no worker reading a mutant."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(conn, bases: dict, payloads: dict, scratch: str, canary: str, max_alloc_mb: float) -> None:
    _detach_from_signals()
    global _MAX_ALLOC_MB
    _MAX_ALLOC_MB = max_alloc_mb
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.CRITICAL)
    references: dict[str, dict] = {}
    stray = StrayMessages().__enter__()  # for the worker's life
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
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
            lost = kind not in ("evil", "data", "bytes") and has_record(ck) is False
            results = run_paths(ck, orig)
            hit = os.path.exists(canary)
            cls = classify(kind, results, references[base], hit, base in PLANNED, lost)
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
                        "stray": stray.take(),
                    },
                )
            )
        finally:
            shutil.rmtree(ck, ignore_errors=True)


class Stopped(BaseException):
    """Raised in the parent by the SIGTERM / SIGINT handler :func:`main` installs: :func:`fuzz`
    stops its workers and returns what it has (a BaseException, so no ``except Exception`` on the
    way swallows it)."""

    def __init__(self, signum: int) -> None:
        import signal

        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


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

    def close(self, wait: float = 5.0) -> None:
        """Idle workers are told to exit, busy ones (a stop before their case ended) killed; whoever
        is still alive ``wait`` seconds later (all of them together) is killed."""
        for s in self.slots:
            if s["case"] is not None:
                s["proc"].kill()
                continue
            try:
                s["conn"].send(None)
            except (OSError, BrokenPipeError):
                pass
        end = time.monotonic() + wait
        for s in self.slots:
            s["proc"].join(max(0.0, end - time.monotonic()))
            if s["proc"].is_alive():
                s["proc"].kill()
                s["proc"].join(1)


def _lost(case: tuple, cls: str, detail: dict) -> dict:
    """The record of a case whose worker gave no result (it died, or hung and was killed)."""
    return {"index": case[0], "base": case[2], "class": cls, "mutation": "?", "kind": "?", "detail": detail}


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
    on_progress: Any = None,
    progress_every: float = 30.0,
    start: float | None = None,
) -> dict:
    """Run ``n`` mutants on ``workers`` processes; returns the result (:func:`_result`).

    Args:
        timeout: seconds one mutant (every reader path) may take; past it the case is a HANG and
            its worker is replaced.
        budget: seconds for the whole run from ``start`` (``time.monotonic()``; default: this
            call), the corpus build included: no mutant starts after it, one in flight gets at most
            ``timeout`` from its own start, then the workers are stopped. So the run ends by
            ``budget + timeout`` plus a few seconds to stop the workers.
        on_progress: called with the result so far (``partial`` true) every ``progress_every``
            seconds while mutants run (``main`` writes the summary files with it, so a killed run
            leaves one).

    A :class:`Stopped` (``main``'s SIGTERM / SIGINT handler) ends the run at once: the workers are
    killed, the cases in flight listed as ``unfinished``, and the result so far returned.
    """
    start = time.monotonic() if start is None else start
    tmp = Path(tempfile.mkdtemp(prefix="ckptq-fuzz-", dir=work))
    canary = str(tmp / "CANARY-code-ran")
    cases: list[dict] = []
    pool, began, stopped_by = None, None, None
    deadline = None if budget is None else start + budget

    def result(partial: bool) -> dict:
        busy = [s["case"][0] for s in pool.slots if s["case"] is not None] if pool else []
        return _result(cases, n, began, start, canary, partial, stopped_by, busy)

    try:
        try:
            corpus = build_corpus(tmp / "corpus", bases_filter)
            payloads = {k: payload_ranges(v) for k, v in corpus.items()}
            names = sorted(corpus)
            scratch = tmp / "scratch"
            scratch.mkdir()
            queue = collections.deque((i, seed, names[i % len(names)]) for i in range(n))
            if deadline is not None and time.monotonic() > deadline:
                stopped_by = "budget"
                queue.clear()
            if queue:
                pool = _Pool(
                    workers, ({k: str(v) for k, v in corpus.items()}, payloads, str(scratch), canary, max_alloc_mb)
                )
            began = flushed = time.monotonic()
            while pool is not None and (queue or any(s["case"] for s in pool.slots)):
                now = time.monotonic()
                if deadline is not None and now > deadline and queue:
                    stopped_by = "budget"
                    queue.clear()
                for i, s in enumerate(pool.slots):
                    if s["case"] is None and queue:
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
                            cases.append(_lost(s["case"], "UNCAUGHT", {"worker": "died"}))
                            pool.restart(i)
                        else:
                            cases.append(payload)
                            _report(payload, verbose)
                        s["case"] = None
                    elif not s["proc"].is_alive():
                        cases.append(_lost(s["case"], "UNCAUGHT", {"worker": "died"}))
                        s["case"] = None
                        pool.restart(i)
                    elif time.monotonic() - s["since"] > timeout:
                        cases.append(_lost(s["case"], "HANG", {}))
                        print(f"[{s['case'][0]}] HANG          {s['case'][2]}", flush=True)
                        s["case"] = None
                        pool.restart(i)
                if on_progress is not None and time.monotonic() - flushed >= progress_every:
                    on_progress(result(partial=True))
                    flushed = time.monotonic()
        except Stopped as e:
            stopped_by = e.name
        out = result(partial=stopped_by not in (None, "budget"))
        if pool is not None:
            pool.close(wait=0.0 if out["partial"] else 5.0)
        if os.path.exists(canary):  # a payload that ran late still counts
            out["canary"] = True
            for c in cases:
                c.setdefault("late_canary", True)
        return out
    finally:
        if pool is not None:
            for s in pool.slots:  # an error above: no worker outlives the run
                if s["proc"].is_alive():
                    s["proc"].kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _report(case: dict, verbose: bool) -> None:
    """Print a finished case when it is not good (or ``verbose``), and anything stray its worker saw."""
    if verbose or case["class"] not in GOOD:
        print(f"[{case['index']}] {case['class']:13s} {case['base']:8s} {case['mutation'][:110]}", flush=True)
    for m in case.get("stray", ()):
        print(f"[{case['index']}] STRAY         {case['base']:8s} {m.splitlines()[0][:110]}", flush=True)


def _result(
    cases: list, n: int, began: float | None, start: float, canary: str, partial: bool, stopped_by: Any, busy: list
) -> dict:
    """``{"cases", "counts", "seconds", "setup_seconds", "canary", "requested", "partial",
    "stopped_by", "unfinished", "stray"}``: ``seconds`` since the first mutant was handed out,
    ``partial`` when written before the run ended (a periodic flush, a signal), ``stopped_by``
    ``"budget"`` or the signal's name (None: every mutant ran), ``unfinished`` the cases in flight."""
    now = time.monotonic()
    done = list(cases)
    return {
        "cases": sorted(done, key=lambda c: c["index"]),
        "counts": collections.Counter(c["class"] for c in done),
        "seconds": now - began if began is not None else 0.0,
        "setup_seconds": (began if began is not None else now) - start,
        "canary": os.path.exists(canary),
        "requested": n,
        "partial": partial,
        "stopped_by": stopped_by if stopped_by is not None or not partial else "running",
        "unfinished": sorted(busy),
        "stray": sum(1 for c in done if c.get("stray")),
    }


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
        "DATA_FLIP / METADATA_VALID: only on te1 (not planned by ckptq, no checksums, no metadata digest): "
        "stored values changed, or .metadata edited into another valid description, read without error"
    )
    lines.append(
        "RECORD_REMOVED: a planned base whose .metadata lost the whole ckptq record: every path reports the "
        "plain DCP checkpoint of the stored components it now describes; a load of the saved state_dict returns "
        "nothing different"
    )
    planned = [c for c in cases if c["base"] in PLANNED]
    lines.append(
        f"planned bases: {len(planned)} mutants, SILENT_WRONG {sum(c['class'] == 'SILENT_WRONG' for c in planned)}; "
        f"changed stored values (kind data): {sum(c['kind'] == 'data' for c in planned)}, of which "
        f"{sum(c['kind'] == 'data' and c['class'] == 'CKPTQ_ERROR' for c in planned)} CKPTQ_ERROR "
        f"({sum(c['kind'] == 'data' and 'ChecksumMismatchError' in str(c.get('errors')) for c in planned)} "
        f"with a ChecksumMismatchError)"
    )
    lines.append(
        f"{len(cases)} mutants in {result['seconds']:.0f} s; code executed: {result['canary']}; "
        f"cases with stray CPython messages (STRAY): {result.get('stray', 0)}"
    )
    stopped = result.get("stopped_by")
    if stopped:
        state = "in progress" if stopped == "running" else f"stopped by {stopped}"
        lines.append(
            f"{state} after {len(cases)} of {result['requested']} mutants"
            + (f" ({len(result['unfinished'])} in flight, not counted)" if result["unfinished"] else "")
        )
    return "\n".join(lines)


def rerun(seed: int, indices: list, bases_filter: list | None = None) -> None:
    """Rerun cases ``indices`` of a run with ``seed`` in this process and print each path's result
    (``--only``); the base of case ``i`` is the ``i % len(bases)``-th of the sorted base names."""
    tmp = Path(tempfile.mkdtemp(prefix="ckptq-fuzz-"))
    canary = tmp / "CANARY-code-ran"
    try:
        names = sorted(bases_filter or BASES)
        corpus = build_corpus(tmp / "corpus", sorted({names[i % len(names)] for i in indices}))
        for i in indices:
            base = names[i % len(names)]
            orig = corpus[base]
            reference = run_paths(orig, orig)
            ck = tmp / f"case{i}"
            kind, what = mutate(orig, ck, random.Random(f"{seed}:{i}"), str(canary), payload_ranges(orig))
            lost = kind not in ("evil", "data", "bytes") and has_record(ck) is False
            results = run_paths(ck, orig)
            cls = classify(kind, results, reference, canary.exists(), base in PLANNED, lost)
            print(f"[{i}] {cls} {base} ({kind}) {what}")
            for p, (status, value) in results.items():
                same = status == "ok" and value == reference[p][1]
                print(f"    {p:13s} {status:8s} {'same' if same else value[:2000]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def machine() -> dict:
    """Where the run happened: CPU model and count, Python and torch versions, UTC date."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def summarize(result: dict, args: argparse.Namespace, command: str) -> dict:
    """The summary of a run (what ``--json`` writes under ``"summary"``)."""
    cases = result["cases"]
    planned = [c for c in cases if c["base"] in PLANNED]
    return {
        "mutants": len(cases),
        "requested": result["requested"],
        "partial": result["partial"],
        "stopped_by": result["stopped_by"],
        "unfinished": result["unfinished"],
        "seconds": round(result["seconds"], 1),
        "setup_seconds": round(result["setup_seconds"], 1),
        "jobs": args.jobs,
        "seed": args.seed,
        "counts": dict(result["counts"]),
        "bad": sum(result["counts"].get(c, 0) for c in CLASSES if c not in GOOD | APART),
        "stray": result["stray"],
        "code_executed": result["canary"],
        "planned_mutants": len(planned),
        "planned_silent_wrong": sum(c["class"] == "SILENT_WRONG" for c in planned),
        "planned_data_mutants": sum(c["kind"] == "data" for c in planned),
        "planned_data_detected": sum(c["kind"] == "data" and c["class"] == "CKPTQ_ERROR" for c in planned),
        "checksum_file_mutants": sum(c["kind"] == "checksums" for c in planned),
        "by_base": {
            b: dict(collections.Counter(c["class"] for c in cases if c["base"] == b))
            for b in sorted({c["base"] for c in cases})
        },
        "bases": {b: BASES[b] for b in sorted({c["base"] for c in cases})},
        "machine": machine(),
        "command": command,
    }


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file renamed over it: a run killed meanwhile leaves the
    previous summary whole, never a cut one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_summary(result: dict, args: argparse.Namespace, command: str) -> tuple[dict, str]:
    """Write ``--json`` / ``--md`` (either may be None) for ``result``; returns ``(summary, table)``."""
    table = summary_table(result)
    summary = summarize(result, args, command)
    if args.json:
        cases = result["cases"] if args.all_cases else [c for c in result["cases"] if c["class"] not in GOOD]
        if not args.all_cases:
            cases += [c for c in result["cases"] if c["class"] in GOOD and c.get("stray")]
        # every case in brief ([index, base, kind, class, mutation]), the others in full
        brief = [[c["index"], c["base"], c["kind"], c["class"], c["mutation"][:80]] for c in result["cases"]]
        _write_atomic(args.json, json.dumps({"summary": summary, "cases": cases, "brief": brief}, default=str))
    if args.md:
        m = summary["machine"]
        state = ""
        if result["partial"]:
            why = "while running" if summary["stopped_by"] == "running" else f"on {summary['stopped_by']}"
            state = (
                f"**Partial**: written {why}, {summary['mutants']} of {summary['requested']} mutants done "
                f"({len(summary['unfinished'])} in flight not counted).\n\n"
            )
        elif summary["stopped_by"] == "budget":
            state = f"Stopped by its time budget after {summary['mutants']} of {summary['requested']} mutants.\n\n"
        _write_atomic(
            args.md,
            f"# ckptq fuzz of mutated checkpoints, {m['date']}\n\n"
            f"Machine: {m['cpu']} ({m['cpu_count']} CPUs), Python {m['python']}, torch {m['torch']}; "
            f"{args.jobs} jobs.\n\nCommand: `{summary['command']}`\n\n{state}```\n{table}\n```\n\nBases:\n\n"
            + "".join(f"* `{b}`: {d}\n" for b, d in summary["bases"].items()),
        )
    return summary, table


def main(argv: list | None = None) -> int:
    start = time.monotonic()
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=2000, help="mutants to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", "--workers", dest="jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per mutant (all reader paths) before HANG")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run (corpus build included): no mutant starts after it, one in flight gets "
        "at most --timeout, then the summary is written",
    )
    ap.add_argument(
        "--max-alloc-mb", type=float, default=512.0, help="peak-memory growth of one path that counts as BIG_ALLOC"
    )
    ap.add_argument("--bases", default=None, help="comma-separated base names (default: all of BASES)")
    ap.add_argument("--json", type=Path, default=None, help="write the counts, the machine and every case here")
    ap.add_argument("--all-cases", action="store_true", help="--json lists every case (default: all but the good)")
    ap.add_argument("--md", type=Path, default=None, help="write the summary table (markdown) here")
    ap.add_argument(
        "--flush-every",
        type=float,
        default=30.0,
        help="seconds between partial summaries written to --json / --md while the run goes on",
    )
    ap.add_argument("--verbose", action="store_true", help="print every case, not only bad ones")
    ap.add_argument("--only", default=None, help="comma-separated case indices: rerun them here, print every path")
    args = ap.parse_args(argv)
    if args.only:
        rerun(args.seed, [int(i) for i in args.only.split(",")], args.bases.split(",") if args.bases else None)
        return 0
    import signal

    command = "python scripts/fuzz_checkpoints.py " + " ".join(argv if argv is not None else sys.argv[1:])

    def stop(signum: int, frame: Any) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal ends the process at once
            signal.signal(sig, signal.SIG_DFL)
        raise Stopped(signum)

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = fuzz(
            args.n,
            args.seed,
            workers=args.jobs,
            timeout=args.timeout,
            budget=args.budget,
            max_alloc_mb=args.max_alloc_mb,
            bases_filter=args.bases.split(",") if args.bases else None,
            verbose=args.verbose,
            on_progress=(lambda r: write_summary(r, args, command)) if args.json or args.md else None,
            progress_every=args.flush_every,
            start=start,
        )
        summary, table = write_summary(result, args, command)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    print(table)
    if result["partial"]:
        print(f"stopped by {result['stopped_by']}: partial summary of {summary['mutants']} mutants", flush=True)
        return 128 + int(getattr(signal.Signals, result["stopped_by"], 0))
    return 1 if summary["bad"] or summary["stray"] or result["canary"] else 0


if __name__ == "__main__":
    sys.exit(main())

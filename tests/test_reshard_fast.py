"""The byte-range reshard path: records written without torch.save, boxes read from byte ranges.

Lossless, so everything is compared byte for byte: the records against ``torch.save``'s, the boxes
against slices of the saved tensors, the resharded checkpoint against the source.
"""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes, raw_bytes

import ckptq
from ckptq.checkpoint import CheckpointView
from ckptq.errors import CheckpointFormatError, ChecksumMismatchError
from ckptq.io import read_metadata
from ckptq.io.record_check import check_record_header
from ckptq.io.records import locate_payload, payload_crc32, tensor_record
from ckptq.io.writer import CheckpointDirWriter
from ckptq.reshard import reshard_checkpoint
from ckptq.verify import check_integrity, verify_checkpoints

DTYPES_SHAPES = [
    (torch.uint8, (7, 33)),
    (torch.bfloat16, (3, 5, 7)),
    (torch.float8_e4m3fn, (64, 16)),
    (torch.float8_e8m0fnu, (129,)),
    (torch.float32, ()),
    (torch.float32, (0, 4)),
    (torch.int64, (2, 2)),
]


def _sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        if dtype == torch.uint8
        else torch.randint(
            0, 256, (*shape, torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8, generator=g
        )
        .view(dtype)
        .reshape(shape)
    )


def _record(t: torch.Tensor) -> bytes:
    rec = tensor_record(t.dtype, tuple(t.shape))
    data = bytes(raw_bytes(t).numpy()) if t.numel() else b""
    return rec.header + data + rec.trailer_for(payload_crc32(data))


def _without_serialization_id(blob: bytes) -> tuple[bytes, list]:
    """The archive with its ``.data/serialization_id`` member's bytes and CRC blanked (the only
    member torch.save makes different in every call)."""
    z = zipfile.ZipFile(io.BytesIO(blob))
    info = next(i for i in z.infolist() if i.filename.endswith("serialization_id"))
    out = bytearray(blob)
    n_name, n_extra = (
        int.from_bytes(blob[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(blob[info.header_offset + 28 : info.header_offset + 30], "little"),
    )  # the local header's
    start = info.header_offset + 30 + n_name + n_extra
    out[start : start + info.file_size] = bytes(info.file_size)
    crc = info.CRC.to_bytes(4, "little")
    while (at := out.find(crc)) >= 0:
        out[at : at + 4] = bytes(4)
    return bytes(out), [i.filename for i in z.infolist()]


@pytest.mark.parametrize("dtype,shape", DTYPES_SHAPES)
def test_record_is_torch_saves_bytes(dtype, shape):
    t = _sample(dtype, shape)
    ours = _record(t)
    ref = io.BytesIO()
    torch.save(t, ref)
    a, names_a = _without_serialization_id(ours)
    b, names_b = _without_serialization_id(ref.getvalue())
    assert names_a == names_b and a == b  # byte for byte but the per-save id
    assert zipfile.ZipFile(io.BytesIO(ours)).testzip() is None  # every member's CRC-32 holds
    check_record_header(io.BytesIO(ours), "record")
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert_same_bytes(back, t, f"{dtype} {shape}")
    at = locate_payload(io.BytesIO(ours), 0, len(ours), "record", dtype, tuple(shape))
    at = at[0]
    assert ours[at : at + t.numel() * t.element_size()] == (bytes(raw_bytes(t).numpy()) if t.numel() else b"")


def test_locate_payload_refuses_what_the_metadata_does_not_say():
    blob = _record(_sample(torch.bfloat16, (4, 8)))
    with pytest.raises(CheckpointFormatError, match="where: the record holds a bfloat16 tensor of shape \\[4, 8\\]"):
        locate_payload(io.BytesIO(blob), 0, len(blob), "where", torch.bfloat16, (4, 9))
    with pytest.raises(CheckpointFormatError, match="truncated or corrupt"):
        locate_payload(io.BytesIO(blob[:-30]), 0, len(blob) - 30, "where", torch.bfloat16, (4, 8))
    bad = bytearray(blob)
    bad[blob.index(b"_rebuild_tensor_v2")] ^= 1  # inside data.pkl: its CRC-32 no longer holds
    with pytest.raises(CheckpointFormatError, match="where"):
        locate_payload(io.BytesIO(bytes(bad)), 0, len(bad), "where", torch.bfloat16, (4, 8))
    strided = io.BytesIO()
    torch.save(_sample(torch.bfloat16, (8, 4)).t(), strided)  # a valid record, not one contiguous run
    n = len(strided.getvalue())
    assert locate_payload(strided, 0, n, "where", torch.bfloat16, (4, 8)) is None


def _chunked_checkpoint(path, full: torch.Tensor, boxes) -> None:
    w = CheckpointDirWriter(path)
    for r, (off, size) in enumerate(boxes):
        piece = full
        for d, (o, n) in enumerate(zip(off, size, strict=False)):
            piece = piece.narrow(d, o, n)
        w.add_chunk(r % 3, "t", full.shape, off, piece)
    w.finish({})


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float8_e4m3fn])
def test_read_box_is_the_slice(tmp_path, dtype, hold, monkeypatch):
    """Uneven row and column chunks; boxes inside one chunk, across several, strided on both
    sides, whole chunks; a staging buffer small enough to need several bands; parts of a chunk
    served from the chunk read whole (``hold``) or read part by part."""
    import ckptq.checkpoint as cp

    monkeypatch.setattr(cp, "STAGING_BYTES", 256)
    monkeypatch.setattr(cp, "HOLD_BYTES", cp.HOLD_BYTES if hold else 0)
    full = _sample(dtype, (37, 20), seed=1)
    boxes = [((0, 0), (10, 20)), ((10, 0), (17, 7)), ((10, 7), (17, 13)), ((27, 0), (10, 20))]
    _chunked_checkpoint(tmp_path / "c", full, boxes)
    view = CheckpointView(tmp_path / "c")
    assert len(view.saved_chunks("t")) == 4
    g = torch.Generator().manual_seed(2)
    probes = boxes + [((0, 0), (37, 20)), ((5, 3), (30, 9)), ((11, 6), (3, 2)), ((36, 19), (1, 1))]
    for _ in range(20):
        r0, c0 = (int(x) for x in torch.randint(0, 20, (2,), generator=g))
        probes.append(
            (
                (r0, c0),
                (int(torch.randint(1, 38 - r0, (1,), generator=g)), int(torch.randint(1, 21 - c0, (1,), generator=g))),
            )
        )
    for off, size in probes:
        out = torch.empty(size, dtype=dtype)
        view.read_box("t", (off, size), out)
        assert_same_bytes(out, full[off[0] : off[0] + size[0], off[1] : off[1] + size[1]], f"box {off} {size}")
    view.close()


def test_read_by_byte_range_is_dcps_load(tmp_path):
    """``CheckpointView.read`` of byte-range-readable entries (the components of NVFP4, a 0-d amax
    among them, and of MXFP8 with its columnwise copy; a plain tensor) gives the bytes DCP's own
    load assembles."""
    from ckptq.io.reader import load_entries

    g = torch.Generator().manual_seed(3)
    sd = {
        "w": ckptq.quantize(torch.randn(96, 64, generator=g), "nvfp4"),
        "m": ckptq.quantize(torch.randn(64, 96, generator=g), "mxfp8", columnwise=True),
        "b": torch.randn(40, generator=g),
    }
    path = tmp_path / "c"
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    view = CheckpointView(path)
    for fqn in ("w", "m", "b"):
        entry = view.entry(fqn)
        assert all(view.saved_chunks(k) is not None for k in entry.keys.values())
        got = view.read(fqn)
        ref = load_entries(view.reader, view.metadata, list(entry.keys.values()))
        if entry.kind == "tensor":
            assert_same_bytes(got, ref[fqn], fqn)
        else:
            assert set(got._components) == set(entry.keys)
            for name, key in entry.keys.items():
                assert_same_bytes(got._components[name], ref[key], key)
    view.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_a_read_advises_the_next_entries_in_the_order_given(tmp_path, monkeypatch):
    """With ``will_read``, a read asks for its own records and then those of the entries after it in
    that order (not the file's), up to READ_AHEAD bytes; without it, its own (and the file window
    after them, not checked here). Same tensors."""
    import ckptq.checkpoint as cp

    sd = {name: _sample(torch.float32, (32, 32), seed=i) for i, name in enumerate("abcd")}  # 4 KiB each
    dcp.save(sd, checkpoint_id=str(tmp_path / "c"), planner=ckptq.QuantizedSavePlanner())
    view = CheckpointView(tmp_path / "c")
    asked: list = []
    monkeypatch.setattr(view, "_advise", lambda rel, start, n: asked.append((start, n)))
    monkeypatch.setattr(view, "_read_ahead", lambda rel, pos: None)  # the file window: not this test's
    ranges = {f: [(start, n) for _, start, n in view._record_ranges(f)] for f in sd}
    assert all(len(r) == 1 for r in ranges.values())
    assert_same_bytes(view.read("c"), sd["c"], "c")
    assert asked == ranges["c"]  # no order given: its own record only
    asked.clear()
    monkeypatch.setattr(cp, "READ_AHEAD", ranges["b"][0][1] + ranges["a"][0][1])
    view.will_read(["d", "b", "a", "c"])
    assert_same_bytes(view.read("d"), sd["d"], "d")
    assert asked == ranges["d"] + ranges["b"] + ranges["a"]
    asked.clear()
    assert_same_bytes(view.read("b"), sd["b"], "b")
    assert asked == ranges["c"]  # a was asked for already
    view.close()


def _flip_payload(path, key: str, offsets, at: float = 0.5) -> str:
    """Flip one bit of the payload of ``key``'s chunk at ``offsets``; returns the record's byte range text."""
    md = read_metadata(path)
    index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn == key and tuple(i.offset) == tuple(offsets))
    view = CheckpointView(path)
    c = next(c for c in view.saved_chunks(key) if c.box[0] == tuple(offsets))
    f = path / info.relative_path
    data = bytearray(f.read_bytes())
    nbytes = torch.Size(c.box[1]).numel() * c.dtype.itemsize
    data[c.payload + int(nbytes * at)] ^= 0x10
    f.write_bytes(bytes(data))
    return f"{info.offset}..{info.offset + info.length}"


@pytest.mark.parametrize("case", ["whole", "partial"])
def test_corrupt_source_chunk_stops_the_reshard(tmp_path, case):
    """A chunk whose bytes differ from its recorded checksum is named (file, byte range, entry),
    whether a target box copies it whole or reads part of it; nothing is written."""
    full = _sample(torch.bfloat16, (64, 32), seed=3)
    _chunked_checkpoint(tmp_path / "c", full, [((0, 0), (32, 32)), ((32, 0), (32, 32))])
    span = _flip_payload(tmp_path / "c", "t", (32, 0), 0.9)
    dst = tmp_path / "dst"
    mesh, plan = ("2", "fsdp2") if case == "whole" else ("4", "fsdp2")
    with pytest.raises(ChecksumMismatchError, match=f"'t'.*bytes {span}.*checksum mismatch"):
        reshard_checkpoint(tmp_path / "c", dst, mesh=mesh, plan=plan)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".dst")]


def test_corrupt_record_header_is_a_format_error(tmp_path):
    full = _sample(torch.uint8, (16, 16))
    _chunked_checkpoint(tmp_path / "c", full, [((0, 0), (8, 16)), ((8, 0), (8, 16))])
    md = read_metadata(tmp_path / "c")
    info = next(v for i, v in md.storage_data.items() if tuple(i.offset) == (8, 0))
    f = tmp_path / "c" / info.relative_path
    data = bytearray(f.read_bytes())
    at = data.index(b"_rebuild_tensor_v2", info.offset)
    data[at] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointFormatError, match=f"'t' \\(chunk at offsets \\[8, 0\\]\\), record '{info.relative_path}'"
    ):
        reshard_checkpoint(tmp_path / "c", tmp_path / "dst", mesh="2", plan="fsdp2")


def test_fast_reshard_of_native_tensors_is_bit_exact_with_checksums(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "a": ckptq.quantize(torch.randn(256, 512, generator=g), "nvfp4"),
        "b": ckptq.quantize(torch.randn(512, 256, generator=g), "mxfp8", columnwise=True),
        "c": ckptq.quantize(torch.randn(256, 256, generator=g), "fp8_block"),
        "d": ckptq.quantize(torch.randn(128, 64, generator=g), "fp8_tensor"),
        "e": torch.randn(100, 3, generator=g).to(torch.bfloat16),
        "f": torch.randn(7, generator=g),
        "step": 3,
    }
    src, mid, dst = tmp_path / "src", tmp_path / "mid", tmp_path / "dst"
    dcp.save(sd, checkpoint_id=str(src), planner=ckptq.QuantizedSavePlanner())
    # 1 -> 4 ranks (TP column cuts: partial, strided reads), then 4 -> 2 (row cuts: whole chunks)
    reshard_checkpoint(src, mid, mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=["a=row", "b=col", "c=row", "e=col"])
    reshard_checkpoint(mid, dst, mesh="2")
    for path in (mid, dst):
        summary = verify_checkpoints(src, path)["summary"]
        assert summary["ok"] and summary["bit_exact"] == summary["compared"] >= 6
        integrity = check_integrity(path)
        assert integrity["summary"]["failed"] == 0 and integrity["summary"]["unverified"] == 0, integrity
        for rel in os.listdir(path):  # every record of every data file: a valid zip, stock torch.load
            if not rel.endswith(".distcp"):
                continue
            md = read_metadata(path)
            blob = (path / rel).read_bytes()
            for index, info in md.storage_data.items():
                if info.relative_path == rel and index.offset is not None:
                    rec = blob[info.offset : info.offset + info.length]
                    assert zipfile.ZipFile(io.BytesIO(rec)).testzip() is None
                    torch.load(io.BytesIO(rec), weights_only=True)
    targets = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    dcp.load(targets, checkpoint_id=str(dst), planner=ckptq.QuantizedLoadPlanner())  # stock reader
    for k, v in sd.items():
        if isinstance(v, ckptq.QuantizedTensor):
            for name, comp in v.components().items():
                assert_same_bytes(targets[k].components()[name], comp, f"{k}.{name}")
        elif isinstance(v, torch.Tensor):
            assert_same_bytes(targets[k], v, k)
    assert targets["step"] == 3

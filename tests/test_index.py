"""The chunk index (ckptq/io/index.py): written next to .metadata, read in part, checked."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptq
from ckptq.checkpoint import CheckpointView, IndexedCheckpointView, open_indexed
from ckptq.contract import read_checksums
from ckptq.io import ChecksumFileSystemWriter
from ckptq.io.index import INDEX_FILE, ChunkIndex
from ckptq.parse import parse_mesh, parse_placement_rules
from ckptq.reshard import plan_reshard, run_reshard
from ckptq.verify import check_integrity
from tests._helpers import assert_same_bytes, assert_same_components

RULES = ["*.q_proj.weight=col", "*.o_proj.weight=row"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "layers.0.q_proj.weight": ckptq.quantize(torch.randn(256, 128, generator=g), "nvfp4"),
            "layers.0.o_proj.weight": ckptq.quantize(torch.randn(128, 256, generator=g), "mxfp8", columnwise=True),
            "experts.weight0": ckptq.quantize(torch.randn(128, 128, generator=g), "fp8_tensor"),
            "experts.weight1": ckptq.quantize(torch.randn(128, 128, generator=g), "fp8_tensor"),
            "norm.weight": torch.randn(128, generator=g),
        },
        "step": 11,
    }


def _save(path, seed: int = 0):
    dcp.save(_state(seed), storage_writer=ChecksumFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner())
    return path


@pytest.fixture()
def src(tmp_path):
    return _save(tmp_path / "src")


def _plan_rows(plan):
    return [
        (j.fqn, [e.fqn for e in j.sources], j.member, j.out, j.out_format, j.out_recipe, j.out_dtype, j.shape)
        + (j.placements, j.owners, j.bytes_per_rank, j.problem, j.note)
        for j in plan.jobs
    ]


def _same_as_metadata(path):
    """Every entry's chunks, locations and checksums from the index equal those of .metadata."""
    full, index = CheckpointView(path), ChunkIndex(path)
    sums = read_checksums(full.metadata.planner_data)
    assert sums and list(index.names) == sorted(full.metadata.state_dict_metadata)
    for key, md in full.metadata.state_dict_metadata.items():
        chunk_list, located, got = index.read_entry(key)
        assert chunk_list == sorted(getattr(md, "chunks", []), key=lambda c: tuple(c.offsets))
        want = full.metadata.storage_data
        assert {k: (v.relative_path, v.offset, v.length) for k, v in located.items()} == {
            k: (want[k].relative_path, want[k].offset, want[k].length) for k in located
        }
        assert len(located) == max(1, len(chunk_list))
        assert got == {k: v for k, v in sums.items() if k[0] == key}


def test_index_written_by_both_writers_and_read_back(src, tmp_path):
    """dcp.save with ckptq's storage writer and the offline writer (reshard) both write it, and
    .metadata's record names it; read back, it says what .metadata says."""
    assert (src / INDEX_FILE).is_file()
    _same_as_metadata(src)
    dst = tmp_path / "dst"
    ckptq.reshard_checkpoint(src, dst, mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=RULES)
    assert (dst / INDEX_FILE).is_file() and CheckpointView(dst).record["index"]["sha256"] == ChunkIndex(dst).digest
    _same_as_metadata(dst)


def test_per_rank_plan_and_data_from_the_index_equal_the_full_reader(src, tmp_path):
    mesh = parse_mesh("dp_shard=2,tp=2")
    rules = parse_placement_rules(mesh, "fsdp2-tp", RULES)
    full, indexed = CheckpointView(src), open_indexed(src)
    assert isinstance(indexed, IndexedCheckpointView)
    for kw in ({}, {"grouped": "stack"}, {"to": "mxfp8"}):
        for r in range(mesh.world_size):
            a = plan_reshard(full, mesh, rules, ranks=[r], **kw)
            b = plan_reshard(indexed, mesh, rules, ranks=[r], **kw)
            assert _plan_rows(a) == _plan_rows(b) and a.summary() == b.summary()
        assert not indexed._rows  # planning read no chunk rows

    def exact(keys):
        raise AssertionError(f"the array checks did not clear {keys}")

    indexed._check_exactly = exact  # a sound checkpoint: the array checks clear every entry
    for e in full.entries():  # whole tensors, bit-exact
        if e.kind == "bytes":
            assert full.read_raw_bytes(e.fqn)[0] == indexed.read_raw_bytes(e.fqn)[0]
        elif e.kind == "quantized":
            assert_same_components(full.read(e.fqn), indexed.read(e.fqn), e.fqn)
        else:
            assert_same_bytes(full.read(e.fqn), indexed.read(e.fqn), e.fqn)
    # a reshard read through each: the same data files, byte for byte
    outs = []
    for name, view in (("a", CheckpointView(src)), ("b", open_indexed(src))):
        plan = plan_reshard(view, mesh, rules, to="mxfp8")
        run_reshard(view, plan, tmp_path / name)
        outs.append(tmp_path / name)
    names = sorted(n for n in os.listdir(outs[0]) if n.endswith(".distcp"))
    assert names and names == sorted(n for n in os.listdir(outs[1]) if n.endswith(".distcp"))
    for n in names:
        assert (outs[0] / n).read_bytes() == (outs[1] / n).read_bytes(), n


def test_damaged_index_is_refused(src):
    blob = bytearray((src / INDEX_FILE).read_bytes())
    header = 8 + int.from_bytes(blob[:8], "little")
    # one flipped byte in the chunk rows: the crc32c of its block (index path) and `ckptq verify`; a
    # load through `.metadata` does not read the rows (it does not use them) and reads the saved values
    damaged = bytearray(blob)
    offsets = _data_offsets(src)
    start, end = offsets["chunks"]
    damaged[header + start + (end - start) // 2] ^= 0x10
    (src / INDEX_FILE).write_bytes(damaged)
    with pytest.raises(ckptq.CheckpointFormatError, match="crc32c"):
        view = open_indexed(src)  # (its check for foreign records reads a first row already)
        for e in view.entries():
            view.read(e.fqn) if e.kind != "bytes" else view.read_raw_bytes(e.fqn)
    with pytest.raises(ckptq.CheckpointFormatError, match="crc32c"):
        check_integrity(src)
    full = CheckpointView(src)
    for e in full.entries():
        if e.kind != "bytes":
            full.read(e.fqn)
    # one flipped byte in the tables: refused on open, by both
    damaged = bytearray(blob)
    start, _ = offsets["entries"]
    damaged[header + start + 3] ^= 0x01
    (src / INDEX_FILE).write_bytes(damaged)
    for opener in (open_indexed, CheckpointView):
        with pytest.raises(ckptq.CheckpointFormatError, match="digest"):
            opener(src)
    (src / INDEX_FILE).write_bytes(blob)
    assert isinstance(open_indexed(src), IndexedCheckpointView)


def _data_offsets(path):
    import json

    raw = (path / INDEX_FILE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return {k: tuple(v["data_offsets"]) for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}


def test_index_of_another_checkpoint_is_refused(src, tmp_path):
    other = _save(tmp_path / "other", seed=1)
    shutil.copy(other / INDEX_FILE, src / INDEX_FILE)
    assert open_indexed(src) is None  # .metadata does not name it: not used
    with pytest.raises(ckptq.CheckpointFormatError, match="not the one"):
        CheckpointView(src)


def test_checkpoint_without_index_reads_as_before(src, tmp_path):
    """DCP's own writer writes none; a later save of it over a ckptq checkpoint leaves a stale
    index that is not used (its .metadata does not name it) and does not stop the full reader."""
    plain = tmp_path / "plain"
    dcp.save(_state(0), checkpoint_id=str(plain), planner=ckptq.QuantizedSavePlanner())
    assert not (plain / INDEX_FILE).exists() and open_indexed(plain) is None
    CheckpointView(plain)
    w = torch.arange(8.0)
    dcp.save({"w": w}, storage_writer=dcp.FileSystemWriter(src, overwrite=True))
    assert (src / INDEX_FILE).is_file() and open_indexed(src) is None
    assert_same_bytes(CheckpointView(src).read("w"), w)


def test_reshard_through_the_index_writes_the_same_bytes(src, tmp_path):
    """``reshard_checkpoint`` through the index (the default; a grouped stack, boxes read by byte
    range): the destination is byte for byte the one the full reader's run (``index=False``)
    writes, index included."""
    kw = dict(mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=RULES, grouped="stack", grouped_glob="*.weight")
    ckptq.reshard_checkpoint(src, tmp_path / "a", index=False, **kw)
    ckptq.reshard_checkpoint(src, tmp_path / "b", **kw)
    a, b = ({p.name: p.read_bytes() for p in sorted((tmp_path / d).iterdir())} for d in "ab")
    assert INDEX_FILE in a and a == b


def test_rows_that_fail_the_readers_checks_are_refused(src):
    """An index whose digests are right but whose rows say something impossible (a chunk outside
    its tensor, a record past its file's end): refused when the entry is read, naming it."""
    import pickle

    from safetensors.numpy import load_file

    from ckptq.contract import with_index
    from ckptq.io.index import pack_index, save_index

    tensors = load_file(str(src / INDEX_FILE))
    index = ChunkIndex(src)
    key = "model.layers.0.q_proj.weight.data"
    i = index.names[key]
    maxnd = index.maxnd
    for column, value, match in ((0, 8, "outside the tensor"), (2 * maxnd + 1, 1 << 40, "truncated")):
        chunks = tensors["chunks"].copy()
        chunks[int(index.entries[i, 3]), column] = value  # its (one) chunk moved down 8 rows / far into its file
        doc = json.loads(bytes(tensors["table"]))
        names = [n.encode() for n in index.names]
        packed, header = pack_index(tensors["entries"], names, chunks, doc)
        save_index(src, packed, header)
        md = pickle.loads((src / ".metadata").read_bytes())
        md.planner_data = with_index(md.planner_data, INDEX_FILE, header["tables_sha256"])
        (src / ".metadata").write_bytes(pickle.dumps(md))
        view = open_indexed(src)
        assert isinstance(view, IndexedCheckpointView)
        with pytest.raises(ckptq.CheckpointFormatError, match=match):
            view.saved_chunks(key)


def _brute_valid(dims, boxes) -> bool:
    """Every box inside ``dims``, no element in two boxes, every element in one (element by element)."""
    import itertools

    seen = set()
    for off, sz in boxes:
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, dims, strict=True)):
            return False
        for p in itertools.product(*[range(o, o + s) for o, s in zip(off, sz, strict=True)]):
            if p in seen:
                return False
            seen.add(p)
    n = 1
    for d in dims:
        n *= d
    return len(seen) == n


def test_array_checks_of_rows_in_order_and_shuffled_agree_and_are_sound():
    """boxes_fine skips its sort for rows already in its order (the chunk index's), ranges_fine
    sorts by start alone: on random small layouts, rows in order and shuffled give one verdict, a
    True one only for a valid layout (element by element), and ranges_fine finds every overlap."""
    import itertools
    import random

    import numpy as np

    from ckptq.io.metadata import _in_order, boxes_fine, ranges_fine

    rng = random.Random(0)
    cleared = 0
    for _ in range(400):
        nd = rng.randint(1, 3)
        entries = []
        for _ in range(rng.randint(1, 3)):
            dims = [rng.randint(1, 4) for _ in range(nd)]
            if rng.random() < 0.6:  # a grid: valid unless changed below
                cuts = [sorted({0, dims[d], *(rng.randint(0, dims[d]) for _ in range(2))}) for d in range(nd)]
                boxes = [
                    ([c[0] for c in cell], [c[1] - c[0] for c in cell])
                    for cell in itertools.product(*[list(zip(c[:-1], c[1:], strict=True)) for c in cuts])
                ]
            else:
                boxes = [([rng.randint(0, 4) for _ in range(nd)], [rng.randint(0, 3) for _ in range(nd)])]
                boxes += [([rng.randint(0, 4) for _ in range(nd)], [rng.randint(0, 3) for _ in range(nd)])]
            if rng.random() < 0.3:
                boxes.append(rng.choice(boxes))  # a repeated box
            entries.append((dims, boxes))
        rows = [(e, off, sz) for e, (_, boxes) in enumerate(entries) for off, sz in boxes]
        valid = all(_brute_valid(dims, boxes) for dims, boxes in entries)
        dims = np.array([d for d, _ in entries], dtype=np.int64)
        in_order = sorted(rows, key=lambda r: (r[0], *[v for d in range(nd) for v in (r[1][d], r[2][d])]))
        shuffled = list(rows)
        rng.shuffle(shuffled)
        verdicts = []
        for case in (in_order, shuffled):
            entry = np.array([r[0] for r in case], dtype=np.int64)
            off = np.array([r[1] for r in case], dtype=np.int64).reshape(-1, nd)
            sz = np.array([r[2] for r in case], dtype=np.int64).reshape(-1, nd)
            if case is in_order:  # the path without a sort
                assert _in_order([a for d in reversed(range(nd)) for a in (sz[:, d], off[:, d])] + [entry])
            verdicts.append(boxes_fine(entry, off, sz, dims, True))
        assert verdicts[0] == verdicts[1] and (not verdicts[0] or valid), entries
        cleared += verdicts[0]
        # byte ranges of records in 3 files: None exactly when two non-empty ones of a file overlap
        recs = [(rng.randint(0, 2), rng.randint(0, 20), rng.randint(0, 5)) for _ in range(rng.randint(1, 6))]
        overlap = any(
            a[0] == b[0] and a[2] and b[2] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]
            for i, a in enumerate(recs)
            for b in recs[i + 1 :]
        )
        code, st, ln = (np.array([r[k] for r in recs], dtype=np.int64) for k in range(3))
        ends = ranges_fine(code, st, ln, 3)
        assert (ends is None) == overlap, recs
        if ends is not None:
            assert ends.tolist() == [max([s + n for c, s, n in recs if c == f], default=0) for f in range(3)]
    assert cleared > 50  # the grids (and some others) pass


def test_first_rows_alone_are_read_and_checked(tmp_path):
    """``rows(i, limit)`` reads (and checks) only the blocks its rows lie in: a damaged block after
    them does not stop it; the entry's whole rows then fail their block's crc32c."""
    import numpy as np

    from ckptq.io.index import BLOCK_ROWS, encode_planner_data, pack_index, save_index

    n = 2 * BLOCK_ROWS + 88  # one 1-d entry of n one-element chunks: three blocks of rows
    chunks = np.array([[i, 1, 0, 4 * i, 4, -1] for i in range(n)], dtype=np.int64)
    doc = {"dtypes": ["float32"], "files": ["__0_0.distcp"], "version": None, "checksums": False}
    doc.update(encode_planner_data(None, {}))
    tensors, header = pack_index(np.array([[0, 0, 1, 0, n, n]]), [b"w"], chunks, doc)
    save_index(tmp_path, tensors, header)
    blob = bytearray((tmp_path / INDEX_FILE).read_bytes())
    start, end = _data_offsets(tmp_path)["chunks"]
    blob[8 + int.from_bytes(blob[:8], "little") + end - 3] ^= 0x01  # in the last block
    (tmp_path / INDEX_FILE).write_bytes(blob)
    index = ChunkIndex(tmp_path)
    assert (index.rows(0, limit=BLOCK_ROWS + 1) == chunks[: BLOCK_ROWS + 1]).all()
    with pytest.raises(ckptq.CheckpointFormatError, match=f"crc32c of its chunk rows {2 * BLOCK_ROWS}"):
        index.rows(0)
    with pytest.raises(ckptq.CheckpointFormatError, match="crc32c"):
        index.check_rows()

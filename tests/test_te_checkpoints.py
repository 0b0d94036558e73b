"""TransformerEngine tensors and TE-written checkpoints through ckptq, tested with the stand-in
(``tests/te_standin``: TE's module paths, reconstructors, quantizer dicts and buffer layouts).

* live TE tensors -> ``QuantizedSavePlanner`` (native ckptq components) -> ``QuantizedLoadPlanner``
  into fresh TE tensors full of garbage: every held buffer equal byte for byte (padding zeroed);
* TE-shaped DCP checkpoints (DCP's default planner pickles each shard's TE object into its record)
  -> inspect / convert / dcp.load through ``SafeFileSystemReader`` without TE: components equal the
  TE tensor's canonical bytes, values equal TE's own dequantize, 1 and 2 gloo ranks;
* malicious records refused with nothing run.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _bounds import REENCODE_E4M3, REENCODE_NVFP4
from _dist import run_distributed
from _helpers import assert_same_bytes, requires_cuda
from _te import standin

import ckptq
from ckptq import adapters
from ckptq.checkpoint import CheckpointView
from ckptq.inspect import inspect_checkpoint
from ckptq.io import SafeFileSystemReader
from ckptq.metrics import bit_exact

te = standin()

# (name, kind, factory options, ckptq format); every TE buffer comes back byte for byte
CASES = [
    ("fp8_e4m3", "float8", dict(fp8_dtype="E4M3"), "fp8_tensor"),
    ("fp8_e5m2", "float8", dict(fp8_dtype="E5M2", columnwise=False), "fp8_tensor"),
    ("mxfp8_sw", "mxfp8", dict(swizzled=True), "mxfp8"),
    ("mxfp8_row", "mxfp8", dict(columnwise=False), "mxfp8"),
    ("nvfp4_2d", "nvfp4", dict(two_d=True), "nvfp4"),
    ("nvfp4_1d_sw", "nvfp4", dict(swizzled=True, columnwise=True), "nvfp4"),
    ("nvfp4_1d", "nvfp4", dict(), "nvfp4"),
    ("blk_2d", "float8_blockwise", dict(block_scaling_dim=2), "fp8_block"),
    ("blk_1d", "float8_blockwise", dict(block_scaling_dim=1), "fp8_block"),
]
SHAPE = (160, 96)  # ragged for 128x128 and 1x128 blocks; multiples of 32 (MXFP8) and 16 (NVFP4)


def _x(seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)


def _te(case, x=None, **extra):
    name, kind, opts, _ = case
    return te.make_te_tensor(_x() if x is None else x, kind, **{**opts, **extra})


def _canonical(t, fqn="w"):
    return adapters.adapter_for(t).to_canonical(t, fqn)[0]


def _same_components(a, b) -> bool:
    ca, cb = a.components(), b.components()
    return ca.keys() == cb.keys() and all(bit_exact(ca[k], cb[k]) for k in ca)


def _rowwise_buffers(bufs: dict) -> dict:
    return {k: v for k, v in bufs.items() if "columnwise" not in k and k != "_transpose"}


# ------------------------------------------------------------------ live TE tensors, one process
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_live_te_native_save_and_load_in_place(tmp_path, case):
    src = _te(case)
    dcp.save({"w": src, "b": torch.arange(4.0)}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    (row,) = [r for r in inspect_checkpoint(tmp_path)["tensors"] if r["fqn"] == "w"]
    assert (row["format"], row["mode"]) == (case[3], "native")
    desc = CheckpointView(tmp_path).entry("w").descriptor
    assert desc.producer["name"] == "transformer_engine" and desc.producer["class"] == type(src).__name__
    assert _same_components(CheckpointView(tmp_path).read("w"), _canonical(src))

    target = te.garbage_like(src)
    planner = ckptq.QuantizedLoadPlanner()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load({"w": target, "b": torch.empty(4)}, checkpoint_id=str(tmp_path), planner=planner)
    _assert_te_bytes(target, src)  # TE's own rowwise AND columnwise bytes
    assert "w" not in planner.derived and not [w for w in caught if "'w'" in str(w.message)]


def _assert_te_bytes(got, want, buffers=None):
    """Every buffer ``want`` holds (or those named) equal in ``got``, byte for byte, padding zeroed."""
    want, got = te.zero_padding(want), te.zero_padding(got)
    assert want.keys() == got.keys()
    for k in buffers or want:
        assert_same_bytes(got[k], want[k], k)


# Checkpoints without the columnwise copy load as before it was stored: the rowwise bytes raw, the
# copy requantized from them with a warning. (kind, factory options, SQNR floor: tests/_bounds.py)
WITHOUT_COLUMNWISE = {
    "nvfp4_1d": ("nvfp4", dict(swizzled=True), REENCODE_NVFP4),
    "blk_1d": ("float8_blockwise", dict(block_scaling_dim=1), REENCODE_E4M3),
    "mxfp8": ("mxfp8", dict(), REENCODE_E4M3),
}


@pytest.mark.parametrize("saved", ["rowwise_usage", "before_columnwise"])
@pytest.mark.parametrize("name", list(WITHOUT_COLUMNWISE))
def test_checkpoint_without_columnwise_copy_loads_with_warning(tmp_path, name, saved):
    kind, opts, floor = WITHOUT_COLUMNWISE[name]
    # magnitudes vary along M, so a columnwise block mixes rows of other scales: the copy is lossy
    x = (_x(shape=(96, 160)).float() * torch.logspace(-2, 1, 96)[:, None]).to(torch.bfloat16)
    src = te.make_te_tensor(x, kind, **opts)  # what the run held: both usages
    rowwise_only = te.make_te_tensor(x, kind, **opts, columnwise=False)
    if saved == "rowwise_usage":  # a TE tensor that held only its rowwise usage
        dcp.save({"w": rowwise_only}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    else:  # the canonical tensor without the copy: the descriptor ckptq wrote before it stored one
        qt = _canonical(src).rowwise_only()
        dcp.save({"w": qt}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
        recipe = CheckpointView(tmp_path).entry("w").descriptor.recipe
        assert recipe == ({"columnwise": False} if kind == "mxfp8" else qt._recipe_to_json(qt.recipe))
        assert kind == "mxfp8" or "columnwise" not in recipe
    assert not any("columnwise" in k for k in CheckpointView(tmp_path).entry("w").keys)
    target = te.garbage_like(src)
    planner = ckptq.QuantizedLoadPlanner()
    with pytest.warns(UserWarning, match=r"'w'.*columnwise copy.*requantized.*SQNR"):
        dcp.load({"w": target}, checkpoint_id=str(tmp_path), planner=planner)
    assert floor < planner.derived["w"] < float("inf")
    _assert_te_bytes(target, src, _rowwise_buffers(te.te_buffers(src)))  # the rowwise copy: raw bytes
    values = rowwise_only.dequantize(dtype=torch.float32)  # what TE quantizes the copy from on a resume
    extra = {"amax": float(_canonical(src).components()["amax"])} if kind == "nvfp4" else {}
    requantized = te.make_te_tensor(values, kind, **opts, **extra)
    _assert_te_bytes(target, requantized, [k for k in te.te_buffers(src) if "columnwise" in k])


@pytest.mark.parametrize("name", ["nvfp4_1d", "blk_1d"])
def test_columnwise_copy_not_kept_by_a_rowwise_target(tmp_path, name):
    """A target without the copy reads only the rowwise components of a checkpoint that has it."""
    kind, opts, _ = WITHOUT_COLUMNWISE[name]
    src = te.make_te_tensor(_x(), kind, **opts)
    dcp.save({"w": src}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    assert any("columnwise" in k for k in CheckpointView(tmp_path).entry("w").keys)
    target = te.garbage_like(te.make_te_tensor(_x(), kind, **opts, columnwise=False))
    ours = _canonical(src).rowwise_only().new_empty(src.shape)
    dcp.load({"w": target}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    dcp.load({"w": ours}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    _assert_te_bytes(target, te.make_te_tensor(_x(), kind, **opts, columnwise=False))
    assert _same_components(ours, _canonical(src).rowwise_only())


def test_unstorable_te_tensor_is_refused_or_saved_in_high_precision(tmp_path):
    src = te.make_te_tensor(_x(), "nvfp4", rht=True, columnwise=True)
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptq.io import dcp_failure

    with pytest.raises(CheckpointException) as ei:  # DCP wraps what the planner raised
        dcp.save({"w": src}, checkpoint_id=str(tmp_path / "a"), planner=ckptq.QuantizedSavePlanner())
    err = dcp_failure(ei.value, "save")
    assert isinstance(err, ckptq.UnsupportedFormatError)
    assert "'w'" in str(err) and "NVFP4Tensor" in str(err) and "high_precision" in str(err)
    planner = ckptq.QuantizedSavePlanner(rules={"w": "high_precision"}, dtype=torch.float32)
    dcp.save({"w": src}, checkpoint_id=str(tmp_path / "b"), planner=planner)
    out = {"w": torch.empty(SHAPE)}
    dcp.load(out, checkpoint_id=str(tmp_path / "b"))
    assert bit_exact(out["w"], src.dequantize(dtype=torch.float32))


# ------------------------------------------------------------------ TE-written checkpoints
def _te_state(seed=0):
    sd = {}
    for i, case in enumerate(CASES):
        sd[f"layers.{i}.{case[0]}.weight"] = _te(case, _x(seed + i))
    sd["layers.0.bias"] = torch.randn(SHAPE[0])
    sd["layers.0._extra_state"] = torch.empty(0, dtype=torch.uint8)
    return sd


@pytest.fixture(scope="module")
def te_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("te") / "ckpt"
    sd = _te_state()
    dcp.save(sd, checkpoint_id=str(path))  # DCP's default planner: each record a pickled TE tensor
    return path, sd


def test_te_checkpoint_records_are_te_pickles(te_ckpt):
    path, _ = te_ckpt
    blob = (path / "__0_0.distcp").read_bytes()
    assert b"_make_mxfp8_tensor_in_reduce_ex" in blob and b"_make_nvfp4_tensor_in_reduce_ex" in blob
    from torch.distributed.checkpoint import FileSystemReader

    fresh = {k: torch.empty(v.shape) for k, v in _te_state().items() if k.endswith("weight")}
    with pytest.raises(BaseException, match="Unsupported global"):  # what stock DCP does without TE
        dcp.load(fresh, storage_reader=FileSystemReader(str(path)))


def test_opening_reads_only_pickles_and_small_storages_and_equals_a_full_read(te_ckpt, monkeypatch):
    """``virtualize`` learns each TE tensor from its first record's pickle and small storages
    (per-tensor values) and does not read the data or block scales, but where the adapter compares
    values (NVFP4 16x16: its two copies' scales): the checkpoint it presents is the one a full read
    of every first record gives."""
    from ckptq.io import foreign, read_metadata

    path, _ = te_ckpt
    full_loads = []
    real_load = foreign._load_whole
    monkeypatch.setattr(foreign, "_load_whole", lambda *a: full_loads.append(a[2]) or real_load(*a))
    monkeypatch.setattr(foreign, "_SKELETON_BYTES", 64)  # the 160 x 96 test tensors' data and scales stay unread
    skeleton = read_metadata(path)
    assert [s.split("'")[-2] for s in full_loads] == ["layers.4.nvfp4_2d.weight"]
    monkeypatch.setattr(foreign, "_SKELETON_BYTES", 1 << 40)  # every storage read
    full = read_metadata(path)
    assert skeleton.state_dict_metadata == full.state_dict_metadata
    assert skeleton.storage_data == full.storage_data
    assert skeleton.planner_data == full.planner_data


def _tensors_of(obj, depth=0) -> dict:
    """``{attribute path: tensor}`` of a loaded record's payload (the stand-in objects' buffers)."""
    out = {}
    for name, v in vars(obj).items() if hasattr(obj, "__dict__") and depth < 3 else ():
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif not isinstance(v, type):
            out.update({f"{name}.{k}": t for k, t in _tensors_of(v, depth + 1).items()})
    return out


def test_whole_records_read_at_once_equal_torch_load(te_ckpt, monkeypatch):
    """A TE record read whole by ckptq (its pickle on ``meta``, then every storage at once, in small
    pieces here so that each storage spans several) holds what ``torch.load`` of the record gives:
    the same tensors, dtypes, shapes, strides, storage offsets and bytes."""
    from ckptq.io import fileio, foreign, read_metadata

    path, _ = te_ckpt
    monkeypatch.setattr(fileio, "PIECE_BYTES", 4096)
    records = {(loc.relative_path, loc.offset): loc for loc in read_metadata(path).storage_data.values()}
    records = [loc for loc in records.values() if isinstance(loc, foreign.ForeignLocation)]
    assert len(records) == len(CASES)
    for loc in records:
        fast = _tensors_of(foreign._load_whole(path, loc, "test"))
        with foreign._open_record(path, loc) as f:
            slow = _tensors_of(foreign.load_record(f, source="test"))
        assert fast.keys() == slow.keys() and len(fast) >= 2, loc.expect.fqn
        for k, t in slow.items():
            got = fast[k]
            assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
                t.dtype,
                t.shape,
                t.stride(),
                t.storage_offset(),
            ), (loc.expect.fqn, k)
            assert_same_bytes(got, t)


def test_reads_in_order_load_the_next_record_ahead_and_raise_its_error_when_read(te_ckpt, tmp_path, monkeypatch):
    """With the order given (``will_read``), reading a TE tensor loads the next one's record on the
    view's background thread; a damaged next record does not fail the read before it, and its
    error is raised by its own read."""
    import shutil
    import threading

    from ckptq.errors import CheckpointFormatError
    from ckptq.io import foreign

    path, sd = te_ckpt
    ck = tmp_path / "ck"
    shutil.copytree(path, ck)
    view = CheckpointView(ck)
    fqns = [f"layers.{i}.{case[0]}.weight" for i, case in enumerate(CASES)]
    second = view._foreign_shard(fqns[1])
    loc = next(iter(second.values()))
    blob = bytearray((ck / loc.relative_path).read_bytes())
    pkl = blob.index(b"\x80\x02", blob.index(b"data.pkl", loc.offset))  # the record's pickle (protocol 2)
    blob[pkl + 3] ^= 0x01
    (ck / loc.relative_path).write_bytes(bytes(blob))

    threads = {}
    real = foreign.shard_canonical

    def spy(root, where):
        threads.setdefault(where.expect.fqn, threading.current_thread().name)
        return real(root, where)

    monkeypatch.setattr(foreign, "shard_canonical", spy)
    view.will_read(fqns)
    assert _same_components(view.read(fqns[0]), _canonical(sd[fqns[0]], fqns[0]))
    with pytest.raises(CheckpointFormatError, match="corrupt"):
        view.read(fqns[1])
    assert _same_components(view.read(fqns[2]), _canonical(sd[fqns[2]], fqns[2]))
    view.close()
    assert threads[fqns[0]] == threading.current_thread().name
    assert threads[fqns[1]].startswith("ckptq-ahead") and threads[fqns[2]].startswith("ckptq-ahead")

    # records beyond the byte budget for loading ahead are loaded by the read itself
    import ckptq.checkpoint

    view = CheckpointView(path)
    smallest = min(next(iter(view._foreign_shard(f).values())).length for f in fqns)
    monkeypatch.setattr(ckptq.checkpoint, "FOREIGN_AHEAD_BYTES", smallest - 1)
    threads.clear()
    view.will_read(fqns)
    for fqn in fqns:
        assert _same_components(view.read(fqn), _canonical(sd[fqn], fqn)), fqn
    assert set(threads.values()) == {threading.current_thread().name}


def test_inspect_te_checkpoint_shows_real_formats(te_ckpt):
    path, sd = te_ckpt
    report = inspect_checkpoint(path, stats=True)
    rows = {r["fqn"]: r for r in report["tensors"]}
    for i, case in enumerate(CASES):
        fqn = f"layers.{i}.{case[0]}.weight"
        r = rows[fqn]
        assert (r["format"], r["mode"]) == (case[3], "native"), fqn
        canon = _canonical(sd[fqn], fqn)  # the stored size is the canonical components', not bf16's
        want_bits = sum(c.numel() * c.element_size() for c in canon.components().values()) * 8 / canon.numel()
        assert r["bits_per_element"] == pytest.approx(want_bits), fqn
        assert r["producer"] == f"transformer_engine {type(sd[fqn]).__name__}"
        assert r["stats"]["max"] == sd[fqn].dequantize(dtype=torch.float32).max().item()
    assert rows["layers.0.bias"]["mode"] == "plain" and rows["layers.0.bias"]["producer"] is None
    assert rows["layers.0._extra_state"]["producer"].startswith("transformer_engine: module extra state")


def test_convert_te_checkpoint_to_native_and_high_precision(te_ckpt, tmp_path):
    path, sd = te_ckpt
    ckptq.reshard_checkpoint(path, tmp_path / "native", to="native")
    ckptq.reshard_checkpoint(path, tmp_path / "fp32", to="float32")
    native, fp32 = CheckpointView(tmp_path / "native"), CheckpointView(tmp_path / "fp32")
    for fqn, t in sd.items():
        if not fqn.endswith("weight"):
            assert bit_exact(native.read(fqn), t)
            continue
        assert _same_components(native.read(fqn), _canonical(t, fqn)), fqn
        assert bit_exact(fp32.read(fqn), t.dequantize(dtype=torch.float32)), fqn
    # the native copy is an ordinary ckptq checkpoint: it reshards and reloads like one
    ckptq.reshard_checkpoint(tmp_path / "native", tmp_path / "r2", mesh="2", misaligned="high-precision")
    fqn = "layers.4.nvfp4_2d.weight"  # 80-row shards: on the 16x16 grid
    assert _same_components(CheckpointView(tmp_path / "r2").read(fqn), _canonical(sd[fqn], fqn))


def test_dcp_load_te_checkpoint_without_te_into_any_target(te_ckpt):
    path, sd = te_ckpt
    weights = {k: v for k, v in sd.items() if k.endswith("weight")}
    plain = {k: torch.empty(v.shape) for k, v in weights.items()}
    ours = {k: _canonical(v, k).new_empty(v.shape) for k, v in weights.items()}
    theirs = {k: te.garbage_like(v) for k, v in weights.items()}
    for target in (plain, ours, theirs):
        dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=ckptq.QuantizedLoadPlanner())
    for k, v in weights.items():
        assert bit_exact(plain[k], v.dequantize(dtype=torch.float32)), k
        assert _same_components(ours[k], _canonical(v, k)), k
        want, got = _rowwise_buffers(te.zero_padding(v)), te.zero_padding(theirs[k])
        assert all(bit_exact(got[b], want[b]) for b in want), k


def test_both_te_flavors_read(tmp_path):
    x = _x(7)
    sd = {"a": te.make_te_tensor(x, "mxfp8", flavor="2974"), "b": te.make_te_tensor(x, "nvfp4", flavor="main")}
    dcp.save(sd, checkpoint_id=str(tmp_path))
    blob = (tmp_path / "__0_0.distcp").read_bytes()
    assert b"transformer_engine_torch" in blob and b"DType" in blob
    view = CheckpointView(tmp_path)
    for k, v in sd.items():
        assert _same_components(view.read(k), _canonical(v, k)), k


def _evil_record() -> bytes:
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch pwned-by-ckptq-test  # transformer_engine",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    return buf.getvalue()


def test_malicious_te_record_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "ck"
    dcp.save({"w": te.make_te_tensor(_x(), "float8")}, checkpoint_id=str(ck))
    md = pickle.loads((ck / ".metadata").read_bytes())
    evil = _evil_record()
    (ck / "__0_0.distcp").write_bytes(evil)
    for info in md.storage_data.values():
        info.offset, info.length = 0, len(evil)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ckptq.UnsafeCheckpointError, match="system") as ei:
        inspect_checkpoint(ck)
    assert "transformer_engine" in str(ei.value)  # names the TE versions that are supported
    assert not (tmp_path / "pwned-by-ckptq-test").exists()


# ------------------------------------------------------------------ 2 gloo ranks
def _global_amax(x):
    return x.float().abs().max().item()


KINDS = {
    "mx": ("mxfp8", {}),
    "nv": ("nvfp4", {"two_d": True}),
    "nv1": ("nvfp4", {}),  # 1x16: columnwise copy stored
    "f8": ("float8", {}),
    "bk": ("float8_blockwise", {"block_scaling_dim": 2}),
    "bk1": ("float8_blockwise", {"block_scaling_dim": 1}),  # 1x128: columnwise copy stored
}


def _save_te_dtensors(rank, ws, root, rows, native, names=tuple(KINDS), layout="fsdp2", resume=False):
    """Each rank quantizes its shard of the same (rows, 256) weights as a TE tensor (per-tensor
    values from the global amax, as TE's amax reduction gives) and saves the DTensors: FSDP2
    ``Shard(0)``, TP row-parallel ``Shard(1)``, or FSDP2-over-TP ``(_StridedShard(0, 2), Shard(0))``
    on a (2, 2) mesh. With ``resume``, every rank then loads into fresh TE shards of the same
    placement and returns, per tensor, the buffers that differ from its saved shard and whether
    the load requantized a columnwise copy."""
    import torch.distributed.checkpoint as dcp
    from _te import standin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptq.chunks import narrow_box
    from ckptq.parse import parse_mesh
    from ckptq.placement import rank_boxes

    tef = standin()
    if layout == "fsdp2-tp":
        mesh, spec = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), parse_mesh("dp=2,tp=2")
        placements = (_StridedShard(0, split_factor=2), Shard(0))
    else:
        mesh, spec = init_device_mesh("cpu", (ws,)), parse_mesh(str(ws))
        placements = (Shard(1 if layout == "tp-row" else 0),)
    shape = (rows, 256)
    box = rank_boxes(shape, spec, placements)[rank]
    sd = {}
    for name in names:
        kind, opts = KINDS[name]
        x = _x(3, shape)
        extra = {"amax": _global_amax(x)} if kind in ("nvfp4", "float8") else {}
        local = tef.make_te_tensor(narrow_box(x, box).contiguous(), kind, **opts, **extra)
        sd[name] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=(256, 1)
        )
    dcp.save(sd, checkpoint_id=root, planner=ckptq.QuantizedSavePlanner() if native else None)
    if not resume:
        return None
    # resume: every rank loads into fresh TE shards of the same placement
    targets = {
        k: DTensor.from_local(
            tef.garbage_like(v.to_local()), mesh, placements, run_check=False, shape=v.shape, stride=(256, 1)
        )
        for k, v in sd.items()
    }
    planner = ckptq.QuantizedLoadPlanner()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=SafeFileSystemReader(root), planner=planner)
    out = {}
    for k, v in sd.items():
        want, got = tef.zero_padding(v.to_local()), tef.zero_padding(targets[k].to_local())
        out[k] = (
            sorted(b for b in want if not torch.equal(want[b].view(torch.uint8), got[b].view(torch.uint8))),
            k in planner.derived,
        )
    return out


def _reference(name, rows):
    kind, opts = KINDS[name]
    x = _x(3, (rows, 256))
    return te.make_te_tensor(x, kind, **opts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "native, layout, ranks",
    [(False, "fsdp2", 2), (True, "fsdp2", 2), (True, "tp-row", 2), (False, "tp-row", 2), (True, "fsdp2-tp", 4)],
    ids=["te_pickles-fsdp2", "native-fsdp2", "native-tp_row", "te_pickles-tp_row", "native-fsdp2_tp_strided"],
)
def test_sharded_te_save_reads_as_one_tensor(tmp_path, native, layout, ranks):
    """Each rank's TE shard (columnwise copies included) is a piece of the whole tensor's: the
    checkpoint reads as the whole TE tensor, every buffer byte for byte, also after resharding
    the native checkpoint to one rank (N -> M); every rank resumes its own shard from it. 64-row
    shards (fsdp2-tp) cut 128x128 blocks, and the 128-row columnwise blocks of 1-D blockwise FP8:
    that copy is then neither stored nor loaded raw (requantized on resume, with a warning)."""
    rows = 256  # shards of 128 (64 under fsdp2-tp) rows / 128 columns
    names = ("mx", "nv", "nv1", "f8", "bk1") if layout == "fsdp2-tp" else tuple(KINDS)
    resumed = run_distributed(ranks, _save_te_dtensors, str(tmp_path / "ck"), rows, native, names, layout, True)
    for rank, per_name in enumerate(resumed):  # each rank got its own TE shard back
        for name, (differ, derived) in per_name.items():
            off_grid = layout == "fsdp2-tp" and name == "bk1"  # the copy is requantized, with a warning
            assert differ == (["_columnwise_data", "_columnwise_scale_inv"] if off_grid else []), (rank, name)
            assert derived == off_grid, (rank, name)
    if native:
        ckptq.reshard_checkpoint(tmp_path / "ck", tmp_path / "one", mesh="1")
    for ck in ("ck", "one") if native else ("ck",):
        view = CheckpointView(tmp_path / ck)
        for name in names:
            want = _reference(name, rows)
            off_grid = layout == "fsdp2-tp" and name == "bk1"  # the shards' columnwise blocks are their own
            assert view.entry(name).kind == "quantized", name
            expected = _canonical(want, name).rowwise_only() if off_grid else _canonical(want, name)
            assert _same_components(view.read(name), expected), (ck, name)
            target = te.garbage_like(want)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dcp.load(
                    {name: target},
                    storage_reader=SafeFileSystemReader(tmp_path / ck),
                    planner=ckptq.QuantizedLoadPlanner(),
                )
            derived = [w for w in caught if "requantized" in str(w.message)]
            assert len(derived) == off_grid, (ck, name)
            _assert_te_bytes(target, want, _rowwise_buffers(te.te_buffers(want)) if off_grid else None)


@pytest.mark.slow
def test_two_rank_te_shards_off_the_global_grid_read_in_high_precision(tmp_path):
    rows = 96  # shards of 48 rows: 128x128 blocks of each shard do not line up with the global grid
    run_distributed(2, _save_te_dtensors, str(tmp_path / "ck"), rows, False, ("bk",))
    view = CheckpointView(tmp_path / "ck")
    e = view.entry("bk")
    assert e.kind == "tensor" and e.descriptor.mode == "high_precision" and "block grids" in e.descriptor.note
    x = _x(3, (rows, 256))
    want = torch.cat(
        [
            te.make_te_tensor(x[r * 48 : (r + 1) * 48], "float8_blockwise", block_scaling_dim=2).dequantize(
                dtype=torch.float32
            )
            for r in range(2)
        ]
    )
    assert bit_exact(view.read("bk"), want)  # each shard dequantized with its own scales
    with pytest.raises(ckptq.ShardingError, match=r"(?s)'bk'.*block grids.*--misaligned high-precision"):
        ckptq.reshard_checkpoint(tmp_path / "ck", tmp_path / "out", to="native")  # named, nothing written
    assert not (tmp_path / "out").exists()
    ckptq.reshard_checkpoint(tmp_path / "ck", tmp_path / "out", to="native", misaligned="high-precision")
    assert bit_exact(CheckpointView(tmp_path / "out").read("bk"), want)  # kept in high precision, exact


def test_cli_commands_a_te_user_runs(te_ckpt, tmp_path):
    from typer.testing import CliRunner

    from ckptq.cli import app

    path, sd = te_ckpt
    runner = CliRunner()
    r = runner.invoke(app, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("layers.2.mxfp8_sw.weight"))
    assert "mxfp8" in line and "native" in line and "transformer_engine MXFP8Tensor" in line
    for name, fmt in [("layers.5.nvfp4_1d_sw.weight", "nvfp4"), ("layers.8.blk_1d.weight", "fp8_block")]:
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(name))
        assert line.split()[1] == f"{fmt}+columnwise", line  # the stored columnwise copy is shown
    r = runner.invoke(app, ["convert", str(path), str(tmp_path / "native"), "--to", "native"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["verify", str(path), str(tmp_path / "native")])  # the TE view vs its copy
    assert r.exit_code == 0 and "failed" in r.stdout, r.output
    assert f"{len(sd)} compared, {len(sd)} bit-exact, 0 failed" in r.stdout


# ------------------------------------------------------------------ CUDA-resident TE tensors
@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("async_save", [False, True], ids=["save", "async_save"])
def test_cuda_te_tensors_save_and_load_in_place(tmp_path, case, async_save):
    """TE's tensors live on the GPU: canonical views of CUDA buffers are written (staged to the
    CPU by DCP, raw bytes) and a load inserts into CUDA buffers; the same bytes as on the CPU."""
    src = _te(case).to("cuda")
    planner = ckptq.QuantizedSavePlanner()
    if async_save:
        dcp.async_save({"w": src}, checkpoint_id=str(tmp_path), planner=planner).result()
    else:
        dcp.save({"w": src}, checkpoint_id=str(tmp_path), planner=planner)
    target = te.garbage_like(_te(case)).to("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": target}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedLoadPlanner())
    _assert_te_bytes(target.to("cpu"), src.to("cpu"))
    assert all(b.is_cuda for b in te.te_buffers(target).values())

"""The planners as drop-ins for DCP's defaults: constructor arguments, plan caching, non-tensor
(bytes) entries, DCP's error phrases, legacy ShardedTensor resharding (2 gloo ranks)."""

from __future__ import annotations

import collections
import datetime
import inspect
import io
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_distributed
from _helpers import assert_same_bytes
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

import ckptq
from ckptq.contract import CKPTQ_KEY
from ckptq.io import SafeFileSystemReader, dcp_failure
from ckptq.metrics import bit_exact


@pytest.fixture(autouse=True)
def _no_cached_plans():
    """DCP's plan caches are class attributes, shared by every save of this process."""

    def clear():
        for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan"):
            getattr(SavePlanner, name).clear()
        SavePlanner._cached_metadata.clear()

    clear()
    yield
    clear()


def _load(sd, path, **kw):
    dcp.load(sd, checkpoint_id=str(path), planner=ckptq.QuantizedLoadPlanner(**kw), no_dist=True)


def _failure(sd, path, **kw) -> Exception:
    with pytest.raises(CheckpointException) as ei:
        _load(sd, path, **kw)
    return dcp_failure(ei.value, str(path))


# ------------------------------------------------------------------ constructor arguments
@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(ckptq.QuantizedSavePlanner, DefaultSavePlanner), (ckptq.QuantizedLoadPlanner, DefaultLoadPlanner)],
)
def test_positional_parameters_are_dcps(ours, theirs):
    def positional(cls):
        return [
            (p.name, p.default)
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"
        ]

    assert positional(ours) == positional(theirs)
    own = [p for p in inspect.signature(ours.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert own and not [p for p in inspect.signature(ours.__init__).parameters.values() if p.kind is p.VAR_KEYWORD]


def test_positional_arguments_bind_like_dcps():
    s = ckptq.QuantizedSavePlanner(False, False, None, True, True)
    d = DefaultSavePlanner(False, False, None, True, True)
    for name in ("flatten_state_dict", "flatten_sharded_tensors", "dedup_save_to_lowest_rank", "_enable_plan_caching"):
        assert getattr(s, name) == getattr(d, name), name
    assert s.mode == "native"
    l = ckptq.QuantizedLoadPlanner(False, False, True)  # noqa: E741
    assert (l.flatten_state_dict, l.flatten_sharded_tensors, l.allow_partial_load) == (False, False, True)
    with pytest.raises(TypeError):
        ckptq.QuantizedSavePlanner(True, True, None, False, False, "high_precision")  # ckptq's are keyword-only
    with pytest.raises(TypeError):
        ckptq.QuantizedLoadPlanner(True, True, False, False)


# ------------------------------------------------------------------ plan caching
class _Spy(ckptq.QuantizedSavePlanner):
    local_plans: list = []

    def create_local_plan(self):
        plan = super().create_local_plan()
        _Spy.local_plans.append(plan)
        return plan


def _save_cached(sd, path, writer=None):
    kw = {"storage_writer": writer} if writer is not None else {"checkpoint_id": str(path)}
    dcp.save(sd, planner=_Spy(enable_plan_caching=True), no_dist=True, **kw)
    return _Spy.local_plans[-1].usable


def test_plan_caching_reuses_unchanged_plans_and_resends_changed_ones(tmp_path):
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q = ckptq.quantize(x, "nvfp4")
    saves = [
        ("first", {"q": q, "w": x.bfloat16()}, True),
        ("same plan", {"q": q, "w": (2 * x).bfloat16()}, False),  # new values, same plan: cached
        ("dtype", {"q": q, "w": x}, True),  # DCP's comparison misses a dtype change (same sizes)
        ("amax", {"q": ckptq.quantize(2 * x, "nvfp4"), "w": x}, True),  # a per-tensor value changed
        ("format", {"q": ckptq.quantize(x, "mxfp8"), "w": x}, True),
    ]
    for i, (what, sd, sent) in enumerate(saves):
        assert _save_cached(sd, tmp_path / str(i)) is sent, what
        md = dcp.FileSystemReader(str(tmp_path / str(i))).read_metadata()
        assert md.planner_data[CKPTQ_KEY]["tensors"]["q"]["format"] == sd["q"].FORMAT, what
        assert md.state_dict_metadata["w"].properties.dtype == sd["w"].dtype, what
        out = {"q": torch.empty_like(sd["q"]), "w": torch.zeros_like(sd["w"])}
        _load(out, tmp_path / str(i))
        assert_same_bytes(out["w"], sd["w"], what)
        for name, c in sd["q"].components().items():
            assert_same_bytes(out["q"].components()[name], c, f"{what}: {name}")


def test_plan_caching_keeps_no_checksums_of_an_earlier_save(tmp_path):
    """The cached Metadata is DCP's object: a writer that stores checksums in it must not leave
    them for the next save, whose data differ."""
    sd = {"w": torch.arange(8.0)}
    assert _save_cached(sd, None, ckptq.io.ChecksumFileSystemWriter(str(tmp_path / "a")))
    sd = {"w": torch.arange(8.0) + 1}
    assert not _save_cached(sd, None, FileSystemWriter(str(tmp_path / "b")))
    out = {"w": torch.zeros(8)}
    _load(out, tmp_path / "b")  # stale checksums would raise ChecksumMismatchError
    assert torch.equal(out["w"], sd["w"])


# ------------------------------------------------------------------ non-tensor (bytes) entries
def test_trainer_state_round_trips(tmp_path):
    np.random.seed(7)
    state = {
        "w": torch.arange(6.0),
        "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "buffer": io.BytesIO(b"loader state"),
        "arrays": [np.arange(5, dtype=np.int64), np.ones((2, 3), dtype=np.float16), np.float64(0.25)],
        "when": datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc),
        "misc": (collections.OrderedDict(a=1), frozenset({1}), slice(1, 2)),  # a tuple is one bytes entry
    }
    dcp.save(state, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    for reader in (None, SafeFileSystemReader(str(tmp_path))):
        out = {"w": torch.zeros(6), "rng": {"numpy": None, "torch": torch.zeros_like(state["rng"]["torch"])}}
        out |= {"buffer": None, "arrays": [None, None, None], "when": None, "misc": None}
        kw = {"storage_reader": reader} if reader is not None else {"checkpoint_id": str(tmp_path)}
        dcp.load(out, planner=ckptq.QuantizedLoadPlanner(), no_dist=True, **kw)
        name, keys, pos, has_gauss, cached = out["rng"]["numpy"]
        ref = state["rng"]["numpy"]
        assert (name, pos, has_gauss, cached) == (ref[0], ref[2], ref[3], ref[4])
        assert keys.dtype == np.uint32 and np.array_equal(keys, ref[1])
        np.random.set_state(out["rng"]["numpy"])
        assert out["buffer"].getvalue() == b"loader state"
        for a, b in zip(out["arrays"], state["arrays"], strict=True):
            assert type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
        assert (out["when"], out["misc"]) == (state["when"], state["misc"])


class _Config:  # a class torch's unpickler rebuilds once allowed (its __dict__ set by BUILD)
    def __init__(self, lr):
        self.lr = lr


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_refused_global_names_it_and_the_opt_in(tmp_path):
    marker = tmp_path / "pwned"
    dcp.save({"obj": _RunsCode(marker), "dq": collections.deque([1])}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    for key, name in (("obj", f"{os.system.__module__}.system"), ("dq", "collections.deque")):
        err = _failure({key: None}, tmp_path / "c")
        assert isinstance(err, ckptq.UnsafePickledObjectError) and isinstance(err, pickle.UnpicklingError)
        assert isinstance(err, ckptq.UnsafeCheckpointError)
        msg = str(err)
        assert f"'{key}'" in msg and name in msg and "QuantizedLoadPlanner(trust_pickled_objects=True)" in msg
    assert not marker.exists()
    out = {"dq": None}
    _load(out, tmp_path / "c", trust_pickled_objects=True)  # DCP's own behaviour, for trusted files
    assert out["dq"] == collections.deque([1])
    # torch's own opt-in (add_safe_globals / safe_globals) works too, and ckptq's call leaves it in place
    dcp.save({"cfg": _Config(0.5)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert f"{__name__}._Config" in str(_failure({"cfg": None}, tmp_path / "d"))
    with torch.serialization.safe_globals([_Config]):
        out = {"cfg": None}
        _load(out, tmp_path / "d")
        assert out["cfg"].lr == 0.5 and _Config in torch.serialization.get_safe_globals()


# ------------------------------------------------------------------ DCP's error phrases
def test_missing_key_and_size_mismatch_keep_dcps_phrases(tmp_path):
    q = ckptq.quantize(torch.randn(32, 64), "fp8_block")
    dcp.save({"w": torch.ones(4), "q": q}, checkpoint_id=str(tmp_path), planner=ckptq.QuantizedSavePlanner())
    cases = [
        ({"w": torch.ones(4), "absent": torch.ones(2)}, ckptq.MissingKeyError, "Missing key in checkpoint state_dict"),
        ({"absent": torch.empty_like(q)}, ckptq.MissingKeyError, "Missing key in checkpoint state_dict: absent."),
        ({"w": torch.ones(5)}, ckptq.CheckpointFormatError, "Size mismatch between saved torch.Size([4]) and current: "
         "torch.Size([5]) for w"),
        ({"q": ckptq.quantize(torch.randn(64, 64), "fp8_block")}, ckptq.CheckpointFormatError,
         "Size mismatch between saved torch.Size([32, 64]) and current: torch.Size([64, 64]) for q"),
        ({"q": torch.zeros(64, 64)}, ckptq.CheckpointFormatError, "Size mismatch between saved"),
    ]  # fmt: skip
    for sd, cls, phrase in cases:
        with pytest.raises(CheckpointException) as ei:  # as DCP's own errors reach callers
            _load(sd, tmp_path)
        assert phrase in str(ei.value)
        err = dcp_failure(ei.value, str(tmp_path))
        assert isinstance(err, cls) and phrase in str(err)
    assert isinstance(ckptq.MissingKeyError("x"), RuntimeError)  # DCP raises RuntimeError
    assert isinstance(ckptq.CheckpointFormatError("x"), ValueError)  # and ValueError for sizes
    # DCP's default planner says the same
    with pytest.raises(CheckpointException, match="Missing key in checkpoint"):
        dcp.load({"absent": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CheckpointException, match="Size mismatch"):
        dcp.load({"w": torch.ones(5)}, checkpoint_id=str(tmp_path), no_dist=True)


def test_checkpoint_flattened_by_torch_2_3_loads(tmp_path):
    """torch <= 2.3 stored a dict holding a list of non-tensors as one entry; DCP's default load
    planner recognises such checkpoints, and so does ckptq's."""
    from torch.distributed.checkpoint import _version

    _version._derived_version = "2_3"  # how torch's own tests write the old layout
    try:
        dcp.save({"w": torch.ones(3), "c": {"d": [1, 2]}}, checkpoint_id=str(tmp_path), no_dist=True)
    finally:
        _version._derived_version = None
    assert "c" in dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    for planner in (DefaultLoadPlanner(), ckptq.QuantizedLoadPlanner()):
        out = {"w": torch.zeros(3), "c": {"d": [0, 0]}}
        dcp.load(out, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
        assert out["c"] == {"d": [1, 2]} and torch.equal(out["w"], torch.ones(3)), type(planner).__name__


# ------------------------------------------------------------------ legacy ShardedTensor
def _sharded(rank, ws, pieces, fill):
    """A 1-d ShardedTensor of 200 elements cut into ``pieces`` equal shards, dealt round-robin."""
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    n = 200 // pieces
    local = [
        Shard.from_tensor_and_offsets(fill[i * n : (i + 1) * n].clone(), shard_offsets=[i * n], rank=rank)
        for i in range(pieces)
        if i % ws == rank
    ]
    return init_from_local_shards(local, 200)


def _sharded_tensor_worker(rank, ws, root):
    values, results = torch.arange(200.0), {}
    for name, save, load in (
        ("dcp", None, None),
        ("ckptq", ckptq.QuantizedSavePlanner(), ckptq.QuantizedLoadPlanner()),
    ):
        path = os.path.join(root, name)
        dcp.save({"st": _sharded(rank, ws, 2, values)}, checkpoint_id=path, planner=save)
        out = {"st": _sharded(rank, ws, 4, torch.zeros(200))}
        dcp.load(out, checkpoint_id=path, planner=load)
        plain = {"st": torch.zeros(200)}
        dcp.load(plain, checkpoint_id=path, planner=load)
        shards = [(s.metadata.shard_offsets[0], s.tensor.tolist()) for s in out["st"].local_shards()]
        results[name] = shards, plain["st"].tolist()  # lists: tensors would travel through shared memory
    return results


@pytest.mark.slow
def test_sharded_tensor_loads_with_another_shard_plan(tmp_path):
    """Saved as 2 shards (one per rank), loaded as 4 shards (two per rank, not contiguous) and
    into a plain tensor on each rank, with DCP's default planners and with ckptq's."""
    values = torch.arange(200.0)
    for rank, results in enumerate(run_distributed(2, _sharded_tensor_worker, str(tmp_path))):
        for name, (shards, plain) in results.items():
            assert [o for o, _ in shards] == [o for o in (0, 50, 100, 150) if (o // 50) % 2 == rank], name
            for offset, t in shards:
                assert t == values[offset : offset + 50].tolist(), f"{name}: rank {rank}, shard at {offset}"
            assert plain == values.tolist(), f"{name}: rank {rank}, plain target"


def _cached_saves_worker(rank, ws, root):
    """Three cached saves of one replicated NVFP4 tensor: the same on both ranks, then different
    amax on rank 1 only (rank 0's plan is unchanged, so it sends none), then the same again."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    same, other = ckptq.quantize(x, "nvfp4"), ckptq.quantize(2 * x, "nvfp4")
    outcomes = []
    for i, q in enumerate((same, other if rank == 1 else same, other)):
        try:
            dcp.save({"q": q}, checkpoint_id=os.path.join(root, str(i)), planner=_Spy(enable_plan_caching=True))
            outcomes.append(("saved", _Spy.local_plans[-1].usable))
        except CheckpointException as e:
            err = dcp_failure(e, root)
            outcomes.append((type(err).__name__, _Spy.local_plans[-1].usable))
    out = {"q": torch.empty_like(other)}
    dcp.load(out, checkpoint_id=os.path.join(root, "2"), planner=ckptq.QuantizedLoadPlanner())
    return outcomes, all(bit_exact(out["q"].components()[k], v) for k, v in other.components().items())


@pytest.mark.slow
def test_plan_caching_still_checks_per_tensor_values_across_ranks(tmp_path):
    """DCP's plan comparison would call rank 1's second plan unchanged (same sizes) and skip the
    check that the shards of one tensor carry one amax; ckptq's sends it and the check fails."""
    (r0, ok0), (r1, ok1) = run_distributed(2, _cached_saves_worker, str(tmp_path))
    assert r0 == [("saved", True), ("InconsistentScaleError", False), ("saved", True)], r0
    assert r1 == [("saved", True), ("InconsistentScaleError", True), ("saved", True)], r1
    assert ok0 and ok1


def test_upstream_runner_substitutes_every_default_planner(tmp_path):
    """scripts/run_dcp_upstream_tests.py: the substitution reaches the names dcp.save / dcp.load and
    test modules use, and a passing-then-failing test is reported."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    check = (
        "import run_dcp_upstream_tests as r; r.install()\n"
        "import ckptq, torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint import default_planner, state_dict_saver, state_dict_loader\n"
        "from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, DefaultLoadPlanner\n"
        "assert DefaultSavePlanner is ckptq.QuantizedSavePlanner is state_dict_saver.DefaultSavePlanner\n"
        "assert DefaultLoadPlanner is ckptq.QuantizedLoadPlanner is state_dict_loader.DefaultLoadPlanner\n"
        "assert dcp.DefaultSavePlanner is ckptq.QuantizedSavePlanner\n"
    )
    env = dict(os.environ, CKPTQ_DCP_SUBSTITUTE_PLANNERS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root / "scripts"), str(root), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=120)

    sys.path.insert(0, str(root / "scripts"))
    try:
        import run_dcp_upstream_tests as runner
    finally:
        sys.path.remove(str(root / "scripts"))
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="test_x.T" name="a" file="test_x.py"/>'
        '<testcase classname="test_x.T" name="b" file="test_x.py"><failure message="m"/></testcase>'
        '<testcase classname="test_x.T" name="c" file="test_x.py"><skipped/></testcase></testsuite></testsuites>'
    )
    assert runner._outcomes(junit) == {"test_x.py": {"T::a": "passed", "T::b": "failed", "T::c": "skipped"}}

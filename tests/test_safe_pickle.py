"""Allow-listed unpickling of DCP metadata (ckptq.io.safe_pickle) and the safe DCP reader."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ckptq.errors import CheckpointFormatError, UnsafeCheckpointError
from ckptq.io import ALLOWED_GLOBALS, SafeFileSystemReader, dcp_failure, read_metadata, safe_loads
from ckptq.io.safe_pickle import _get_layout

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


class _Payload:
    """Unpickling this runs ``os.system`` (creates ``marker``): the classic malicious pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def _save_many_dtypes(path, **writer_kw):
    sd = {
        "model": {
            "f32": torch.randn(6, 4),
            "bf16": torch.randn(3, 3).bfloat16(),
            "f16": torch.randn(2).half(),
            "f64": torch.zeros(2, dtype=torch.float64),
            "e4m3": torch.randn(4, 4).to(torch.float8_e4m3fn),
            "e5m2": torch.randn(4).to(torch.float8_e5m2),
            "e8m0": torch.ones(2).to(torch.float8_e8m0fnu),
            "u8": torch.zeros(4, dtype=torch.uint8),
            "i8": torch.zeros(2, dtype=torch.int8),
            "i64": torch.arange(5),
            "b": torch.zeros(2, dtype=torch.bool),
            "c64": torch.zeros(2, dtype=torch.complex64),
            "scalar": torch.tensor(3.0),
            "empty": torch.zeros(0, 3),
            "cl": torch.randn(1, 2, 2, 2).to(memory_format=torch.channels_last),
            "param": torch.nn.Parameter(torch.randn(2)),
        },
        "step": 3,
        "extra": {"lr": 0.1, "sched": [1, 2, {"x": torch.ones(2)}]},
    }
    dcp.save(sd, storage_writer=FileSystemWriter(path, **writer_kw))
    return path


def _recorded_globals(data: bytes) -> set[tuple[str, str]]:
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return seen


@pytest.fixture(scope="module")
def many_dtypes_ckpt(tmp_path_factory):
    return _save_many_dtypes(tmp_path_factory.mktemp("dtypes"), thread_count=2)


def test_real_metadata_round_trips_like_pickle(many_dtypes_ckpt):
    data = (many_dtypes_ckpt / ".metadata").read_bytes()
    expected = pickle.loads(data)
    got = safe_loads(data, source="x")
    assert isinstance(got, Metadata)
    assert got == expected  # dataclass equality: every entry, chunk, storage location, planner_data
    assert got.state_dict_metadata["model.cl"].properties.memory_format == torch.contiguous_format
    assert got.state_dict_metadata["model.e8m0"].properties.dtype == torch.float8_e8m0fnu
    assert isinstance(got.storage_meta.checkpoint_id, pathlib.PurePath)


@pytest.mark.parametrize("writer_kw", [{}, {"single_file_per_rank": False}])
def test_allow_list_covers_what_dcp_writes(tmp_path, writer_kw):
    data = (_save_many_dtypes(tmp_path, **writer_kw) / ".metadata").read_bytes()
    used = _recorded_globals(data)
    assert used <= set(ALLOWED_GLOBALS), used - set(ALLOWED_GLOBALS)
    # The pickle really uses the protocol features the unpickler must support.
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert {"STACK_GLOBAL", "NEWOBJ", "BUILD", "REDUCE"} <= ops


def test_allow_list_excludes_code_runners():
    for bad in [
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("os", "system"),
        ("posix", "system"),
        ("subprocess", "Popen"),
        ("torch", "load"),
        ("torch", "tensor"),
        ("torch.storage", "_load_from_bytes"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("copyreg", "_reconstructor"),
        ("pathlib", "Path.write_text"),
    ]:
        assert bad not in ALLOWED_GLOBALS
    assert ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] is _get_layout
    assert _get_layout("torch.strided") is torch.strided
    with pytest.raises(pickle.UnpicklingError):
        _get_layout("os.system")


def test_payload_is_live_with_plain_pickle(tmp_path):
    # Control: the payload used below really runs code under pickle.loads.
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_refuses_os_system_and_runs_nothing(tmp_path, protocol):
    marker = tmp_path / "pwned"
    data = pickle.dumps(_Payload(marker), protocol=protocol)
    with pytest.raises(UnsafeCheckpointError) as ei:
        safe_loads(data, source="/ckpt/.metadata")
    msg = str(ei.value)
    assert f"{os.system.__module__}.system" in msg and "/ckpt/.metadata" in msg
    assert not marker.exists()


def test_refuses_payload_hidden_inside_real_metadata(tmp_path, many_dtypes_ckpt):
    marker = tmp_path / "pwned"
    md = pickle.loads((many_dtypes_ckpt / ".metadata").read_bytes())
    md.planner_data["__ckptq__"] = {"version": 1, "tensors": {"w": _Payload(marker)}}
    with pytest.raises(UnsafeCheckpointError, match="system"):
        safe_loads(pickle.dumps(md))
    assert not marker.exists()


@pytest.mark.parametrize(
    "module,name",
    [("builtins", "eval"), ("torch", "load"), ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2")],
)
def test_refuses_any_other_global(module, name):
    data = b"\x80\x04" + pickle.GLOBAL + f"{module}\n{name}\n".encode() + pickle.STOP
    with pytest.raises(UnsafeCheckpointError, match=f"'{module}.{name}'"):
        safe_loads(data)


def test_refuses_persistent_ids():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if isinstance(obj, str) and obj == "x" else None

    buf = io.BytesIO()
    P(buf).dump(["x"])
    with pytest.raises(UnsafeCheckpointError, match="persistent id"):
        safe_loads(buf.getvalue())


def test_refuses_and_undoes_class_mutation():
    # GLOBAL StorageMeta; (None, {"evil": 1}); BUILD -> setattr(StorageMeta, "evil", 1) in plain pickle.
    data = (
        b"\x80\x02"
        + pickle.GLOBAL
        + b"torch.distributed.checkpoint.metadata\nStorageMeta\n"
        + pickle.NONE
        + pickle.EMPTY_DICT
        + pickle.SHORT_BINUNICODE
        + b"\x04evil"
        + pickle.BININT1
        + b"\x01"
        + pickle.SETITEM
        + pickle.TUPLE2
        + pickle.BUILD
        + pickle.STOP
    )
    pickle.loads(data)  # control: plain pickle does mutate the class
    assert StorageMeta.evil == 1
    del StorageMeta.evil
    with pytest.raises(UnsafeCheckpointError, match="modify"):
        safe_loads(data)
    assert not hasattr(StorageMeta, "evil")


def test_foreign_os_path_reads_as_pure_path():
    data = (
        b"\x80\x02"
        + pickle.GLOBAL
        + b"pathlib\nWindowsPath\n"
        + pickle.SHORT_BINUNICODE
        + b"\x05C:\\ck"
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )
    got = safe_loads(data)
    assert isinstance(got, pathlib.PureWindowsPath) and str(got) == "C:\\ck"


@pytest.mark.parametrize("cut", [0, 10, "half", -1])
def test_truncated_metadata_is_a_format_error(tmp_path, many_dtypes_ckpt, cut):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(many_dtypes_ckpt, d)
    data = (d / ".metadata").read_bytes()
    n = len(data) // 2 if cut == "half" else (len(data) - 1 if cut == -1 else cut)
    (d / ".metadata").write_bytes(data[:n])
    with pytest.raises(CheckpointFormatError, match="truncated or corrupt") as ei:
        SafeFileSystemReader(d).read_metadata()
    assert not isinstance(ei.value, UnsafeCheckpointError)


def test_reader_loads_like_dcp(many_dtypes_ckpt):
    sd = {"model": {"f32": torch.zeros(6, 4), "e4m3": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, "step": 0}
    ref = {"model": {"f32": torch.zeros(6, 4), "e4m3": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, "step": 0}
    dcp.load(sd, storage_reader=SafeFileSystemReader(many_dtypes_ckpt), no_dist=True)
    dcp.load(ref, checkpoint_id=many_dtypes_ckpt, no_dist=True)
    assert sd["step"] == 3 == ref["step"]
    assert torch.equal(sd["model"]["f32"], ref["model"]["f32"]) and sd["model"]["f32"].abs().sum() > 0
    assert torch.equal(sd["model"]["e4m3"].view(torch.uint8), ref["model"]["e4m3"].view(torch.uint8))


def test_reader_refuses_unsafe_non_tensor_entry(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "ck"
    dcp.save({"w": torch.ones(2), "evil": _Payload(marker)}, checkpoint_id=d)
    assert not marker.exists()
    sd = {"w": torch.zeros(2), "evil": None}
    with pytest.raises(CheckpointException) as ei:  # DCP wraps every per-rank failure
        dcp.load(sd, storage_reader=SafeFileSystemReader(d), no_dist=True)
    err = dcp_failure(ei.value, str(d))
    assert isinstance(err, UnsafeCheckpointError) and "'evil'" in str(err)
    assert not marker.exists()


def test_reader_refuses_locations_outside_the_directory(tmp_path):
    d = tmp_path / "ck"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=d)
    md = pickle.loads((d / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="outside"):
        read_metadata(d)


def test_read_metadata_errors(tmp_path, many_dtypes_ckpt):
    with pytest.raises(CheckpointFormatError, match="no such file"):
        read_metadata(tmp_path / "missing")
    (tmp_path / "model.pt").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match="is a file"):
        read_metadata(tmp_path / "model.pt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointFormatError, match="not a DCP checkpoint"):
        read_metadata(empty)
    (empty / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match="interrupted"):
        read_metadata(empty)
    per_rank = tmp_path / "per_rank"
    per_rank.mkdir()
    (per_rank / "__0.metadata").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match="per-rank"):
        read_metadata(per_rank)
    not_md = tmp_path / "not_md"
    not_md.mkdir()
    (not_md / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointFormatError, match="not DCP Metadata"):
        read_metadata(not_md)
    # The .metadata file itself is accepted as the path.
    assert read_metadata(many_dtypes_ckpt / ".metadata").version == "1.0.0"


def test_read_metadata_detects_missing_and_truncated_data_files(tmp_path):
    d = tmp_path / "ck"
    dcp.save({"w": torch.ones(64), "v": torch.ones(3)}, checkpoint_id=d)
    data_file = d / "__0_0.distcp"
    blob = data_file.read_bytes()
    data_file.write_bytes(blob[:-10])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        read_metadata(d)
    read_metadata(d, verify_storage=False)  # metadata alone is fine
    data_file.unlink()
    with pytest.raises(CheckpointFormatError, match="missing"):
        read_metadata(d)


# ------------------------------------------------------------------ non-tensor (bytes) entries
def _respelled_record(obj, old: bytes, new: bytes) -> io.BytesIO:
    """``torch.save(obj)`` with ``old`` replaced by ``new`` in its pickle (GLOBAL opcodes are
    newline-terminated text, so a module can be respelled), re-zipped."""
    import zipfile

    buf = io.BytesIO()
    torch.save(obj, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                assert old in data
                data = data.replace(old, new)
            z.writestr(info.filename, data)
    out.seek(0)
    return out


def test_numpy_1x_spelling_of_rng_state_loads():
    """numpy 1.x pickles ``numpy.core.multiarray._reconstruct``; numpy 2 ``numpy._core``."""
    np = pytest.importorskip("numpy")
    from ckptq.io.safe_pickle import load_pickled_object

    state = np.random.RandomState(3).get_state()
    record = _respelled_record(state, b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert "numpy.core.multiarray._reconstruct" in torch.serialization.get_unsafe_globals_in_checkpoint(record)
    record.seek(0)
    name, keys, pos, has_gauss, cached = load_pickled_object(record, where="test")
    assert (name, pos, has_gauss, cached) == (state[0], state[2], state[3], state[4])
    assert keys.dtype == state[1].dtype and np.array_equal(keys, state[1])


def test_trainer_state_globals_are_data_only():
    """No entry of the widened list is a function that runs what the pickle names."""
    from ckptq.io.safe_pickle import trainer_state_globals

    names = {name for _, name in trainer_state_globals()}
    assert {"_io.BytesIO", "numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct"} <= names
    for bad in ("builtins.eval", "builtins.exec", "builtins.getattr", "os.system", "numpy.load", "pickle.loads"):
        assert bad not in names
    assert not any(name.startswith(("subprocess.", "posix.", "nt.", "importlib.")) for name in names)


def test_safe_loads_refuses_a_declared_length_past_the_end_before_unpickling():
    """The public ``safe_loads`` runs the same length check as the ``.metadata`` reader: a
    ``BYTEARRAY8`` that declares 2**50 bytes in a short pickle is a CheckpointFormatError naming the
    source, not a 1 PiB allocation (MemoryError)."""
    import pickle

    from ckptq.errors import CheckpointFormatError
    from ckptq.io.safe_pickle import safe_loads

    good = pickle.dumps({"a": 1}, protocol=4)
    assert safe_loads(good) == {"a": 1}
    bad = good[:2] + b"\x96" + (2**50).to_bytes(8, "little") + good[2:]
    with pytest.raises(
        CheckpointFormatError, match=r"x\.pkl: the pickle is truncated or corrupt .* declares 1125899906842624 bytes"
    ):
        safe_loads(bad, source="x.pkl")

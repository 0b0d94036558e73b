"""ckptq's storage writer and reader knobs (``thread_count``, ``buffer_bytes``, ``sync_every``,
``fadvise``, async staging): every setting writes the records ``torch.save`` writes and reads back
the saved bytes exactly; records of another framing still load through ``torch.load``."""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptq
from ckptq.io import ChecksumFileSystemWriter, SafeFileSystemReader, read_metadata
from ckptq.io.records import tensor_record
from tests._helpers import CUDA_MARKS, assert_same_bytes, requires_cuda

warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")


def _state_dict(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return {
        "a": ckptq.quantize(torch.randn(256, 512, generator=g).to(device), "nvfp4"),
        "b": ckptq.quantize(torch.randn(128, 256, generator=g).to(device), "mxfp8"),
        "c": torch.randn(300, 70, generator=g).bfloat16().to(device),
        "d": torch.tensor(3.0, device=device),
        "e": torch.zeros(0, 4, device=device),
        "step": {"epoch": 3},
    }


def _targets(device="cpu"):
    return {
        "a": ckptq.quantize(torch.zeros(256, 512, device=device), "nvfp4"),
        "b": ckptq.quantize(torch.zeros(128, 256, device=device), "mxfp8"),
        "c": torch.zeros(300, 70, dtype=torch.bfloat16, device=device),
        "d": torch.tensor(0.0, device=device),
        "e": torch.ones(0, 4, device=device),
        "step": {"epoch": 0},
    }


def _check_loaded(got, want):
    for k in "ab":
        for name, v in want[k]._components.items():
            assert_same_bytes(got[k]._components[name].cpu(), v.cpu(), f"{k}.{name}")
    for k in "cde":
        assert_same_bytes(got[k].cpu(), want[k].cpu(), k)
    assert got["step"] == want["step"]


def _without_id(blob: bytes) -> bytes:
    """A record with its ``.data/serialization_id`` member blanked (torch.save makes it differ per call)."""
    z = zipfile.ZipFile(io.BytesIO(blob))
    info = next(i for i in z.infolist() if i.filename.endswith("serialization_id"))
    out = bytearray(blob)
    n_name = int.from_bytes(blob[info.header_offset + 26 : info.header_offset + 28], "little")
    n_extra = int.from_bytes(blob[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + n_name + n_extra
    out[start : start + info.file_size] = bytes(info.file_size)
    crc = info.CRC.to_bytes(4, "little")
    while (at := out.find(crc)) >= 0:
        out[at : at + 4] = bytes(4)
    return bytes(out)


def _records(path) -> dict:
    md = read_metadata(path)
    out = {}
    for index, info in md.storage_data.items():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            out[(index.fqn, None if index.offset is None else tuple(index.offset))] = f.read(info.length)
    return out


@pytest.mark.parametrize("threads,buffer_bytes", [(1, 1 << 16), (3, 1 << 16), (4, None)])
def test_writer_knobs_write_torch_saves_records_and_load_back_exactly(tmp_path, threads, buffer_bytes):
    sd = _state_dict()
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    planner = ckptq.QuantizedSavePlanner
    w = ChecksumFileSystemWriter(ours, thread_count=threads, buffer_bytes=buffer_bytes, sync_every=1 << 16)
    dcp.save(sd, storage_writer=w, planner=planner(), no_dist=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ref), planner=planner(), no_dist=True)
    files = sorted(p.name for p in ours.glob("*.distcp"))
    assert files == [f"__0_{i}.distcp" for i in range(threads)]
    a, b = _records(ours), _records(ref)
    assert set(a) == set(b)
    for key in a:  # each record byte for byte what DCP's writer (torch.save) wrote, but the per-save id
        if key[1] is None:
            assert a[key] == b[key], key
        else:
            assert _without_id(a[key]) == _without_id(b[key]), key
            assert zipfile.ZipFile(io.BytesIO(a[key])).testzip() is None  # the payload's zip CRC-32 holds
    for reader in (SafeFileSystemReader(ours, buffer_bytes=buffer_bytes, thread_count=threads), None):
        got = _targets()
        dcp.load(
            got, storage_reader=reader, checkpoint_id=None if reader else ours, planner=ckptq.QuantizedLoadPlanner()
        )
        _check_loaded(got, sd)
    assert "9 verified, 0 without checksum, 0 failed" in _verify(ours)


def test_reader_asks_for_its_own_files_early_only_when_the_layout_is_the_saved_one(tmp_path, monkeypatch):
    import ckptq.io.reader as reader_module

    sd = _state_dict()
    writer = ChecksumFileSystemWriter(tmp_path, thread_count=3)
    dcp.save(sd, storage_writer=writer, planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    asked = []
    monkeypatch.setattr(reader_module, "advise_later", lambda ranges: asked.append(sorted(ranges)))

    def load(**kw) -> None:
        got = _targets()
        reader = SafeFileSystemReader(tmp_path, **kw)
        dcp.load(got, storage_reader=reader, planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
        _check_loaded(got, sd)

    load(early_read_ahead=3 << 20)  # saved by one rank, loaded by one: its three files, 1 MiB each
    assert asked == [[(str(tmp_path / f"__0_{i}.distcp"), 0, 1 << 20) for i in range(3)]]
    load(early_read_ahead=0)
    assert len(asked) == 1
    (tmp_path / "__1_0.distcp").write_bytes(b"")  # now the files are of 2 ranks: another layout
    load()
    assert len(asked) == 1


def _verify(path) -> str:
    from typer.testing import CliRunner

    from ckptq.cli import app

    return CliRunner().invoke(app, ["verify", str(path)]).output


@pytest.mark.parametrize("buffer_bytes", [1 << 16, None])
def test_reader_reads_parts_other_dtypes_and_foreign_framing(tmp_path, buffer_bytes, monkeypatch):
    sd = _state_dict()
    path = tmp_path / "ck"
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    # another dtype (cast) and a column slice (narrowed from the whole record)
    got = {"c": torch.zeros(300, 70)}
    dcp.load(got, storage_reader=SafeFileSystemReader(path, buffer_bytes=buffer_bytes, fadvise=False), no_dist=True)
    assert torch.equal(got["c"], sd["c"].float())
    # records whose framing is not this torch's (here: a changed pickle) load through torch.load
    slow, fast = [], []
    read_item, read_fast = SafeFileSystemReader._read_item, SafeFileSystemReader._read_fast
    monkeypatch.setattr(SafeFileSystemReader, "_read_item", lambda self, *a: slow.append(a[3]) or read_item(self, *a))
    monkeypatch.setattr(
        SafeFileSystemReader, "_read_fast", lambda self, *a: fast.append(read_fast(self, *a)) or fast[-1]
    )

    def load():
        slow.clear(), fast.clear()
        got = _targets()
        reader = SafeFileSystemReader(path, buffer_bytes=buffer_bytes)
        dcp.load(got, storage_reader=reader, planner=ckptq.QuantizedLoadPlanner())
        _check_loaded(got, sd)
        return len(slow), list(fast)

    n_slow, n_fast = load()
    assert n_slow == 1 and n_fast == [True] * 7  # the bytes entry; every tensor record but the empty one
    real = tensor_record

    def other_framing(dtype, shape):
        rec = real(dtype, shape)
        return dataclasses.replace(rec, header=b"X" + rec.header[1:])

    monkeypatch.setattr("ckptq.io.records.tensor_record", other_framing)
    assert load() == (8, [False] * 7)  # every record read the slow way


def test_a_flipped_payload_byte_is_named_by_the_fast_reader(tmp_path):
    sd = _state_dict()
    path = tmp_path / "ck"
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    md = read_metadata(path)
    index = next(i for i in md.storage_data if i.fqn == "c")
    info = md.storage_data[index]
    at = info.offset + len(tensor_record(torch.bfloat16, (300, 70)).header) + 1000
    with open(path / info.relative_path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptq.errors import ChecksumMismatchError
    from ckptq.io import dcp_failure

    with pytest.raises(CheckpointException) as e:
        reader = SafeFileSystemReader(path, buffer_bytes=1 << 16)
        dcp.load(_targets(), storage_reader=reader, planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
    err = dcp_failure(e.value, str(path))
    assert isinstance(err, ChecksumMismatchError)
    assert "'c'" in str(err) and f"bytes {info.offset}..{info.offset + info.length}" in str(err)


def test_async_save_reuses_its_staging_and_stages_each_saves_values(tmp_path):
    from ckptq.io import writer as w

    sd = _state_dict()
    fut = dcp.async_save(
        sd, storage_writer=ChecksumFileSystemWriter(tmp_path / "one"), planner=ckptq.QuantizedSavePlanner()
    )
    fut.result()
    kept = dict(w._STAGED)
    sd2 = _state_dict()
    sd2["c"] = sd2["c"] + 1  # new values, same shapes: the kept staging is copied into
    sd2["step"] = {"epoch": 4}
    fut = dcp.async_save(
        sd2, storage_writer=ChecksumFileSystemWriter(tmp_path / "two"), planner=ckptq.QuantizedSavePlanner()
    )
    fut.result()
    assert set(w._STAGED) == set(kept) and all(w._STAGED[k] is kept[k] for k in kept) and not w._STAGED_BUSY
    for path, want in ((tmp_path / "one", sd), (tmp_path / "two", sd2)):
        got = _targets()
        dcp.load(got, storage_reader=SafeFileSystemReader(path), planner=ckptq.QuantizedLoadPlanner())
        _check_loaded(got, want)
    w._STAGED.clear()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_MARKS)])
def test_reserved_staging_is_what_the_first_async_save_stages_into(tmp_path, device):
    """reserve_staging makes the copy dcp.async_save then uses (nothing allocated during the save),
    page-locked for CUDA tensors; release_staging frees it."""
    from ckptq.io import release_staging, reserve_staging
    from ckptq.io import writer as w

    w._STAGED.clear()
    sd = _state_dict(device)
    sd["f"] = torch.randn(6, 8, device=device).t()  # strided: staged with the same strides
    nbytes = reserve_staging(sd)
    ((key, reserved),) = w._STAGED.items()
    tensors = w._staged_tensors(reserved)
    want = sum(v.nbytes for k in "ab" for v in sd[k].components().values()) + sum(sd[k].nbytes for k in "cdef")
    assert nbytes == want and len(tensors) == len(sd["a"].components()) + len(sd["b"].components()) + 4
    assert all(t.device.type == "cpu" and t.is_pinned() == (device == "cuda") for t in tensors if t.numel())
    again = {**_state_dict(device), "f": torch.zeros(6, 8, device=device).t()}
    assert reserve_staging(again) == nbytes and list(w._STAGED) == [key] and w._STAGED[key] is reserved
    ptrs = [t.data_ptr() for t in tensors]
    dcp.async_save(
        sd, storage_writer=ChecksumFileSystemWriter(tmp_path / "ck"), planner=ckptq.QuantizedSavePlanner()
    ).result()
    assert w._STAGED[key] is reserved and [t.data_ptr() for t in w._staged_tensors(reserved)] == ptrs
    for k in "cf":  # the save staged into the reservation
        assert_same_bytes(reserved[k], sd[k].cpu(), f"staged {k}")
    assert reserved["f"].stride() == sd["f"].stride()
    got = _targets(device)
    dcp.load(got, storage_reader=SafeFileSystemReader(tmp_path / "ck"), planner=ckptq.QuantizedLoadPlanner())
    _check_loaded(got, sd)
    release_staging({**_targets(device), "f": torch.zeros(6, 8, device=device).t()})  # same structure
    assert not w._STAGED
    reserve_staging(sd)
    release_staging()
    assert not w._STAGED


@requires_cuda
def test_cuda_tensors_save_through_pinned_pieces_and_load_back_exactly(tmp_path):
    sd = _state_dict("cuda")
    for name, save in (
        (
            "sync",
            lambda p: dcp.save(
                sd,
                storage_writer=ChecksumFileSystemWriter(p, buffer_bytes=1 << 16),
                planner=ckptq.QuantizedSavePlanner(),
                no_dist=True,
            ),
        ),
        (
            "async",
            lambda p: dcp.async_save(
                sd,
                storage_writer=ChecksumFileSystemWriter(p, buffer_bytes=1 << 16),
                planner=ckptq.QuantizedSavePlanner(),
            ).result(),
        ),
    ):
        save(tmp_path / name)
        for buffer_bytes in (1 << 16, None):
            got = _targets("cuda")
            dcp.load(
                got,
                storage_reader=SafeFileSystemReader(tmp_path / name, buffer_bytes=buffer_bytes),
                planner=ckptq.QuantizedLoadPlanner(),
            )
            _check_loaded(got, sd)


@pytest.mark.parametrize("ahead_records", [0, 3, 100])
def test_a_files_thread_resolves_destinations_at_most_read_ahead_bytes_past_the_commits(tmp_path, ahead_records):
    """read_ahead_bytes bounds how far past the committed records a file's thread resolves (and so
    may allocate) destinations; with a slow caller it does run that far ahead."""
    import threading
    import time

    from torch.distributed.checkpoint import DefaultLoadPlanner

    nbytes = 64 * 4 * 256  # one 64 KiB record per tensor
    sd = {f"t{i:02d}": torch.full((64, 256), float(i)) for i in range(24)}
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(tmp_path / "ck", thread_count=1), no_dist=True)
    lock, state = threading.Lock(), {"resolved": 0, "committed": 0, "most": 0}

    class Counting(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            with lock:
                state["resolved"] += 1
                state["most"] = max(state["most"], state["resolved"] - state["committed"])
            return super().resolve_tensor(read_item)

        def commit_tensor(self, read_item, tensor):
            with lock:
                state["committed"] += 1
            super().commit_tensor(read_item, tensor)

    class SlowCaller(SafeFileSystemReader):
        def _read_fast(self, *args, **kwargs):
            # a slow caller, slow outside the planner lock (which commits and resolves share), so
            # the file's thread runs as far ahead as it may
            time.sleep(0.02)
            return super()._read_fast(*args, **kwargs)

    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = SlowCaller(tmp_path / "ck", read_ahead_bytes=ahead_records * nbytes, buffer_bytes=1 << 14)
    dcp.load(got, storage_reader=reader, planner=Counting(), no_dist=True)
    for k in sd:
        assert_same_bytes(got[k], sd[k], k)
    # at most the records within read_ahead_bytes from the one the caller takes, the one it commits
    # and the next one; unbounded, well past the bounded cases (how far depends on thread timing)
    assert 1 <= state["most"] <= ahead_records + 2 and (ahead_records < 24 or state["most"] >= 8)


def test_a_planner_error_on_a_reading_thread_is_named_and_stops_every_thread(tmp_path):
    """Destinations are resolved on the files' reading threads: a planner that fails there fails the
    load with the record named, and no reading thread is left running."""
    import threading

    from torch.distributed.checkpoint.api import CheckpointException

    from ckptq.errors import CheckpointFormatError
    from ckptq.io import dcp_failure

    path = tmp_path / "ck"
    w = ChecksumFileSystemWriter(path, thread_count=3)
    dcp.save(_state_dict(), storage_writer=w, planner=ckptq.QuantizedSavePlanner(), no_dist=True)

    class Failing(ckptq.QuantizedLoadPlanner):
        def resolve_tensor(self, read_item):
            if read_item.storage_index.fqn == "c":
                raise RuntimeError("no room for c")
            return super().resolve_tensor(read_item)

    before = threading.active_count()
    with pytest.raises(CheckpointException) as e:
        reader = SafeFileSystemReader(path, thread_count=3, buffer_bytes=1 << 16)
        dcp.load(_targets(), storage_reader=reader, planner=Failing(), no_dist=True)
    err = dcp_failure(e.value, str(path))
    assert isinstance(err, CheckpointFormatError) and "'c'" in str(err) and "no room for c" in str(err)
    assert threading.active_count() == before


@requires_cuda
@pytest.mark.parametrize("reader", ["safe", "dcp"])
def test_decoding_loads_into_cuda_targets_run_there_and_equal_the_cpu_loads(tmp_path, monkeypatch, reader):
    """Targets on a CUDA device whose source must be converted (high-precision values re-encoded,
    another format re-encoded, a quantized entry into a plain target) get their source region read
    into that device and converted there: the same bytes as the same load into CPU targets, and as
    the CUDA load that converts on the CPU (``DEVICE_DECODE_BYTES`` = 0)."""
    from torch.distributed.checkpoint import FileSystemReader

    import ckptq.planners.load as load_mod

    sd = _state_dict()
    dcp.save(sd, checkpoint_id=tmp_path / "native", planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    hp = ckptq.QuantizedSavePlanner(mode="high_precision")
    dcp.save(sd, checkpoint_id=tmp_path / "hp", planner=hp, no_dist=True)

    def targets(device):
        return {  # each one converted: a and b swap formats
            "a": ckptq.quantize(torch.zeros(256, 512, device=device), "mxfp8"),
            "b": ckptq.quantize(torch.zeros(128, 256, device=device), "nvfp4"),
        }

    def plain_targets(device):
        return {k: torch.zeros(sd[k].shape, dtype=torch.bfloat16, device=device) for k in "ab"}

    devices = []
    real = load_mod._Decode._decode_device
    monkeypatch.setattr(
        load_mod._Decode, "_decode_device", lambda self, n: devices.append(real(self, n)) or real(self, n)
    )

    def load(ck, make, device):
        got = make(device)
        rd = SafeFileSystemReader(ck) if reader == "safe" else FileSystemReader(str(ck))
        dcp.load(got, storage_reader=rd, planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
        return {k: dict(v._components) if isinstance(v, ckptq.QuantizedTensor) else {"": v} for k, v in got.items()}

    for ck, make in ((tmp_path / "hp", targets), (tmp_path / "native", targets), (tmp_path / "native", plain_targets)):
        want = load(ck, make, "cpu")
        devices.clear()
        on_gpu = load(ck, make, "cuda")
        assert devices and all(d is not None and d.type == "cuda" for d in devices), devices
        monkeypatch.setattr(load_mod, "DEVICE_DECODE_BYTES", 0)
        devices.clear()
        on_cpu = load(ck, make, "cuda")
        assert devices and all(d is None for d in devices), devices
        monkeypatch.setattr(load_mod, "DEVICE_DECODE_BYTES", 1 << 30)
        for k, comps in want.items():
            for name, v in comps.items():
                assert_same_bytes(on_gpu[k][name].cpu(), v, f"{ck.name} {k}.{name} (converted on the GPU)")
                assert_same_bytes(on_cpu[k][name].cpu(), v, f"{ck.name} {k}.{name} (converted on the CPU)")


def test_reader_threads_default_to_fewer_where_cuda_is_in_use(monkeypatch):
    """Data files read at once: 8 in a process without CUDA, 4 in one that has initialized CUDA
    (measured on GPU targets: ``ckptq.io.fileio.DEFAULT_READ_THREADS_CUDA``); an explicit
    ``thread_count`` wins either way."""
    from ckptq.io import fileio

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fileio.default_read_threads() == fileio.DEFAULT_THREADS == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert fileio.default_read_threads() == fileio.DEFAULT_READ_THREADS_CUDA == 4
    assert SafeFileSystemReader("unused", thread_count=3).thread_count == 3
    assert SafeFileSystemReader("unused").thread_count is None  # decided when the data is read


def test_willneed_asks_for_the_whole_range_one_device_window_per_call(tmp_path, monkeypatch):
    from ckptq.io import fileio

    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * (3 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        chunk = fileio.willneed_chunk(fd)
        dev = os.fstat(fd).st_dev
        queue = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue"
        if os.path.exists(f"{queue}/read_ahead_kb"):  # a whole disk: its limits, as Linux caps the call
            kib = max(int(open(f"{queue}/{n}").read()) for n in ("read_ahead_kb", "max_sectors_kb"))
            assert chunk == max(4, kib) << 10
        assert chunk >= 4 << 10
        monkeypatch.setitem(fileio._willneed_chunks, dev, 1 << 20)  # 1 MiB windows
        calls = []
        monkeypatch.setattr(os, "posix_fadvise", lambda *a: calls.append(a))
        fileio.willneed(fd, 4096, (5 << 19) + 1)  # 2.5 MiB + 1 byte from 4 KiB
        assert [c[1:] for c in calls] == [
            (4096, 1 << 20, os.POSIX_FADV_WILLNEED),
            (4096 + (1 << 20), 1 << 20, os.POSIX_FADV_WILLNEED),
            (4096 + (2 << 20), (1 << 19) + 1, os.POSIX_FADV_WILLNEED),
        ]
        calls.clear()
        fileio.willneed(fd, 1 << 20, 0)  # 0: to the end of the file
        assert [c[1:3] for c in calls] == [(1 << 20, 1 << 20), (2 << 20, 1 << 20)]
    finally:
        os.close(fd)


def test_willneed_chunk_falls_back_where_no_block_device_holds_the_file():
    from ckptq.io import fileio

    r, w = os.pipe()  # a pipe's device is no block device: Linux's default read-ahead window
    try:
        fileio._willneed_chunks.pop(os.fstat(r).st_dev, None)
        assert fileio.willneed_chunk(r) == fileio.WILLNEED_FALLBACK
    finally:
        os.close(r)
        os.close(w)


def _resident(path, n: int) -> int:
    """Bytes of the first ``n`` bytes of ``path`` that are in the page cache (``mincore``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open(path, "rb") as f:
        addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip("mmap failed")
        try:
            vec = (ctypes.c_ubyte * ((n + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            if libc.mincore(addr, n, vec) != 0:
                pytest.skip("mincore failed")
            return sum(v & 1 for v in vec) * mmap.PAGESIZE
        finally:
            libc.munmap(addr, n)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/self"), reason="Linux only")
def test_willneed_fetches_a_range_longer_than_one_call_fetches(tmp_path):
    """The reason for :func:`willneed`: one WILLNEED call of a long range leaves most of it unread."""
    import time

    from ckptq.io import fileio

    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        chunk = fileio.willneed_chunk(f.fileno())
        if chunk > 16 << 20:
            pytest.skip(f"this disk's read-ahead window is {chunk >> 20} MiB: the file would be too large")
        n = 4 * chunk
        f.write(os.urandom(1 << 20) * (n >> 20) + os.urandom(n % (1 << 20)))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:

        def fetched(advise) -> int:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if _resident(path, n):
                pytest.skip("this file system keeps the file in memory (DONTNEED drops nothing)")
            advise()
            got, since = _resident(path, n), time.monotonic()
            while got < n and time.monotonic() - since < 0.5:  # until all of it, or no more for 0.5 s
                time.sleep(0.05)
                now = _resident(path, n)
                if now != got:
                    got, since = now, time.monotonic()
            return got

        assert fetched(lambda: os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)) < n  # one call: one window
        assert fetched(lambda: fileio.willneed(fd, 0, n)) == n
    finally:
        os.close(fd)

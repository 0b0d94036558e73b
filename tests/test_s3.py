"""Object storage (``s3://``) wherever a path goes: ``dcp.save`` / ``dcp.load`` with ckptq's writer
and reader, and inspect / verify / reshard / convert / export reading and writing buckets, against
moto's standalone S3 server (a real HTTP server process, started here on 127.0.0.1), bit-exact
against the same runs on local folders; a two-process reshard bucket -> bucket under torchrun; kill
-9 midway leaves nothing any reader accepts; the credentials never reach any output."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_components

import ckptq
from ckptq.checkpoint import CheckpointView
from ckptq.io import AtomicFileSystemWriter, SafeFileSystemReader, read_metadata

pytest.importorskip("s3fs")
pytest.importorskip("moto")
pytest.importorskip("flask")  # moto's server (moto[server])

# Made-up credentials (moto accepts any): no output of any test may contain them.
KEY_ID, SECRET = "CKPTQTESTKEYID4F1C", "ckptq-test-secret-9b27e1d0"
RULES = ["*.q_proj.weight=col", "*.o_proj.weight=row"]
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free port of 127.0.0.1, the usual AWS environment variables pointing
    at it (inherited by child processes), and two buckets; yields an ``s3fs`` file system."""
    import s3fs

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("moto's S3 server did not start")
                time.sleep(0.1)
        os.environ.update(env)
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        for bucket in ("ckptq-src", "ckptq-dst"):
            fs.mkdir(bucket)
        yield fs
    finally:
        proc.kill()
        proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


def _url(bucket: str) -> str:
    return f"s3://{bucket}/{uuid.uuid4().hex[:8]}/ck"


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.q_proj.weight": ckptq.quantize(torch.randn(256, 128, generator=g), "nvfp4"),
        "layers.0.o_proj.weight": ckptq.quantize(torch.randn(128, 256, generator=g), "mxfp8", columnwise=True),
        "layers.1.q_proj.weight": ckptq.quantize(torch.randn(128, 128, generator=g), "fp8_tensor"),
        "norm.weight": torch.randn(128, generator=g),
        "step": torch.tensor([seed]),
    }


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _assert_same_state(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, ckptq.QuantizedTensor):
            assert_same_components(got[k], v, k)
        else:
            assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def _names(fs, url: str) -> list[str]:
    p = url[len("s3://") :]
    return sorted(n.rsplit("/", 1)[-1] for n in fs.ls(p, refresh=True)) if fs.exists(p) else []


def _no_secrets(*texts: str) -> None:
    for t in texts:
        assert KEY_ID not in t and SECRET not in t, "a credential reached the output"


def test_dcp_save_load_round_trip(s3, tmp_path):
    """``dcp.save`` with AtomicFileSystemWriter to s3:// and ``dcp.load`` with SafeFileSystemReader
    and QuantizedLoadPlanner: bit-exact; the data object is the local save's file byte for byte;
    DCP's own ``FsspecReader`` (``torch.load`` of each record) reads it too; saving over it is
    refused without ``overwrite``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    sd, url = _state(1), _url("ckptq-src")
    dcp.save(sd, storage_writer=AtomicFileSystemWriter(url), planner=ckptq.QuantizedSavePlanner())
    assert _names(s3, url) == [".metadata", "__0_0.distcp"]  # the temporary .metadata.tmp is gone
    # against ckptq's local writer with one file per rank (its records are torch.save's byte for byte
    # but for .data/serialization_id: ckptq.io.records)
    local = ckptq.io.ChecksumFileSystemWriter(tmp_path / "ck", thread_count=1)
    dcp.save(sd, storage_writer=local, planner=ckptq.QuantizedSavePlanner())
    assert s3.cat_file(f"{url[5:]}/__0_0.distcp") == (tmp_path / "ck" / "__0_0.distcp").read_bytes()

    out = _zeros(sd)
    dcp.load(out, storage_reader=SafeFileSystemReader(url), planner=ckptq.QuantizedLoadPlanner())
    _assert_same_state(out, sd)
    out = _zeros(sd)
    dcp.load(out, storage_reader=FsspecReader(url), planner=ckptq.QuantizedLoadPlanner())
    _assert_same_state(out, sd)
    view = CheckpointView(url)
    assert view.local is False and view.files == [f"{url}/__0_0.distcp"]
    _assert_same_state({k: view.read(k) for k in sd}, sd)

    with pytest.raises(BaseException, match="cannot replace one atomically"):
        dcp.save(_state(2), storage_writer=AtomicFileSystemWriter(url), planner=ckptq.QuantizedSavePlanner())
    _assert_same_state({k: CheckpointView(url).read(k) for k in sd}, sd)  # untouched
    dcp.save(
        _state(2), storage_writer=AtomicFileSystemWriter(url, overwrite=True), planner=ckptq.QuantizedSavePlanner()
    )
    out = _zeros(sd)
    dcp.load(out, storage_reader=SafeFileSystemReader(url), planner=ckptq.QuantizedLoadPlanner())
    _assert_same_state(out, _state(2))


class _Requests:
    """Counts the S3 API calls of the s3fs client (botocore's ``before-call`` event, by operation
    name) while the block runs: what the moto server is asked, request by request."""

    def __init__(self, fs) -> None:
        self.client, self.calls = fs.s3, collections.Counter()

    def _count(self, model, **_) -> None:
        self.calls[model.name] += 1

    def __enter__(self) -> collections.Counter:
        self.client.meta.events.register("before-call.s3", self._count)
        return self.calls

    def __exit__(self, *exc) -> None:
        self.client.meta.events.unregister("before-call.s3", self._count)


def _quantized(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": ckptq.quantize(torch.randn(64, 256, generator=g), "mxfp8") for i in range(n)}


def test_requests_of_a_save_and_a_load(s3, monkeypatch):
    """``dcp.save`` uploads the rank's data object with one PUT and ``.metadata`` with one more (no
    ``.metadata.tmp`` copied and deleted); ``dcp.load`` fetches ``.metadata`` and then the records
    of the data object together: one ranged GET per window of records next to each other
    (``READ_WINDOW`` bytes at most), never one per record."""
    from ckptq.io import storage

    sd, url = _quantized(6), _url("ckptq-src")
    with _Requests(s3) as calls:
        dcp.save(sd, storage_writer=AtomicFileSystemWriter(url), planner=ckptq.QuantizedSavePlanner())
    assert calls["PutObject"] == 2 and not calls.keys() & {"CopyObject", "CreateMultipartUpload", "UploadPart"}, calls
    assert _names(s3, url) == [".metadata", "__0_0.distcp"]
    size = s3.info(f"{url[5:]}/__0_0.distcp")["size"]
    records = len(read_metadata(url).storage_data)
    assert records == 12  # 6 entries of 2 components each
    for window, gets in ((storage.READ_WINDOW, 1), (size // 5, 6)):  # 6: the last window is the rest
        monkeypatch.setattr(storage, "READ_WINDOW", window)
        out = _zeros(sd)
        with _Requests(s3) as calls:
            dcp.load(out, storage_reader=SafeFileSystemReader(url), planner=ckptq.QuantizedLoadPlanner())
        _assert_same_state(out, sd)
        assert calls["GetObject"] == 1 + gets, (window, calls)  # .metadata, then the windows

    # Plain (unquantized) entries: the first bytes of each one's record are looked at for another
    # library's pickled tensor (ckptq.io.foreign), all in one GET when their records lie together.
    monkeypatch.undo()
    sd, url = _state(1), _url("ckptq-src")
    dcp.save(sd, storage_writer=AtomicFileSystemWriter(url), planner=ckptq.QuantizedSavePlanner())
    out = _zeros(sd)
    with _Requests(s3) as calls:
        dcp.load(out, storage_reader=SafeFileSystemReader(url), planner=ckptq.QuantizedLoadPlanner())
    _assert_same_state(out, sd)
    assert calls["GetObject"] == 3, calls  # .metadata, the two plain entries' first bytes, the records


def test_save_spreads_a_rank_over_objects(s3, monkeypatch):
    """A rank's records larger than ``OBJECT_BYTES`` are spread over several objects (uploaded by
    ``thread_count`` threads at once), each built and uploaded whole; ckptq's reader and DCP's own
    ``FsspecReader`` read them bit-exact."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from ckptq.io import storage

    sd = _quantized(5, seed=1)
    monkeypatch.setattr(storage, "OBJECT_BYTES", 40_000)  # each tensor: 16 KiB of fp8 + 512 B of scales
    for threads in (1, 2):
        url = _url("ckptq-src")
        writer = AtomicFileSystemWriter(url, thread_count=threads)
        dcp.save(sd, storage_writer=writer, planner=ckptq.QuantizedSavePlanner())
        assert _names(s3, url) == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
        for reader in (SafeFileSystemReader(url), FsspecReader(url)):
            out = _zeros(sd)
            dcp.load(out, storage_reader=reader, planner=ckptq.QuantizedLoadPlanner())
            _assert_same_state(out, sd)


def test_te_checkpoint_in_a_bucket_reads_as_locally(s3, tmp_path):
    """A checkpoint whose records are pickled TransformerEngine tensors (the tests' stand-in, saved
    by stock ``dcp.save``) read from s3://: the first bytes of its plain entries' records, fetched
    together (``storage.read_ranges``), reveal the same TE tensors as the local read, and they
    load (dequantized) bit-exact with the local loads."""
    from _te import standin

    from ckptq.inspect import inspect_checkpoint

    te = standin()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g)
    sd = {
        "a": te.make_te_tensor(x, "mxfp8", flavor="2974"),
        "b": te.make_te_tensor(x, "nvfp4", flavor="main"),
        "bias": torch.randn(64, generator=g),
    }
    local, url = tmp_path / "te", _url("ckptq-src")
    dcp.save(sd, checkpoint_id=str(local))
    s3.put(str(local), url[5:], recursive=True)
    here = read_metadata(local)
    with _Requests(s3) as calls:
        there = read_metadata(url)
    assert there.state_dict_metadata == here.state_dict_metadata and there.storage_data == here.storage_data
    assert there.planner_data == here.planner_data
    # .metadata, the three entries' first bytes (one GET: their records lie together), then each TE
    # tensor's first record whole (the adapters read its pickle)
    assert calls["GetObject"] == 4, calls
    a, b = inspect_checkpoint(local), inspect_checkpoint(url)
    assert a["tensors"] == b["tensors"] and {r["fqn"]: r["format"] for r in b["tensors"]}["a"] == "mxfp8"
    out_here, out_there = ({k: torch.zeros(v.shape) for k, v in sd.items()} for _ in range(2))  # dequantized
    for path, out in ((local, out_here), (url, out_there)):
        dcp.load(out, storage_reader=SafeFileSystemReader(path), planner=ckptq.QuantizedLoadPlanner())
    for k in sd:
        assert torch.equal(out_here[k].view(torch.uint8), out_there[k].view(torch.uint8)), k


def test_range_prefetcher_reads_across_windows(s3):
    """:class:`ckptq.io.storage.RangePrefetcher` covers ranges with windows (neighbours within
    ``gap`` together, long ranges split) and serves any read in ascending order from them: reads
    that cross windows, skip windows, fall outside every window, or run past the object's end."""
    from ckptq.io.storage import RangePrefetcher

    data = bytes(range(256)) * 400  # 102400 bytes
    key = f"ckptq-src/{uuid.uuid4().hex[:8]}/blob"
    s3.pipe_file(key, data)
    ranges = [(0, 1000), (1100, 5000), (20_000, 50_000), (90_000, 102_400)]
    with _Requests(s3) as calls:
        src = RangePrefetcher(f"s3://{key}", ranges, window=16_384, ahead=2, gap=200)
        assert src.windows == [(0, 5000), (20_000, 36_384), (36_384, 50_000), (90_000, 102_400)]
        buf = bytearray(4000)
        assert src.readinto(buf, 500) == 4000 and buf == data[500:4500]
        assert src.pread(20_000, 30_000) == data[30_000:50_000]  # across two windows
        assert src.pread(10, 60_000) == data[60_000:60_010]  # in no window: fetched by itself
        assert src.pread(1000, 102_000) == data[102_000:]  # the object ends first
        src.close()
    # the four windows, the read outside them, and the rest of the read past the end (refused: 416;
    # a HEAD then tells that the object ended)
    assert calls["GetObject"] == 6 and calls["HeadObject"] == 1, calls

    src = RangePrefetcher(f"s3://{key}", ranges, window=16_384, ahead=1, gap=200)
    assert src.pread(100, 95_000) == data[95_000:95_100]  # windows before it skipped
    src.close()


def test_tools_on_buckets_match_local_runs(s3, tmp_path):
    """inspect, verify, reshard, convert and export, s3 -> s3, local -> s3 and s3 -> local: the
    same results as the local runs (bit-exact tensors; identical safetensors files)."""
    from ckptq.export import export_checkpoint
    from ckptq.inspect import inspect_checkpoint
    from ckptq.reshard import reshard_checkpoint
    from ckptq.verify import check_integrity, verify_checkpoints

    local = tmp_path / "src"
    dcp.save(_state(3), storage_writer=AtomicFileSystemWriter(local), planner=ckptq.QuantizedSavePlanner())
    src = _url("ckptq-src")
    s3.put(str(local), src[5:], recursive=True)

    a, b = inspect_checkpoint(local), inspect_checkpoint(src)
    assert a["tensors"] == b["tensors"] and a["summary"] == b["summary"]
    assert b["path"] == src
    integrity = check_integrity(src)["summary"]
    assert integrity["ok"] and integrity["verified"] == integrity["records"] > 0

    def same(x, y):
        s = verify_checkpoints(x, y)["summary"]
        assert s["ok"] and s["bit_exact"] == s["compared"] > 0, s

    opts = dict(mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=RULES)
    reshard_checkpoint(local, tmp_path / "r", **opts)
    r_s3 = _url("ckptq-dst")
    res = reshard_checkpoint(src, r_s3, **opts)
    assert res["path"] == r_s3 and _names(s3, r_s3) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    same(tmp_path / "r", r_s3)
    assert check_integrity(r_s3)["summary"]["unverified"] == 0
    reshard_checkpoint(src, tmp_path / "r_from_s3", **opts)  # s3 -> local
    same(tmp_path / "r", tmp_path / "r_from_s3")
    with pytest.raises(ckptq.CkptqError, match="exists; pass --overwrite"):
        reshard_checkpoint(src, tmp_path / "r_from_s3", **opts)
    with pytest.raises(ckptq.CkptqError, match="pass --overwrite"):
        reshard_checkpoint(src, r_s3, **opts)

    conv = dict(to="mxfp8", mesh="3", plan="fsdp2")
    reshard_checkpoint(local, tmp_path / "c", **conv)
    c_s3 = _url("ckptq-dst")
    reshard_checkpoint(local, c_s3, **conv)  # local -> s3, requantized
    same(tmp_path / "c", c_s3)

    ex = dict(layout="compressed-tensors", config=False, max_shard_size="40KB")
    hf = _url("ckptq-dst")
    with pytest.raises(ckptq.UnsupportedFormatError, match="nothing was written"):  # refused after writing shards
        export_checkpoint(src, hf, **ex)
    assert _names(s3, hf) == []  # ... which are gone
    export_checkpoint(local, tmp_path / "hf", on_inexact="keep", **ex)
    export_checkpoint(src, hf, on_inexact="keep", **ex)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert len(files) > 3 and _names(s3, hf) == files
    for name in files:  # the same bytes: the header written first on S3 is the local one's final header
        assert s3.cat_file(f"{hf[5:]}/{name}") == (tmp_path / "hf" / name).read_bytes(), name


@pytest.mark.slow
def test_torchrun_reshard_bucket_to_bucket(s3, tmp_path):
    """``torchrun --nproc-per-node 2 -m ckptq reshard s3://... s3://...`` (gloo): each process
    writes its own objects (``__{rank}_{process}.distcp``), rank 0 ``.metadata``; bit-exact
    against one local process; no credential in any output."""
    from ckptq.reshard import reshard_checkpoint
    from ckptq.verify import check_integrity, verify_checkpoints

    local = tmp_path / "src"
    dcp.save(_state(4), storage_writer=AtomicFileSystemWriter(local), planner=ckptq.QuantizedSavePlanner())
    src, dst = _url("ckptq-src"), _url("ckptq-dst")
    s3.put(str(local), src[5:], recursive=True)
    reshard_checkpoint(local, tmp_path / "one", mesh="dp_shard=2,tp=2", plan="fsdp2-tp", rules=RULES)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "CKPTQ_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    rules = sum([["--rule", r] for r in RULES], [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ckptq"]
    args = ["reshard", src, dst, "--mesh", "dp_shard=2,tp=2", "--plan", "fsdp2-tp", *rules]
    proc = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "by 2 processes" in proc.stderr
    _no_secrets(proc.stdout, proc.stderr)
    names = _names(s3, dst)
    assert ".metadata" in names and {n.split("_")[-1] for n in names if n.endswith(".distcp")} == {
        "0.distcp",
        "1.distcp",
    }, names
    s = verify_checkpoints(tmp_path / "one", dst)["summary"]
    assert s["ok"] and s["bit_exact"] == s["compared"] > 0
    integrity = check_integrity(dst)["summary"]
    assert integrity["ok"] and integrity["unverified"] == 0  # both processes' checksums reached .metadata


class _Stall(ckptq.QuantizedSavePlanner):
    """Stops for good midway through writing the data (where the kill comes)."""

    def __init__(self, midway):
        super().__init__()
        self.midway, self.n = midway, 0

    def resolve_data(self, item):
        self.n += 1
        if self.n == 20:
            self.midway.set()
            time.sleep(600)
        return super().resolve_data(item)


def _killed_save(url, midway):
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": ckptq.quantize(torch.randn(256, 256, generator=g), "nvfp4") for i in range(16)}
    dcp.save(sd, storage_writer=AtomicFileSystemWriter(url), planner=_Stall(midway), no_dist=True)


def _killed_reshard(src, dst, midway):
    from ckptq.io import writer
    from ckptq.reshard import reshard_checkpoint

    add, calls = writer.CheckpointDirWriter.add_encoded, [0]

    def stalling(self, *a, **k):  # stops for good after some records went out
        calls[0] += 1
        if calls[0] == 4:
            midway.set()
            time.sleep(600)
        return add(self, *a, **k)

    writer.CheckpointDirWriter.add_encoded = stalling
    reshard_checkpoint(src, dst, mesh="2", plan="fsdp2")


def _kill_midway(target, *args) -> None:
    """Run ``target(*args, midway)`` in a new process (spawned: a fork of this one, with fsspec's
    and torch's threads running, can hang) and kill -9 it once it sets ``midway``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    midway = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, midway), daemon=True)
    proc.start()
    reached = midway.wait(300)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert reached, "the child did not reach its midpoint"


def test_kill_9_midway_leaves_nothing_accepted(s3, tmp_path):
    """kill -9 of a ``dcp.save`` and of a reshard into s3:// midway: nothing visible (uploads
    complete only when a file is closed, ``.metadata`` last); every reader refuses the prefix; the
    next run into it succeeds."""
    from ckptq.reshard import reshard_checkpoint

    url = _url("ckptq-dst")
    _kill_midway(_killed_save, url)
    assert _names(s3, url) == []  # the data object's upload never completed: nothing is visible
    with pytest.raises(ckptq.CheckpointFormatError, match="no '.metadata' object"):
        read_metadata(url)
    with pytest.raises(ckptq.CkptqError):
        CheckpointView(url)
    with pytest.raises(BaseException, match="metadata"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=SafeFileSystemReader(url), no_dist=True)

    local = tmp_path / "src"
    dcp.save(_state(5), storage_writer=AtomicFileSystemWriter(local), planner=ckptq.QuantizedSavePlanner())
    dst = _url("ckptq-dst")
    _kill_midway(_killed_reshard, str(local), dst)
    assert _names(s3, dst) == []
    with pytest.raises(ckptq.CheckpointFormatError):
        read_metadata(dst)
    reshard_checkpoint(local, dst, mesh="2", plan="fsdp2")
    assert read_metadata(dst).state_dict_metadata


def test_cli_on_urls_names_urls_never_credentials(s3, caplog):
    """``ckptq inspect`` / ``verify`` take URLs; a missing checkpoint is a clear error naming the
    URL; no credential in the output or in ckptq's log records."""
    import logging

    from typer.testing import CliRunner

    from ckptq.cli import app

    url, missing = _url("ckptq-src"), _url("ckptq-src")
    dcp.save(_state(6), storage_writer=AtomicFileSystemWriter(url), planner=ckptq.QuantizedSavePlanner())
    with caplog.at_level(logging.DEBUG, logger="ckptq"):
        runs = [CliRunner().invoke(app, args) for args in (["inspect", url], ["verify", url], ["inspect", missing])]
    assert [r.exit_code for r in runs] == [0, 0, 1], [r.output for r in runs]
    assert missing in runs[2].output and "nothing is stored" in runs[2].output
    _no_secrets(*(r.output for r in runs), *(r.getMessage() for r in caplog.records if r.name.startswith("ckptq")))

"""Checksums: every chunk ckptq writes carries a crc32c of its bytes; loads verify them.

Corruption is made by flipping one bit in the middle of a record's byte range (inside the tensor
payload, where torch's own zip reader notices nothing), so each test would pass silently without
checksums.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_distributed
from _helpers import requires_cuda
from torch.distributed.checkpoint.api import CheckpointException
from typer.testing import CliRunner

import ckptq
from ckptq.checksums import checksum, checksum_key, payload
from ckptq.contract import read_checksums
from ckptq.io import ChecksumFileSystemWriter, SafeFileSystemReader, dcp_failure, read_metadata

warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w_mx": ckptq.quantize(torch.randn(128, 256, generator=g), "mxfp8"),
        "w_nv": ckptq.quantize(torch.randn(64, 128, generator=g), "nvfp4"),
        "w_f8": ckptq.quantize(torch.randn(32, 64, generator=g), "fp8_tensor"),
        "w_m4": ckptq.quantize(torch.randn(2, 32, 96, generator=g), "mxfp4"),
        "norm": torch.randn(256, generator=g).to(torch.bfloat16),
        "step": 7,
    }


def _empty_like(sd: dict) -> dict:
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def _save(sd, path, writer=ChecksumFileSystemWriter):
    dcp.save(sd, storage_writer=writer(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)


def save_old(sd, path) -> None:
    """A checkpoint as ckptq saved it through DCP's ``FileSystemWriter`` before it recorded
    checksums and metadata digests for such saves: no checksum table, digest or checksum files."""
    import pickle

    from ckptq.contract import CKPTQ_KEY, DIGEST_KEY

    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes())
    for k in ("checksums", DIGEST_KEY):
        md.planner_data[CKPTQ_KEY].pop(k)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    for f in path.glob("*.ckptq-crc32c"):
        f.unlink()


def _flip(path, fqn: str) -> tuple[str, int, int]:
    """Flip one bit in the middle of ``fqn``'s first record; returns its (file, start, end)."""
    md = read_metadata(path)
    index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn == fqn)
    f = path / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    f.write_bytes(bytes(data))
    return info.relative_path, info.offset, info.offset + info.length


def _load(path, sd, *, reader=True, **planner_kwargs):
    try:
        if reader:
            dcp.load(
                sd,
                storage_reader=SafeFileSystemReader(path),
                planner=ckptq.QuantizedLoadPlanner(**planner_kwargs),
                no_dist=True,
            )
        else:
            dcp.load(sd, checkpoint_id=str(path), planner=ckptq.QuantizedLoadPlanner(**planner_kwargs), no_dist=True)
    except CheckpointException as e:
        raise dcp_failure(e, str(path)) from None


def test_every_record_has_the_checksum_of_its_payload(tmp_path):
    sd = _state()
    _save(sd, tmp_path / "ck")
    md = read_metadata(tmp_path / "ck")
    table = read_checksums(md.planner_data)
    assert set(table) == {checksum_key(i) for i in md.storage_data}
    assert table[("norm", (0,))] == checksum(sd["norm"])
    for name in ("w_mx", "w_nv", "w_f8"):
        for comp, t in sd[name].components().items():
            assert table[(f"{name}.{comp}", (0,) * t.dim())] == checksum(t), (name, comp)
    out = _empty_like(sd)
    _load(tmp_path / "ck", out)
    for name in ("w_mx", "w_nv", "w_f8"):
        for comp, t in sd[name].components().items():
            assert bytes(payload(out[name].components()[comp])) == bytes(payload(t)), (name, comp)
    assert out["step"] == 7


@pytest.mark.parametrize("fqn", ["w_mx.data", "w_nv.scale", "norm", "step"])
@pytest.mark.parametrize("reader", [True, False], ids=["SafeFileSystemReader", "FileSystemReader"])
def test_a_flipped_bit_is_a_checksum_error_naming_file_bytes_and_fqn(tmp_path, fqn, reader):
    sd = _state()
    _save(sd, tmp_path / "ck")
    rel, start, end = _flip(tmp_path / "ck", fqn)
    with pytest.raises(ckptq.ChecksumMismatchError) as e:
        _load(tmp_path / "ck", _empty_like(sd), reader=reader)
    msg = str(e.value)
    assert f"'{fqn}'" in msg and rel in msg and f"{start}..{end}" in msg and "checksum mismatch" in msg


def test_verification_can_be_turned_off(tmp_path):
    sd = _state()
    _save(sd, tmp_path / "ck")
    _flip(tmp_path / "ck", "norm")
    out = _empty_like(sd)
    _load(tmp_path / "ck", out, verify_checksums=False)  # loads the corrupt bytes, as asked
    assert not torch.equal(out["norm"], sd["norm"])
    with pytest.raises(ckptq.ChecksumMismatchError):
        _load(tmp_path / "ck", _empty_like(sd))  # the default verifies


def test_checkpoint_without_checksums_loads_with_one_notice(tmp_path, caplog):
    sd = _state()
    save_old(sd, tmp_path / "ck")
    assert read_checksums(read_metadata(tmp_path / "ck").planner_data) is None
    with caplog.at_level(logging.WARNING, logger="ckptq"):
        _load(tmp_path / "ck", _empty_like(sd))
    notices = [r for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0].getMessage()


def test_verify_path_checks_integrity(tmp_path):
    from ckptq.cli import app

    sd = _state()
    _save(sd, tmp_path / "ck")
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(tmp_path / "ck")])
    n = len(read_metadata(tmp_path / "ck").storage_data)
    assert ok.exit_code == 0, ok.output
    assert f"{n} verified, 0 without checksum, 0 failed" in ok.output
    rel, start, end = _flip(tmp_path / "ck", "w_nv.data")
    bad = runner.invoke(app, ["verify", str(tmp_path / "ck")])
    assert bad.exit_code == 1
    assert "w_nv.data" in bad.output and f"{start}..{end}" in bad.output and "1 failed" in bad.output
    save_old(sd, tmp_path / "plain")
    old = runner.invoke(app, ["verify", str(tmp_path / "plain")])
    assert old.exit_code == 0 and f"0 verified, {n} without checksum" in old.output
    assert "no checksums" in old.output


def test_offline_tools_write_checksums(tmp_path):
    sd = _state()
    save_old(sd, tmp_path / "src")  # no checksums in the source
    ckptq.reshard_checkpoint(tmp_path / "src", tmp_path / "bf16", to="bfloat16")
    ckptq.reshard_checkpoint(tmp_path / "src", tmp_path / "r2", mesh="dp_shard=2", plan="fsdp2")
    from ckptq.verify import check_integrity

    for out in ("bf16", "r2"):
        report = check_integrity(tmp_path / out)
        s = report["summary"]
        assert s["ok"] and s["has_checksums"] and s["unverified"] == 0 and s["verified"] == s["records"], (out, s)
    _flip(tmp_path / "r2", "w_mx.data")
    assert check_integrity(tmp_path / "r2")["summary"]["failed"] == 1


def test_async_save_records_checksums(tmp_path):
    sd = _state()
    fut = dcp.async_save(
        sd, storage_writer=ChecksumFileSystemWriter(tmp_path / "ck"), planner=ckptq.QuantizedSavePlanner(), no_dist=True
    )
    fut.result()
    md = read_metadata(tmp_path / "ck")
    assert set(read_checksums(md.planner_data)) == {checksum_key(i) for i in md.storage_data}


def _two_rank_save(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256) / 1000
    sd = {
        "w": distribute_tensor(full.clone(), mesh, [Shard(0)]),
        "q": distribute_tensor(full.clone(), mesh, [Shard(0)]),
    }
    sd = ckptq.quantize_state_dict(sd, {"q": "mxfp8"})
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(path), planner=ckptq.QuantizedSavePlanner())


def _two_rank_load(rank, world, path, safe):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.zeros(64, 256), mesh, [Shard(1)])}
    reader = SafeFileSystemReader(path) if safe else None
    try:
        dcp.load(sd, storage_reader=reader, checkpoint_id=None if safe else path, planner=ckptq.QuantizedLoadPlanner())
    except CheckpointException as e:
        err = dcp_failure(e, path)
        return type(err).__name__, str(err)
    return None, None


@pytest.mark.slow
def test_two_ranks_gather_every_checksum_and_partial_reads_are_verified(tmp_path):
    path = str(tmp_path / "ck")
    run_distributed(2, _two_rank_save, path)
    md = read_metadata(path)
    table = read_checksums(md.planner_data)
    assert set(table) == {checksum_key(i) for i in md.storage_data}
    # each rank writes its own files (ChecksumFileSystemWriter: thread_count of them, see ckptq.io.fileio)
    assert {i.relative_path.split("_")[2] for i in md.storage_data.values()} == {"0", "1"}
    # both ranks' chunks of "w" are in the table, and a Shard(1) load reads parts of each chunk
    rel, start, end = _flip(tmp_path / "ck", "w")
    results = run_distributed(2, _two_rank_load, path, True)
    assert all(kind == "ChecksumMismatchError" and f"{start}..{end}" in msg for kind, msg in results), results


def test_export_writes_checksums_that_reads_and_verify_check(tmp_path):
    from safetensors import safe_open

    from ckptq.checkpoint import open_checkpoint
    from ckptq.checksums import read_safetensors_table
    from ckptq.export import export_checkpoint
    from ckptq.verify import check_integrity

    sd = {
        "model.layers.0.mlp.weight": ckptq.quantize(torch.randn(64, 128), "mxfp8"),
        "model.norm.weight": torch.randn(128),
    }
    _save(sd, tmp_path / "ck")
    export_checkpoint(tmp_path / "ck", tmp_path / "hf", layout="compressed-tensors", config=False)
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as h:
        table = read_safetensors_table(h.metadata())
        assert table and set(table) == set(h.keys())
        assert all(table[k] == checksum(h.get_tensor(k)) for k in h.keys())
    s = check_integrity(tmp_path / "hf")["summary"]
    assert s["ok"] and s["verified"] == s["records"] == len(table)
    # flip one bit inside the quantized weight's bytes
    name = next(k for k in table if k.endswith("weight_packed") or k.endswith(".weight") and "mlp" in k)
    data = bytearray(files[0].read_bytes())
    n = int.from_bytes(data[:8], "little")
    import json

    start, end = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 1
    files[0].write_bytes(bytes(data))
    report = check_integrity(tmp_path / "hf")
    assert report["summary"]["failed"] == 1 and report["problems"][0]["fqn"] == name
    with pytest.raises(ckptq.ChecksumMismatchError, match=name):
        open_checkpoint(tmp_path / "hf").read("model.layers.0.mlp.weight")


@pytest.mark.cuda
@requires_cuda
def test_cuda_resident_tensors_are_checksummed_like_cpu_ones(tmp_path):
    sd = _state()
    _save(sd, tmp_path / "cpu")
    cuda = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    _save(cuda, tmp_path / "cuda")
    a = read_checksums(read_metadata(tmp_path / "cpu").planner_data)
    b = read_checksums(read_metadata(tmp_path / "cuda").planner_data)
    assert a == b
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in cuda.items()}
    _load(tmp_path / "cuda", out)
    assert torch.equal(out["norm"].cpu(), sd["norm"])


def test_verify_path_checks_torch_save_member_crcs(tmp_path):
    from ckptq.verify import check_integrity

    torch.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, tmp_path / "m.pt")
    s = check_integrity(tmp_path / "m.pt")["summary"]
    assert s["ok"] and s["verified"] == s["records"] >= 3
    import zipfile

    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    data = bytearray((tmp_path / "m.pt").read_bytes())
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 100] ^= 1
    (tmp_path / "m.pt").write_bytes(bytes(data))
    report = check_integrity(tmp_path / "m.pt")
    assert report["summary"]["failed"] == 1 and report["problems"][0]["fqn"].endswith("/data/0")


# ---------------------------------------------------------------- the combine arithmetic and the kernels' split
def test_combine_joins_the_checksums_of_pieces_into_that_of_the_whole():
    import random

    import crc32c

    from ckptq.checksums import combine

    rng = random.Random(5)
    data = bytes(rng.getrandbits(8) for _ in range(5000))
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(data) + 1), rng.randint(1, 6)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        value = crc32c.crc32c(pieces[0])
        for p in pieces[1:]:
            value = combine(value, crc32c.crc32c(p), len(p))
        assert value == crc32c.crc32c(data)
    assert combine(crc32c.crc32c(b"abc"), crc32c.crc32c(b""), 0) == crc32c.crc32c(b"abc")
    assert combine(0, crc32c.crc32c(b"abc"), 3) == crc32c.crc32c(b"abc")  # crc32c(b"") == 0


def test_the_kernels_split_and_combine_equal_crc32c_on_cpu():
    """The CPU implementation of ``ckptq::crc32c`` runs the CUDA kernel's code (ckptq/csrc/crc32c.h:
    unaligned head and tail, slice-by-16 segments, each shifted by x^(8 m) and XORed) on the CPU;
    small segments make many pieces."""
    import crc32c

    from ckptq import ops

    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=g)
    with ops.force("cpu"):
        if ops.crc32c(buf[:1]) is None:
            pytest.skip("the C++ extension with ckptq::crc32c is not built")
        for size in (0, 1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 255, 256, 257, 1023, 4097, 65_543):
            for off in (0, 1, 7, 15, 16):
                t = buf[off : off + size]
                want = crc32c.crc32c(t.numpy().tobytes())
                for seg in (0, 64, 192):
                    assert int(ops.crc32c(t, segment=seg)) == want, (size, off, seg)
                assert int(ops.crc32c(t, 0xDEADBEEF)) == crc32c.crc32c(t.numpy().tobytes(), 0xDEADBEEF)
        x = torch.randn(33, 17, generator=g).to(torch.bfloat16).t()  # non-contiguous: row-major bytes
        assert int(ops.crc32c(x)) == checksum(x)
        torch.library.opcheck(torch.ops.ckptq.crc32c.default, (buf[3:1000], 5, 64))  # schema, fake kernel
    assert ops.crc32c(buf) is None  # unforced, CPU tensors are left to the crc32c package


def test_zip_crc32_in_pieces_is_zlibs(monkeypatch):
    """``payload_crc32`` hashed in pieces on threads and joined by ``crc32_combine`` is
    ``zlib.crc32`` of the whole (a running value continued too), at piece borders and off them."""
    import zlib

    from ckptq.checksums import crc32_combine
    from ckptq.io import records

    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (10_007,), dtype=torch.uint8, generator=g).numpy()
    for a, b in [(0, 5), (5, 0), (1, 1), (3, 1000), (6000, 4007)]:
        first, second = data[:a].tobytes(), data[a : a + b].tobytes()
        assert crc32_combine(zlib.crc32(first), zlib.crc32(second), b) == zlib.crc32(first + second)
    monkeypatch.setattr(records, "CRC_PIECE", 1000)  # 10 pieces, the last one short
    for value in (0, 0x1234ABCD):
        assert records.payload_crc32(data, value) == zlib.crc32(data.tobytes(), value)

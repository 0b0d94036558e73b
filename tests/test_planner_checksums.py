"""Checksums of saves planned by ckptq through DCP's own ``FileSystemWriter`` (per-rank checksum
files), and the digest that protects ``.metadata`` itself (issue 23).

Corruption is one flipped bit in the middle of a record (inside the payload, where torch's zip
reader notices nothing), and metadata edits keep a checkpoint that every other check accepts, so
each test would pass silently without the checksum or the digest.
"""

from __future__ import annotations

import logging
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_distributed
from _helpers import assert_same_bytes, assert_same_components
from test_checksums import _empty_like, _flip, _load, _state, save_old
from typer.testing import CliRunner

import ckptq
from ckptq.checkpoint import open_checkpoint
from ckptq.checksums import SIDECAR, checksum_key
from ckptq.contract import CKPTQ_KEY, DIGEST_KEY, read_checksums
from ckptq.io import ChecksumFileSystemWriter, read_metadata

warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")


def _dcp_save(sd, path) -> None:
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner(), no_dist=True)


def _rewrite_metadata(path, edit) -> None:
    """Unpickle ``.metadata`` (a test's own trusted file), apply ``edit`` to it, pickle it back."""
    f = path / ".metadata"
    md = pickle.loads(f.read_bytes())
    edit(md)
    f.write_bytes(pickle.dumps(md))


def _view_reads_all(path) -> None:
    view = open_checkpoint(path)
    for fqn in ("w_mx", "w_nv", "w_f8", "norm"):
        view.read(fqn)


def _verify_cli(path):
    from ckptq.cli import app

    return CliRunner().invoke(app, ["verify", str(path)])


def test_dcp_filesystem_writer_save_records_checksums_and_a_flipped_scale_bit_is_caught(tmp_path):
    sd, ck = _state(), tmp_path / "ck"
    _dcp_save(sd, ck)
    assert (ck / SIDECAR.format(rank=0)).is_file()
    md = read_metadata(ck)
    assert set(read_checksums(md.planner_data)) == {checksum_key(i) for i in md.storage_data}
    out = _empty_like(sd)
    _load(ck, out, reader=False)  # DCP's FileSystemReader: intact data loads
    assert _verify_cli(ck).exit_code == 0
    _flip(ck, "w_mx.scale")
    for reader in (True, False):  # SafeFileSystemReader, and DCP's FileSystemReader + the planner
        with pytest.raises(ckptq.ChecksumMismatchError, match="w_mx.scale"):
            _load(ck, _empty_like(sd), reader=reader)
    with pytest.raises(ckptq.ChecksumMismatchError, match="w_mx.scale"):
        _view_reads_all(ck)
    bad = _verify_cli(ck)
    assert bad.exit_code == 1 and "w_mx.scale" in bad.output and "1 failed" in bad.output


def test_async_save_with_dcp_writer_records_checksums(tmp_path):
    sd, ck = _state(), tmp_path / "ck"
    dcp.async_save(sd, checkpoint_id=str(ck), planner=ckptq.QuantizedSavePlanner(), no_dist=True).result()
    md = read_metadata(ck)
    assert set(read_checksums(md.planner_data)) == {checksum_key(i) for i in md.storage_data}


def test_ckptq_writer_keeps_the_table_in_the_metadata_and_writes_no_checksum_files(tmp_path):
    sd, ck = _state(), tmp_path / "ck"
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(ck), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    assert not list(ck.glob("*.ckptq-crc32c"))
    table = pickle.loads((ck / ".metadata").read_bytes()).planner_data[CKPTQ_KEY]["checksums"]
    assert "chunks" in table and "ranks" not in table


def test_a_deleted_checksum_file_is_an_error(tmp_path):
    sd, ck = _state(), tmp_path / "ck"
    _dcp_save(sd, ck)
    (ck / SIDECAR.format(rank=0)).unlink()
    with pytest.raises(ckptq.CheckpointFormatError, match="missing"):
        read_metadata(ck)


def test_a_writer_without_a_local_directory_is_named_once(tmp_path, caplog):
    class NoMetaWriter(dcp.FileSystemWriter):
        def storage_meta(self):
            return None

    from ckptq.planners import save as save_planner

    save_planner._WARNED.clear()  # once per process: forget earlier tests' saves
    sd, ck = _state(), tmp_path / "ck"
    with caplog.at_level(logging.WARNING, logger="ckptq"):
        dcp.save(sd, storage_writer=NoMetaWriter(ck), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    notes = [r.getMessage() for r in caplog.records if "cannot record checksums" in r.getMessage()]
    assert len(notes) == 1 and "ChecksumFileSystemWriter" in notes[0]
    assert read_checksums(read_metadata(ck).planner_data) is None and not list(ck.glob("*.ckptq-crc32c"))


def _two_rank_dcp_save(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256) / 1000
    sd = ckptq.quantize_state_dict({"q": distribute_tensor(full, mesh, [Shard(0)])}, {"q": "mxfp8"})
    dcp.save(sd, checkpoint_id=path, planner=ckptq.QuantizedSavePlanner())


@pytest.mark.slow
def test_two_rank_dcp_writer_save_has_every_chunks_checksum(tmp_path):
    ck = tmp_path / "ck"
    run_distributed(2, _two_rank_dcp_save, str(ck))
    assert sorted(p.name for p in ck.glob("*.ckptq-crc32c")) == [SIDECAR.format(rank=r) for r in (0, 1)]
    md = read_metadata(ck)
    assert set(read_checksums(md.planner_data)) == {checksum_key(i) for i in md.storage_data}
    assert {i.relative_path for i in md.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp"}
    _flip(ck, "q.scale")
    from ckptq.verify import check_integrity

    assert check_integrity(ck)["summary"]["failed"] == 1


def _descriptor_version(md):  # no other version exists yet: refused as one from a newer ckptq
    md.planner_data[CKPTQ_KEY]["tensors"]["w_mx"]["version"] += 1


def _plain_dtype(md):  # a valid checkpoint that reads other values
    md.state_dict_metadata["norm"].properties.dtype = torch.float16


def _logical_dtype(md):  # a valid checkpoint whose tensor dequantizes to another dtype
    md.planner_data[CKPTQ_KEY]["tensors"]["w_mx"]["dtype"] = "float16"


@pytest.mark.parametrize(
    "edit, match", [(_descriptor_version, "newer|digest"), (_plain_dtype, "digest"), (_logical_dtype, "digest")]
)
@pytest.mark.parametrize("writer", ["dcp", "ckptq"])
def test_metadata_edits_are_detected_by_every_reader(tmp_path, edit, match, writer):
    sd, ck = _state(), tmp_path / "ck"
    if writer == "dcp":
        _dcp_save(sd, ck)
    else:
        dcp.save(sd, storage_writer=ChecksumFileSystemWriter(ck), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    _rewrite_metadata(ck, edit)
    for read in (
        lambda: read_metadata(ck),
        lambda: open_checkpoint(ck),
        lambda: _load(ck, _empty_like(sd), reader=True),
        lambda: _load(ck, _empty_like(sd), reader=False),
    ):
        with pytest.raises(ckptq.CheckpointFormatError, match=match):
            read()
    bad = _verify_cli(ck)
    assert bad.exit_code != 0 and re.search(match, bad.output)


def test_swapped_chunk_locations_are_checksum_errors(tmp_path):
    """Two chunks' storage locations swapped: a valid checkpoint with the halves exchanged. The
    digest does not cover locations; each chunk's checksum (keyed by its offsets) catches it."""
    sd = _state()
    _dcp_save(sd, tmp_path / "src")
    ckptq.reshard_checkpoint(tmp_path / "src", tmp_path / "r2", mesh="dp_shard=2", plan="fsdp2")

    def swap(md):
        a, b = sorted((i for i in md.storage_data if i.fqn == "norm"), key=lambda i: tuple(i.offset))
        md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]

    _rewrite_metadata(tmp_path / "r2", swap)
    with pytest.raises(ckptq.ChecksumMismatchError, match="norm"):
        open_checkpoint(tmp_path / "r2").read("norm")
    assert _verify_cli(tmp_path / "r2").exit_code == 1


def test_offline_tools_write_a_digest(tmp_path):
    sd = _state()
    _dcp_save(sd, tmp_path / "src")
    ckptq.reshard_checkpoint(tmp_path / "src", tmp_path / "r2", mesh="dp_shard=2", plan="fsdp2")
    assert DIGEST_KEY in read_metadata(tmp_path / "r2").planner_data[CKPTQ_KEY]
    _rewrite_metadata(tmp_path / "r2", _logical_dtype)
    with pytest.raises(ckptq.CheckpointFormatError, match="digest"):
        read_metadata(tmp_path / "r2")


def test_old_checkpoint_loads_with_the_notice(tmp_path, caplog):
    sd, ck = _state(), tmp_path / "old"
    save_old(sd, ck)
    for reader in (True, False):
        caplog.clear()
        out = _empty_like(sd)
        with caplog.at_level(logging.WARNING, logger="ckptq"):
            _load(ck, out, reader=reader)
        msgs = [r.getMessage() for r in caplog.records]
        assert any("no checksums" in m for m in msgs) and any("no metadata digest" in m for m in msgs), msgs
        assert_same_bytes(out["norm"], sd["norm"], "norm")
        assert_same_components(out["w_mx"], sd["w_mx"], "w_mx")
    assert _verify_cli(ck).exit_code == 0


@pytest.mark.parametrize("text", ["[1, 2]", '{"algorithm": "crc32c", "rank": 0, "chunks": [["w", [0], -1]]}', "{"])
def test_a_malformed_checksum_file_is_an_error(tmp_path, text):
    sd, ck = _state(), tmp_path / "ck"
    _dcp_save(sd, ck)
    (ck / SIDECAR.format(rank=0)).write_text(text)
    with pytest.raises(ckptq.CheckpointFormatError, match="checksum file"):
        read_metadata(ck)

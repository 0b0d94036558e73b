"""The pool of CPU read destinations (``ckptq.io.read_buffers``): blocks freed are reused while a
read is under way, unmapped after; the tensors are ordinary CPU tensors a read fills exactly."""

from __future__ import annotations

import gc
import io
import os
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptq.io import ChecksumFileSystemWriter, SafeFileSystemReader, fileio, read_buffers
from tests._helpers import assert_same_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool is Linux only")
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _pool_on(monkeypatch):
    monkeypatch.setattr(read_buffers, "POOLED", True)
    monkeypatch.setattr(read_buffers, "HUGE_PAGES", True)
    monkeypatch.setattr(read_buffers, "_POOL", read_buffers._Pool())  # whatever reads other tests left open
    yield
    gc.collect()


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_block_freed_during_a_read_is_reused_and_unmapped_after():
    with read_buffers.reading():
        t = read_buffers.empty_for_read((4 * MiB,), torch.uint8)
        ptr = t.data_ptr()
        view = t[10:20]
        del t
        assert read_buffers.idle_bytes() == 0  # the view still uses the block
        del view
        assert read_buffers.idle_bytes() == 4 * MiB
        again = read_buffers.empty_for_read((2, MiB), torch.float16)  # same size class (4 MiB)
        assert again.data_ptr() == ptr and read_buffers.idle_bytes() == 0
        other = read_buffers.empty_for_read((6 * MiB,), torch.uint8)  # another class: a new block
        assert other.data_ptr() != ptr
        del again, other
        assert read_buffers.idle_bytes() == 10 * MiB
    assert read_buffers.idle_bytes() == 0  # the last read ended: idle blocks unmapped
    t = read_buffers.empty_for_read((4 * MiB,), torch.uint8)
    del t
    assert read_buffers.idle_bytes() == 0  # freed with no read under way: not kept


def test_idle_blocks_are_capped_oldest_first(monkeypatch):
    monkeypatch.setattr(read_buffers, "POOL_BYTES", 8 * MiB)
    with read_buffers.reading():
        a, b, c = (read_buffers.empty_for_read((n * MiB,), torch.uint8) for n in (2, 4, 6))
        ptr_c = c.data_ptr()
        del a, b
        assert read_buffers.idle_bytes() == 6 * MiB
        del c  # 12 MiB idle > 8: the oldest (2 MiB, then 4 MiB) go
        assert read_buffers.idle_bytes() == 6 * MiB
        assert [b.size for b in read_buffers._POOL.idle] == [6 * MiB]
        assert read_buffers.empty_for_read((6 * MiB,), torch.uint8).data_ptr() == ptr_c
        big = read_buffers.empty_for_read((10 * MiB,), torch.uint8)
        del big  # larger than the cap: never kept
        assert read_buffers.idle_bytes() <= 8 * MiB


def test_nested_and_lifetime_reads():
    outer = read_buffers.Reading()
    with read_buffers.reading():
        t = read_buffers.empty_for_read((2 * MiB,), torch.uint8)
    del t
    assert read_buffers.idle_bytes() == 2 * MiB  # the outer read is still under way
    outer.close()
    outer.close()  # once
    assert read_buffers.idle_bytes() == 0 and read_buffers._POOL.readers == 0
    forgotten = read_buffers.Reading()
    assert read_buffers._POOL.readers == 1
    del forgotten
    gc.collect()
    assert read_buffers._POOL.readers == 0  # left when its owner was collected


def test_pool_tensors_are_ordinary_cpu_tensors(tmp_path):
    """A fresh block is advised huge pages; a read fills it byte-exact; copies, views, shared memory
    and torch.save behave as on any CPU tensor; small tensors and POOLED off: torch.empty."""
    src = torch.randn(3, MiB).to(torch.bfloat16)  # 6 MiB
    path = tmp_path / "x.bin"
    path.write_bytes(src.view(torch.uint8).numpy().tobytes())
    with read_buffers.reading():
        t = read_buffers.empty_for_read((3, MiB), torch.bfloat16)
        assert (t.shape, t.dtype, t.device.type, t.is_contiguous()) == ((3, MiB), torch.bfloat16, "cpu", True)
        assert t.data_ptr() % (2 * MiB) == 0
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
            assert "hg" in _vm_flags(t.data_ptr() + 3 * MiB)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert fileio.pread_pieces(fd, t.view(torch.uint8).numpy().reshape(-1), 0) == 6 * MiB
        finally:
            os.close(fd)
        assert_same_bytes(t, src)
        buf = io.BytesIO()
        torch.save({"t": t[1:]}, buf)
        buf.seek(0)
        assert_same_bytes(torch.load(buf)["t"], src[1:])
        shared = t.clone().share_memory_()
        t.share_memory_()
        assert t.is_shared()
        assert_same_bytes(t, src)
        assert_same_bytes(shared, src)
        with pytest.raises(RuntimeError):
            t.view(torch.uint8).reshape(-1).resize_(7 * MiB)  # a fixed-size storage
        small = read_buffers.empty_for_read((MiB,), torch.uint8)
        assert small.untyped_storage().resizable()  # torch.empty
    read_buffers.POOLED = False
    assert read_buffers.empty_for_read((8 * MiB,), torch.uint8).untyped_storage().resizable()


def test_threads_take_and_free_at_once(monkeypatch):
    monkeypatch.setattr(read_buffers, "POOL_BYTES", 16 * MiB)
    errors = []

    def work(k: int) -> None:
        try:
            for i in range(40):
                t = read_buffers.empty_for_read(((2 + (i + k) % 3) * MiB,), torch.uint8)
                t.fill_(k)
                assert bool((t == k).all())
                del t
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with read_buffers.reading():
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors and 0 < read_buffers.idle_bytes() <= 16 * MiB
    assert read_buffers.idle_bytes() == 0


def test_reads_leave_no_idle_blocks(tmp_path):
    """A load through SafeFileSystemReader and an offline view, once closed, hold no idle block; the
    view's reads reuse the blocks of the tensors freed before them."""
    from ckptq.checkpoint import open_checkpoint

    sd = {f"w{i}": torch.randn(MiB) for i in range(3)}  # 4 MiB each
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(tmp_path), no_dist=True)
    got = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(got, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    for k in sd:
        assert_same_bytes(got[k], sd[k], k)
    assert read_buffers.idle_bytes() == 0
    view = open_checkpoint(tmp_path)
    ptrs = set()
    for k in sd:
        t = view.read(k)
        assert_same_bytes(t, sd[k], k)
        ptrs.add(t.data_ptr())
        del t
    assert len(ptrs) == 1  # one block, reused
    assert read_buffers.idle_bytes() == 4 * MiB
    view.close()
    assert read_buffers.idle_bytes() == 0

"""crc32c of CUDA tensors on the GPU (``ckptq::crc32c``, ckptq/csrc/cuda/crc32c_cuda.cu): the same
value as the ``crc32c`` package over the tensor's bytes copied to the host, for every size, offset
and alignment class; and checkpoint checksums of CUDA tensors taken there, with no host copy."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import requires_cuda

import ckptq
from ckptq import checksums, ops

warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")


def _kernel_or_skip():
    if ops.crc32c(torch.zeros(1, dtype=torch.uint8, device="cuda")) is None:
        pytest.skip("the CUDA extension with ckptq::crc32c is not built")


def _host_crc(t: torch.Tensor, value: int = 0) -> int:
    import crc32c

    return crc32c.crc32c(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes(), value)


@requires_cuda
def test_gpu_crc32c_equals_the_crc32c_package_for_every_size_and_offset():
    _kernel_or_skip()
    g = torch.Generator().manual_seed(1)
    buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g).cuda()
    sizes = [0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 255, 256, 257, 1000, 4095, 4096, 4097]
    sizes += [65_536 + 13, 1 << 20, (1 << 20) + 5, (3 << 20) - 40]
    for size in sizes:
        for off in (0, 1, 2, 7, 8, 15, 16, 31):
            t = buf[off : off + size]
            want = _host_crc(t)
            assert int(ops.crc32c(t)) == want, (size, off)
            for seg in (64, 320, 4096):
                assert int(ops.crc32c(t, segment=seg)) == want, (size, off, seg)
            assert int(ops.crc32c(t, 0x1234ABCD)) == _host_crc(t, 0x1234ABCD), (size, off)


@requires_cuda
def test_gpu_crc32c_of_every_dtype_and_non_contiguous_tensors():
    _kernel_or_skip()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(257, 129, generator=g)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64):
        t = x.to(dt).cuda()
        assert int(ops.crc32c(t)) == _host_crc(t) == checksums.checksum(t.cpu()), dt
        assert int(ops.crc32c(t.t())) == _host_crc(t.t()), dt  # row-major bytes of the transpose
        assert int(ops.crc32c(t[3:, 5:77])) == _host_crc(t[3:, 5:77]), dt
    torch.library.opcheck(torch.ops.ckptq.crc32c.default, (x.cuda()[1:], 7, 128))  # schema, fake kernel


@requires_cuda
@pytest.mark.skipif(os.environ.get("CKPTQ_TEST_BIG") != "1", reason="1 GiB: set CKPTQ_TEST_BIG=1")
def test_gpu_crc32c_of_a_gibibyte():
    _kernel_or_skip()
    t = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda")
    assert int(ops.crc32c(t[3:])) == _host_crc(t[3:])


@requires_cuda
def test_checksums_of_cuda_tensors_are_taken_on_the_gpu_without_a_host_copy(monkeypatch):
    _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    cpu = {f"t{i}": torch.randn(100 + i, 37, generator=g).to(torch.bfloat16) for i in range(5)}
    want = {k: checksums.checksum(v) for k, v in cpu.items()}

    def no_copy(data):
        raise AssertionError("a CUDA tensor was copied to the host to be hashed")

    monkeypatch.setattr(checksums, "payload", no_copy)
    hasher = checksums.Hasher()
    for k, v in cpu.items():
        hasher.submit(k, v.cuda())
    assert hasher.results() == want
    assert {k: checksums.checksum(v.cuda()) for k, v in cpu.items()} == want


@requires_cuda
def test_planner_checksums_of_a_cuda_state_dict_equal_those_of_the_same_cpu_one(tmp_path):
    from test_checksums import _state

    from ckptq.checksums import read_sidecar

    sd = _state()
    cuda = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    for name, state in (("cpu", sd), ("cuda", cuda)):
        dcp.save(state, checkpoint_id=str(tmp_path / name), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    assert read_sidecar(tmp_path / "cuda", 0) == read_sidecar(tmp_path / "cpu", 0)
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in cuda.items()}
    dcp.load(out, checkpoint_id=str(tmp_path / "cuda"), planner=ckptq.QuantizedLoadPlanner(), no_dist=True)
    assert torch.equal(out["norm"].cpu(), sd["norm"])


@requires_cuda
def test_the_gpu_hash_sees_what_the_callers_stream_wrote_before_it():
    """The kernel runs on a side stream that waits for the caller's: bytes written on the caller's
    (non-default) stream just before, behind a long GPU sleep, are what is hashed."""
    _kernel_or_skip()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the write
        x.fill_(7)
        hasher = checksums.Hasher()
        hasher.submit("x", x)
        value = checksums.checksum(x)
    want = _host_crc(torch.full((32 << 20,), 7, dtype=torch.uint8))
    assert hasher.results() == {"x": want} and value == want

"""``--device`` of the offline tools (``ckptq.io.device``): the choice of device, the read-ahead
stream, and the same output bytes on the CPU and a CUDA device for convert / reshard / export."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_same_bytes, assert_same_components, requires_cuda

import ckptq
from ckptq.checkpoint import open_checkpoint
from ckptq.errors import UsageError
from ckptq.export import export_checkpoint
from ckptq.io.device import PrefetchStats, prefetch, resolve_device
from ckptq.reshard import reshard_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """fp8 per-tensor, fp8 128x128 and MXFP8 (columnwise) weights, a plain norm and a step counter."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "layers.0.q_proj.weight": ckptq.quantize(torch.randn(256, 256, generator=g), "fp8_tensor"),
        "layers.0.k_proj.weight": ckptq.quantize(torch.randn(256, 128, generator=g), "fp8_block"),
        "layers.0.mlp.up_proj.weight": ckptq.quantize(torch.randn(256, 256, generator=g), "mxfp8", columnwise=True),
        "layers.0.norm.weight": torch.randn(256, generator=g),
        "step": 7,
    }
    path = tmp_path_factory.mktemp("device") / "src"
    dcp.save(sd, checkpoint_id=str(path), planner=ckptq.QuantizedSavePlanner())
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_dirs(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between {a} and {b}"


# ---------------------------------------------------------------------------------- resolve_device
def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() and ckptq.ops.backend_name("cuda") == "cuda" else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device(None).type == want
    for forced in ("cpu", "reference"):  # a forced CPU-side backend keeps auto on the CPU
        with ckptq.ops.force(forced):
            assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UsageError, match="--device"):
        resolve_device("tpu")
    with pytest.raises(UsageError, match="--device"):
        resolve_device("cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--device cuda: the CUDA kernels cannot run here.*--device cpu"):
            resolve_device("cuda")


# ---------------------------------------------------------------------------------- prefetch
def test_prefetch_order_and_thread():
    threads = set()

    def read(i):
        threads.add(threading.current_thread().name)
        return torch.full((3,), i)

    stats = PrefetchStats()
    got = [(i, int(v[0])) for i, v in prefetch(range(6), read, device=torch.device("cpu"), stats=stats)]
    assert got == [(i, i) for i in range(6)]
    assert threads == {"ckptq-prefetch"} and stats.to_device == 0


def test_prefetch_raises_at_the_failing_item():
    def read(i):
        if i == 2:
            raise OSError("disk gone")
        return i

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for i, _ in prefetch(range(5), read, device=torch.device("cpu")):
            seen.append(i)
    assert seen == [0, 1]


def test_prefetch_closed_early_stops_reading():
    read_items = []

    def read(i):
        read_items.append(i)
        return i

    stream = prefetch(range(1000), read, device=torch.device("cpu"), depth=1)
    assert next(stream) == (0, 0)
    stream.close()  # joins the reader thread
    assert len(read_items) <= 4
    assert not any(t.name == "ckptq-prefetch" for t in threading.enumerate())


# ---------------------------------------------------------------------------------- CPU (explicit)
@pytest.mark.parametrize(
    "options",
    [dict(to="nvfp4"), dict(to="fp8_block", mesh="2"), dict(to="bfloat16")],
    ids=["fp8-to-nvfp4", "to-fp8_block-mesh2", "to-bf16"],
)
def test_convert_on_cpu_is_whole_tensor_requantize(src, tmp_path, options):
    out = reshard_checkpoint(src, tmp_path / "out", device="cpu", **options)
    assert out["device"] == "cpu"
    a, b = open_checkpoint(src), open_checkpoint(tmp_path / "out")
    for e in a.entries():
        if e.kind != "quantized":
            continue
        x, y = a.read(e.fqn), b.read(e.fqn)
        if options["to"] == "bfloat16":
            assert_same_bytes(y, x.dequantize(torch.bfloat16), e.fqn)
        else:
            fmt = options["to"]
            want = x if x.FORMAT == fmt else ckptq.requantize(x, fmt)
            assert_same_components(y, want, e.fqn)


def test_export_on_cpu(src, tmp_path):
    out = export_checkpoint(
        src, tmp_path / "hf", layout="modelopt", format="nvfp4", config=False, on_inexact="keep", device="cpu"
    )
    assert out["device"] == "cpu" and len(out["requantized"]) == 3


def test_cli_device_flag(src, tmp_path):
    from typer.testing import CliRunner

    from ckptq.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "a"), "--to", "nvfp4", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "computing on cpu" in r.output
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "b"), "--to", "nvfp4", "--device", "tpu"])
    assert r.exit_code != 0 and "--device" in r.output
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------- CUDA vs CPU
@requires_cuda
@pytest.mark.parametrize(
    "options",
    [
        dict(to="nvfp4"),  # fp8 (per-tensor, block) and mxfp8 -> nvfp4
        dict(to="fp8_tensor"),  # mxfp8 -> fp8 (the amax reduced on the device)
        dict(to="fp8_block", mesh="2"),  # requantized and resharded
        dict(to="bfloat16", mesh="2"),  # dequantized
        dict(mode="high-precision", mesh="3", plan="replicate"),  # reshard, dequantized in high precision
    ],
    ids=["to-nvfp4", "to-fp8_tensor", "to-fp8_block-mesh2", "to-bf16-mesh2", "reshard-high-precision"],
)
def test_reshard_cuda_same_bytes_as_cpu(src, tmp_path, options):
    cpu = reshard_checkpoint(src, tmp_path / "cpu", device="cpu", **options)
    gpu = reshard_checkpoint(src, tmp_path / "gpu", device="cuda", **options)
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda")
    assert sorted(cpu["requantized"]) == sorted(gpu["requantized"])
    assert_same_dirs(tmp_path / "cpu", tmp_path / "gpu")


@requires_cuda
@pytest.mark.parametrize(
    "layout,kwargs",
    [
        ("modelopt", dict(format="nvfp4")),  # fp8 / mxfp8 -> nvfp4
        ("compressed-tensors", dict(format="fp8_tensor")),  # mxfp8 / fp8 block -> fp8 per tensor
        ("compressed-tensors", dict(ignore=["*"])),  # every weight dequantized to bf16
    ],
    ids=["modelopt-nvfp4", "ct-fp8", "bf16"],
)
def test_export_cuda_same_bytes_as_cpu(src, tmp_path, layout, kwargs):
    common = dict(layout=layout, config=False, on_inexact="keep", **kwargs)
    cpu = export_checkpoint(src, tmp_path / "cpu", device="cpu", **common)
    gpu = export_checkpoint(src, tmp_path / "gpu", device="cuda", **common)
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda")
    assert_same_dirs(tmp_path / "cpu", tmp_path / "gpu")


# ---------------------------------------------------------------------------------- parallel reads
def test_read_in_pieces_same_bytes_and_checked(src, tmp_path, monkeypatch):
    """Long runs of bytes are read in pieces on threads, each piece hashed by its thread and the
    checksums joined in order: the same tensors, and a flipped byte in the middle of a chunk is
    still a checksum error."""
    import shutil
    import threading

    import ckptq.checkpoint as cp
    import ckptq.io.fileio as fileio
    from ckptq.errors import ChecksumMismatchError

    whole = {e.fqn: open_checkpoint(src).read(e.fqn) for e in open_checkpoint(src).entries() if e.kind != "bytes"}
    monkeypatch.setattr(fileio, "PIECE_BYTES", 1000)  # every run of >= 2000 bytes goes through the pool
    readers, real = set(), cp.CheckpointView._pread_range

    def spy(self, *args):
        readers.add(threading.current_thread().name.split("_")[0])
        return real(self, *args)

    monkeypatch.setattr(cp.CheckpointView, "_pread_range", spy)
    view = open_checkpoint(src)
    for fqn, want in whole.items():
        got = view.read(fqn)
        if isinstance(want, torch.Tensor) and not hasattr(want, "FORMAT"):
            assert_same_bytes(got, want, fqn)
        else:
            assert_same_components(got, want, fqn)
    assert "ckptq-pread" in readers  # the long runs went through the shared read threads
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    chunk = open_checkpoint(bad).saved_chunks("layers.0.q_proj.weight.data")[0]
    with open(bad / chunk.file, "r+b") as f:
        f.seek(chunk.payload + 30_000)  # the 31st piece of the 64 KiB payload
        b = f.read(1)
        f.seek(chunk.payload + 30_000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumMismatchError):
        open_checkpoint(bad).read("layers.0.q_proj.weight")

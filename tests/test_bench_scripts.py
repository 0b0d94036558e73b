"""The GPU checkpoint benchmark runs end to end (on 2 gloo CPU processes, at 1/64 of its model size), so
that a change to the planners or to the script does not leave it broken until the next GPU session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_script(name: str, *args: str) -> str:
    """``python scripts/<name> args...`` (must succeed within 300 s); its standard output."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args], check=True, capture_output=True, text=True, timeout=300
    ).stdout


@pytest.mark.slow
def test_bench_gpu_checkpoint_runs_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    _run_script(
        "bench_gpu_checkpoint.py",
        "--device",
        "cpu",
        "--divide",
        "8",
        "--layers",
        "1",
        "--repeat",
        "1",
        "--probe-gib",
        "0.01",
        "--disk-gib",
        "0.0625",
        "--one-gpu-load",
        "--keep-caches",
        "--dir",
        str(tmp_path / "d"),
        "--out",
        str(out),
        "--port",
        "29533",
    )
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and [x["rank"] for x in r["ranks"]] == [0, 1]
    for x in r["ranks"]:
        a, b, c = (x[f"save_{k}"]["GB"] for k in ("a_default_bf16", "b_ckptq_native", "c_quantize_on_save"))
        # MXFP8 (1 + 1/32 B/element) and NVFP4 (0.5 + 1/16 B/element) against bf16's 2 B/element, plus
        # each record's ~1 KB of framing: between 0.28 and 0.36 of the bf16 bytes at this size
        assert 0.28 < b / a < 0.36 and c == b, (a, b, c)
        assert x["save_d_high_precision"]["GB"] == x["save_a_bf16_ckptq_writer"]["GB"] == a  # same records
        assert all(
            x[f"async_{k}"]["total_s"] >= x[f"async_{k}"]["blocked_s"] > 0
            for k in ("a_default_bf16", "b_ckptq_native", "c_quantize_then_async", "d_high_precision")
        )
        reserved = x["reserve_staging"]["GB_per_case"]  # ckptq's writer's cases, one state dict structure
        assert x["reserve_staging"]["s"] > 0 and reserved["b_ckptq_native"] > 0
        assert set(reserved.values()) == {reserved["b_ckptq_native"]}
        assert x["disk_probe"]["write_GBps"] > 0 and x["disk_probe"]["read_GBps"] > 0
        assert x["rounds"] == {"saves": 1, "async": 1, "loads": 1}
        loads = [k for k in x if k.startswith("load_")]
        assert len(loads) == 9 and all(x[k]["s"] > 0 and len(x[k]["all_s"]) == 1 for k in loads)
        # each dcp.load split into before read_data / in it / after it, all inside the timed load
        split = x["load_b_native_safe_reader"]
        assert split["before_read_s"] > 0 and split["read_data_s"] > 0 and split["after_read_s"] >= 0
    assert r["load_b_native_on_1_gpu"]["s"] > 0
    text = _run_script("bench_gpu_checkpoint.py", "--table", str(out))
    assert text.count("| ckptq native (MXFP8 / NVFP4) |") == 2 and "native save vs default planner" in text


@pytest.mark.slow
def test_bench_gpu_checkpoint_saves_only_runs_every_round_of_the_saves_alone(tmp_path):
    out = tmp_path / "r.json"
    _run_script(
        "bench_gpu_checkpoint.py",
        *("--device", "cpu", "--divide", "8", "--layers", "1", "--repeat", "3", "--saves-only", "--keep-caches"),
        *("--probe-gib", "0.01", "--disk-gib", "0.0625", "--dir", str(tmp_path / "d"), "--out", str(out)),
        *("--port", "29537"),
    )
    r = json.loads(out.read_text())
    for x in r["ranks"]:
        assert x["rounds"] == {"saves": 3} and not [k for k in x if k.startswith(("load_", "async_"))]
        assert all(len(x[f"save_{k}"]["all_s"]) == 3 for k in ("a_default_bf16", "b_ckptq_native", "d_high_precision"))
    text = _run_script("bench_gpu_checkpoint.py", "--table", str(out))
    assert text.count("native save vs default planner") == 2 and "native load" not in text


def test_bench_read_ahead_runs_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    text = _run_script(
        "bench_read_ahead.py",
        *("--device", "cpu", "--layers", "1", "--divide", "8", "--rounds", "1"),
        *("--aheads", "1M,inf", "--dir", str(tmp_path / "d"), "--out", str(out)),
    )
    r = json.loads(out.read_text())
    for src in ("native", "high_precision"):
        assert set(r[src]) == {"GB", "plain_read", "1M", "inf"} and r[src]["GB"] > 0
        assert all(len(r[src][c]["all_s"]) == 1 and r[src][c]["GBps"] > 0 for c in ("plain_read", "1M", "inf"))
    assert r["high_precision"]["GB"] > 3 * r["native"]["GB"]  # bf16 values against MXFP8 / NVFP4 codes
    assert "high_precision  inf" in text


def test_bench_disk_layout_runs(tmp_path):
    for what, keys in (
        ("layout", {"one_file", "eight_files", "eight_fallocated"}),
        ("age", {"one_file_right_after", "eight_files_right_after", "eight_files_later", "one_file_later"}),
    ):
        out = tmp_path / f"{what}.json"
        _run_script(
            "bench_disk_layout.py",
            *(what, "--gib", "0.02", "--fill-gib", "0.02", "--rounds", "1", "--dir", str(tmp_path / what)),
            *("--out", str(out)),
        )
        (r,) = json.loads(out.read_text())["rounds"]
        assert keys <= set(r) and not (tmp_path / what).exists()
        for k in keys:  # GB/s, or a case's write / read GB/s and one extent count per file
            v = r[k]
            assert (
                v > 0 if what == "age" else v["read1_GBps"] > 0 and len(v["extents"]) == (1 if k == "one_file" else 8)
            )


def test_bench_storage_io_runs(tmp_path):
    out = tmp_path / "r.json"
    _run_script(
        "bench_storage_io.py",
        "--gb",
        "0.02",
        "--repeat",
        "1",
        "--threads",
        "1,2",
        "--dir",
        str(tmp_path / "d"),
        "--out",
        str(out),
    )
    r = json.loads(out.read_text())
    saves, loads = r["saves"], r["loads"]
    assert set(saves) == {
        "bf16_dcp_writer",
        "native_dcp_writer",
        "bf16_ckptq_writer_t1",
        "native_ckptq_writer_t1",
        "bf16_ckptq_writer_t2",
        "native_ckptq_writer_t2",
        "high_precision_ckptq_writer",
    }
    # the same records whichever writer and thread count: the same bytes in all
    assert (
        saves["bf16_dcp_writer"]["GB"]
        == saves["bf16_ckptq_writer_t2"]["GB"]
        == saves["high_precision_ckptq_writer"]["GB"]
    )
    assert saves["native_dcp_writer"]["GB"] == saves["native_ckptq_writer_t1"]["GB"]
    readers = {f"{k}_safe_reader_t{n}" for k in ("bf16", "native") for n in (1, 2)}  # besides the default 4
    assert (
        set(loads)
        == {"bf16_dcp_reader", "native_dcp_reader", "bf16_safe_reader", "native_safe_reader"}
        | {"high_precision_safe_reader"}
        | readers
    )
    assert all(v["s"] > 0 and v["cpu_s_per_GB"] > 0 for v in loads.values()) and r["disk_probe"]["read_GBps"] > 0


@pytest.mark.slow
def test_bench_scaleout_runs(tmp_path):
    """scripts/bench_scaleout.py end to end at a tiny size: the source, the disk probe, one
    2-process torchrun export, the JSON and the table."""
    out = tmp_path / "r.json"
    _run_script(
        "bench_scaleout.py",
        "--workdir",
        str(tmp_path / "w"),
        "--size-gb",
        "0.001",
        "--side",
        "256",
        "--probe-gb",
        "0.002",
        "--procs",
        "2",
        "--only",
        "export",
        "--json",
        str(out),
    )
    r = json.loads(out.read_text())
    (run,) = r["runs"]
    assert run["op"] == "export" and run["procs"] == 2 and "error" not in run, run
    assert run["read_bytes"] == r["source"]["bytes"] > 8 * 256 * 256 and run["written_bytes"] > 8 * 256 * 256
    assert run["gbps"] > 0 and r["disk"]["write_gbps"] > 0 and r["disk"]["read_gbps"] > 0
    assert not (tmp_path / "w" / "src").exists()  # the source is removed at the end


def test_bench_load_one_gpu_runs(tmp_path):
    out = _run_script(
        "bench_load_one_gpu.py", "--layers", "1", "--divide", "16", "--repeat", "1", "--dir", str(tmp_path / "d")
    )
    rows = [line for line in out.splitlines() if line.startswith("| ") and ("disk" in line or "page cache" in line)]
    assert len(rows) == 10, out  # five cases, each from the disk and from the page cache
    assert "native, SafeFileSystemReader" in out and "tottime" in out


def test_bench_read_pages_runs(tmp_path):
    out = tmp_path / "r.json"
    text = _run_script(
        "bench_read_pages.py",
        *("--mib", "8", "--tensors", "2", "--rounds", "1", "--modes", "pool,pool_4k,torch"),
        *("--workdir", str(tmp_path / "w"), "--out", str(out)),
    )
    r = json.loads(out.read_text())
    assert r["bytes"] > 16 << 20 and list(r["modes"]) == ["pool", "pool_4k", "torch"]
    assert all(len(x["runs_s"]) == 1 and x["GBps"] > 0 for x in r["modes"].values())
    assert r["over_first"]["pool"] == 1.0 and "torch takes" in text


def test_bench_offline_runs(tmp_path):
    out = tmp_path / "r.json"
    text = _run_script(
        "bench_offline.py",
        *("--gb", "0.01", "--dim", "1024", "--repeat", "1", "--devices", "cpu", "--cases", "read,convert TE -> native"),
        *("--workdir", str(tmp_path / "w"), "--json", str(out)),
    )
    r = json.loads(out.read_text())
    assert r["dim"] == 1024 and r["te_source_bytes"] > 0 and r["disk_probe"]["read_GBps"] > 0
    cases = {x["case"]: x for x in r["results"]}
    assert len(cases) == 4 and all(x["GBps"] > 0 and len(x["runs_s"]) == 1 for x in cases.values())
    for x in cases.values():  # the probe read again before each run, each run set against it
        assert len(x["probe_runs_GBps"]) == 1 and x["probe_read_GBps"] > 0 and len(x["disk_fraction_runs"]) == 1
    assert not (tmp_path / "w" / "probe.bin").exists()
    assert cases["convert TE -> native (no kernels)"]["output_bytes"] > 0
    assert "| read TE source (open + read every entry) | cpu |" in text


@pytest.mark.skipif(not os.path.exists("/proc/diskstats"), reason="Linux /proc/diskstats only")
def test_trace_read_runs(tmp_path, monkeypatch):
    """Both modes trace a cold read of a small checkpoint: every entry and piece recorded, the
    disk sampled (on a machine whose temporary folder is on no listed device, e.g. an overlay,
    the first listed device is sampled: the events are what is checked here)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptq.io import ChecksumFileSystemWriter

    src = tmp_path / "ckpt"
    sd = {f"w{i}": torch.randn(1024, 1024) for i in range(3)}
    dcp.save(sd, storage_writer=ChecksumFileSystemWriter(src), no_dist=True)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import trace_read

    try:
        dev = trace_read.disk_name(src)
    except SystemExit:
        dev = open("/proc/diskstats").readline().split()[2]
    for mode in ("view", "probe"):
        out = tmp_path / f"{mode}.json"
        text = _run_script(
            "trace_read.py", "--source", str(src), "--mode", mode, "--rounds", "1", "--device", dev, "--out", str(out)
        )
        run = json.loads(out.read_text())["runs"][0]
        kinds = [e[0] for e in run["events"]]
        assert kinds.count("disk") > 0 and kinds.count("piece") > 0 and kinds[-1] in ("end", "disk")
        assert kinds.count("entry") == (3 if mode == "view" else 0) and f"{mode} ckpt round 0" in text
        assert run["summary"]["seconds"] > 0

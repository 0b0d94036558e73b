"""The ``ckptq`` CLI through typer's CliRunner: exit codes, stdout/stderr split, ``--json``."""

from __future__ import annotations

import json
import os
import pickle
import pkgutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

import ckptq
import ckptq.cli
from ckptq.cli import app

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 384, generator=g)
    sd = {
        "nv": ckptq.quantize(x, "nvfp4"),
        "mx": ckptq.quantize(x, "mxfp8"),
        "fb": ckptq.quantize(x, "fp8_block"),
        "ft": ckptq.quantize(x, "fp8_tensor"),
        "bias": torch.tensor([0.5, float("inf")]),
        "step": 7,
    }
    path = tmp_path_factory.mktemp("ck")
    dcp.save(sd, checkpoint_id=path, planner=ckptq.QuantizedSavePlanner(rules={"mx": "high_precision"}))
    return path, sd


def _run(args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def test_inspect_json(ckpt):
    path, sd = ckpt
    r = _run(["inspect", path, "--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)  # stdout holds the JSON and nothing else
    rows = {t["fqn"]: t for t in report["tensors"]}
    assert (rows["nv"]["format"], rows["nv"]["bytes"]) == ("nvfp4", 49152 + 6144 + 4)
    assert rows["nv"]["bits_per_element"] == pytest.approx(55300 * 8 / (256 * 384))
    assert (rows["mx"]["mode"], rows["mx"]["bytes"]) == ("high_precision", 2 * 256 * 384)
    assert rows["step"]["format"] == "bytes"
    assert report["summary"]["formats"] == {
        "bytes": 1,
        "float32": 1,
        "fp8_block": 1,
        "fp8_tensor": 1,
        "mxfp8": 1,
        "nvfp4": 1,
    }
    assert "stats" not in rows["nv"]


def test_inspect_stats_json_is_strict(ckpt):
    path, sd = ckpt
    r = _run(["inspect", path, "--stats", "--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    rows = {t["fqn"]: t for t in report["tensors"]}
    assert rows["bias"]["stats"] == {"min": 0.5, "max": "inf", "nan": 0, "inf": 1}
    assert rows["nv"]["stats"]["amax"] == sd["nv"].components()["amax"].item()
    assert rows["ft"]["stats"]["scale_min"] == sd["ft"].components()["scale_inv"].item()


def test_inspect_table(ckpt):
    path, _ = ckpt
    r = _run(["inspect", path])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["FQN", "FORMAT", "MODE", "SHAPE", "DTYPE", "SIZE", "BITS/ELEM", "CHUNKS"]
    nv = next(line for line in lines if line.startswith("nv "))
    assert nv.split()[:3] == ["nv", "nvfp4", "native"] and "4.500" in nv and "54.00 KiB" in nv
    assert any(line.startswith("world size") and line.split()[-1] == "1" for line in lines)
    assert r.stderr == ""


def test_inspect_table_with_stats(ckpt):
    path, _ = ckpt
    r = _run(["inspect", path, "--stats"])
    assert r.exit_code == 0, r.stderr
    header = r.stdout.splitlines()[0].split()
    assert header[-7:] == ["MIN", "MAX", "NAN", "INF", "SCALE_MIN", "SCALE_MAX", "AMAX"]


def test_inspect_missing_path_exits_1(tmp_path):
    r = _run(["inspect", tmp_path / "nope"])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: ") and "nope" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_inspect_not_a_checkpoint_exits_1(tmp_path):
    r = _run(["inspect", tmp_path, "--json"])
    assert r.exit_code == 1 and "not a DCP checkpoint" in r.stderr and r.stdout == ""


def test_debug_env_prints_traceback(tmp_path):
    r = _run(["inspect", tmp_path / "nope"], env={"CKPTQ_DEBUG": "1"})
    assert r.exit_code == 1 and "Traceback" in r.stderr and "Error: " in r.stderr


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_inspect_refuses_malicious_metadata(tmp_path):
    ck = tmp_path / "ck"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=ck)
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    r = _run(["inspect", ck])
    assert r.exit_code == 1
    assert "Error: " in r.stderr and f"{os.system.__module__}.system" in r.stderr
    assert not marker.exists()
    # Also when the payload hides inside otherwise valid metadata.
    ck2 = tmp_path / "ck2"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=ck2)
    md = pickle.loads((ck2 / ".metadata").read_bytes())
    md.planner_data["x"] = _Payload(marker)
    (ck2 / ".metadata").write_bytes(pickle.dumps(md))
    r = _run(["inspect", ck2, "--stats", "--json"])
    assert r.exit_code == 1 and r.stdout == ""
    assert not marker.exists()


@pytest.mark.parametrize("args", [["inspect"], ["inspect", ".", "--bogus"], ["nosuchcommand"]])
def test_usage_errors_exit_2(args):
    assert _run(args).exit_code == 2


def test_doctor(monkeypatch):
    r = _run(["doctor", "--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["torch"] == torch.__version__ and report["ckptq"] == ckptq.__version__
    assert report["backends"]["reference"]["active"] is True
    r = _run(["doctor"])
    assert r.exit_code == 0
    assert any(line.split()[:2] == ["reference", "yes"] for line in r.stdout.splitlines())


def test_doctor_fails_when_forced_backend_is_missing(monkeypatch):
    import ckptq.ops

    real = ckptq.ops.backend_report()
    inactive = [name for name, b in real["backends"].items() if not b["active"]]
    if not inactive:
        pytest.skip("every backend is active on this machine")
    name = inactive[0]  # "cuda" on a CPU-only machine
    monkeypatch.setattr(ckptq.ops, "backend_report", lambda: {**real, "forced": name})
    r = _run(["doctor", "--json"])
    assert r.exit_code == 1 and name in r.stderr
    assert json.loads(r.stdout)["forced"] == name  # the report is still printed


def test_version():
    r = _run(["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"ckptq {ckptq.__version__}"


def test_every_command_module_is_registered():
    # Adding a command is one file: every public module of ckptq/cli is discovered and registered.
    modules = {m.name for m in pkgutil.iter_modules(ckptq.cli.__path__) if not m.name.startswith("_")}
    registered = {c.name for c in app.registered_commands}
    assert {"inspect", "doctor"} <= modules
    assert modules <= registered


def test_main_entry_point(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["ckptq", "doctor", "--json"])
    with pytest.raises(SystemExit) as ei:
        ckptq.cli.main()
    assert ei.value.code == 0
    assert json.loads(capsys.readouterr().out)["backends"]


def test_malformed_mesh_is_a_usage_error(ckpt, tmp_path):
    path, _ = ckpt
    r = _run(["reshard", path, tmp_path / "out", "--mesh", "dp_shard=x"])
    assert r.exit_code == 2, r.stderr
    assert r.stderr.startswith("Error: --mesh dp_shard=x: expected") and "Traceback" not in r.stderr
    assert "Try 'ckptq reshard --help' for help." in r.stderr
    assert r.stdout == "" and not (tmp_path / "out").exists()


def test_convert_to_an_unknown_target_names_the_flag_and_the_formats(ckpt, tmp_path):
    path, _ = ckpt
    r = _run(["convert", path, tmp_path / "out", "--to", "int3"])
    assert r.exit_code == 2
    assert r.stderr.splitlines()[0] == (
        "Error: --to int3: expected native (keep each tensor's format), a format (fp8_block, fp8_tensor, "
        "mxfp4, mxfp8, nvfp4) or a high-precision dtype (bfloat16, float16, float32, bf16, fp16, fp32)"
    )


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--dtype", "int8"], "--dtype int8"),
        (["--misaligned", "maybe"], "--misaligned maybe"),
        (["--grouped", "stacks"], "--grouped stacks"),
        (["--mode", "fast"], "--mode fast"),
        (["--plan", "fsdp2-tp", "--mesh", "dp_shard=2,tp=2", "--rule", "*.q"], "--rule *.q"),
        (["--plan", "no-such-plan.json"], "--plan no-such-plan.json"),
    ],
)
def test_reshard_option_typos_exit_2(ckpt, tmp_path, args, flag):
    path, _ = ckpt
    r = _run(["reshard", path, tmp_path / "out", *args])
    assert r.exit_code == 2 and r.stderr.startswith(f"Error: {flag}: "), r.stderr
    assert not (tmp_path / "out").exists()


def _tree_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_library_calls_write_what_the_cli_writes(ckpt, tmp_path):
    from ckptq.placement import MeshSpec

    path, _ = ckpt
    cases = [
        (
            ["reshard", path, tmp_path / "cli1", "--mesh", "2", "--mode", "native"],
            lambda dst: ckptq.reshard_checkpoint(path, dst, mesh="2", mode="native"),
        ),
        (
            [
                "convert",
                path,
                tmp_path / "cli2",
                "--to",
                "fp8_block",
                "--block",
                "1x128",
                "--no-pow2",
                "--mesh",
                "dp_shard=2",
                "--misaligned",
                "high-precision",
            ],
            lambda dst: ckptq.reshard_checkpoint(
                path,
                dst,
                to="fp8_block",
                block=(1, 128),
                pow2=False,
                mesh=MeshSpec(("dp_shard",), (2,)),
                misaligned="high_precision",
            ),
        ),
        (
            ["convert", path, tmp_path / "cli3", "--to", "fp16"],
            lambda dst: ckptq.reshard_checkpoint(path, dst, to="fp16"),
        ),
    ]
    for i, (args, call) in enumerate(cases):
        r = _run([*args, "--json"])
        assert r.exit_code == 0, r.stderr
        result = call(tmp_path / f"lib{i}")
        assert set(result) == {
            "path",
            "world_size",
            "bytes_per_rank",
            "tensors",
            "requantized",
            "plan",
            "processes",
            "process_rank",
            "seconds",
            "device",
        }
        assert result["plan"] == json.loads(r.stdout)["plan"]
        assert _tree_bytes(tmp_path / f"lib{i}") == _tree_bytes(args[2]), args
        assert _run(["verify", tmp_path / f"lib{i}", args[2]]).exit_code == 0
    dry = ckptq.reshard_checkpoint(path, tmp_path / "dry", mesh="2", dry_run=True)
    assert set(dry) == {"plan"} and dry["plan"]["world_size"] == 2 and not (tmp_path / "dry").exists()


def test_convert_with_fp8_dtype(ckpt, tmp_path):
    path, _ = ckpt
    result = ckptq.reshard_checkpoint(path, tmp_path / "out", to="fp8_tensor", fp8_dtype="e5m2")
    assert result["tensors"] == 6
    from ckptq.checkpoint import CheckpointView

    quantized = [e for e in CheckpointView(tmp_path / "out").entries() if e.kind == "quantized"]
    assert quantized and all(e.descriptor.recipe["fp8_dtype"] == "float8_e5m2" for e in quantized)


def _dead_pid() -> int:
    for pid in range(999_999, 10_000_000):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
    pytest.skip("no free PID found")


def test_reshard_removes_stale_temporaries_of_killed_runs(ckpt, tmp_path, caplog):
    path, _ = ckpt
    stale = tmp_path / f".out.ckptq-tmp-{_dead_pid()}"
    live = tmp_path / f".out.ckptq-tmp-{os.getppid()}"  # a running process: maybe another reshard
    other = tmp_path / f".other.ckptq-tmp-{_dead_pid()}"  # another destination's: not ours
    for d in (stale, live, other):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"partial")
    with caplog.at_level("WARNING", logger="ckptq"):
        r = _run(["reshard", path, tmp_path / "out", "--dry-run"])  # a dry run writes (and removes) nothing
        assert r.exit_code == 0 and stale.exists()
        r = _run(["reshard", path, tmp_path / "out"])
    assert r.exit_code == 0, r.stderr
    assert not stale.exists() and live.exists() and other.exists()
    notes = [rec.getMessage() for rec in caplog.records if rec.name == "ckptq"]
    assert len(notes) == 1 and str(stale) in notes[0] and "killed" in notes[0]

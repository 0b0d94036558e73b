"""What a new user meets in the first hour of the ``ckptq`` CLI: lossy pairs judged by ``verify``,
one ``.distcp`` file as an argument, ``--rule`` globs that match nothing, a quick ``--help``, and
the help, progress, dry-run and error texts (through typer's CliRunner)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

import ckptq
from ckptq.cli import app
from ckptq.metrics import REENCODE_FLOORS, SQNR_FLOORS, sqnr_bound

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")

ROOT = Path(__file__).resolve().parents[1]


def _run(args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def _save(path, sd, **planner):
    dcp.save(
        sd, storage_writer=ckptq.io.AtomicFileSystemWriter(str(path)), planner=ckptq.QuantizedSavePlanner(**planner)
    )
    return path


@pytest.fixture(scope="module")
def x():
    return torch.randn(256, 384, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, x):
    """The quick start's shape of checkpoint: one nvfp4 ``proj.weight``, a plain bias."""
    root = tmp_path_factory.mktemp("first-hour")
    return _save(root / "ckpt", {"proj.weight": ckptq.quantize(x, "nvfp4"), "proj.bias": torch.zeros(256)})


# ----------------------------------------------------------------------------- verify judges lossy pairs
def test_verify_fails_unrelated_weights_of_different_formats(tmp_path, x):
    """Two unrelated weights, nvfp4 and bf16 (or mxfp8): SQNR about -3 dB must fail without --min-sqnr."""
    y = torch.randn(256, 384, generator=torch.Generator().manual_seed(6))
    a = _save(tmp_path / "a", {"w": ckptq.quantize(x, "nvfp4")})
    for name, other in (("bf16", y.to(torch.bfloat16)), ("mx", ckptq.quantize(y, "mxfp8"))):
        b = _save(tmp_path / name, {"w": other})
        r = _run(["verify", a, b, "--json"])
        assert r.exit_code == 1, r.output
        row = json.loads(r.stdout)["tensors"][0]
        assert row["status"] == "below_threshold" and row["sqnr_db"] < 0
        assert row["bound_db"] == (SQNR_FLOORS["nvfp4"][0] if name == "bf16" else REENCODE_FLOORS["nvfp4"][0])


def test_verify_passes_a_lossy_pair_within_its_formats_bound(tmp_path, x):
    a = _save(tmp_path / "a", {"w": ckptq.quantize(x, "nvfp4"), "h": x})
    b = _save(tmp_path / "b", {"w": x.to(torch.bfloat16), "h": x.to(torch.bfloat16)})  # the source values
    r = _run(["verify", a, b])
    assert r.exit_code == 0, r.output
    assert "MIN_SQNR" in r.stdout.splitlines()[0] and "2 compared, 0 bit-exact, 0 failed" in r.stdout


def test_verify_refuses_a_pair_with_no_known_bound(tmp_path, x):
    a = _save(tmp_path / "a", {"w": ckptq.quantize(x, "fp8_tensor")})
    b = _save(tmp_path / "b", {"w": ckptq.quantize(x, "fp8_tensor", fp8_dtype=torch.float8_e5m2)})
    r = _run(["verify", a, b])
    assert r.exit_code == 1 and "no_bound" in r.stdout
    assert "pass --min-sqnr DB" in r.stderr and "fp8_tensor vs fp8_tensor" in r.stderr
    assert _run(["verify", a, b, "--min-sqnr", "20"]).exit_code == 0


def test_verify_help_says_how_lossy_pairs_are_judged():
    r = _run(["verify", "--help"])
    text = " ".join(r.stdout.split())
    assert r.exit_code == 0 and "must reach the SQNR floor" in text and "pass --min-sqnr" in text


def test_the_tests_bounds_are_the_librarys():
    sys.path.insert(0, str(Path(__file__).parent))
    import _bounds

    assert _bounds.FLOOR_NVFP4_1D == SQNR_FLOORS["nvfp4"][0] and _bounds.REENCODE_E4M3 == REENCODE_FLOORS["e4m3"][0]
    assert sqnr_bound("nvfp4", "bfloat16") == SQNR_FLOORS["nvfp4"]
    assert sqnr_bound("nvfp4_2d", "e4m3", quantized=(True, True)) == REENCODE_FLOORS["nvfp4"]
    assert sqnr_bound("e4m3", "e5m2", quantized=(True, True)) is None
    assert sqnr_bound("float32", "bfloat16") == SQNR_FLOORS["bfloat16"]
    assert _bounds.FLOOR_MXFP4 == SQNR_FLOORS["mxfp4"][0] and _bounds.REENCODE_MXFP4 == REENCODE_FLOORS["mxfp4"][0]
    assert sqnr_bound("mxfp4", "bfloat16") == SQNR_FLOORS["mxfp4"]
    assert sqnr_bound("mxfp4_ceil", "float32") == SQNR_FLOORS["mxfp4_ceil"]
    assert sqnr_bound("mxfp4_ceil", "nvfp4", quantized=(True, True)) == REENCODE_FLOORS["mxfp4"]
    assert sqnr_bound("e5m2", "mxfp4", quantized=(True, True)) == REENCODE_FLOORS["mxfp4"]


# ----------------------------------------------------------------------------- one .distcp file
def _data_file(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]  # ckptq's writer spreads a rank's records over thread_count files


def test_a_single_distcp_file_is_refused_with_the_folder_to_pass(tmp_path, ckpt):
    f = _data_file(ckpt)
    for cmd in (["verify", f], ["inspect", f], ["verify", f, ckpt]):
        r = _run(cmd)
        assert r.exit_code == 1, (cmd, r.output)
        assert f"pass the folder instead ({ckpt})" in r.stderr, r.stderr
    # corrupted or truncated, alone: the same advice, not "0 failed" or "Not a directory"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / f.name).write_bytes(f.read_bytes()[:100])
    r = _run(["inspect", bad / f.name])
    assert r.exit_code == 1 and "has no .metadata" in r.stderr and "Errno" not in r.stderr


# ----------------------------------------------------------------------------- --rule globs
def test_a_rule_that_matches_nothing_is_an_error(tmp_path, ckpt):
    args = ["reshard", ckpt, tmp_path / "tp", "--mesh", "dp_shard=2,tp=2", "--plan", "fsdp2-tp"]
    r = _run([*args, "--rule", "*.q_proj.weight=col", "--rule", "proj.weight=col"])
    assert r.exit_code == 2 and "--rule *.q_proj.weight=col" not in r.stderr
    assert r.stderr.startswith("Error: --rule *.q_proj.weight: matches no tensor") and "proj.weight" in r.stderr
    assert not (tmp_path / "tp").exists()
    r = _run([*args, "--rule", "*.q_proj.weight=col", "--rule", "proj.weight=col", "--allow-unmatched"])
    assert r.exit_code == 0, r.output
    assert "Warning: --rule *.q_proj.weight matches no tensor" in r.stderr
    r = _run(["reshard", ckpt, tmp_path / "x", "--mesh", "2", "--rule", "proj.weight=col"])
    assert r.exit_code == 2 and "--rule applies to --plan fsdp2-tp" in r.stderr


def test_readme_reshard_rules_match_the_quick_start_checkpoint():
    text = (ROOT / "README.md").read_text()
    assert "--rule 'proj.weight=col'" in text and "q_proj" not in text.split("Offline, with no process group")[1][:600]


# ----------------------------------------------------------------------------- quick help, help texts
def test_import_cli_does_not_import_torch():
    code = "import sys, ckptq, ckptq.cli; assert 'torch' not in sys.modules, 'torch imported'; print(ckptq.UsageError)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_lazy_facade_keeps_every_public_name():
    for name in ckptq.__all__:
        assert getattr(ckptq, name) is not None
    assert set(ckptq.__all__) <= set(dir(ckptq)) and ckptq.io.SafeFileSystemReader
    with pytest.raises(AttributeError):
        ckptq.no_such_name  # noqa: B018


@pytest.mark.parametrize("command", ["inspect", "verify", "reshard", "convert", "export", "doctor"])
def test_every_help_has_examples_short_flag_and_no_bool_metavar(command):
    r = _run([command, "-h"])
    assert r.exit_code == 0 and ("Examples:\n    ckptq " in r.stdout or "Examples:\n    torchrun" in r.stdout)
    assert "<bool>" not in r.stdout and "-h, --help" in r.stdout


def test_root_help_offers_completion_and_short_help():
    r = _run(["-h"])
    assert r.exit_code == 0 and "--install-completion" in r.stdout and "<bool>" not in r.stdout


# ----------------------------------------------------------------------------- progress, Ctrl-C, dry run
def test_verify_reports_its_totals_for_progress_bars(tmp_path, ckpt):
    from ckptq.verify import check_integrity, verify_checkpoints

    totals, done = [], []
    verify_checkpoints(ckpt, ckpt, progress=lambda: done.append(1), on_total=totals.append)
    assert totals == [2] and len(done) == 2
    totals, done = [], []
    s = check_integrity(ckpt, progress=done.append, on_total=totals.append)["summary"]
    assert totals == [s["bytes"]] and sum(done) == s["bytes"]


def test_ctrl_c_says_nothing_was_written(monkeypatch, ckpt, tmp_path):
    import ckptq.inspect

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptq.inspect, "inspect_checkpoint", interrupted)
    r = _run(["inspect", ckpt])
    assert r.exit_code == 130 and r.stderr.strip() == "Aborted; nothing was written"


def test_dry_run_says_so_and_what_would_be_written(ckpt, tmp_path):
    r = _run(["reshard", ckpt, tmp_path / "out", "--mesh", "2", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"dry run: nothing written; would write {tmp_path / 'out'} for 2 ranks (2 files, " in r.stderr
    assert not (tmp_path / "out").exists()


def test_large_meshes_are_summarized(ckpt, tmp_path):
    args = ["reshard", ckpt, tmp_path / "out", "--mesh", "64", "--plan", "replicate", "--dry-run"]
    r = _run(args)
    assert r.exit_code == 0, r.output
    assert len(r.stdout.splitlines()) < 25 and "... 56 more" in r.stdout and "--per-rank" in r.stdout
    assert len(_run([*args, "--per-rank"]).stdout.splitlines()) > 64


def test_one_rank_is_singular(ckpt, tmp_path):
    r = _run(["reshard", ckpt, tmp_path / "out"])
    assert r.exit_code == 0 and "for 1 rank" in r.stderr and "1 ranks" not in r.stderr


# ----------------------------------------------------------------------------- messages
def test_mesh_zero_says_what_is_wrong(ckpt, tmp_path):
    r = _run(["reshard", ckpt, tmp_path / "out", "--mesh", "0"])
    assert r.exit_code == 2 and "at least 1 rank" in r.stderr and "comma-separated" not in r.stderr
    r = _run(["reshard", ckpt, tmp_path / "out", "--mesh", "dp_shard=0"])
    assert r.exit_code == 2 and "'dp_shard' has size 0" in r.stderr


def test_doctor_names_a_bogus_backend_plainly():
    r = _run(["doctor"], env={"CKPTQ_BACKEND": "bogus"})
    assert r.exit_code == 1 and "invalid:" not in r.output
    assert "Error: CKPTQ_BACKEND='bogus' is not a backend: set it to one of reference, cpu, cuda" in r.stderr


def test_inspect_hf_folder_producer_and_ratio_definition(ckpt, tmp_path):
    assert _run(["export", ckpt, tmp_path / "hf", "--layout", "modelopt", "--no-model-config"]).exit_code == 0
    r = _run(["inspect", tmp_path / "hf"])
    assert r.exit_code == 0, r.output
    assert "modelopt modelopt" not in r.stdout
    assert "stored tensor bytes / " in r.stdout and "(2 bytes per element)" in r.stdout


def test_convert_block_names_the_supported_blocks(ckpt, tmp_path):
    r = _run(["convert", ckpt, tmp_path / "out", "--to", "fp8_block", "--block", "100x7"])
    assert r.exit_code == 2 and "128x128 or 1x128" in r.stderr and "--allow-any-block" in r.stderr


def test_packaging_metadata_builds_without_warnings_of_ours():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # an SPDX string, not the deprecated table
    assert any(r.startswith("numpy") for r in meta["build-system"]["requires"])


def test_verify_mxfp4_against_bf16_and_nvfp4(tmp_path):
    """ckptq verify judges mxfp4 by its floors: vs high precision (SQNR_FLOORS), vs another
    quantized encoding (REENCODE_FLOORS)."""
    from ckptq.verify import verify_checkpoints

    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(4))
    for name, t in (
        ("m4", ckptq.quantize(w, "mxfp4", scale_rule="ceil")),
        ("bf", w.bfloat16()),
        ("nv", ckptq.quantize(w, "nvfp4")),
    ):
        dcp.save({"w": t}, checkpoint_id=str(tmp_path / name), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
    for other, floor in (("bf", SQNR_FLOORS["mxfp4_ceil"][0]), ("nv", REENCODE_FLOORS["mxfp4"][0])):
        report = verify_checkpoints(tmp_path / "m4", tmp_path / other)
        (row,) = report["tensors"]
        assert report["summary"]["ok"] and row["bound_db"] == floor and row["sqnr_db"] >= floor, row

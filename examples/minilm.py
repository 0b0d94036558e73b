"""Main job: quantized DCP checkpoints of a real model (all-MiniLM-L6-v2), end to end.

For each format (nvfp4, mxfp8, fp8_block 128x128, fp8_tensor, mxfp4), every 2-D Linear weight of the
model's encoder (36 weights: 384x384, 1536x384, 384x1536) is quantized, then:

1. saved natively with ``dcp.save(..., storage_writer=AtomicFileSystemWriter(path),
   planner=QuantizedSavePlanner())`` (single process, no process group; atomic and checksummed; the
   other parameters stay plain fp32 tensors in the same state dict);
2. inspected with the CLI, ``ckptq inspect PATH`` (its table is printed with ``--verbose``);
3. loaded into a fresh state dict of empty QuantizedTensors of the same format and recipe with
   ``QuantizedLoadPlanner``; every component of every weight must come back bit-exact; every record
   must match its checksum (``ckptq verify PATH``), and a copy with one flipped bit must fail to load
   with ``ChecksumMismatchError``;
4. saved in high precision (``mode="high_precision"``, bf16), which plain DCP loads into bf16 tensors;
5. measured: bytes on disk of native / high-precision / a bf16 reference checkpoint (the same
   state dict with the 36 weights cast to bf16, saved with plain DCP), SQNR of the dequantized
   weights vs the fp32 originals, and the cosine similarity of sentence embeddings computed with
   the dequantized (reloaded) weights vs the fp32 model on 16 fixed sentences; the SQNR must
   reach the floor of the format's rounding model (:data:`SQNR_FLOOR_DB`);
5b. exported (``ckptq export``) to every Hugging Face layout that holds the format, and the folder
   decoded back twice, each a column of its own: by the layout's formula as ckptq reads it (always;
   equal to ckptq's dequantized weights, NVFP4 within 2 fp32 ulp) and by compressed-tensors' own
   dequantizers where that library is installed (equal, or within its bf16 output rounding).

Then the sharded round trip, all formats at once (gloo process groups on the CPU):

6. 2 ranks save the model FSDP2-style: every parameter is a ``Shard(0)`` DTensor, and the local
   shard of each Linear weight is quantized on its rank with the tensor's global amax (all-reduced,
   as a quantized training step holds it);
7. the checkpoint is resharded offline, without a process group, to the mesh ``dp_shard=2,tp=2``
   with the placement rules ``fsdp2-tp`` (``ckptq.reshard_checkpoint``, what ``ckptq reshard`` runs);
8. 4 ranks load it into DTensors of those placements with ``QuantizedLoadPlanner``; every component of
   every loaded shard is compared byte for byte with the same box of the weight quantized whole by
   one process, and every plain tensor (embeddings, LayerNorms, biases) with the original.

    python examples/minilm.py [--formats nvfp4,mxfp8] [--verbose] [--json-out results.json] [--keep DIR]

Output: what is done to which model, one line per step as it finishes, one result table (120
columns), the checks made and a last line ``PASSED: ...`` (exit 0) or ``FAILED: ...`` naming the
failed checks (exit 1). Every check is a comparison: bytes bit-exact, checksum records verified and a
flipped bit caught, SQNR above a floor with its reason, exported weights decoded back within a stated
bound. ``--verbose`` also prints the ``ckptq inspect`` tables, per-step detail and the wide table of
every measurement; ``--json-out`` writes all of it (rows, checks, tables) as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bert  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import ckptq  # noqa: E402
from ckptq.cli import console_command  # noqa: E402
from ckptq.formats.base import slice_box  # noqa: E402
from ckptq.io import AtomicFileSystemWriter, SafeFileSystemReader, dcp_failure, read_metadata  # noqa: E402
from ckptq.metrics import bit_exact, sqnr_db  # noqa: E402
from ckptq.verify import check_integrity  # noqa: E402

#: format name -> quantization recipe (the defaults of docs/formats.md, "10. Recipes", spelled out).
FORMATS: dict[str, dict] = {
    "nvfp4": {},  # 1x16 blocks, e4m3 block scales, fp32 amax
    "mxfp8": {},  # 1x32 blocks, e8m0 scales, e4m3 data
    "fp8_block": {"block": (128, 128)},  # 128x128 blocks, pow2 fp32 scale_inv
    "fp8_tensor": {},  # one fp32 scale_inv per tensor
    "mxfp4": {"scale_rule": "floor"},  # 1x32 blocks, e8m0 scales (OCP MX floor rule), e2m1 data
}

#: Floors for the SQNR of the 36 dequantized weights vs the fp32 originals, in dB: the floors of
#: tests/_bounds.py. A float format with p mantissa bits, rounding to nearest, gives ~6.02 p + 13.4 dB
#: on Gaussian-like values (the trained weights are: 31.5 dB measured for E4M3, p = 3); NVFP4 (E2M1
#: under exact 1x16 block scales) 20.5 dB; MXFP4 (E2M1 under power-of-two 1x32 scales) 18.7 dB, floor
#: 17.0 (ckptq.metrics.SQNR_FLOORS). Floor = model - 1.5 dB; a bug costing one bit costs ~6 dB.
SQNR_FLOOR_DB: dict[str, float] = {"nvfp4": 19.0, "mxfp8": 30.0, "fp8_block": 30.0, "fp8_tensor": 30.0, "mxfp4": 17.0}

#: Width of the default output: every line of it fits (the wide table is for --verbose).
COLUMNS = 120
_VERBOSE = False


def log(msg: str) -> None:
    """A line of the default output (kept within :data:`COLUMNS`)."""
    print(msg, flush=True)


def detail(msg: str) -> None:
    """A line printed with ``--verbose`` only (inspect tables, per-step detail, the wide table)."""
    if _VERBOSE:
        print(msg, flush=True)


def _short(text: str, width: int = COLUMNS) -> str:
    """``text`` on one line (newlines become spaces), cut to ``width`` characters (``...`` marks a cut)."""
    one = str(text).replace("\n", " ")
    return one if len(one) <= width else one[: width - 3] + "..."


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain table: columns left-aligned, two spaces apart, headers of one or two lines (``\n``),
    a dashed rule under them; each column exactly as wide as its longest header line or cell."""
    head = [h.split("\n") for h in headers]
    depth = max(len(h) for h in head)
    head = [[""] * (depth - len(h)) + h for h in head]
    widths = [max([len(x) for x in h] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [line([h[k] for h in head]) for k in range(depth)]
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in rows)
    return "\n".join(out)


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
        info.length for idx, info in md.storage_data.items() if idx.fqn in wanted or idx.fqn.startswith(prefixes)
    )


def corruption_caught(src: Path, copy: Path, fqn: str, target: dict) -> bool:
    """Copy checkpoint ``src``, flip one bit in the middle of ``fqn``'s record, load the copy: is it
    a ``ckptq.ChecksumMismatchError`` (rather than a silently different tensor)?"""
    shutil.copytree(src, copy)
    info = next(v for k, v in read_metadata(copy).storage_data.items() if k.fqn == fqn)
    f = copy / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset + info.length // 2] ^= 0x04
    f.write_bytes(bytes(data))
    try:
        dcp.load(target, storage_reader=SafeFileSystemReader(copy), planner=ckptq.QuantizedLoadPlanner())
    except CheckpointException as e:
        return isinstance(dcp_failure(e, str(copy)), ckptq.ChecksumMismatchError)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return False


def run_inspect(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*console_command(), "inspect", str(path), *extra], capture_output=True, text=True)


def fresh_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors of the same kind: QuantizedTensors of the same format/recipe, plain tensors."""
    return {
        k: (v.new_empty(v.shape) if isinstance(v, ckptq.QuantizedTensor) else torch.empty_like(v))
        for k, v in state.items()
    }


_E2M1_LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def load_hf_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded Hugging Face safetensors folder (``model.safetensors.index.json``)."""
    from safetensors.torch import load_file

    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    t: dict[str, torch.Tensor] = {}
    for f in sorted(set(idx["weight_map"].values())):
        t.update(load_file(str(folder / f)))
    return t


def formula_weights(t: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """ckptq's decode of exported Linear weights: each layout's decode formula (docs/producers.md 4.1:
    ModelOpt NVFP4QTensor / MXFP8QTensor / FP8, compressed-tensors, DeepSeek ``weight_dequant``) on the tensors
    ``t`` of the folder (:func:`load_hf_folder`), in fp32. Needs no optional library.

    Returns ``{name: fp32 tensor of the weight's logical shape}`` for each ``name`` (``m.weight``).
    Raises KeyError when a weight's tensors are missing from ``t``.
    """
    out = {}
    for n in names:
        m = n[: -len(".weight")]
        w = t[f"{m}.weight"] if f"{m}.weight" in t else t[f"{m}.weight_packed"]
        e8m0 = t.get(f"{m}.scale", t.get(f"{m}.weight_scale"))  # DeepSeek-V4 names its scales ``m.scale``
        if e8m0 is not None and e8m0.dtype in (torch.uint8, torch.float8_e8m0fnu):
            p2 = torch.exp2(e8m0.view(torch.uint8).float() - 127)  # E8M0: 2^(e-127)
        if (
            w.dtype in (torch.uint8, torch.int8)
            and e8m0 is not None
            and e8m0.dtype in (torch.uint8, torch.float8_e8m0fnu)
        ):
            # MXFP4 (compressed-tensors weight_packed, DeepSeek-V4 I8 weight): lut[q] * 2^(e-127) per 1x32
            b = w.view(torch.uint8)
            q = torch.stack([_E2M1_LUT[(b & 0xF).long()], _E2M1_LUT[(b >> 4).long()]], -1).reshape(b.shape[0], -1)
            out[n] = q * p2.repeat_interleave(32, -1)[:, : q.shape[1]]
        elif f"{m}.scale" in t:  # DeepSeek-V4 FP8: w * 2^(e-127) on the 128x128 grid
            out[n] = w.float() * p2.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        elif w.dtype == torch.uint8:  # NVFP4: lut[q] * (weight_scale * weight_scale_2 | / weight_global_scale)
            q = torch.stack([_E2M1_LUT[(w & 0xF).long()], _E2M1_LUT[(w >> 4).long()]], -1).reshape(w.shape[0], -1)
            g = t.get(f"{m}.weight_scale_2")
            s = (
                t[f"{m}.weight_scale"].float() * g
                if g is not None
                else t[f"{m}.weight_scale"].float() / t[f"{m}.weight_global_scale"]
            )
            out[n] = q * s.repeat_interleave(16, -1)
        elif f"{m}.weight_scale_inv" in t:
            s = t[f"{m}.weight_scale_inv"]
            out[n] = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        elif t[f"{m}.weight_scale"].dtype == torch.uint8:  # MXFP8: q * 2^(e-127)
            out[n] = w.float() * torch.exp2(t[f"{m}.weight_scale"].float() - 127).repeat_interleave(32, -1)
        else:  # FP8: one decode scale, or compressed-tensors' block scales on the 128x128 grid
            s = t[f"{m}.weight_scale"].float()
            if s.numel() > 1:
                s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
            out[n] = w.float() * s.reshape(()) if s.numel() == 1 else w.float() * s
    return out


#: The layouts whose consumer library ships a dequantizer this job can call (compressed-tensors'
#: CompressedTensorsDequantizer and FP8BlockDequantizer); ModelOpt's needs a GPU stack, so it has none.
LIBRARY_DECODERS = {"compressed-tensors": "CompressedTensorsDequantizer", "deepseek-fp8": "FP8BlockDequantizer"}


def library_weights(
    folder: Path, t: dict[str, torch.Tensor], layout: str, names: list[str]
) -> tuple[dict[str, torch.Tensor] | None, str]:
    """compressed-tensors' own decode of the exported weights (``layout`` ``compressed-tensors``, or
    ``deepseek-fp8`` through its FP8BlockDequantizer), as fp32 tensors; ``t`` as for
    :func:`formula_weights` (not modified).

    Returns ``(weights, decoder)``, or ``(None, why)`` when the layout has no library decoder here or
    compressed-tensors cannot be imported ("not installed"). Errors of the library itself propagate.
    """
    if layout not in LIBRARY_DECODERS:
        return None, "no library decoder"
    quiet = {name: logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")}
    levels = {name: lg.level for name, lg in quiet.items()}
    try:
        # importing compressed-tensors may import torchao, which logs what it cannot load on this
        # machine (its CUDA kernels) and what torch deprecates: not results of this job
        for lg in quiet.values():
            lg.setLevel(logging.ERROR)
        if layout == "compressed-tensors":
            from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

            out = CompressedTensorsDequantizer(str(folder), dtype=torch.float32).validate(dict(t))
        else:
            import re

            from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

            targets = [f"re:^{re.escape(n[: -len('.weight')])}$" for n in names]
            out = FP8BlockDequantizer(targets=targets, dtype=torch.float32).process(dict(t))
    except ImportError:
        return None, "not installed"
    finally:
        for name, lg in quiet.items():
            lg.setLevel(levels[name])
    return {n: out[n].float() for n in names}, f"compressed-tensors {LIBRARY_DECODERS[layout]}"


def compare_decoded(fmt: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], library: bool) -> dict:
    """Decoded weights ``got`` vs ckptq's dequantized ``want`` (fp32, same names and shapes).

    The bound: ckptq's own decode (``library=False``) must be bit-exact, except NVFP4 within 2 fp32
    ulp (the global scale: ckptq decodes ``(s * amax) * (1/2688)``, the layouts ``s * ws2`` and
    ``s / gs``; ckptq/adapters/hf.py). A library's decode must be bit-exact or, where the library
    returns bf16 values (compressed-tensors 0.20 decodes NVFP4 into bf16, then casts to the dtype
    asked for), within one bf16 ulp of ckptq's values rounded to bf16.

    Returns ``{"exact", "max_ulps" (fp32 ulps, 0 if exact), "bf16_output", "within_bound", "bound"}``.
    """
    exact = all(torch.equal(got[n], want[n]) for n in want)
    ulps = 0
    for n in want:
        a, b = got[n].reshape(-1), want[n].reshape(-1)
        differ = a != b
        if differ.any():
            d = (a[differ].view(torch.int32).long() - b[differ].view(torch.int32).long()).abs().max()
            ulps = max(ulps, int(d))
    bf16_output = not exact and all(torch.equal(got[n], got[n].bfloat16().float()) for n in want)
    if exact:
        ok, bound = True, "bit-exact"
    elif not library:
        ok = fmt == "nvfp4" and all(torch.allclose(got[n], want[n], rtol=2 * 2**-23, atol=0) for n in want)
        bound = "bit-exact" + (", NVFP4 within 2 fp32 ulp" if fmt == "nvfp4" else "")
    else:
        rounded = {n: want[n].bfloat16().float() for n in want}
        ok = bf16_output and all(bool(((got[n] - rounded[n]).abs() <= rounded[n].abs() * 2**-7).all()) for n in want)
        bound = "bit-exact, or bf16 output within 1 bf16 ulp of ckptq's rounded to bf16"
    return {"exact": exact, "max_ulps": ulps, "bf16_output": bf16_output, "within_bound": ok, "bound": bound}


def run_exports(fmt: str, native: Path, deq: dict, emb: torch.Tensor, ctx: dict) -> dict:
    """Export the native checkpoint to every HF layout that holds ``fmt``, decode each folder with
    ckptq's formula and with the library's dequantizer (where there is one), and compare: weights
    vs ckptq's dequantized ``deq`` (:func:`compare_decoded`), sentence embeddings vs ``emb``.

    Returns ``{layout: {"numerics_max_ulps", "ckptq_decode": {...}, "library_decode": {...}}}``;
    a decode not run has ``{"decoder": None, "why": ...}``."""
    from ckptq.adapters.hf import LAYOUTS
    from ckptq.export import export_checkpoint

    names = ctx["names"]

    def measured(w: dict, decoder: str, library: bool) -> dict:
        cmp = compare_decoded(fmt, w, deq, library)
        # bit-identical weights give bit-identical embeddings (same encoder, same inputs): encode only if not
        emb2 = emb if cmp["exact"] else ctx["encoder"].encode(bert.SENTENCES, weights=w)
        return {
            "decoder": decoder,
            **cmp,
            "emb_equal": bool(torch.equal(emb2, emb)),
            "emb_max_abs_diff": float((emb2 - emb).abs().max()),
        }

    res = {}
    for layout, lay in LAYOUTS.items():
        fm = lay.format_map(fmt)
        if fm is None or fm.ndim not in (None, 2):  # gpt-oss holds 3-D experts only, MiniLM's Linears are 2-D
            continue
        dst = ctx["work"] / f"{fmt}-hf-{layout}"
        # decoded below by formula and library, not built as a transformers model: no model config; the
        # consumer-dtype check's findings are kept in the report rather than refused
        rep = export_checkpoint(native, dst, layout=layout, config=False, on_inexact="keep")
        t = load_hf_folder(dst)
        entry = {"numerics_max_ulps": max(rep["numerics"].values(), default=0)}
        entry["ckptq_decode"] = measured(formula_weights(t, names), "layout formula (ckptq)", library=False)
        lib, how = library_weights(dst, t, layout, names)
        entry["library_decode"] = {"decoder": None, "why": how} if lib is None else measured(lib, how, library=True)
        res[layout] = entry
    return res


def check(name: str, ok: bool, detail_: str) -> dict:
    """One check of the job: what was compared, whether it held, and what was seen."""
    return {"check": name, "ok": bool(ok), "detail": detail_}


def export_checks(hf: dict) -> list[dict]:
    """The checks of one format's HF exports (a result of :func:`run_exports`): ckptq's decode of
    every layout within its bound, and the library's where it ran."""
    out = []
    for who, key in (("ckptq", "ckptq_decode"), ("compressed-tensors", "library_decode")):
        ran = {lay: v[key] for lay, v in hf.items() if v[key]["decoder"] is not None}
        if not ran:
            continue
        bad = [f"{lay} ({v['max_ulps']} fp32 ulp)" for lay, v in ran.items() if not v["within_bound"]]
        bound = next(iter(ran.values()))["bound"]
        out.append(
            check(
                f"HF export, {who} decode",
                not bad,
                f"{', '.join(ran)}: " + (f"outside bound ({bound}): {', '.join(bad)}" if bad else bound),
            )
        )
    return out


def run_format(fmt: str, recipe: dict, ctx: dict) -> dict:
    """Steps 1-5b for one format. Returns its row: measurements, ``checks`` (see :func:`check`)."""
    t0 = time.perf_counter()
    orig, names, enc, work = ctx["orig"], ctx["names"], ctx["encoder"], ctx["work"]
    row: dict = {"format": fmt, "recipe": {k: list(v) if isinstance(v, tuple) else v for k, v in recipe.items()}}
    checks: list[dict] = []
    row["checks"] = checks

    q = {n: ckptq.quantize(orig[n], fmt, **recipe) for n in names}
    state = {**orig, **q}  # non-quantized parameters stay plain fp32 tensors
    t_quant = time.perf_counter() - t0

    # 1. native save
    native = work / f"{fmt}-native"
    dcp.save(state, storage_writer=AtomicFileSystemWriter(native), planner=ckptq.QuantizedSavePlanner())

    # 2. inspect
    r = run_inspect(native)
    detail(f"\n$ ckptq inspect {native}   (exit {r.returncode})")
    detail(r.stdout.rstrip())
    row["inspect_exit"], row["inspect_output"] = r.returncode, r.stdout
    if r.returncode != 0:
        row["inspect_stderr"] = r.stderr
        detail(r.stderr.rstrip())
    rj = run_inspect(native, "--json")  # cross-check: the CLI sees the 36 native tensors of this format
    try:
        listed = {t["fqn"]: t for t in json.loads(rj.stdout)["tensors"]}
        seen = sum(listed.get(n, {}).get("format") == fmt and listed[n].get("mode") == "native" for n in names)
        why = ""
    except (ValueError, KeyError, TypeError) as e:
        seen = 0
        why = f"; --json exit {rj.returncode}, unreadable output ({e}): {rj.stderr.strip()[-300:]}"
    row["inspect_native_tensors"] = f"{seen}/{len(names)}"
    checks.append(
        check(
            "ckptq inspect",
            r.returncode == 0 and seen == len(names),
            f"exit {r.returncode}; --json lists {seen}/{len(names)} weights as native {fmt}{why}",
        )
    )

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
    n_plain = len(orig) - len(names)
    plain_exact = sum(bit_exact(loaded[k], orig[k]) for k in orig if k not in q)
    row["bit_exact"] = f"{exact}/{len(names)}"
    row["bit_exact_count"], row["quantized_tensors"] = exact, len(names)
    row["plain_exact"] = f"{plain_exact}/{n_plain}"
    row["plain_exact_count"], row["plain_tensors"] = plain_exact, n_plain
    checks.append(
        check(
            "native reload bit-exact",
            not bad,
            f"{row['bit_exact']} weights, every component"
            + (f"; differ: {bad[:3]}{'...' if len(bad) > 3 else ''}" if bad else ""),
        )
    )
    checks.append(check("plain tensors unchanged", plain_exact == n_plain, f"{row['plain_exact']}"))

    # 3b. integrity: every record carries a checksum; one flipped bit in a copy is caught on load
    integrity = check_integrity(native)["summary"]
    caught = corruption_caught(native, work / f"{fmt}-corrupt", f"{names[0]}.data", fresh_like(state))
    row["integrity"] = f"{integrity['verified']}/{integrity['records']}" + (
        ", flip caught" if caught else ", FLIP MISSED"
    )
    row["checksums_verified"], row["checksum_records"], row["flip_caught"] = (
        integrity["verified"],
        integrity["records"],
        caught,
    )
    checks.append(
        check(
            "checksums verified",
            integrity["ok"] and integrity["verified"] == integrity["records"],
            f"{integrity['verified']}/{integrity['records']} records (ckptq verify)",
        )
    )
    checks.append(check("flipped bit caught", caught, f"ChecksumMismatchError on {names[0]}.data: {caught}"))

    # 4. high-precision save; plain DCP (default planner) must load it into bf16 tensors
    hp = work / f"{fmt}-hp"
    dcp.save(
        state, checkpoint_id=str(hp), planner=ckptq.QuantizedSavePlanner(mode="high_precision", dtype=torch.bfloat16)
    )
    plain_target = {n: torch.empty(q[n].shape, dtype=torch.bfloat16) for n in names}
    dcp.load(plain_target, storage_reader=SafeFileSystemReader(hp))  # plain DCP planner
    hp_ok = sum(bit_exact(plain_target[n], q[n].dequantize(torch.bfloat16)) for n in names)
    row["hp_equals_dequant_bf16"] = f"{hp_ok}/{len(names)}"
    checks.append(
        check(
            "high precision == dequantize(bf16)",
            hp_ok == len(names),
            f"{hp_ok}/{len(names)} weights, loaded by plain DCP",
        )
    )

    # 5. sizes, SQNR, embeddings from the *reloaded* weights
    row["native_bytes"], row["hp_bytes"], row["bf16_bytes"] = dir_bytes(native), dir_bytes(hp), ctx["bf16_bytes"]
    row["native_weight_bytes"] = stored_bytes(native, names)
    row["hp_weight_bytes"] = stored_bytes(hp, names)
    row["bf16_weight_bytes"] = ctx["bf16_weight_bytes"]
    row["native_over_bf16"] = row["native_bytes"] / row["bf16_bytes"]
    row["native_over_bf16_weights"] = row["native_weight_bytes"] / row["bf16_weight_bytes"]
    row["weight_bits_per_element"] = 8 * row["native_weight_bytes"] / ctx["numel"]
    deq = {n: loaded[n].dequantize(torch.float32) for n in names}
    row["sqnr_db"] = sqnr_db(
        torch.cat([orig[n].flatten() for n in names]), torch.cat([deq[n].flatten() for n in names])
    )
    row["sqnr_floor_db"] = SQNR_FLOOR_DB[fmt]
    checks.append(
        check(
            "weight SQNR >= floor",
            row["sqnr_db"] >= SQNR_FLOOR_DB[fmt],
            f"{row['sqnr_db']:.2f} dB, floor {SQNR_FLOOR_DB[fmt]:.1f} dB",
        )
    )
    emb = enc.encode(bert.SENTENCES, weights=deq)
    cos = (emb * ctx["ref_emb"]).sum(dim=1)
    row["cos_mean"], row["cos_min"] = cos.mean().item(), cos.min().item()
    try:
        bert.sanity_check(emb)
        row["ranking_ok"] = True
    except AssertionError as e:  # reported, not a check: a property of the format, not of ckptq
        row["ranking_ok"] = False
        row["ranking_note"] = str(e)
        log(_short(f"note: paraphrase ranking with {fmt} weights: {e}"))
    # 5b. export to each Hugging Face layout holding this format; decode it back (ckptq, the library)
    t_hf = time.perf_counter()
    try:
        row["hf_export"] = run_exports(fmt, native, deq, emb, ctx)
        row["hf_export_seconds"] = time.perf_counter() - t_hf
        checks.extend(export_checks(row["hf_export"]))
    except Exception as e:  # a failed check; the DCP steps above still count
        row["hf_export"] = {"error": f"{type(e).__name__}: {e}"}
        row["hf_export_traceback"] = traceback.format_exc()
        checks.append(check("HF export", False, f"{type(e).__name__}: {e}"))
    row["seconds"] = time.perf_counter() - t0
    row["quantize_seconds"] = t_quant
    detail(
        f"{fmt}: quantize {t_quant:.1f}s, HF export + decodes {row.get('hf_export_seconds', 0):.1f}s, "
        f"total {row['seconds']:.1f}s; reload {row['bit_exact']} bit-exact "
        f"(+{row['plain_exact']} plain), high-precision == dequantize(bf16): {row['hp_equals_dequant_bf16']}"
    )
    return row


# ------------------------------------------------------------------------------ sharded round trip
#: The layouts of steps 6-8. The source is FSDP2 on 2 ranks: ``Shard(0)`` everywhere (FSDP2's
#: ``torch.chunk`` cuts: 384 rows -> 2 x 192). The target is FSDP2 over TP on 4 ranks, laid out by
#: the ``fsdp2-tp`` preset with these rules: q/k/v and the MLP's up projection column-parallel
#: (weights ``(_StridedShard(0, 2), Shard(0))``, 96-row shards of the 384-row weights), the MLP's
#: down projection ``encoder.layer.N.output.dense`` (384x1536) row-parallel (``(Shard(0),
#: Shard(1))``, columns cut at 768); everything else, attention.output.dense included, is only
#: FSDP-sharded (``(Shard(0), Replicate())``): cut row-parallel at column 192 it would split
#: fp8_block's 128-wide blocks.
SOURCE_RANKS = 2
TARGET_MESH = "dp_shard=2,tp=2"
TARGET_PLAN = "fsdp2-tp"
TP_RULES = ("*.attention.self.*=col", "*.intermediate.dense.*=col", "*.[0-9].output.dense.*=row")
#: The recipes of the sharded round trip: those of FORMATS, except fp8_block, whose 128x128 blocks
#: cannot be cut at row 192 (ckptq refuses such a save with a ShardingError); sharded, fp8_block
#: uses 1x128 blocks (one scale per 128 values of a row, the other common fp8_block recipe).
SHARDED_RECIPES: dict[str, dict] = {**FORMATS, "fp8_block": {"block": (1, 128)}}
#: Formats with a per-tensor amax: every shard must be quantized with the global one.
PER_TENSOR_AMAX = ("nvfp4", "fp8_tensor")


def _recipe_note(fmt: str) -> str:
    """How the sharded recipe differs from the single-process one ("" when it does not)."""
    if SHARDED_RECIPES[fmt] == FORMATS[fmt]:
        return ""
    return " (" + "x".join(map(str, SHARDED_RECIPES[fmt]["block"])) + ")"


def _recipe_label(fmt: str) -> str:
    """The block of the single-process recipe, e.g. `` (128x128)`` ("" where the format has one block)."""
    block = FORMATS[fmt].get("block")
    return " (" + "x".join(map(str, block)) + ")" if block else ""


def _sharded_path(work: Path, fmt: str, what: str) -> Path:
    return work / f"{fmt}-{what}"


def _local_box(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's shard, by DTensor's own rule (the one DCP uses)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(offsets), tuple(sizes)


def _narrow(t: torch.Tensor, box) -> torch.Tensor:
    for d, (off, size) in enumerate(zip(*box, strict=False)):
        t = t.narrow(d, off, size)
    return t


def _poison(t) -> None:
    """Fill every byte with 0xFF (NaN for the float types), so that a shard the load does not
    write cannot match its expected bytes by chance."""
    for c in t.components().values() if isinstance(t, ckptq.QuantizedTensor) else [t]:
        c.reshape(-1).view(torch.uint8).fill_(0xFF)


def _save_worker(rank: int, world_size: int, work: str, formats: list[str], names: list[str]) -> dict:
    """Step 6 on one rank: save the model as FSDP2 ``Shard(0)`` DTensors, quantized weights locally."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    orig = bert.load_state_dict()
    seconds = {}
    for fmt in formats:
        t0 = time.perf_counter()
        state = {}
        for k, v in orig.items():
            if not v.is_floating_point():  # position_ids: a buffer, which FSDP2 does not shard
                state[k] = v
                continue
            local = _narrow(v, _local_box(v.shape, mesh, [Shard(0)])).contiguous()
            if k in names:
                kw = {}
                if fmt in PER_TENSOR_AMAX:  # one amax for all shards of the tensor
                    amax = local.abs().amax()
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
                    kw["amax"] = amax
                local = ckptq.quantize(local, fmt, **SHARDED_RECIPES[fmt], **kw)
            state[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride())
        dcp.save(
            state,
            checkpoint_id=str(_sharded_path(Path(work), fmt, f"{world_size}ranks")),
            planner=ckptq.QuantizedSavePlanner(),
        )
        seconds[fmt] = time.perf_counter() - t0
    return seconds


def _target_layout():
    """The target mesh and ``fsdp2-tp`` plan, as ``ckptq.reshard_checkpoint`` builds them from the
    same strings: which placements each tensor gets there."""
    from ckptq import parse

    mesh = parse.parse_mesh(TARGET_MESH)
    return mesh, parse.parse_placement_rules(mesh, TARGET_PLAN, TP_RULES)


def _load_worker(rank: int, world_size: int, work: str, formats: list[str], names: list[str]) -> dict:
    """Step 8 on one rank: load the resharded checkpoint into DTensors of the target layout and
    return, per format, the tensors whose loaded shard differs from the expected bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    spec, layout = _target_layout()
    mesh = init_device_mesh("cpu", spec.sizes, mesh_dim_names=spec.names)
    orig = bert.load_state_dict()
    out = {}
    for fmt in formats:
        t0 = time.perf_counter()
        state, want = {}, {}
        for k, v in orig.items():
            if not v.is_floating_point():  # the position_ids buffer: a plain tensor, whole
                want[k] = v
                state[k] = torch.empty_like(v)
                _poison(state[k])
                continue
            placements = layout.placements(k, v.ndim)
            box = _local_box(v.shape, mesh, placements)
            if k in names:
                # The reference: the whole weight quantized by one process, then the box of this
                # shard -- not what the 2 ranks saved (their shards were quantized separately).
                want[k] = slice_box(ckptq.quantize(v, fmt, **SHARDED_RECIPES[fmt]), box)
            else:
                want[k] = _narrow(v, box)
            local = torch.empty_like(want[k])
            _poison(local)
            state[k] = DTensor.from_local(local, mesh, placements, run_check=False, shape=v.shape, stride=v.stride())
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(_sharded_path(Path(work), fmt, "resharded")),
            planner=ckptq.QuantizedLoadPlanner(),
        )
        differ = []
        for k, t in state.items():
            got = t.to_local() if isinstance(t, DTensor) else t
            if k in names:
                ok = (
                    type(got) is type(want[k])
                    and got.recipe == want[k].recipe
                    and all(bit_exact(got.components()[c], w) for c, w in want[k].components().items())
                )
            else:
                ok = bit_exact(got, want[k])
            if not ok:
                differ.append(k)
        out[fmt] = {"differ": differ, "seconds": time.perf_counter() - t0}
    return out


def _rank_main(rank, world_size, store, fn, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # several ranks share the cores
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()  # (a failed rank skips it: the parent reports its error and ends the others)
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined in a gloo
    process group (a FileStore rendezvous: nothing listens on the network); the results by rank.
    Raises RuntimeError when a rank fails, with the tracebacks of every rank that failed within 5 s
    of the first (the others are then ended)."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ckptq-store-") as d:
        store = os.path.join(d, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, store, fn, args, queue), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, error = {}, None
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size and error is None:
                try:
                    rank, status, payload = queue.get(timeout=1.0)
                except queue_mod.Empty:
                    dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                    if dead:
                        error = f"rank(s) exited without a result (exit codes {dead})"
                    elif time.monotonic() > deadline:
                        error = f"no result after {timeout:.0f} s"
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    error = f"rank {rank}: {payload}"
            # the other ranks' errors too (a moment's grace): the first to arrive may be a rank that
            # only failed because another did
            grace = time.monotonic() + 5.0
            while error is not None and len(results) < world_size and time.monotonic() < grace:
                try:
                    rank, status, payload = queue.get(timeout=0.5)
                except queue_mod.Empty:
                    continue
                if status != "ok":
                    error += f"\nrank {rank}: {payload}"
        finally:
            for p in procs:
                p.join(timeout=30 if error is None else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    if error is not None:
        raise RuntimeError(f"{fn.__name__} on {world_size} ranks failed: {error}")
    return [results[r] for r in range(world_size)]


def reshard(src: Path, dst: Path) -> dict:
    """Step 7: ``ckptq reshard SRC DST --mesh dp_shard=2,tp=2 --plan fsdp2-tp --rule ...``."""
    return ckptq.reshard_checkpoint(src, dst, mesh=TARGET_MESH, plan=TARGET_PLAN, rules=list(TP_RULES))


def load_resharded(formats: list[str], work: Path, names: list[str], plain: list[str]) -> dict[str, dict]:
    """Step 8: load every format's resharded checkpoint on the target mesh's ranks; per format, how
    many quantized weights and plain tensors came back bit-exact (on every rank)."""
    spec, _ = _target_layout()
    t0 = time.perf_counter()
    loaded = spawn_ranks(spec.world_size, _load_worker, str(work), formats, names)
    detail(
        f"sharded: {spec.world_size} ranks loaded them into DTensors of those placements "
        f"({time.perf_counter() - t0:.1f} s, process start included)"
    )
    out = {}
    for fmt in formats:
        differ = sorted({k for per_rank in loaded for k in per_rank[fmt]["differ"]})  # wrong on any rank
        exact, plain_exact = sum(n not in differ for n in names), sum(k not in differ for k in plain)
        out[fmt] = {
            "recipe": {k: list(v) if isinstance(v, tuple) else v for k, v in SHARDED_RECIPES[fmt].items()},
            "exact_count": exact,
            "quantized_tensors": len(names),
            "bit_exact": f"{exact}/{len(names)}",
            "plain_exact_count": plain_exact,
            "plain_tensors": len(plain),
            "plain_exact": f"{plain_exact}/{len(plain)}",
            "differ": differ,
            "load_seconds_per_rank": [per_rank[fmt]["seconds"] for per_rank in loaded],
        }
        detail(
            f"sharded {fmt}{_recipe_note(fmt)}: {out[fmt]['bit_exact']} quantized weights bit-exact, "
            f"{out[fmt]['plain_exact']} plain tensors unchanged" + (f"; DIFFER: {differ[:4]}" if differ else "")
        )
    return out


def sharded_problems(r: dict) -> list[str]:
    """What failed in one format's sharded round trip (a result of :func:`run_sharded`)."""
    if "error" in r:
        return [f"sharded round trip: {r['error']}"]
    if r["exact_count"] != r["quantized_tensors"] or r["plain_exact_count"] != r["plain_tensors"]:
        return [
            f"sharded round trip: {r['bit_exact']} weights bit-exact, {r['plain_exact']} plain tensors "
            f"unchanged; differ: {r['differ'][:4]}"
        ]
    return []


def sharded_checks(r: dict, fmt: str) -> list[dict]:
    """The checks of one format's sharded round trip (a result of :func:`run_sharded`)."""
    if "error" in r:
        return [check("2->4 ranks round trip", False, r["error"])]
    note = _recipe_note(fmt)
    return [
        check(
            "2->4 ranks reshard bit-exact",
            r["exact_count"] == r["quantized_tensors"],
            f"{r['bit_exact']} weights{note}" + (f"; differ: {r['differ'][:4]}" if r["differ"] else ""),
        ),
        check("2->4 ranks plain unchanged", r["plain_exact_count"] == r["plain_tensors"], r["plain_exact"]),
    ]


def placement_summary(names: list[str], layout) -> str:
    """Which placements layer 0's weights get on the target mesh, grouped: ``query/key/value
    (SS(0,2), S(0)); ...`` (module names without ``encoder.layer.0.``, ``attention.self.``, ``.dense``)."""
    from ckptq.placement import format_placements

    groups: dict[str, list[str]] = {}
    for n in names:
        if n.startswith("encoder.layer.0."):
            short = n[len("encoder.layer.0.") : -len(".weight")].replace("attention.self.", "").replace(".dense", "")
            groups.setdefault(format_placements(layout.placements(n, 2)), []).append(short)
    return "; ".join(f"{'/'.join(v)} {k}" for k, v in groups.items())


def run_sharded(formats: list[str], ctx: dict) -> dict[str, dict]:
    """Steps 6-8 for all formats (one process group per step): the results of
    :func:`load_resharded`, with the timings."""
    work, names, orig = ctx["work"], ctx["names"], ctx["orig"]
    spec, layout = _target_layout()

    t0 = time.perf_counter()
    saved = spawn_ranks(SOURCE_RANKS, _save_worker, str(work), formats, names)
    t_save = time.perf_counter() - t0
    detail(
        f"\nsharded: {SOURCE_RANKS} ranks saved the model as FSDP2 Shard(0) DTensors, every Linear weight's "
        f"shard quantized on its rank ({t_save:.1f} s for {len(formats)} format(s), process start included)"
    )

    t0 = time.perf_counter()
    reports = {}
    for fmt in formats:
        t1 = time.perf_counter()
        report = reshard(_sharded_path(work, fmt, f"{SOURCE_RANKS}ranks"), _sharded_path(work, fmt, "resharded"))
        reports[fmt] = {
            "reshard_seconds": time.perf_counter() - t1,
            "target_ranks": report["world_size"],
            "bytes_per_target_rank": report["bytes_per_rank"],
        }
    t_reshard = time.perf_counter() - t0
    from ckptq.placement import format_placements

    detail(
        f"sharded: resharded offline to mesh {spec} ({spec.world_size} ranks, one file each), plan "
        f"{TARGET_PLAN} with rules {' '.join(TP_RULES)} ({t_reshard:.1f} s); layer 0 weights there:"
    )
    for n in names:
        if n.startswith("encoder.layer.0."):
            detail(f"  {n:48s} {str(tuple(orig[n].shape)):12s} {format_placements(layout.placements(n, 2))}")

    t0 = time.perf_counter()
    out = load_resharded(formats, work, names, [k for k in orig if k not in names])
    timings = {"save_s": t_save, "reshard_s": t_reshard, "load_s": time.perf_counter() - t0}
    for fmt, r in out.items():
        r.update(
            reports[fmt], source_ranks=SOURCE_RANKS, save_seconds_per_rank=[x[fmt] for x in saved], timings=timings
        )
    return out


def _decode_cell(hf: dict | None, key: str) -> str:
    """One format's HF decode column (``key`` ``ckptq_decode`` or ``library_decode``): the largest
    embedding difference over its layouts, ``same`` when bit-identical, ``n/a (...)`` when not run."""
    if not hf:
        return "-"
    if "error" in hf:
        return "error"
    ran = [v[key] for v in hf.values() if v[key]["decoder"] is not None]
    if not ran:
        whys = sorted({v[key]["why"] for v in hf.values()})
        return "n/a (not installed)" if "not installed" in whys else f"n/a ({', '.join(whys)})"
    cell = "same" if all(r["emb_equal"] for r in ran) else f"{max(r['emb_max_abs_diff'] for r in ran):.1e}"
    if any(r["bf16_output"] for r in ran):
        cell += " (bf16)"
    return cell if all(r["within_bound"] for r in ran) else cell + " OUT"


#: The result table of the default output (two-line headers; it fits :data:`COLUMNS`).
SUMMARY_HEADERS = [
    "format",
    "weights\nvs bf16",
    "SQNR\ndB",
    "reload\nbit-exact",
    "checksums,\nbit flip",
    "emb cos\nmean/min",
    f"{SOURCE_RANKS}->4 ranks\nbit-exact",
    "HF decode:\nckptq",
    "HF decode:\ncompressed-tensors",
]

LEGEND = [
    "weights vs bf16: stored bytes of the 36 quantized weights / as bf16; SQNR: the 36 weights dequantized vs fp32",
    "reload bit-exact: tensors equal byte for byte (36 quantized, every component, + 68 plain) after a native reload",
    "  on 1 process, and after 2 FSDP2 ranks -> ckptq reshard -> 4 ranks (fp8_block there with 1x128 blocks: 128x128",
    "  ones cannot be cut at row 192); checksums: crc32c records verified, and one flipped bit in a copy caught",
    "emb cos: per sentence, embedding with the reloaded weights vs fp32 weights, 16 sentences (mean/min)",
    "HF decode: max |d| of embeddings from the exported HF folders vs from ckptq's weights, over the format's",
    "  layouts (same = bit-identical), decoded by ckptq (each layout's formula, fp32; NVFP4's global scale <= 2",
    "  fp32 ulp off) and by compressed-tensors' dequantizers; (bf16): that library returned bf16 values (0.20",
    "  decodes NVFP4 into bf16): ckptq's weights rounded to bf16 -- the same formula, another output dtype",
]


def summary_table(rows: list[dict]) -> list[list[str]]:
    """The rows of :data:`SUMMARY_HEADERS`: one per format."""
    table = []
    for r in rows:
        s = r.get("sharded", {})
        if "exact_count" in s:
            n = s["quantized_tensors"] + s["plain_tensors"]
            sharded = f"{s['exact_count'] + s['plain_exact_count']}/{n}{_recipe_note(r['format'])}"
        else:
            sharded = "error"
        if "native_bytes" not in r:
            table.append([r["format"], "-", "-", "error", "-", "-", sharded, "-", "-"])
            continue
        n = r["quantized_tensors"] + r["plain_tensors"]
        table.append(
            [
                r["format"],
                f"{r['native_over_bf16_weights']:.3f}",
                f"{r['sqnr_db']:.2f}",
                f"{r['bit_exact_count'] + r['plain_exact_count']}/{n}",
                f"{r['checksums_verified']}/{r['checksum_records']} " + ("caught" if r["flip_caught"] else "MISSED"),
                f"{r['cos_mean']:.4f}/{r['cos_min']:.4f}",
                sharded,
                _decode_cell(r.get("hf_export"), "ckptq_decode"),
                _decode_cell(r.get("hf_export"), "library_decode"),
            ]
        )
    return table


def wide_table(rows: list[dict], formats: list[str]) -> tuple[list[str], list[list[str]], list[str]]:
    """Every measurement, one row per format (``--verbose``, and the JSON): headers, rows, legend."""
    headers = [
        "format",
        "native B",
        "high-prec B",
        "bf16 B",
        "native/bf16",
        "weights native/bf16",
        "weight SQNR dB",
        "bit-exact reload",
        "checksums verified",
        "emb cos mean",
        "emb cos min",
        f"{SOURCE_RANKS}->{_target_layout()[0].world_size} ranks bit-exact",
        "plain unchanged",
        "HF export: ckptq decode (emb vs ckptq)",
        "HF export: compressed-tensors decode",
    ]
    table = []
    for r in rows:
        s = r.get("sharded", {})
        if "exact_count" in s:
            sharded_cols = [s["bit_exact"] + _recipe_note(r["format"]), s["plain_exact"]]
        else:
            sharded_cols = ["error", "error"]
        if "native_bytes" not in r:
            table.append(
                [r["format"]] + ["-"] * 6 + [r.get("bit_exact", "error")] + ["-"] * 3 + sharded_cols + ["-"] * 2
            )
            continue
        hf = r.get("hf_export") or {}
        per_layout = {}
        for key in ("ckptq_decode", "library_decode"):
            cells = []
            for layout, v in ({} if "error" in hf else hf).items():
                d = v[key]
                if d["decoder"] is None:
                    cells.append(f"{layout}: n/a ({d['why']})")
                else:
                    cells.append(f"{layout}: " + ("same" if d["emb_equal"] else f"max|d| {d['emb_max_abs_diff']:.1e}"))
            per_layout[key] = ", ".join(cells) or ("error" if "error" in hf else "-")
        table.append(
            [
                r["format"],
                f"{r['native_bytes']:,}",
                f"{r['hp_bytes']:,}",
                f"{r['bf16_bytes']:,}",
                f"{r['native_over_bf16']:.3f}",
                f"{r['native_over_bf16_weights']:.3f}",
                f"{r['sqnr_db']:.2f}",
                r["bit_exact"],
                r["integrity"],
                f"{r['cos_mean']:.5f}",
                f"{r['cos_min']:.5f}",
                *sharded_cols,
                per_layout["ckptq_decode"],
                per_layout["library_decode"],
            ]
        )
    legend = [
        "B = bytes on disk of the whole checkpoint directory, whose other parameters are fp32 in all three;",
        "'weights native/bf16' counts the stored bytes of the 36 quantized weights only; 'checksums verified':",
        "records of the native checkpoint whose crc32c matched (`ckptq verify PATH`), and whether one flipped bit",
        "in a copy was caught on load (ChecksumMismatchError); emb cos: per sentence, embedding with the reloaded",
        "dequantized weights vs with the fp32 weights, over 16 sentences;",
        f"'{headers[11]}': saved by {SOURCE_RANKS} FSDP2 ranks, resharded offline to mesh {TARGET_MESH} "
        f"({TARGET_PLAN}),",
        "loaded by its ranks: weights whose every loaded component equals the same box of the weight quantized",
        "whole; 'plain unchanged': the other tensors (embeddings, LayerNorms, biases) equal to the originals"
        + (
            "; fp8_block is sharded with 1x128 blocks: 128x128 blocks cannot be cut at row 192"
            if "fp8_block" in formats
            else ""
        ),
        "'HF export': `ckptq export` to each Hugging Face layout holding the format, decoded by ckptq (the layout's",
        "formula) and by compressed-tensors' own dequantizers where installed; per layout, sentence embeddings vs",
        "those from ckptq's dequantized weights ('same' = bit-identical)",
    ]
    return headers, table, legend


def verdict(rows: list[dict]) -> tuple[int, str]:
    """The job's exit code and last line from the ``checks`` of its rows (one row per format, each
    with ``format`` and ``checks``: see :func:`check`).

    Returns ``(0, "PASSED: ...")`` when there is at least one check per row and every check holds,
    else ``(1, "FAILED: ...")`` naming the failed checks. The line fits :data:`COLUMNS`.
    """
    checks = [(r["format"], c) for r in rows for c in r.get("checks", [])]
    empty = [r["format"] for r in rows if not r.get("checks")]
    failed = [f"{fmt} {c['check']}" for fmt, c in checks if not c["ok"]] + [f"{fmt}: no check ran" for fmt in empty]
    if not rows:
        return 1, "FAILED: no format ran"
    if failed:
        return 1, _short(f"FAILED: {len(failed)} of {len(checks)} checks: {'; '.join(failed)}")
    return 0, _short(
        f"PASSED: {len(checks)}/{len(checks)} checks on {len(rows)} format{'s' if len(rows) > 1 else ''}: reloads + "
        f"{SOURCE_RANKS}->4 reshard bit-exact, bit flip caught, SQNR >= floor, HF decodes in bound"
    )


def _library_version() -> str:
    """The installed compressed-tensors version, or ``not installed``."""
    from importlib import metadata

    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of %(default)s")
    ap.add_argument("--verbose", action="store_true", help="also the inspect tables, step detail and the wide table")
    ap.add_argument("--json-out", type=Path, help="also write every result (rows, checks, tables) as JSON here")
    ap.add_argument("--keep", type=Path, help="write the checkpoints under this (new) directory and keep them")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"unknown format(s) {unknown}; choose from {list(FORMATS)}")
    global _VERBOSE
    _VERBOSE = args.verbose
    try:
        return _run(formats, args)
    except Exception as e:  # the job itself broke (model, work directory): still one verdict line
        traceback.print_exc()
        log(_short(f"FAILED: {type(e).__name__}: {e}"))
        return 1


def _run(formats: list[str], args) -> int:
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
    shapes = ", ".join(sorted({"x".join(map(str, orig[n].shape)) for n in names}))
    recipes = ", ".join(f"{f}{_recipe_label(f)}" for f in formats)
    spec = _target_layout()[0]
    log(
        f"model: sentence-transformers/all-MiniLM-L6-v2 ({len(orig)} fp32 tensors); fp32 sanity: paraphrase cos "
        f"{stats['paraphrase_mean']:.3f} vs unrelated {stats['unrelated_mean']:.3f}"
    )
    log(
        f"quantized: its {len(names)} Linear weights ({shapes}; {numel:,} elements); "
        f"the other {len(orig) - len(names)} stay fp32"
    )
    log(f"formats: {recipes}")
    log("per format, 1 process: quantize -> dcp.save native (atomic, crc32c) -> ckptq inspect -> reload -> ckptq")
    log("  verify, a flipped bit -> save high precision (bf16), load it with plain DCP -> embed 16 sentences with")
    log("  the reloaded weights -> ckptq export to each HF layout of the format -> decode it back by ckptq and by")
    log(f"  compressed-tensors' own dequantizers ({_library_version()})")
    log(
        f"sharded (gloo): {SOURCE_RANKS} ranks save FSDP2 Shard(0) DTensors -> ckptq reshard offline to mesh "
        f"{TARGET_MESH} ({TARGET_PLAN})"
    )
    log(
        f"  -> {spec.world_size} ranks load DTensors of those placements, compared byte for byte "
        "with the weights quantized whole"
    )

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
            "orig": orig,
            "names": names,
            "encoder": enc,
            "work": work,
            "numel": numel,
            "ref_emb": ref_emb,
            "bf16_bytes": dir_bytes(bf16),
            "bf16_weight_bytes": stored_bytes(bf16, names),
        }
        rows = []
        for fmt in formats:
            t1 = time.perf_counter()
            try:
                rows.append(run_format(fmt, FORMATS[fmt], ctx))
            except Exception as e:  # report and go on with the next format
                tb = traceback.format_exc()
                detail(tb)
                rows.append({"format": fmt, "checks": [check("steps 1-5", False, f"{type(e).__name__}: {e}")]})
                rows[-1]["traceback"] = tb
            cs = rows[-1]["checks"]
            log(f"  {fmt:<11}{time.perf_counter() - t1:6.1f} s  {sum(c['ok'] for c in cs)}/{len(cs)} checks passed")
        # steps 6-8, all formats at once; each row gets "sharded": {...}
        t1 = time.perf_counter()
        try:
            sharded = run_sharded(formats, ctx)
            tm = next(iter(sharded.values()))["timings"]
            log(
                f"  {'sharded':<11}{time.perf_counter() - t1:6.1f} s  save {tm['save_s']:.1f} s, reshard "
                f"{tm['reshard_s']:.1f} s, load {tm['load_s']:.1f} s (process starts included); "
                f"on {spec.world_size} ranks:"
            )
            log(_short(f"{'':13}{placement_summary(names, _target_layout()[1])}"))
        except Exception as e:  # a failed rank, save or reshard: every format fails
            tb = traceback.format_exc()
            detail(tb)
            log(_short(f"  {'sharded':<11}{time.perf_counter() - t1:6.1f} s  failed: {type(e).__name__}: {e}"))
            sharded = {fmt: {"error": f"{type(e).__name__}: {str(e)[-2000:]}", "traceback": tb} for fmt in formats}
        for r in rows:
            r["sharded"] = sharded[r["format"]]
            r["checks"].extend(sharded_checks(r["sharded"], r["format"]))
    finally:
        if cleanup is not None:
            cleanup.cleanup()
    elapsed = time.perf_counter() - t0

    headers, table, legend = wide_table(rows, formats)
    detail("\nEvery measurement:")
    for line in legend:
        detail(line)
    detail(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True))
    detail("\nChecks:")
    for r in rows:
        for c in r["checks"]:
            detail(f"  {'ok  ' if c['ok'] else 'FAIL'} {r['format']:<11} {c['check']}: {c['detail']}")

    summary = summary_table(rows)
    log("")
    log(text_table(SUMMARY_HEADERS, summary))
    for line in LEGEND:
        log(line)
    code, last = verdict(rows)
    n_checks = sum(len(r["checks"]) for r in rows)
    n_failed = sum(not c["ok"] for r in rows for c in r["checks"])
    log("")
    log(
        f"checks: {n_checks}, {n_failed} failed (per format: inspect, reloads, "
        f"checksums, bit flip, high precision, SQNR, HF decodes, {SOURCE_RANKS}->{spec.world_size} ranks)"
    )
    for r in rows:
        for c in r["checks"]:
            if not c["ok"]:
                log(_short(f"  FAILED {r['format']} {c['check']}: {c['detail']}"))
    log(
        _short(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.python_implementation()} "
            f"{platform.python_version()}; elapsed {elapsed:.1f} s; --verbose: inspect tables and every measurement"
        )
    )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(
            json.dumps(
                {
                    "model": "sentence-transformers/all-MiniLM-L6-v2",
                    "quantized_weights": len(names),
                    "quantized_elements": numel,
                    "sentences": len(bert.SENTENCES),
                    "elapsed_s": elapsed,
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "python": platform.python_version(),
                    "compressed_tensors": _library_version(),
                    "ok": code == 0,
                    "verdict": last,
                    "summary_headers": SUMMARY_HEADERS,
                    "summary_table": summary,
                    "summary_legend": LEGEND,
                    "headers": headers,
                    "table": table,
                    "legend": legend,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
        log(f"wrote {args.json_out}")
    log(last)
    return code


if __name__ == "__main__":
    sys.exit(main())

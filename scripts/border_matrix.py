"""The border table: producer -> ckptq -> consumer, per format and model dtype, every cell computed.

``python scripts/border_matrix.py [--dtypes bfloat16,float16,float32] [--formats fp8_tensor,fp8_block,fp8_row,mxfp8]
[--producers compressed-tensors,deepseek-style,ckptq] [--workdir DIR] [--json]``

Each row builds a tiny random Llama (transformers' own ``LlamaForCausalLM`` from a config, no download)
in the row's model dtype, then:

1. **producer**: writes a quantized folder with the producer's own code path
   (``compressed-tensors``: its ``apply_quantization_config``, ``calculate_qparams`` and
   ``ModelCompressor.compress_model`` + ``save_pretrained`` + ``update_config``, what llm-compressor runs
   around them, with the observer replaced by a plain min/max; ``deepseek-style``: no library writes
   DeepSeek FP8 on a CPU, so this script writes it as DeepSeek-V3's checkpoints are laid out, fp32
   ``weight_scale_inv`` = block amax / 448; ``ckptq``: ``ckptq.quantize`` of the weights saved natively
   with DCP, the model's config.json in the checkpoint folder);
2. **ckptq import**: ``reshard_checkpoint(folder, native, to="native")`` (a DCP checkpoint);
3. **export** back to the producer's layout (``ckptq``: to compressed-tensors and DeepSeek FP8) with
   ``export_checkpoint`` defaults; a refusal is a cell, and then the ``on_inexact`` choices it offers are
   run too;
4. **consumer**: transformers' ``AutoModelForCausalLM.from_pretrained(dst)`` with no arguments, one
   forward (compressed-tensors decompresses on the first one), and each weight compared as bytes with
   ckptq's dequantization of the native checkpoint in the loaded parameter's dtype.

Cells: ``bytes equal`` (every tensor of the producer's folder written back with the same name, dtype,
shape and bytes), ``decode equal`` (every loaded weight equals ckptq's dequantization), ``refused (why)``,
or ``DIFFERS (...)`` / ``consumer fails (...)`` -- which a correct ckptq never shows silently.

ModelOpt: no ModelOpt library runs here (nvidia-modelopt is not installed and its quantizers need CUDA),
so there is no ModelOpt producer row; transformers 5.x has no ModelOpt loader (vLLM / TensorRT-LLM read
it, neither runs here), and the ``ckptq -> modelopt`` rows show what transformers' default load does with
such a folder anyway (it loads the E4M3 codes unscaled), which ``ckptq export`` states when it writes one.
DeepSeek FP8 through transformers needs ``accelerate`` (else its cells read ``consumer fails (ImportError``).

Adding rows (NVFP4, torchao, ...): register a :class:`Producer` in ``PRODUCERS`` whose ``build`` writes
a folder for ``(fmt, dtype)`` and names the ckptq layout(s) to export to; the pipeline and the judge are
shared. ``tests/test_border_matrix.py`` runs a fast subset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
E4M3 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------- models
def tiny_llama(dtype: torch.dtype, seed: int = 0):
    """A random one-layer Llama whose Linear dims are multiples of 128 (FP8 blocks) and 32 (MXFP8)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=512,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    model.config.dtype = dtype  # what save_pretrained records (from_pretrained builds the model in it)
    return model


# ----------------------------------------------------------------------------------------- producers
@dataclasses.dataclass(frozen=True)
class Producer:
    """One producer: ``build(folder, fmt, dtype)`` writes its checkpoint for a ckptq format name;
    ``layouts``: the ckptq export layouts its rows go back to; ``foreign``: its folder is a Hugging
    Face folder whose tensors the export must reproduce byte for byte."""

    name: str
    formats: tuple[str, ...]
    layouts: tuple[str, ...]
    build: Callable[[Path, str, torch.dtype], None]
    foreign: bool = True


def _ct_minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min/max per the scheme's strategy (what llm-compressor's min-max observer reduces over)."""
    from compressed_tensors.quantization import QuantizationStrategy as S

    if args.strategy == S.TENSOR:
        return torch.aminmax(w)
    if args.strategy == S.CHANNEL:
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy in (S.GROUP, S.TENSOR_GROUP):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == S.BLOCK:
        bm, bk = args.block_structure
        b = w.reshape(w.shape[0] // bm, bm, w.shape[1] // bk, bk)
        return b.amin((1, 3)), b.amax((1, 3))
    raise ValueError(f"strategy {args.strategy}")


#: the compressed-tensors preset scheme of each row's format (``fp8_row``: ckptq's fp8_block with a
#: (1, K) block, compressed-tensors' per-channel FP8, as its FP8_DYNAMIC preset writes the weights)
_CT_PRESET = {
    "fp8_tensor": "FP8",
    "fp8_block": "FP8_BLOCK",
    "mxfp8": "MXFP8",
    "fp8_row": "FP8_DYNAMIC",
    "nvfp4": "NVFP4A16",
}
#: the ckptq format (and recipe) of a row's format name
CKPTQ_FORMAT = {"fp8_row": "fp8_block"}


def build_compressed_tensors(folder: Path, fmt: str, dtype: torch.dtype) -> None:
    """A compressed-tensors folder written by compressed-tensors' own code (weights only, as
    llm-compressor's ``QuantizationModifier`` with a min-max observer)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    model = tiny_llama(dtype)
    scheme = preset_name_to_scheme(_CT_PRESET[fmt], ["Linear"])
    scheme.input_activations = None  # weight-only: ckptq keeps weights
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            args = module.quantization_scheme.weights
            mn, mx = _ct_minmax(module.weight.data, args)
            gs = None
            if hasattr(module, "weight_global_scale"):  # NVFP4: the tensor's global scale first
                gs = generate_gparam(*torch.aminmax(module.weight.data))
                module.weight_global_scale.data.copy_(gs)
            scale, _ = calculate_qparams(mn, mx, args, global_scale=gs)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def build_deepseek_style(folder: Path, fmt: str, dtype: torch.dtype) -> None:
    """DeepSeek-V3's layout: E4M3 ``weight`` and fp32 ``weight_scale_inv`` (block amax / 448) per
    128x128 block, ``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``."""
    from safetensors.torch import save_file

    model = tiny_llama(dtype)
    out = {}
    for name, t in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith("proj.weight"):
            m, k = t.shape
            b = t.float().reshape(m // 128, 128, k // 128, 128)
            s = (b.abs().amax((1, 3)) / 448.0).clamp_min(1e-12)
            out[name] = (b / s[:, None, :, None]).reshape(m, k).to(E4M3)
            out[f"{mod}.weight_scale_inv"] = s
        else:
            out[name] = t.contiguous()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(model.config.to_json_string())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (folder / "config.json").write_text(json.dumps(cfg))


def build_ckptq(folder: Path, fmt: str, dtype: torch.dtype) -> None:
    """ckptq's own checkpoint: every ``*proj.weight`` quantized with ckptq's default recipe, saved
    natively by DCP, and the model's config.json saved into the checkpoint folder."""
    import torch.distributed.checkpoint as dcp

    import ckptq

    model = tiny_llama(dtype)

    def q(v):
        if fmt == "fp8_row":
            return ckptq.quantize(v, "fp8_block", block=(1, v.shape[-1]))
        return ckptq.quantize(v, fmt)

    sd = {k: q(v) if k.endswith("proj.weight") else v for k, v in model.state_dict().items()}
    dcp.save(sd, storage_writer=ckptq.io.AtomicFileSystemWriter(str(folder)), planner=ckptq.QuantizedSavePlanner())
    model.config.save_pretrained(folder)


PRODUCERS: list[Producer] = [
    Producer(
        "compressed-tensors",
        ("fp8_tensor", "fp8_block", "fp8_row", "mxfp8", "nvfp4"),
        ("compressed-tensors",),
        build_compressed_tensors,
    ),
    Producer("deepseek-style", ("fp8_block",), ("deepseek-fp8",), build_deepseek_style),
    Producer(
        "ckptq",
        ("fp8_tensor", "fp8_block", "fp8_row", "mxfp8"),
        ("compressed-tensors", "deepseek-fp8", "modelopt"),
        build_ckptq,
        foreign=False,
    ),
]


# ----------------------------------------------------------------------------------------- judging
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def bytes_equal(src: Path, dst: Path) -> str | None:
    """None when every tensor of ``src`` is in ``dst`` with the same dtype, shape and bytes, else what differs."""
    a, b = _read_folder(src), _read_folder(dst)
    for k, t in a.items():
        u = b.get(k)
        if u is None:
            return f"'{k}' missing"
        if u.dtype != t.dtype or u.shape != t.shape:
            return f"'{k}' {t.dtype} {tuple(t.shape)} -> {u.dtype} {tuple(u.shape)}"
        if not torch.equal(_bits(t), _bits(u)):
            return f"'{k}' bytes differ"
    return None


def consumer_verdict(dst: Path, native: Path) -> str:
    """transformers' default load of ``dst`` against ckptq's dequantization of ``native``."""
    from transformers import AutoModelForCausalLM

    from ckptq.checkpoint import open_checkpoint
    from ckptq.formats.base import QuantizedTensor

    try:
        model = AutoModelForCausalLM.from_pretrained(str(dst))
        model(input_ids=torch.zeros(1, 2, dtype=torch.long))  # compressed-tensors decompresses here
    except Exception as e:  # the consumer's own failure is the verdict
        return f"consumer fails ({type(e).__name__}: {str(e).splitlines()[0][:90]})"
    params = model.state_dict()
    view = open_checkpoint(native)
    bad, worst, n = [], 0.0, 0
    for e in view.entries():
        if e.kind == "bytes" or e.fqn not in params:
            continue
        p = params[e.fqn]
        x = view.read(e.fqn)
        ours = x.dequantize(p.dtype) if isinstance(x, QuantizedTensor) else x.to(p.dtype)
        n += 1
        if p.dtype != ours.dtype or not torch.equal(_bits(p), _bits(ours)):
            bad.append(e.fqn)
            if p.dtype == ours.dtype:
                worst = max(worst, float((p.float() - ours.float()).abs().max()))
    if bad:
        return f"DIFFERS ({len(bad)}/{n} weights, max abs diff {worst:.3g}, e.g. {bad[0]})"
    return "decode equal"


def run_row(prod: Producer, fmt: str, dtype_name: str, layout: str, work: Path) -> str:
    """One cell: producer -> ckptq import (native DCP) -> export -> transformers default load."""
    from ckptq.errors import CkptqError
    from ckptq.export import export_checkpoint
    from ckptq.reshard import ReshardOptions, reshard_checkpoint

    dtype = DTYPES[dtype_name]
    base = work / f"{prod.name}-{fmt}-{dtype_name}-{layout}"
    src, native = base / "src", base / "native"
    src.mkdir(parents=True)
    try:
        prod.build(src, fmt, dtype)
    except Exception as e:
        return f"producer fails ({type(e).__name__}: {str(e)[:80]})"
    try:
        if prod.foreign:
            reshard_checkpoint(src, native, ReshardOptions(to="native"))
            (native / "config.json").write_text((src / "config.json").read_text())
        else:
            native = src
    except CkptqError as e:
        return f"refused by import ({str(e)[:160]})"

    refusal = ""

    def export(dst: Path, **kw) -> str:
        nonlocal refusal
        try:
            res = export_checkpoint(native, dst, layout=layout, **kw)
        except CkptqError as e:
            refusal = str(e)
            return "refused (" + refusal.split(": ", 1)[-1].split("; ")[0].split(". Exact")[0][:200] + ")"
        sq = res["consumer"]["requantized_sqnr_db"]
        # requantized: the reference is ckptq's dequantization of what was written (the new values)
        verdict = consumer_verdict(dst, dst if sq else native)
        if layout == "modelopt":  # transformers has no ModelOpt loader: what it does anyway, for the record
            return f"not a transformers layout (its default load: {verdict}); vLLM / TensorRT-LLM read it, not run here"
        if sq:
            verdict += f" (of the requantized values, {min(sq.values()):.1f} dB vs the source)"
        if prod.foreign and verdict == "decode equal" and not kw:
            why = bytes_equal(src, dst)
            return "bytes equal, decode equal" if why is None else f"decode equal (bytes: {why})"
        return verdict

    cell = export(base / "dst")
    if "--on-inexact float32" in refusal:  # the exact choices the refusal offers, judged the same way
        for choice in ("float32", "requantize"):
            cell += f"; --on-inexact {choice}: " + export(base / f"dst-{choice}", on_inexact=choice)
    if cell.startswith("refused") and prod.foreign:  # and the producer's own folder, as it is
        cell += "; the producer's folder itself: " + consumer_verdict(src, native)
    return cell


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "compressed-tensors", "accelerate", "safetensors"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    from ckptq._version import __version__

    out["ckptq"] = __version__
    return out


def run_matrix(producers, formats, dtypes, work: Path) -> list[dict]:
    from ckptq.adapters.hf import LAYOUTS

    rows = []
    for prod in PRODUCERS:
        if prod.name not in producers:
            continue
        for fmt in prod.formats:
            if fmt not in formats:
                continue
            for layout in prod.layouts:
                if LAYOUTS[layout].format_map(CKPTQ_FORMAT.get(fmt, fmt)) is None:
                    continue
                if fmt == "fp8_row" and layout != "compressed-tensors":  # (1, K) blocks: compressed-tensors only
                    continue
                for dt in dtypes:
                    cell = run_row(prod, fmt, dt, layout, work)
                    rows.append({"producer": prod.name, "format": fmt, "layout": layout, "dtype": dt, "cell": cell})
    return rows


def markdown(rows: list[dict], vers: dict[str, str]) -> str:
    lines = [
        "Library versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "",
        "| producer | format | export layout | model dtype | producer -> ckptq -> consumer |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['producer']} | {r['format']} | {r['layout']} | {r['dtype']} | {r['cell']} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--formats", default="fp8_tensor,fp8_block,fp8_row,mxfp8")
    ap.add_argument("--producers", default=",".join(p.name for p in PRODUCERS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="border-"))
    try:
        rows = run_matrix(args.producers.split(","), args.formats.split(","), args.dtypes.split(","), work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    vers = versions()
    print(json.dumps({"versions": vers, "rows": rows}, indent=2) if args.json else markdown(rows, vers))
    return 0 if not any(r["cell"].startswith(("DIFFERS", "consumer fails")) for r in rows) else 1  # silent ones


if __name__ == "__main__":
    sys.exit(main())

"""Export a checkpoint to a Hugging Face safetensors folder a serving engine loads (``ckptq export``).

:func:`export_checkpoint` reads any source :func:`ckptq.checkpoint.open_checkpoint` opens (a ckptq /
DCP checkpoint, a safetensors folder, ...) one tensor at a time and writes, for a layout of
:mod:`ckptq.adapters.hf` (``modelopt``, ``compressed-tensors``, ``deepseek-fp8``, ``deepseek-v4``,
``gpt-oss``):

* sharded ``model-0000x-of-0000N.safetensors`` (each quantized weight's tensors in one shard) and
  ``model.safetensors.index.json``;
* ``config.json`` with the layout's ``quantization_config`` (merged into the base config: ``config=``,
  else the source folder's ``config.json``), and ``hf_quant_config.json`` for ModelOpt;
* quantized weights in the layout's tensor names and dtypes; tensors matching ``ignore`` and every
  other floating tensor in bf16 (activation / KV scales another producer stored stay as they are).

Each shard's header is written from the plan (names, dtypes, shapes are known before any data is
read), then the tensors stream in one at a time. Output goes to a temporary sibling folder renamed
into place; nothing is left at ``dst`` on error.

Names: the HF name of a weight ``<module>.weight`` is the training FQN (identity); ``names`` rename
rules ``["SRC=DST", ...]`` (``*`` globs, :func:`ckptq.adapters.hf.parse_rename_rules`) map training
FQNs to HF names, e.g. ``"*=model.*"`` prefixes every name with ``model.``. A quantized tensor whose
name does not end in ``.weight`` is written as ``<name>.weight`` (+ the layout's suffixes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import adapters
from .adapters import hf
from .checkpoint import open_checkpoint
from .checksums import SAFETENSORS_KEY, Hasher, safetensors_table
from .errors import CkptqError, UnsupportedFormatError, UsageError
from .formats import requantize
from .formats.base import QuantizedTensor
from .io.writer import check_destination, commit_dir, staging_dir

__all__ = ["export_checkpoint", "parse_size", "LAYOUT_NAMES"]

LAYOUT_NAMES = tuple(hf.LAYOUTS)
_ST_NAME = {v: k for k, v in hf.ST_DTYPES.items()}


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000000"`` or an int -> bytes; UsageError otherwise."""
    if isinstance(text, int) and text > 0:
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise UsageError(f"{flag}: cannot parse '{text}'; write a size like 5GB, 500MB or 1000000")
    base = 1024 if m.group(3) else 1000
    n = float(m.group(1)) * base ** " KMGT".index((m.group(2) or " ").upper())
    if n < 1:
        raise UsageError(f"{flag}: '{text}' is not a positive size")
    return int(n)


def _parse_layout(layout: str) -> hf.HFLayout:
    if layout not in hf.LAYOUTS:
        flat = [a.producer for a in adapters.registered() if a.safetensors_flatten is not None]
        raise UsageError(f"--layout: unknown layout '{layout}'; choose one of {list(hf.LAYOUTS) + flat}")
    return hf.LAYOUTS[layout]


def _parse_format(lay: hf.HFLayout, fmt: str | None) -> str | None:
    if fmt is None:
        return None
    fmt = fmt.replace("-", "_")
    allowed = [f.format for f in lay.formats]
    if fmt not in allowed:
        raise UsageError(f"--format: layout '{lay.name}' holds {allowed}, not '{fmt}'")
    return fmt


# --------------------------------------------------------------------------------------- planning
class _ExportEntry:
    """One source entry and what it becomes."""

    def __init__(self, fqn, kind, out_names, fm=None, module=None, recipe=None, fmt=None, requant=False):
        self.fqn, self.kind, self.out_names = fqn, kind, out_names  # out_names: [(name, dtype, shape)]
        self.fm, self.module, self.recipe, self.fmt, self.requant = fm, module, recipe, fmt, requant

    @property
    def nbytes(self) -> int:
        import math

        return sum(math.prod(s) * d.itemsize for _, d, s in self.out_names)


def _layout_recipe(fm: hf.FormatMap) -> dict:
    from .formats.base import dtype_to_str

    out: dict[str, Any] = {}
    for field, (allowed, _) in fm.requires.items():
        v = allowed[0]
        out[field] = dtype_to_str(v) if isinstance(v, torch.dtype) else (list(v) if isinstance(v, tuple) else v)
    return out


def _plan(view, lay, fmt, ignore, rules) -> tuple[list[_ExportEntry], list[str]]:
    items: list[_ExportEntry] = []
    skipped: list[str] = []
    seen: dict[str, str] = {}
    for e in view.entries():
        name = hf.rename(e.fqn, rules)
        if e.kind == "bytes":
            skipped.append(e.fqn)
            continue
        ignored = hf.glob_matches(e.fqn, ignore) or hf.glob_matches(name, ignore)
        quantize_plain = (
            fmt is not None
            and e.kind == "tensor"
            and not ignored
            and e.fqn.endswith(".weight")
            and len(e.shape) >= 2
            and e.dtype is not None
            and e.dtype.is_floating_point
            and e.dtype.itemsize >= 2
            and e.fqn.rsplit(".", 1)[-1] not in hf.AUX_SUFFIXES
        )
        if (e.kind == "quantized" and not ignored) or quantize_plain:
            module = lay.module_of(name)
            target = fmt or e.format
            fm = lay.format_map(target)
            src_recipe = dict(e.descriptor.recipe) if e.kind == "quantized" else {}
            if fmt is None:
                hf.check_exportable(fm, lay, e.fqn, target, src_recipe, e.shape)
                recipe, requant = src_recipe, False
            else:
                keep = e.kind == "quantized" and e.format == fmt
                if keep:
                    try:
                        hf.check_exportable(fm, lay, e.fqn, target, src_recipe, e.shape)
                    except UnsupportedFormatError:
                        keep = False
                recipe = src_recipe if keep else _layout_recipe(fm)
                hf.check_exportable(fm, lay, e.fqn, target, {**_default_recipe(target), **recipe}, e.shape)
                requant = not keep
            out = hf.export_plan(fm, module, e.shape, {**_default_recipe(target), **recipe})
            items.append(_ExportEntry(e.fqn, "quantized", out, fm, module, recipe, target, requant))
        elif hf.convert_act_scale(name, lay.name) is not None and e.kind == "tensor":
            new, fn = hf.convert_act_scale(name, lay.name)
            if fn is None:
                skipped.append(e.fqn)  # the layout has no static activation scale
                continue
            shape = tuple(hf.ACT_SCALE[lay.name][2])
            items.append(_ExportEntry(e.fqn, "tensor", [(new, torch.float32, shape)], fm=fn))
        else:
            dtype = e.dtype
            if e.kind == "quantized":
                dtype = torch.bfloat16
            elif (
                dtype is not None
                and dtype.is_floating_point
                and name.rsplit(".", 1)[-1] not in hf.AUX_SUFFIXES
                and lay.plain_dtype is not None
            ):
                dtype = lay.plain_dtype
            items.append(_ExportEntry(e.fqn, "tensor", [(name, dtype, tuple(e.shape))]))
        for n, _, _ in items[-1].out_names:
            if n in seen:
                raise CkptqError(
                    f"output tensor '{n}' would come from both '{seen[n]}' and '{e.fqn}'; fix the "
                    f"rename rules (names=/--rename)"
                )
            seen[n] = e.fqn
    return items, skipped


def _default_recipe(fmt: str) -> dict:
    from .formats import format_class

    cls = format_class(fmt)
    return cls._recipe_to_json(cls.Recipe())


def _shards(items: list[_ExportEntry], max_bytes: int) -> list[list[_ExportEntry]]:
    shards: list[list[_ExportEntry]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards if shards[0] else []


# --------------------------------------------------------------------------------------- writing
def _header(entries: list[tuple[str, torch.dtype, tuple]], metadata: dict) -> bytes:
    import math

    head: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        head[name] = {"dtype": _ST_NAME[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _write_tensor(f, t: torch.Tensor) -> int:
    flat = t.contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    arr = flat.numpy()
    f.write(memoryview(arr))
    return arr.nbytes


def _values(view, it: _ExportEntry):
    x = view.read(it.fqn)
    if it.kind == "tensor" and callable(it.fm):  # an activation scale, renamed / inverted for the layout
        return {it.out_names[0][0]: it.fm(x)}, {}, {}
    if it.kind == "tensor":
        dtype = it.out_names[0][1]
        if isinstance(x, QuantizedTensor):
            return {it.out_names[0][0]: x.dequantize(dtype)}, {}, {}
        return {it.out_names[0][0]: x if x.dtype == dtype else x.to(dtype)}, {}, {}
    if it.requant:
        opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in it.recipe.items()}
        if "fp8_dtype" in opts and isinstance(opts["fp8_dtype"], str):
            from .formats.base import str_to_dtype

            opts["fp8_dtype"] = str_to_dtype(opts["fp8_dtype"])
        src = x if isinstance(x, QuantizedTensor) else x
        x = requantize(src, it.fmt, **opts)
    return hf.export_tensors(it.fm, it.module, x)


def _base_config(src: Path, config: Any) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if config is not None:
        p = Path(config)
    else:
        folder = src if src.is_dir() else src.parent
        p = folder / "config.json"
        if not p.is_file():
            return {}
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CkptqError(f"{p}: cannot read the base config ({e}); pass config= / --config a valid config.json") from e


def export_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    layout: str,
    format: str | None = None,
    ignore: Sequence[str] = hf.DEFAULT_IGNORE,
    max_shard_size: str | int = "5GB",
    names: Any = None,
    config: Any = None,
    overwrite: bool = False,
    progress: bool | Callable[[int], None] | None = None,
) -> dict:
    """Write checkpoint ``src`` as a Hugging Face safetensors folder ``dst`` in ``layout``.

    Args:
        src: any checkpoint :func:`ckptq.checkpoint.open_checkpoint` reads.
        dst: the output folder (new; an existing one needs ``overwrite``).
        layout: ``"modelopt"``, ``"compressed-tensors"``, ``"deepseek-fp8"``, ``"deepseek-v4"`` (MXFP4
            experts + E8M0-scaled 128x128 FP8) or ``"gpt-oss"`` (3-D MXFP4 experts as ``*_blocks`` /
            ``*_scales``; the weight's name is the module parameter's, e.g. ``...experts.gate_up_proj``);
            or ``"torchao"``: torchao's own safetensors form (:func:`export_flattened`; ``format`` and
            ``ignore`` do not apply).
        format: requantize every quantized tensor (and every plain floating ``*.weight`` of rank >= 2
            not ignored) to this ckptq format with :func:`ckptq.requantize` first (tensors already in
            it with a recipe the layout holds are kept bit-exact); None: each quantized tensor in its
            own format (an error if the layout cannot hold it), plain tensors in bf16.
        ignore: fnmatch globs of FQNs / HF names (or their module paths) kept in bf16.
            Activation scales a source carries (ModelOpt ``input_scale`` = amax/2688,
            compressed-tensors ``input_global_scale`` = 2688/amax) are renamed and inverted for the
            layout (fp32 ``1/x``), dropped (listed in ``skipped``) for DeepSeek; KV-cache scales stay.
        max_shard_size: bytes per shard (``"5GB"``, ``"500MB"``, an int); a weight's tensors share a shard.
        names: rename rules training FQN -> HF name (``["SRC=DST"]`` or ``{SRC: DST}``); default identity.
        config: base ``config.json`` (a path or a dict) to add ``quantization_config`` to; default the
            source folder's ``config.json`` if any.
        overwrite: replace an existing ``dst``.
        progress: ``True`` for a tqdm bar on stderr, or a callable given the bytes of each tensor written.

    Returns:
        ``{"path", "layout", "files", "bytes", "tensors", "quantized": {fqn: format}, "requantized":
        [fqn], "high_precision": [fqn], "skipped": [fqn], "numerics": {fqn: max fp32 ulps between the
        layout consumer's decode and ckptq's (NVFP4; 0 = bit-exact)}, "config_files": [...]}``.

    Raises:
        UsageError: an unknown layout or format, a size or rename rule that does not parse.
        UnsupportedFormatError: a tensor the layout cannot hold (names it and the fix).
        CkptqError: ``dst`` exists (without ``overwrite``) or overlaps ``src``; nothing is written.
    """
    flat = adapters.flattening(layout)
    if flat is not None:
        if format is not None:
            raise UsageError(f"--format does not apply to --layout {layout}; convert the checkpoint with --to first")
        return export_flattened(src, dst, flat, max_shard_size, names, overwrite, progress)
    lay = _parse_layout(layout)
    fmt = _parse_format(lay, format)
    max_bytes = parse_size(max_shard_size)
    try:
        rules = hf.parse_rename_rules(names)
    except ValueError as e:
        raise UsageError(f"--rename: {e}") from None
    ignore = tuple(ignore or ())
    view = open_checkpoint(src)
    dst = Path(dst).absolute()
    srcp = Path(view.path).absolute()
    check_destination(srcp, dst, overwrite)
    items, skipped = _plan(view, lay, fmt, ignore, rules)
    base = _base_config(srcp, config)
    shards = _shards(items, max_bytes)
    n = len(shards)
    total = sum(it.nbytes for it in items)
    if progress is True:
        from tqdm import tqdm

        with tqdm(total=total, unit="B", unit_scale=True, desc="exporting", leave=False) as bar:
            return _run(view, lay, dst, shards, n, base, items, skipped, overwrite, bar.update)
    return _run(view, lay, dst, shards, n, base, items, skipped, overwrite, progress or None)


def _run(view, lay, dst: Path, shards, n, base, items, skipped, overwrite, progress) -> dict:
    tmp = staging_dir(dst)
    weight_map: dict[str, str] = {}
    numerics: dict[str, int] = {}
    files = []
    written = 0
    try:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            files.append(fname)
            entries = [o for it in shard for o in it.out_names]
            meta_keys = {  # room for the amax records (fixed width), filled in as the tensors are written
                hf.amax_metadata_key(name): hf.encode_amax(torch.zeros(tuple(it.out_names[0][2][:-2])))
                for it in shard
                if it.kind == "quantized"
                for name in hf.amax_record_names(it.fm, it.module, it.recipe)
            }
            metadata = {
                "format": "pt",
                **meta_keys,
                SAFETENSORS_KEY: safetensors_table({name: 0 for name, _, _ in entries}),
            }
            header = _header(entries, metadata)
            hasher = Hasher()
            with open(tmp / fname, "wb", buffering=0) as f:
                f.write(header)
                for it in shard:
                    tensors, meta, info = _values(view, it)
                    for name, dtype, shape in it.out_names:
                        t = tensors[name]
                        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                            raise CkptqError(
                                f"internal: '{name}' is {t.dtype} {tuple(t.shape)}, planned {dtype} {shape}"
                            )
                        written += _write_tensor(f, t)
                        hasher.submit(name, t)
                        weight_map[name] = fname
                    metadata.update(meta)
                    if "max_ulps" in info:
                        numerics[it.fqn] = info["max_ulps"]
                    if progress:
                        progress(it.nbytes)
                    del tensors
                metadata[SAFETENSORS_KEY] = safetensors_table(hasher.results())
                final = _header(entries, metadata)
                if len(final) != len(header):
                    raise CkptqError("internal: shard header changed size")
                f.seek(0)
                f.write(final)
        with open(tmp / "model.safetensors.index.json", "w") as f:
            json.dump(
                {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2
            )
        used = {it.module: it.fm for it in items if it.kind == "quantized"}
        ignored_modules = sorted(
            {
                name[: -len(".weight")]
                for it in items
                if it.kind == "tensor"
                for name, _, shape in it.out_names
                if name.endswith(".weight")
            }
        )
        cfg_files = lay.write_config(used, ignored_modules)
        out_cfg = {k: v for k, v in base.items() if k != "quantization_config"}
        out_cfg.setdefault("torch_dtype", "bfloat16")
        out_cfg["quantization_config"] = cfg_files["config.json"]["quantization_config"]
        for name, content in {**cfg_files, "config.json": out_cfg}.items():
            with open(tmp / name, "w") as f:
                json.dump(content, f, indent=2, sort_keys=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, dst)
    return {
        "path": str(dst),
        "layout": lay.name,
        "files": files,
        "bytes": written,
        "tensors": len(weight_map),
        "quantized": {it.fqn: it.fmt for it in items if it.kind == "quantized"},
        "requantized": [it.fqn for it in items if it.kind == "quantized" and it.requant],
        "high_precision": [it.fqn for it in items if it.kind == "tensor"],
        "skipped": skipped,
        "numerics": numerics,
        "config_files": sorted({*cfg_files, "config.json"}),
    }


def export_flattened(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    adapter: adapters.Adapter,
    max_shard_size: str | int = "5GB",
    names: Any = None,
    overwrite: bool = False,
    progress: bool | Callable[[int], None] | None = None,
) -> dict:
    """Write ``src`` as safetensors files in a library's own flattened form (``adapter``'s
    ``safetensors_flatten``; torchao: what its ``flatten_tensor_state_dict`` writes, read back by its
    ``unflatten_tensor_state_dict``): quantized tensors as the adapter flattens them, plain ones as
    stored, each file's ``__metadata__`` describing its tensors (``tensor_names``) plus ckptq's
    checksum table, and a ``model.safetensors.index.json`` when there are several files.

    Returns the dict of :func:`export_checkpoint` (``layout`` the producer's name, no config files).
    Raises as :func:`export_checkpoint`, and UnsupportedFormatError for a tensor the library's
    classes cannot hold (names it).
    """
    import json as _json

    from safetensors.torch import save_file

    from .checksums import checksum

    max_bytes = parse_size(max_shard_size)
    try:
        rules = hf.parse_rename_rules(names)
    except ValueError as e:
        raise UsageError(f"--rename: {e}") from None
    view = open_checkpoint(src)
    dst = Path(dst).absolute()
    check_destination(Path(view.path).absolute(), dst, overwrite)
    if progress is True:
        progress = None  # one pass over whole tensors; the caller's callable still gets the bytes
    tmp = staging_dir(dst)
    shards: list[tuple[dict, dict]] = [({}, {})]
    numerics: dict[str, int] = {}
    quantized: dict[str, str] = {}
    plain, skipped = [], []
    written = 0
    try:
        for e in view.entries():
            if e.kind == "bytes":
                skipped.append(e.fqn)
                continue
            name = hf.rename(e.fqn, rules)
            x = view.read(e.fqn)
            if isinstance(x, QuantizedTensor):
                producer = e.descriptor.producer if e.descriptor is not None else None
                tensors, record, info = adapter.safetensors_flatten(name, x, producer)
                quantized[e.fqn] = x.FORMAT
                if "max_ulps" in info:
                    numerics[e.fqn] = info["max_ulps"]
            else:
                tensors, record = {name: x.contiguous()}, _json.dumps({"_type": "Tensor"})
                plain.append(e.fqn)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            data, meta = shards[-1]
            if data and sum(t.numel() * t.element_size() for t in data.values()) + size > max_bytes:
                shards.append(({}, {}))
                data, meta = shards[-1]
            data.update(tensors)
            meta[name] = record
            written += size
            if callable(progress):
                progress(size)
        files, weight_map = [], {}
        for i, (data, meta) in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            metadata = {
                "format": "pt",
                **meta,
                "tensor_names": _json.dumps(list(meta)),
                SAFETENSORS_KEY: safetensors_table({n: checksum(t) for n, t in data.items()}),
            }
            save_file(data, str(tmp / fname), metadata=metadata)
            files.append(fname)
            weight_map.update(dict.fromkeys(data, fname))
        if len(files) > 1:
            with open(tmp / "model.safetensors.index.json", "w") as f:
                _json.dump({"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}, f)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, dst)
    return {
        "path": str(dst),
        "layout": adapter.producer,
        "files": files,
        "bytes": written,
        "tensors": len(weight_map),
        "quantized": quantized,
        "requantized": [],
        "high_precision": plain,
        "skipped": skipped,
        "numerics": numerics,
        "config_files": [],
    }

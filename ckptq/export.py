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
  other floating tensor in the model config's dtype (bf16 without one: the dtype transformers builds
  the model in, so nothing the consumer keeps is lost; activation / KV scales another producer stored
  stay as they are).

Each shard's header is written from the plan (names, dtypes, shapes are known before any data is
read), then the tensors stream in one at a time. Output goes to a temporary sibling folder renamed
into place; nothing is left at ``dst`` on error.

Names: the HF name of a weight ``<module>.weight`` is the training FQN (identity); ``names`` rename
rules ``["SRC=DST", ...]`` (``*`` globs, :func:`ckptq.adapters.hf.parse_rename_rules`) map training
FQNs to HF names, e.g. ``"*=model.*"`` prefixes every name with ``model.``. A quantized tensor whose
name does not end in ``.weight`` is written as ``<name>.weight`` (+ the layout's suffixes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import adapters
from .adapters import hf
from .checkpoint import open_checkpoint
from .checksums import SAFETENSORS_KEY, Hasher, safetensors_table
from .distributed import Group, expect_shared_dir, prepare_write_commit
from .errors import CkptqError, UnsupportedFormatError, UsageError
from .formats import requantize
from .formats.base import QuantizedTensor, dtype_to_str, str_to_dtype
from .io import storage
from .io.device import device_scope, prefetch, resolve_device, to_host
from .io.fileio import DEFAULT_SYNC_EVERY, Flusher
from .io.writer import check_destination, commit_dir, staging_dir, write_error
from .metrics import sqnr_db

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
    allowed = lay.format_names()
    if fmt not in allowed:
        raise UsageError(f"--format: layout '{lay.name}' holds {allowed}, not '{fmt}'")
    return fmt


# --------------------------------------------------------------------------------------- planning
class _ExportEntry:
    """One source entry and what it becomes."""

    def __init__(self, fqn, kind, out_names, fm=None, module=None, recipe=None, fmt=None, requant=False, stored=None):
        self.fqn, self.kind, self.out_names = fqn, kind, out_names  # out_names: [(name, dtype, shape)]
        self.fm, self.module, self.recipe, self.fmt, self.requant = fm, module, recipe, fmt, requant
        self.stored = stored or {}  # {suffix: (dtype, shape)} the source's producer record keeps

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


def _plan(view, lay, fmt, ignore, rules, plain_dtype: torch.dtype) -> tuple[list[_ExportEntry], list[str]]:
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
            src_recipe = dict(e.descriptor.recipe) if e.kind == "quantized" else {}
            fm = lay.format_map(target, src_recipe, e.shape)
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
            stored = {} if requant else hf.stored_layout(fm, e.descriptor.producer, lay)
            out = hf.export_plan(fm, module, e.shape, {**_default_recipe(target), **recipe}, stored)
            items.append(_ExportEntry(e.fqn, "quantized", out, fm, module, recipe, target, requant, stored))
        elif hf.convert_act_scale(name, lay.name) is not None and e.kind == "tensor":
            new, fn = hf.convert_act_scale(name, lay.name)
            if fn is None:
                skipped.append(e.fqn)  # the layout has no static activation scale
                continue
            shape = tuple(hf.ACT_SCALE[lay.name][2])
            items.append(_ExportEntry(e.fqn, "tensor", [(new, torch.float32, shape)], fm=fn))
        else:
            dtype = e.dtype
            if e.kind == "quantized" or (
                dtype is not None
                and dtype.is_floating_point
                and name.rsplit(".", 1)[-1] not in hf.AUX_SUFFIXES
                and not lay.keeps_plain_dtype
            ):
                dtype = plain_dtype
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


def _computes(it: _ExportEntry, x: Any) -> bool:
    """Whether :func:`_values` runs kernels on ``x`` (dequantizes or quantizes it): worth the device."""
    if it.kind == "tensor":
        return not callable(it.fm) and isinstance(x, QuantizedTensor)
    return it.requant


def _open_out(path: Any) -> Any:
    """A shard file opened for writing: unbuffered locally (its header is rewritten in place),
    a streamed multipart upload on an object store."""
    return storage.open_file(path, "wb") if storage.is_url(path) else open(path, "wb", buffering=0)


def _final_header(view, shard, consumer: _Consumer, entries, metadata: dict, hasher: Hasher, device) -> bytes:
    """The shard's header with its checksums and amax records, from computing its values once
    without writing them (for outputs that cannot be rewritten in place: the values are computed
    again as they are written, deterministically; on every device the same bytes)."""
    with contextlib.closing(_shard_values(view, shard, consumer, device)) as values:
        for it, tensors, meta, _ in values:
            for name, _, _ in it.out_names:
                hasher.submit(name, tensors[name])
            metadata.update(meta)
            del tensors
    metadata[SAFETENSORS_KEY] = safetensors_table(hasher.results())
    return _header(entries, metadata)


def _shard_values(view, shard: list[_ExportEntry], consumer: _Consumer, device):
    """Yield ``(it, tensors, metadata, info)`` (:func:`_values`) for each entry of ``shard`` in order,
    computed on ``device``; the next entry's source is read on a thread meanwhile
    (:func:`ckptq.io.device.prefetch`; closing this generator stops that thread)."""
    if hasattr(view, "will_read"):  # the disk reads the next entries while this one is computed and written
        view.will_read([it.fqn for it in shard])
    stream = prefetch(shard, lambda it: view.read(it.fqn), device=device, wants_device=_computes)
    try:
        for it, x in stream:
            with device_scope(device):
                out = _values(x, it, consumer)
            del x
            yield (it, *out)
    finally:
        stream.close()


def _values(x, it: _ExportEntry, consumer: _Consumer):
    """The layout's tensors of entry ``it`` from its source value ``x`` (on the host, or on the CUDA
    device of ``--device`` where :func:`_computes`: the kernels run there, the results come back)."""
    if it.kind == "tensor" and callable(it.fm):  # an activation scale, renamed / inverted for the layout
        return {it.out_names[0][0]: it.fm(to_host(x))}, {}, {}
    if it.kind == "tensor":
        dtype = it.out_names[0][1]
        if isinstance(x, QuantizedTensor):
            return {it.out_names[0][0]: to_host(x.dequantize(dtype))}, {}, {}
        return {it.out_names[0][0]: x if x.dtype == dtype else x.to(dtype)}, {}, {}
    if it.requant:
        x = to_host(requantize(x, it.fmt, **_recipe_options(it.recipe)))
    recipe = {**_default_recipe(it.fmt), **x._recipe_to_json(x.recipe)}
    stored = {} if it.requant else it.stored
    out = hf.export_tensors(it.fm, it.module, x, stored)
    check = hf.consumer_decode(consumer.layout, it.fm, it.module, out[0], consumer.dtype, x.dequantize)
    if check.status == "differs":
        exact = requantize(x, it.fmt, **{**_recipe_options(recipe), "pow2": True})
        sqnr = sqnr_db(x.dequantize(torch.float32), exact.dequantize(torch.float32))
        if consumer.on_inexact == "requantize":
            out = hf.export_tensors(it.fm, it.module, exact, stored)
            after = hf.consumer_decode(consumer.layout, it.fm, it.module, out[0], consumer.dtype, exact.dequantize)
            consumer.requantized[it.fqn] = sqnr
            if after.status != "equal":
                consumer.inexact[it.fqn] = (after, sqnr)
        else:
            consumer.inexact[it.fqn] = (check, sqnr)
    elif check.status == "unloadable":
        consumer.unloadable[it.fqn] = check.reason
    return out


def _recipe_options(recipe: dict) -> dict:
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in recipe.items()}
    if isinstance(opts.get("fp8_dtype"), str):
        opts["fp8_dtype"] = str_to_dtype(opts["fp8_dtype"])
    return opts


#: what ``export`` does when the consumer's default loader would decode a weight differently from ckptq
ON_INEXACT = ("refuse", "float32", "requantize", "keep")


class _Consumer:
    """The consumer's model dtype and policy, and what the check found while writing."""

    def __init__(self, layout: hf.HFLayout, dtype: torch.dtype, on_inexact: str):
        self.layout, self.dtype, self.on_inexact = layout, dtype, on_inexact
        self.inexact: dict[str, tuple[hf.ConsumerDecode, float]] = {}
        self.unloadable: dict[str, str] = {}
        self.requantized: dict[str, float] = {}

    def findings(self, since: tuple | None = None) -> tuple[dict, dict, dict]:
        """What the check found so far (``inexact``, ``unloadable``, ``requantized``; picklable), or
        only what it found after ``since`` (an earlier :meth:`findings`)."""
        now = (dict(self.inexact), dict(self.unloadable), dict(self.requantized))
        if since is None:
            return now
        return tuple({k: v for k, v in d.items() if k not in old} for d, old in zip(now, since, strict=True))

    def set_findings(self, parts: list[tuple[dict, dict, dict]]) -> None:
        """Replace what the check found with ``parts`` (:meth:`findings` of each shard, in shard order)."""
        self.inexact, self.unloadable, self.requantized = {}, {}, {}
        for inexact, unloadable, requantized in parts:
            self.inexact.update(inexact)
            self.unloadable.update(unloadable)
            self.requantized.update(requantized)

    def report(self) -> dict:
        return {
            "loaders": hf.CONSUMERS.get(self.layout.name, ""),
            "dtype": dtype_to_str(self.dtype),
            "on_inexact": self.on_inexact,
            "differs": {
                f: {"elements": c.elements, "max_abs_diff": c.max_abs_diff, "requantize_sqnr_db": q}
                for f, (c, q) in self.inexact.items()
            },
            "unloadable": dict(self.unloadable),
            "requantized_sqnr_db": dict(self.requantized),
        }

    def problem(self) -> str | None:
        """The refusal message (None: nothing the policy does not allow)."""
        lines = []
        if self.unloadable and self.on_inexact != "keep":
            f, why = next(iter(self.unloadable.items()))
            lines.append(
                f"{len(self.unloadable)} tensor(s) cannot load in the consumer's default path, e.g. '{f}': {why}; "
                f"choose another --layout (docs/producers.md: which consumer reads which layout), a config whose "
                f"dtype the consumer decodes, or --on-inexact keep to write it anyway"
            )
        if self.inexact and self.on_inexact in ("refuse", "requantize"):  # requantize: what it could not fix
            worst = max(c.max_abs_diff for c, _ in self.inexact.values())
            n = sum(c.elements for c, _ in self.inexact.values())
            low = min(q for _, q in self.inexact.values())
            f, (c, _) = next(iter(self.inexact.items()))
            lines.append(
                f"{len(self.inexact)} tensor(s) would load differently from ckptq's {dtype_to_str(self.dtype)} "
                f"dequantization in the consumer's default path ({n} values, max abs diff {worst:.3g}; e.g. '{f}': "
                f"{c.reason}). Exact choices: --on-inexact float32 (config dtype float32: the scales load as they "
                f"are), --on-inexact requantize (power-of-two scales, which a {dtype_to_str(self.dtype)} model "
                f"holds exactly; SQNR vs the current values >= {low:.1f} dB), or --on-inexact keep to write "
                f"it with the difference"
            )
        return "; ".join(lines) or None


def _base_config(src: Path, config: Any) -> tuple[dict, str]:
    """The model config the export adds ``quantization_config`` to, and where it came from.

    ``config`` a dict or a path: that one; ``False``: none (an explicit choice: the folder's
    ``config.json`` then holds only the quantization config, which no model loader can build from);
    None: the first ``config.json`` with a ``model_type`` in the source folder (a Hugging Face folder,
    or a DCP checkpoint folder the model's config was saved into) or the folder beside it (its parent).

    Raises:
        UsageError: none found, or the one given / found has no ``model_type`` (transformers'
            ``from_pretrained`` refuses such a config); names ``--config``.
    """
    if config is False:
        return {}, "none (--no-model-config)"
    if isinstance(config, dict):
        cfg, where = dict(config), "config="
    elif config is not None:
        cfg, where = _read_config(config if storage.is_url(config) else Path(config)), str(config)
    else:
        folder = src if storage.is_url(src) or src.is_dir() else src.parent
        candidates = (storage.join(folder, "config.json"), storage.join(storage.parent_of(folder), "config.json"))
        found = [p for p in candidates if storage.file_size(p) is not None]
        usable = [(p, c) for p, c in ((p, _read_config(p)) for p in found) if "model_type" in c]
        if not usable:
            seen = f" ({', '.join(str(p) for p in found)} has no model_type)" if found else ""
            raise UsageError(
                f"no model config.json in {folder} or beside it{seen}; pass --config PATH (the config.json of "
                f"the Hugging Face model these weights belong to), or --no-model-config for a folder only "
                f"ckptq reads back (transformers and vLLM cannot load a config.json without a model)"
            )
        cfg, where = usable[0][1], str(usable[0][0])
    if "model_type" not in cfg:
        raise UsageError(
            f"--config {where}: it has no 'model_type', so transformers' from_pretrained cannot build a model "
            f"from it; pass the model's own config.json (or --no-model-config)"
        )
    return cfg, where


def _read_config(p: Any) -> dict:
    try:
        with storage.open_file(p, "r") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{p}: cannot read the model config ({e}); pass --config a valid config.json") from e
    if not isinstance(cfg, dict):
        raise UsageError(f"{p}: not a JSON object; pass --config a model's config.json")
    return cfg


def _model_dtype(cfg: dict) -> torch.dtype:
    """The dtype transformers builds the model in from ``cfg`` (``dtype``, older ``torch_dtype``; bf16 default)."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    try:
        dt = str_to_dtype(str(name).replace("torch.", ""))
    except Exception:
        return torch.bfloat16
    return dt if dt in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16


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
    on_inexact: str = "refuse",
    overwrite: bool = False,
    progress: bool | Callable[[int], None] | None = None,
    device: str | torch.device | None = "auto",
    distributed: bool = False,
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
            own format (an error if the layout cannot hold it), plain tensors in the model dtype.
        ignore: fnmatch globs of FQNs / HF names (or their module paths) kept in high precision (the
            model config's dtype, bf16 without one, as every plain floating tensor).
            Activation scales a source carries (ModelOpt ``input_scale`` = amax/2688,
            compressed-tensors ``input_global_scale`` = 2688/amax) are renamed and inverted for the
            layout (fp32 ``1/x``), dropped (listed in ``skipped``) for DeepSeek; KV-cache scales stay.
        max_shard_size: bytes per shard (``"5GB"``, ``"500MB"``, an int); a weight's tensors share a shard.
        names: rename rules training FQN -> HF name (``["SRC=DST"]`` or ``{SRC: DST}``); default identity.
        config: base ``config.json`` (a path or a dict, with a ``model_type``) to add
            ``quantization_config`` to; None: the ``config.json`` in the source folder or beside it
            (its parent), else UsageError naming ``--config``; False: none (only ckptq reads the folder).
        on_inexact: what to do when the consumer's default loader (transformers ``from_pretrained(dst)``
            with no arguments, which builds the model in the config's ``dtype``) would decode a weight
            differently from ckptq's dequantization in that dtype, or cannot load it
            (:func:`ckptq.adapters.hf.consumer_decode`): ``"refuse"`` (default: an error that gives the
            count, max abs diff and the exact choices; nothing is written), ``"float32"`` (write
            ``dtype: float32``, in which the fp32 scales load as they are), ``"requantize"``
            (power-of-two scales, which the model dtype holds exactly; the SQNR is reported) or
            ``"keep"`` (write it; the difference is reported). See docs/producers.md.
        overwrite: replace an existing ``dst``.
        progress: ``True`` for a tqdm bar on stderr, or a callable given the bytes of each tensor written.
        device: where requantizing and dequantizing run: ``"auto"`` (a CUDA device when one is there
            and ckptq's CUDA kernels are built, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``
            (:func:`ckptq.io.device.resolve_device`). The next tensor is read on a thread meanwhile
            (:func:`ckptq.io.device.prefetch`); tensors written as they are stay on the host. The
            same bytes on every device.
        distributed: split the shard files over the processes of the default ``torch.distributed``
            process group (initialized from torchrun's environment with gloo if it is not yet): every
            process plans the same shards, writes whole shard files of its own (balanced by bytes;
            at most as many processes work as there are files) into one staging folder, and rank 0
            writes the index and config files and renames the folder once every process succeeded.
            The files are the same bytes as one process's. Every process must call this with the
            same arguments; the result is returned on every process. Not for ``layout="torchao"``.

    Returns:
        ``{"path", "layout", "files", "bytes", "tensors", "quantized": {fqn: format}, "requantized":
        [fqn], "high_precision": [fqn], "skipped": [fqn], "numerics": {fqn: max fp32 ulps between the
        layout consumer's decode and ckptq's (NVFP4; 0 = bit-exact)}, "config_files": [...], "config_from":
        where the model config came from, "consumer": {"loaders", "dtype", "on_inexact", "differs": {fqn:
        {"elements", "max_abs_diff", "requantize_sqnr_db"}}, "unloadable": {fqn: why}, "requantized_sqnr_db":
        {fqn: dB}}, "device": where the kernels ran}``.

    Raises:
        UsageError: an unknown layout or format, a size or rename rule that does not parse, a
            ``device`` that cannot be used.
        UnsupportedFormatError: a tensor the layout cannot hold (names it and the fix), or the
            consumer's default loader would decode differently and ``on_inexact`` is ``"refuse"``.
        CkptqError: ``dst`` exists (without ``overwrite``) or overlaps ``src``; nothing is written.
            In distributed mode, on every process, when any process failed (naming the ranks).
    """
    flat = adapters.flattening(layout)
    if flat is not None:
        if distributed:
            raise UsageError(f"--layout {layout} is written by one process; run it without torchrun")
        if format is not None:
            raise UsageError(f"--format does not apply to --layout {layout}; convert the checkpoint with --to first")
        return export_flattened(src, dst, flat, max_shard_size, names, overwrite, progress)
    dev = resolve_device(device)
    lay = _parse_layout(layout)
    fmt = _parse_format(lay, format)
    if on_inexact not in ON_INEXACT:
        raise UsageError(f"--on-inexact: '{on_inexact}' is not one of {list(ON_INEXACT)}")
    max_bytes = parse_size(max_shard_size)
    try:
        rules = hf.parse_rename_rules(names)
    except ValueError as e:
        raise UsageError(f"--rename: {e}") from None
    ignore = tuple(ignore or ())
    view = open_checkpoint(src)
    dst = storage.location(dst)
    srcp = storage.location(view.path)
    check_destination(srcp, dst, overwrite)
    base, config_from = _base_config(srcp, config)
    items, skipped = _plan(view, lay, fmt, ignore, rules, _model_dtype(base))
    if on_inexact == "float32":
        base = {**base, "dtype": "float32", "torch_dtype": "float32"}
    consumer = _Consumer(lay, _model_dtype(base), on_inexact)
    shards = _shards(items, max_bytes)
    n = len(shards)
    total = sum(it.nbytes for it in items)
    group = Group.default() if distributed else None
    try:
        if progress is True:
            from tqdm import tqdm

            show = group is None or group.rank == 0
            with tqdm(total=total, unit="B", unit_scale=True, desc="exporting", leave=False, disable=not show) as bar:
                result = _run(view, lay, dst, shards, n, base, items, skipped, consumer, bar.update, group, dev)
        else:
            result = _run(view, lay, dst, shards, n, base, items, skipped, consumer, progress or None, group, dev)
    finally:
        if group is not None:
            group.close()
    return {**result, "config_from": config_from, "device": str(dev)}


def _run(view, lay, dst: Any, shards, n, base, items, skipped, consumer: _Consumer, progress, group, device) -> dict:
    """Write ``shards`` into a staging folder and rename it to ``dst``: alone, or with the shard files
    split over the processes of ``group`` (:func:`ckptq.distributed.prepare_write_commit`: each
    process writes whole files of its own; rank 0 merges what they report, writes the index and the
    config files last and renames the folder once every process succeeded). Requantizing and
    dequantizing run on ``device``."""
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def write(tmp: Any) -> dict:
        expect_shared_dir(tmp, group)
        mine = range(n) if group is None else sorted(group.assign({i: _shard_bytes(s) for i, s in enumerate(shards)}))
        return {i: _write_shard(view, storage.join(tmp, files[i]), shards[i], consumer, progress, device) for i in mine}

    def commit(tmp: Any, parts: list[dict]) -> dict:
        done = {i: part for p in parts for i, part in p.items()}  # shard order: the one-process report
        weight_map: dict[str, str] = {}
        numerics: dict[str, int] = {}
        for i in range(n):
            names, _, shard_numerics, _, size = done[i]
            _check_shard_file(storage.join(tmp, files[i]), size)
            weight_map.update(dict.fromkeys(names, files[i]))
            numerics.update(shard_numerics)
        consumer.set_findings([done[i][3] for i in range(n)])
        problem = consumer.problem()
        if problem:
            raise UnsupportedFormatError(f"export to {lay.name}: {problem}; nothing was written")
        written = sum(done[i][1] for i in range(n))
        cfg_files = _write_configs(tmp, lay, base, items, weight_map, written)
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
            "consumer": consumer.report(),
        }

    def or_write_error(step):  # a full disk, a file-size limit...: the error names dst and the cause
        def run(*args):
            try:
                return step(*args)
            except OSError as e:
                raise write_error(dst, e) from e

        return run

    return prepare_write_commit(
        group,
        prepare=or_write_error(lambda: staging_dir(dst)),
        write=or_write_error(write),
        commit=or_write_error(commit),
        abort=lambda: None,  # each shard file is closed as it is written
        discard=storage.remove_tree,
    )


def _shard_bytes(shard: list[_ExportEntry]) -> int:
    return max(1, sum(it.nbytes for it in shard))


def _write_shard(view, path: Any, shard: list[_ExportEntry], consumer: _Consumer, progress, device) -> tuple:
    """Write one shard file (header from the plan, the tensors one at a time, then the header again
    with the checksums and amax records; fsynced). On an object store (``path`` a URL: an object
    cannot be rewritten) the final header comes from a first pass over the values instead. The values
    are computed on ``device``, the next entry's source read meanwhile (:func:`_shard_values`). Returns
    ``(tensor names, payload bytes, {fqn: max_ulps}, consumer findings, file size)``: what the index
    and the report need from it."""
    entries = [o for it in shard for o in it.out_names]
    meta_keys = {  # room for the amax records (fixed width), filled in as the tensors are written
        hf.amax_metadata_key(name): hf.encode_amax(torch.zeros(tuple(it.out_names[0][2][:-2])))
        for it in shard
        if it.kind == "quantized"
        for name in hf.amax_record_names(it.fm, it.module, it.recipe)
    }
    metadata = {"format": "pt", **meta_keys, SAFETENSORS_KEY: safetensors_table({name: 0 for name, _, _ in entries})}
    header = _header(entries, metadata)
    hasher = Hasher()
    before = consumer.findings()
    remote = storage.is_url(path)
    if remote:
        header = _final_header(view, shard, consumer, entries, metadata, hasher, device)
    names: list[str] = []
    numerics: dict[str, int] = {}
    written = 0
    values = _shard_values(view, shard, consumer, device)
    with _open_out(path) as f, _write_back(f, remote) as flusher, contextlib.closing(values):
        f.write(header)
        for it, tensors, meta, info in values:
            for name, dtype, shape in it.out_names:
                t = tensors[name]
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise CkptqError(f"internal: '{name}' is {t.dtype} {tuple(t.shape)}, planned {dtype} {shape}")
                n = _write_tensor(f, t)
                written += n
                if flusher is not None:
                    flusher.wrote(n)
                if not remote:
                    hasher.submit(name, t)
                names.append(name)
            metadata.update(meta)
            if "max_ulps" in info:
                numerics[it.fqn] = info["max_ulps"]
            if progress:
                progress(it.nbytes)
            del tensors
        size = f.tell()
        if not remote:
            metadata[SAFETENSORS_KEY] = safetensors_table(hasher.results())
            final = _header(entries, metadata)
            if len(final) != len(header):
                raise CkptqError("internal: shard header changed size")
            f.seek(0)
            f.write(final)  # fsynced by _write_back
    return names, written, numerics, consumer.findings(since=before), size


@contextlib.contextmanager
def _write_back(f: Any, remote: bool):
    """A :class:`~ckptq.io.fileio.Flusher` of local shard file ``f`` (None for an object store): the
    write-back starts every :data:`~ckptq.io.fileio.DEFAULT_SYNC_EVERY` bytes written (on a thread),
    so the disk writes the shard while the next sources are read instead of all of it at the end;
    on a normal exit it waits for that and fsyncs the file, on an error it only waits."""
    if remote:
        yield None
        return
    flusher, ok = Flusher(f.fileno(), DEFAULT_SYNC_EVERY), False
    try:
        yield flusher
        ok = True
    finally:
        flusher.close(fsync=ok)


def _check_shard_file(path: Any, size: int) -> None:
    """The shard file a process wrote is in the staging folder with its ``size`` (by ``stat``: not read;
    local folders only: an object store's listing is the same from every host)."""
    if storage.is_url(path):
        return
    found = path.stat().st_size if path.exists() else -1
    if found != size:
        raise CkptqError(
            f"{path} {'is missing' if found < 0 else f'has {found} bytes'}, the process that wrote it wrote "
            f"{size}: with several hosts, the output must be on a file system every host sees at the same path "
            f"(docs/design.md, offline tools); nothing was committed"
        )


def _write_configs(tmp: Any, lay, base: dict, items, weight_map: dict, written: int) -> dict:
    """Write the layout's config files, ``model.safetensors.index.json`` and, last, ``config.json``
    (``base`` + the layout's ``quantization_config``; on an object store the folder is a loadable
    model once it exists); returns the layout's config files."""
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
    if "dtype" not in out_cfg and "torch_dtype" not in out_cfg:
        out_cfg["dtype"] = "bfloat16"  # transformers 5 reads "dtype" (older releases "torch_dtype")
        out_cfg["torch_dtype"] = "bfloat16"
    out_cfg["quantization_config"] = cfg_files["config.json"]["quantization_config"]
    for name, content in cfg_files.items():
        if name != "config.json":
            with storage.open_file(storage.join(tmp, name), "w") as f:
                json.dump(content, f, indent=2, sort_keys=True)
    with storage.open_file(storage.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with storage.open_file(storage.join(tmp, "config.json"), "w") as f:
        json.dump(out_cfg, f, indent=2, sort_keys=True)
    return cfg_files


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

    from safetensors.torch import save, save_file

    from .checksums import checksum

    max_bytes = parse_size(max_shard_size)
    try:
        rules = hf.parse_rename_rules(names)
    except ValueError as e:
        raise UsageError(f"--rename: {e}") from None
    view = open_checkpoint(src)
    dst = storage.location(dst)
    check_destination(storage.location(view.path), dst, overwrite)
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
            if storage.is_url(tmp):  # the shard is in memory already: one upload
                with storage.open_file(storage.join(tmp, fname), "wb") as f:
                    f.write(save(data, metadata=metadata))
            else:
                save_file(data, str(tmp / fname), metadata=metadata)
            files.append(fname)
            weight_map.update(dict.fromkeys(data, fname))
        if len(files) > 1:
            with storage.open_file(storage.join(tmp, "model.safetensors.index.json"), "w") as f:
                _json.dump({"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}, f)
        commit_dir(tmp, dst)
    except BaseException as e:
        storage.remove_tree(tmp)
        if isinstance(e, OSError):
            raise write_error(dst, e) from e
        raise
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
        "config_from": "none (torchao's safetensors form has no config.json)",
        "device": "cpu",  # nothing is computed: the tensors are flattened as they are
        "consumer": {
            "loaders": hf.CONSUMERS.get(adapter.producer, adapter.producer),
            "dtype": None,
            "on_inexact": None,
            "differs": {},
            "unloadable": {},
            "requantized_sqnr_db": {},
        },
    }

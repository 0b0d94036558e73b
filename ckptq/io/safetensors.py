"""Hugging Face safetensors checkpoints as a ckptq source (read-only).

``open_checkpoint`` accepts one ``.safetensors`` file or a folder with ``model.safetensors.index.json``
(or ``*.safetensors`` files) and optional ``config.json`` / ``hf_quant_config.json``. The layout
(ModelOpt, compressed-tensors, DeepSeek FP8: :mod:`ckptq.adapters.hf`) is detected from the config
and the tensor names; each quantized weight becomes a ckptq ``"quantized"`` entry named
``<module>.weight`` whose ``keys`` map each ckptq component to the HF tensor holding it, with
producer ``{"name": ..., "layout": ...}`` in its descriptor. Everything else is a plain tensor entry.

Data, block scales and per-tensor FP8 scales are the stored values (bit-exact; a bf16 / fp16 FP8 scale,
as compressed-tensors writes for bf16 / fp16 models, widens exactly to ckptq's fp32 ``scale_inv``, and
the descriptor's producer record keeps each HF tensor's dtype and shape, ``"stored"``, so that an export
back to the layout writes the same bytes); the NVFP4 global scale
becomes ckptq's ``amax`` (exact when the exporter recorded it, else the closest value, see
:mod:`ckptq.adapters.hf`). HF names are the training FQNs unless ``names=`` rename rules say otherwise
(:func:`ckptq.adapters.hf.parse_rename_rules`, written training FQN -> HF name as for the export,
applied in reverse).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import adapters
from ..adapters import hf
from ..checksums import check, checksum, read_safetensors_table
from ..contract import Descriptor, Entry, EntryTable
from ..errors import CheckpointFormatError
from ..formats import from_components
from ..formats.base import QuantizedTensor, str_to_dtype
from ..numerics import HP_FORMATS
from .source import SourceKind

__all__ = ["SafetensorsView", "is_safetensors_source", "check_safetensors_records", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"


def is_safetensors_source(path: Path) -> bool:
    """A ``.safetensors`` file, or a folder holding an index or ``*.safetensors`` files (no DCP ``.metadata``)."""
    try:
        if path.is_file():
            return path.suffix == ".safetensors"
        if path.is_dir() and not (path / ".metadata").exists():
            return (path / INDEX_NAME).is_file() or any(path.glob("*.safetensors"))
    except OSError:
        return False
    return False


def _read_json(p: Path) -> dict | None:
    if not p.is_file():
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{p}: not readable JSON ({e}); fix or remove the file") from e


class SafetensorsView(EntryTable):
    """Read-only logical view of a safetensors file or folder (:class:`ckptq.io.source.CheckpointSource`).

    Args:
        path: a ``.safetensors`` file or a folder.
        names: the rename rules the export used, training FQN -> HF name (``["*=model.*"]`` or
            ``{"*": "model.*"}``); applied in reverse (HF name -> FQN). Default identity.

    Raises:
        CheckpointFormatError: a shard listed in the index is missing, a tensor of the index is not in
            its shard, the config disagrees with the tensors, or a tensor has the wrong shape; each
            message names the file, the tensor and the fix.
        UnsupportedFormatError: the config names a quantization method ckptq does not read.
    """

    world_size = None

    def __init__(self, path: str | Path, *, names: Any = None):
        from safetensors import safe_open

        self.path = Path(path)
        self._rules = hf.parse_rename_rules(names)
        folder = self.path if self.path.is_dir() else self.path.parent
        self.config = _read_json(folder / "config.json")
        self.hf_quant_config = _read_json(folder / "hf_quant_config.json")
        self._where: dict[str, Path] = {}  # HF name -> file
        self._meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._file_meta: dict[Path, dict] = {}
        index = _read_json(folder / INDEX_NAME) if self.path.is_dir() else None
        if self.path.is_dir():
            if index is not None:
                wm = index.get("weight_map")
                if not isinstance(wm, dict):
                    raise CheckpointFormatError(f"{folder / INDEX_NAME}: no 'weight_map' object; regenerate the index")
                files = sorted({folder / f for f in wm.values()})
                for f in files:
                    if not f.is_file():
                        raise CheckpointFormatError(
                            f"{f}: shard listed in {INDEX_NAME} is missing (it holds e.g. "
                            f"'{next(n for n, v in wm.items() if folder / v == f)}'); copy the missing shard "
                            f"into the folder or re-export the checkpoint"
                        )
            else:
                files = sorted(folder.glob("*.safetensors"))
        else:
            files = [self.path]
        self.files = files
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    self._file_meta[f] = dict(h.metadata() or {})
                    for name in h.keys():
                        sl = h.get_slice(name)
                        dt = hf.ST_DTYPES.get(sl.get_dtype())
                        if dt is None:
                            raise CheckpointFormatError(
                                f"{f}: tensor '{name}' has safetensors dtype "
                                f"{sl.get_dtype()}, which ckptq does not read"
                            )
                        self._meta[name] = (dt, tuple(int(s) for s in sl.get_shape()))
                        self._where.setdefault(name, f)
            except CheckpointFormatError:
                raise
            except Exception as e:  # safetensors raises its own error types for truncated headers
                raise CheckpointFormatError(
                    f"{f}: not a readable safetensors file ({e}); re-copy or re-export it"
                ) from e
        if index is not None:
            for name, fname in index["weight_map"].items():
                f = folder / fname
                if name not in self._meta or self._where[name] != f:
                    raise CheckpointFormatError(
                        f"{f}: tensor '{name}' is listed in {INDEX_NAME} but is not in that shard; the "
                        f"index and shards disagree: regenerate the index or re-export"
                    )
        # quantized tensors another library stored flattened (its adapter reads them; e.g. torchao's
        # safetensors support): their member tensors are not HF layout tensors
        self._flat: dict[str, tuple[adapters.Adapter, adapters.FlatTensor]] = {}
        for f in files:
            self._flat.update(adapters.safetensors_groups(self._file_meta[f], self._meta, str(f)))
        flat_members = {n for _, fl in self._flat.values() for n in fl.members.values()}
        layout_names = [n for n in self._meta if n not in flat_members]
        method = ((self.config or {}).get("quantization_config") or {}).get("quant_method")
        producers = {a.producer for a, _ in self._flat.values()}
        if self._flat and (method is None or method in producers):
            self.layout = None  # that library's own folder, not an HF serving layout
        else:
            self.layout = hf.detect_layout(self.config, self.hf_quant_config, layout_names, str(self.path))
        if self.layout is not None:
            self.source = f"safetensors ({self.layout.name})"
        else:
            self.source = f"safetensors ({', '.join(sorted(producers))})" if self._flat else "safetensors"
        self._build_entries()

    # ------------------------------------------------------------------ entries
    def _logical_dtype(self) -> torch.dtype:
        cfg = self.config or {}
        name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        try:
            dt = str_to_dtype(str(name).replace("torch.", ""))
        except Exception:
            return torch.bfloat16
        return dt if dt in HP_FORMATS else torch.bfloat16

    def _build_entries(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._plain: dict[str, str] = {}  # fqn -> HF name
        self._quant: dict[str, tuple[hf.FormatMap, dict[str, str]]] = {}
        flat_members = {n for _, fl in self._flat.values() for n in fl.members.values()}
        names = [n for n in self._meta if n not in flat_members]
        groups, rest = hf.group_modules(names, self.layout) if self.layout else ({}, names)
        for name, (adapter, flat) in self._flat.items():
            fqn = hf.rename(name, self._rules, inverse=True)
            qt, producer = adapter.safetensors_to_canonical(flat, self._flat_tensors(flat, describe=True))
            keys = {c: flat.members[f] for c, f in flat.components.items() if f in flat.members}
            desc = {**qt.descriptor(), "mode": "native", "producer": producer}
            desc["components"] = {c: {**v, "fqn": keys.get(c, fqn)} for c, v in desc["components"].items()}
            self._entries[fqn] = Entry(fqn, "quantized", tuple(qt.shape), qt.dtype, Descriptor.from_dict(desc), keys)
        dtype = self._logical_dtype()
        producer = self.layout.producer if self.layout else None
        if self.layout is not None and self.layout.name == "modelopt" and isinstance(self.hf_quant_config, dict):
            producer = str((self.hf_quant_config.get("producer") or {}).get("name", producer))
        for module, group in groups.items():
            where = f"{self._where[next(iter(group.values()))]}"
            candidates = hf.match_formats(
                self.layout, module, group, {n: self._meta[n][0] for n in group.values()}, where
            )
            problem = None
            for fm in candidates:
                data_name = group[fm.data.suffix]
                shape = hf.logical_shape(
                    fm, self._meta[data_name][1], f"{self._where[data_name]}: tensor '{data_name}'"
                )
                recipe = self._recipe_for(fm, group, shape)
                problem = next(
                    (
                        (t, hf.expected_shape(t, fm, shape, recipe))
                        for t in fm.tensors
                        if not hf.shape_fits(t, fm, self._meta[group[t.suffix]][1], shape, recipe)
                    ),
                    None,
                )
                if problem is None:
                    break
            if problem is not None:
                fm, (t, want) = candidates[0], problem
                data_name = group[fm.data.suffix]
                shape = hf.logical_shape(fm, self._meta[data_name][1], f"tensor '{data_name}'")
                got = self._meta[group[t.suffix]][1]
                raise CheckpointFormatError(
                    f"{self._where[group[t.suffix]]}: tensor '{group[t.suffix]}' has shape {list(got)}, but "
                    f"{self.layout.name} {fm.format} of a weight of shape {list(shape)} (from "
                    f"'{data_name}') needs {list(want)}; the file is truncated or the config's scheme "
                    f"(e.g. block size) disagrees with the tensors: fix config.json or re-export"
                )
            fqn = hf.rename(f"{module}{self.layout.weight_suffix}", self._rules, inverse=True)
            keys = hf.component_keys(fm, group, recipe)
            stored = {t.suffix: self._meta[group[t.suffix]] for t in fm.tensors}
            desc = Descriptor.from_dict(hf.descriptor(fm, self.layout, shape, dtype, recipe, keys, producer, stored))
            self._entries[fqn] = Entry(fqn, "quantized", tuple(shape), dtype, desc, keys)
            self._quant[fqn] = (fm, group)
        for name in rest:
            self._check_not_orphan(name)
            fqn = hf.rename(name, self._rules, inverse=True)
            dt, shape = self._meta[name]
            if fqn in self._entries:
                raise CheckpointFormatError(
                    f"{self._where[name]}: tensor '{name}' maps to '{fqn}', which another "
                    f"tensor already maps to; fix the rename rules"
                )
            self._entries[fqn] = Entry(fqn, "tensor", shape, dt, None, {fqn: fqn})
            self._plain[fqn] = name

    def _check_not_orphan(self, name: str) -> None:
        """Raise CheckpointFormatError for a layout's packed data tensor found without its scale (a
        missing shard or a partial copy): read as a plain uint8/int8 tensor it would be silently wrong."""
        if self.layout is None:
            return
        for fm in self.layout.formats:
            d = fm.data
            if not name.endswith(fm.separator + d.suffix) or self._meta[name][0] != d.dtype:
                continue
            if d.suffix != "weight" or d.dtype in (torch.uint8, torch.int8):
                scale = next(t for t in fm.tensors if t.component != "data")
                want = fm.name(name[: -len(fm.separator + d.suffix)], scale)
                raise CheckpointFormatError(
                    f"{self._where[name]}: tensor '{name}' ({self.layout.name} {fm.format} data) has no scale "
                    f"tensor '{want}' in the folder; a shard is missing or the copy is partial: copy the "
                    f"complete checkpoint (all shards and model.safetensors.index.json)"
                )

    def _recipe_for(self, fm: hf.FormatMap, group: dict, shape: tuple[int, ...]) -> dict:
        record = self._amax_record_text(fm, group) is not None
        if fm.format not in ("fp8_block", "fp8_tensor"):
            return hf.import_recipe(fm, {}, self.config, shape, record)
        stored = {t.suffix: self._load(group[t.suffix]) for t in fm.tensors if t.component == "scale_inv"}
        return hf.import_recipe(fm, stored, self.config, shape, record)

    def _amax_record_text(self, fm: hf.FormatMap, group: dict) -> str | None:
        """The exporter's ``ckptq.amax`` record of this weight's global scale (file metadata), if any."""
        for name in hf.amax_record_names(fm, "", {}):
            hf_name = group[name.lstrip(".")]
            text = self._file_meta.get(self._where[hf_name], {}).get(hf.amax_metadata_key(hf_name))
            if text:
                return text
        return None

    def _flat_tensors(self, flat: adapters.FlatTensor, describe: bool = False) -> dict[str, torch.Tensor]:
        """The stored member tensors of a flattened foreign tensor; ``describe``: only its ``small``
        fields are read, the others are meta tensors of their header dtype and shape."""
        out = {}
        for field, name in flat.members.items():
            if describe and field not in flat.small:
                dt, shape = self._meta[name]
                out[name] = torch.empty(shape, dtype=dt, device="meta")
            else:
                out[name] = self._load(name)
        return out

    def _load(self, name: str) -> torch.Tensor:
        """Tensor ``name`` from its file, checked against the file's checksum table when it has one
        (files ``ckptq export`` wrote; :func:`_load_checked`)."""
        f = self._where[name]
        return _load_checked(f, name, read_safetensors_table(self._file_meta.get(f)))

    # ------------------------------------------------------------------ CheckpointSource interface
    def hf_name(self, fqn: str) -> str:
        """The HF tensor name of a plain entry (the module path + ``.weight`` of a quantized one)."""
        if fqn in self._plain:
            return self._plain[fqn]
        if fqn not in self._quant:  # a flattened foreign tensor: its own name
            return hf.rename(fqn, self._rules)
        fm, group = self._quant[fqn]
        return group[fm.data.suffix]

    def read(self, fqn: str) -> QuantizedTensor | torch.Tensor:
        """The whole logical tensor: a QuantizedTensor for quantized weights, else the stored tensor."""
        e = self.entry(fqn)
        if e.kind == "tensor":
            return self._load(self._plain[fqn])
        if fqn not in self._quant:  # flattened by another library: its adapter, the same checks
            adapter, flat = self._flat[hf.rename(fqn, self._rules)]
            qt, _ = adapter.safetensors_to_canonical(flat, self._flat_tensors(flat))
            return from_components(e.descriptor, qt.components())
        fm, group = self._quant[fqn]
        stored = {t.suffix: self._load(group[t.suffix]) for t in fm.tensors}
        for t in fm.tensors:
            if t.component == "scale":
                hf.check_e8m0_finite(
                    fm, stored[t.suffix], f"{self._where[group[t.suffix]]}: tensor '{group[t.suffix]}'"
                )
        text = self._amax_record_text(fm, group)
        record = None if text is None else hf.decode_amax(text, e.shape[:-2])
        where = f"{self._where[group[fm.data.suffix]]}: weight '{fqn}'"
        comps = hf.import_components(fm, stored, e.shape, e.descriptor.recipe, record, where)
        return from_components(e.descriptor, comps)

    def read_raw_bytes(self, fqn: str) -> tuple[bytes, Any]:
        raise CheckpointFormatError(f"{self.path}: safetensors sources have no non-tensor entries ('{fqn}')")

    def mapping(self, key: str) -> tuple | None:
        return None

    def saved_chunks(self, key: str) -> list | None:
        """None: tensors are read whole, through ``safetensors`` (each checked against its file's checksum)."""
        return None

    def close(self) -> None:
        """Nothing to release (each read opens and closes its file)."""


#: The kind :func:`ckptq.checkpoint.open_checkpoint` lists.
SOURCE = SourceKind("Hugging Face safetensors", is_safetensors_source, SafetensorsView)


def _load_checked(f: Path, name: str, table: dict | None) -> torch.Tensor:
    """Tensor ``name`` of safetensors file ``f``; compared with ``table[name]`` when present.

    Raises:
        CheckpointFormatError: the tensor cannot be read (a damaged file).
        ChecksumMismatchError: its bytes differ from the checksum the file records (names the file,
            the byte range and the tensor).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as h:
            t = h.get_tensor(name)
    except Exception as e:
        raise CheckpointFormatError(f"{f}: cannot read tensor '{name}' ({e}); the file is damaged: re-copy it") from e
    expected = (table or {}).get(name)
    if expected is not None and checksum(t) != expected:
        start, end = _byte_range(f, name)
        check(t, expected, f"{f}: tensor '{name}', bytes {start}..{end}")
    return t


def _byte_range(f: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor ``name`` in safetensors file ``f`` (from its header)."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    start, end = header[name]["data_offsets"]
    return 8 + n + int(start), 8 + n + int(end)


def check_safetensors_records(path: str | Path, progress: Any = None) -> tuple[list, int, int]:
    """Read every tensor of a safetensors file or folder once and check it (``ckptq verify PATH``).

    Returns:
        ``(problems, verified, unverified)`` as :meth:`ckptq.io.SafeFileSystemReader.check_records`,
        with ``problems`` as ``(name, file, start, end, message)``; tensors of files without a ckptq
        checksum table (written by other tools) count as ``unverified``.

    Raises:
        CheckpointFormatError: a file is not a readable safetensors file.
    """
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    problems, verified, unverified = [], 0, 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                names, table = list(h.keys()), read_safetensors_table(h.metadata())
        except Exception as e:
            raise CheckpointFormatError(f"{f}: not a readable safetensors file ({e}); re-copy or re-export it") from e
        for name in names:
            start, end = _byte_range(f, name)
            if progress is not None:
                progress(end - start)
            try:
                _load_checked(f, name, table)
            except CheckpointFormatError as e:
                text = str(e)
                problems.append(
                    (name, f.name, start, end, text.split(": ", 2)[-1] if text.startswith(str(f)) else text)
                )
                continue
            if table is not None and name in table:
                verified += 1
            else:
                unverified += 1
    return problems, verified, unverified

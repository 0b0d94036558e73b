"""Hugging Face safetensors layouts of quantized weights: ModelOpt, compressed-tensors, DeepSeek FP8.

One :class:`HFLayout` record per layout, each with one :class:`FormatMap` per ckptq format it can
hold. A format map is a small table: which HF tensor (``<module>.<suffix>``) holds which ckptq
component, in which on-disk dtype, through which *codec* (a named, exact or bounded transform).
Everything layout-specific lives here; :mod:`ckptq.io.safetensors` (import) and
:mod:`ckptq.export` (export) only walk these tables.

Layouts (facts: docs/producers.md, "4. Hugging Face folders")::

    layout              format      HF tensors of module m (dtype)                                  codec
    modelopt            nvfp4       m.weight (u8, M x K/2), m.weight_scale (e4m3, M x K/16),
                                    m.weight_scale_2 (fp32, ())  = amax/2688 (decode)               ws2
                        fp8_tensor  m.weight (e4m3), m.weight_scale (fp32, ())                       same
                        mxfp8       m.weight (e4m3), m.weight_scale (u8 E8M0, M x K/32)              same
    compressed-tensors  nvfp4       m.weight_packed (u8), m.weight_scale (e4m3),
                                    m.weight_global_scale (fp32, (1,)) = 2688/amax (encode)          gs
                        mxfp8       m.weight (e4m3), m.weight_scale (u8 E8M0)                        same
                        fp8_block   m.weight (e4m3), m.weight_scale (fp32, ceil grid)                same
                        fp8_block   m.weight (e4m3), m.weight_scale (fp32, (M, 1)): block (1, K)     same
                        fp8_tensor  m.weight (e4m3), m.weight_scale (fp32, (1,))                     vec1
    deepseek-fp8        fp8_block   m.weight (e4m3), m.weight_scale_inv (fp32, ceil(M/128) x
                                    ceil(K/128)), a decode multiplier despite the name               same

FP8 scales are read in fp32, bf16 or fp16 (:attr:`HFTensor.accepts`; widened exactly), a per-tensor
scale as ``()`` or ``(1,)``; the descriptor's producer record keeps what was stored, and an export back
to the layout writes it again (:func:`stored_layout`). :func:`consumer_decode` predicts what the
layout's default loader decodes (``ckptq.export``'s ``on_inexact``).

safetensors 0.8 knows F8_E8M0 and F4, but every consumer reads E8M0 scales and packed FP4 as
``uint8`` (torch 2.13 has no ``copy_`` for ``float4_e2m1fn_x2``), so they are stored as U8.

Exactness (see :func:`nvfp4_global_for_layout` for the NVFP4 global scale):

* ``same``/``vec1``/``rows16`` codecs copy bytes (``rows16``: a 16x16-block NVFP4 scale grid is
  repeated over its 16 rows, because the layouts only have 1x16 blocks; same decoded values).
* NVFP4's global scale: ckptq stores ``amax`` and decodes ``e2m1 * ((s * amax) * (1/2688))``;
  ModelOpt decodes ``e2m1 * (s * ws2)`` and compressed-tensors ``e2m1 * (s / gs)``. No fp32
  ``ws2``/``gs`` reproduces ckptq's two roundings for every E4M3 ``s`` in general, so the exporter
  searches the fp32 neighbours of ``amax/2688`` (``2688/amax``) for the one whose consumer decode is
  closest to ckptq's over the block scales that *occur* in the tensor (often bit-exact; measured
  at most 2 fp32 ulps otherwise, see tests/test_hf.py) and records ckptq's ``amax`` in the shard's
  ``__metadata__`` (``ckptq.amax.<tensor>``) so that a re-import is bit-exact. An import without
  that record searches the neighbours of ``ws2*2688`` (``2688/gs``) the same way.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._version import __version__
from ..errors import CheckpointFormatError, UnsupportedFormatError
from ..formats import format_class
from ..formats.base import DESCRIPTOR_VERSION, dtype_to_str

__all__ = [
    "HFTensor",
    "FormatMap",
    "HFLayout",
    "LAYOUTS",
    "layout",
    "detect_layout",
    "group_modules",
    "match_formats",
    "import_components",
    "export_tensors",
    "nvfp4_global_for_layout",
    "amax_metadata_key",
    "encode_amax",
    "decode_amax",
    "DEFAULT_IGNORE",
    "shape_fits",
    "stored_layout",
    "ConsumerDecode",
    "consumer_decode",
    "CONSUMERS",
    "AUX_SUFFIXES",
    "ST_DTYPES",
]

_F32 = torch.float32
E4M3, U8 = torch.float8_e4m3fn, torch.uint8

#: safetensors dtype strings <-> torch dtypes (the ones these layouts use, plus common plain ones)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}

#: default ``ignore`` globs of :func:`ckptq.export.export_checkpoint` (kept in high precision as ModelOpt /
#: llm-compressor do): output heads, embeddings, norms, routers/gates.
DEFAULT_IGNORE = ("*lm_head*", "*embed*", "*norm*", "*.gate.weight", "*router*")

#: suffixes of activation / KV-cache scales another producer stored next to a weight (kept in fp32)
AUX_SUFFIXES = ("input_scale", "input_global_scale", "k_scale", "v_scale", "output_scale")

#: the static NVFP4 activation scale per layout: suffix, semantic (``decode`` = amax/2688 as ModelOpt's
#: ``input_scale``, ``encode`` = 2688/amax as compressed-tensors' ``input_global_scale``) and shape
#: (``()`` or ``(1,)``). ckptq computes none (no activation calibration); an imported one is carried
#: over, renamed and inverted (``1/x`` in fp32, as compressed-tensors' own ModelOpt converter does).
ACT_SCALE = {"modelopt": ("input_scale", "decode", ()), "compressed-tensors": ("input_global_scale", "encode", (1,))}


def convert_act_scale(name: str, target: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """``(new name, transform)`` of an activation-scale tensor ``name`` for layout ``target``; None
    when ``name`` is not one (or ``target`` has none: it is then dropped by the exporter)."""
    for suffix, semantic, _ in ACT_SCALE.values():
        if name.endswith("." + suffix):
            if target not in ACT_SCALE:
                return name, None  # type: ignore[return-value]
            t_suffix, t_semantic, t_shape = ACT_SCALE[target]
            flip = semantic != t_semantic
            new = name[: -len(suffix)] + t_suffix

            def fn(x: torch.Tensor, flip=flip, t_shape=t_shape) -> torch.Tensor:
                x = x.to(_F32)
                return (torch.reciprocal(x) if flip else x).reshape(t_shape)

            return new, fn
    return None


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One HF tensor ``<module>.<suffix>`` of a quantized weight.

    Attributes:
        suffix: appended to the module path (``weight_scale``).
        component: the ckptq component it holds (``data``, ``scale``, ``scale_inv``, ``amax``).
        dtype: its on-disk dtype.
        codec: ``same`` (bytes), ``vec1`` (a () scalar stored as (..., 1)), ``rows16`` (a 16x16
            NVFP4 scale grid repeated over rows), ``ws2`` (amax <-> amax/2688), ``gs`` (amax <-> 2688/amax).
        accepts: further on-disk dtypes read exactly (widened to the component's dtype: a bf16 or
            fp16 scale is an exact fp32 value). compressed-tensors 0.20 writes FP8 scales in the
            model's dtype (``quantization/lifecycle/initialize.py``: the scale parameter takes the
            observed weight's dtype), so FP8 folders of bf16 / fp16 models carry bf16 / fp16 scales.
    """

    suffix: str
    component: str
    dtype: torch.dtype
    codec: str = "same"
    accepts: tuple[torch.dtype, ...] = ()

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """Every on-disk dtype this tensor is read from (the written one first)."""
        return (self.dtype, *self.accepts)


@dataclasses.dataclass(frozen=True)
class FormatMap:
    """How one ckptq format is stored in one layout."""

    format: str
    tensors: tuple[HFTensor, ...]
    #: the layout's description of the scheme (compressed-tensors QuantizationArgs / ModelOpt quant_algo)
    scheme: Mapping[str, Any]
    #: recipe fields the layout cannot hold: field -> (allowed values, why)
    requires: Mapping[str, tuple[tuple, str]] = dataclasses.field(default_factory=dict)
    #: the consumers need K (the last dim) to be a multiple of this (their group size)
    k_multiple: int = 1

    @property
    def data(self) -> HFTensor:
        return next(t for t in self.tensors if t.component == "data")

    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.suffix for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """One Hugging Face layout: its formats (first match wins on import) and its config files."""

    name: str
    producer: str
    formats: tuple[FormatMap, ...]
    #: ``config.json["quantization_config"]["quant_method"]`` values that mean this layout
    quant_methods: tuple[str, ...]
    #: tensor-name suffixes only this layout writes (detection from names when there is no config)
    marker_suffixes: tuple[str, ...]
    #: ``(formats used {module: FormatMap}, ignored modules) -> {file name: json}``
    write_config: Callable[[Mapping[str, FormatMap], Sequence[str]], dict] = None  # type: ignore[assignment]

    def format_map(self, fmt: str, recipe: Mapping | None = None, shape: Sequence[int] = ()) -> FormatMap | None:
        """The first map of ``fmt`` whose recipe requirements ``recipe`` (of a weight of ``shape``)
        meets, else the first map of ``fmt`` (its :func:`check_exportable` then names what is wrong)."""
        maps = [f for f in self.formats if f.format == fmt]
        if recipe is not None:
            met = [f for f in maps if all(_meets(recipe.get(k), a, shape) for k, (a, _) in f.requires.items())]
            maps = met or maps
        return maps[0] if maps else None

    def format_names(self) -> list[str]:
        """The ckptq formats the layout holds (each once)."""
        return list(dict.fromkeys(f.format for f in self.formats))


#: a ``requires`` value meaning "one scale per row": ``block == (1, K)`` (compressed-tensors' channel strategy)
PER_ROW = "per-row"


def _meets(v: Any, allowed: tuple, shape: Sequence[int]) -> bool:
    v = tuple(v) if isinstance(v, list) else v
    if PER_ROW in allowed:
        return len(shape) >= 2 and v == (1, int(shape[-1]))
    return v in [dtype_to_str(a) if isinstance(a, torch.dtype) else a for a in allowed]


# ----------------------------------------------------------------------------- config writers
def _ignore_globs(ignored: Sequence[str]) -> list[str]:
    return sorted(set(ignored))


def _modelopt_config(used: Mapping[str, FormatMap], ignored: Sequence[str]) -> dict:
    algos = {m: fm.scheme for m, fm in used.items()}
    distinct = {json_key(s) for s in algos.values()}
    quant: dict[str, Any] = {"kv_cache_quant_algo": None, "exclude_modules": _ignore_globs(ignored)}
    if len(distinct) <= 1:
        scheme = next(iter(algos.values()), {"quant_algo": None})
        quant.update({k: v for k, v in scheme.items() if k in ("quant_algo", "group_size")})
    else:
        quant["quant_algo"] = "MIXED_PRECISION"
        quant["quantized_layers"] = {
            m: {k: v for k, v in s.items() if k in ("quant_algo", "group_size")} for m, s in sorted(algos.items())
        }
    hf_quant = {"producer": {"name": "modelopt", "version": f"ckptq-{__version__}"}, "quantization": quant}
    groups = {}
    for i, scheme in enumerate(sorted({json_key(s): s for s in algos.values()}.values(), key=json_key)):
        targets = ["Linear"] if len(distinct) == 1 else sorted(m for m, s in algos.items() if s == scheme)
        groups[f"group_{i}"] = {
            "targets": targets,
            "weights": dict(scheme["weights"]),
            "input_activations": scheme.get("input_activations"),
        }
    qc = {
        "quant_method": "modelopt",
        "quant_algo": quant["quant_algo"],
        "producer": hf_quant["producer"],
        "config_groups": groups,
        "ignore": quant["exclude_modules"],
        "kv_cache_scheme": None,
    }
    if "group_size" in quant:
        qc["group_size"] = quant["group_size"]
    return {"hf_quant_config.json": hf_quant, "config.json": {"quantization_config": qc}}


def _ct_config(used: Mapping[str, FormatMap], ignored: Sequence[str]) -> dict:
    by_scheme: dict[str, list[str]] = {}
    schemes: dict[str, Mapping] = {}
    for m, fm in used.items():
        by_scheme.setdefault(json_key(fm.scheme), []).append(m)
        schemes[json_key(fm.scheme)] = fm.scheme
    single = len(schemes) == 1
    groups = {}
    for i, key in enumerate(sorted(schemes)):
        s = schemes[key]
        targets = ["Linear"] if single else [f"re:^{re.escape(m)}$" for m in sorted(by_scheme[key])]
        groups[f"group_{i}"] = {
            "targets": targets,
            "weights": dict(s["weights"]),
            "input_activations": None,
            "output_activations": None,
            "format": s["format"],
        }
    fmt = next(iter(schemes.values()))["format"] if single else "mixed-precision"
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": _ignore_globs(ignored),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }
    return {"config.json": {"quantization_config": qc}}


def _deepseek_config(used: Mapping[str, FormatMap], ignored: Sequence[str]) -> dict:
    qc = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": _ignore_globs(ignored),
    }
    return {"config.json": {"quantization_config": qc}}


def json_key(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True, default=str)


# ----------------------------------------------------------------------------- the tables
_FP8_E4M3 = ((torch.float8_e4m3fn,), "the layout stores E4M3 weights only")
#: FP8 scale dtypes read besides fp32 (written back as they were: the descriptor's producer record)
_HALF = (torch.bfloat16, torch.float16)

LAYOUTS: dict[str, HFLayout] = {}


def _register(lay: HFLayout) -> HFLayout:
    LAYOUTS[lay.name] = lay
    return lay


_register(
    HFLayout(
        "modelopt",
        "modelopt",
        (
            FormatMap(
                "nvfp4",
                (
                    HFTensor("weight", "data", U8),
                    HFTensor("weight_scale", "scale", E4M3, "rows16"),
                    HFTensor("weight_scale_2", "amax", _F32, "ws2"),
                ),
                {
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                },
                k_multiple=16,
            ),
            FormatMap(
                "mxfp8",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale", U8)),
                {
                    "quant_algo": "MXFP8",
                    "group_size": 32,
                    "weights": {"dynamic": False, "num_bits": 8, "type": "float", "group_size": 32},
                },
                k_multiple=32,
            ),
            FormatMap(
                "fp8_tensor",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale_inv", _F32, accepts=_HALF)),
                {"quant_algo": "FP8", "weights": {"dynamic": False, "num_bits": 8, "type": "float"}},
                {"fp8_dtype": _FP8_E4M3},
            ),
        ),
        ("modelopt", "modelopt_fp4"),
        ("weight_scale_2",),
        _modelopt_config,
    )
)

_register(
    HFLayout(
        "compressed-tensors",
        "compressed-tensors",
        (
            FormatMap(
                "nvfp4",
                (
                    HFTensor("weight_packed", "data", U8),
                    HFTensor("weight_scale", "scale", E4M3, "rows16"),
                    HFTensor("weight_global_scale", "amax", _F32, "gs"),
                ),
                {
                    "format": "nvfp4-pack-quantized",
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "tensor_group",
                        "group_size": 16,
                        "dynamic": False,
                        "observer": None,
                        "scale_dtype": "torch.float8_e4m3fn",
                    },
                },
                k_multiple=16,
            ),
            FormatMap(
                "mxfp8",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale", U8)),
                {
                    "format": "mxfp8-quantized",
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                        "dynamic": False,
                        "observer": None,
                        "scale_dtype": "torch.uint8",
                    },
                },
                k_multiple=32,
            ),
            FormatMap(
                "fp8_block",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale_inv", _F32, accepts=_HALF)),
                {
                    "format": "float-quantized",
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "block",
                        "block_structure": [128, 128],
                        "dynamic": False,
                        "observer": None,
                    },
                },
                {"fp8_dtype": _FP8_E4M3, "block": (((128, 128),), "the scheme written is block [128, 128]")},
            ),
            FormatMap(  # one scale per row (M, 1): the channel strategy (compressed-tensors' FP8_DYNAMIC preset)
                "fp8_block",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale_inv", _F32, accepts=_HALF)),
                {
                    "format": "float-quantized",
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "channel",
                        "dynamic": False,
                        "observer": None,
                    },
                },
                {"fp8_dtype": _FP8_E4M3, "block": ((PER_ROW,), "the channel scheme has one scale per row")},
            ),
            FormatMap(
                "fp8_tensor",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale_inv", _F32, "vec1", _HALF)),
                {
                    "format": "float-quantized",
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "tensor",
                        "dynamic": False,
                        "observer": None,
                    },
                },
                {"fp8_dtype": _FP8_E4M3},
            ),
        ),
        ("compressed-tensors",),
        ("weight_packed", "weight_global_scale"),
        _ct_config,
    )
)

_register(
    HFLayout(
        "deepseek-fp8",
        "deepseek",
        (
            FormatMap(
                "fp8_block",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale_inv", "scale_inv", _F32, accepts=_HALF)),
                {"quant_method": "fp8", "weight_block_size": [128, 128]},
                {"fp8_dtype": _FP8_E4M3, "block": (((128, 128),), "DeepSeek-V3 / HF 'fp8' weights use 128x128 blocks")},
            ),
        ),
        ("fp8",),
        ("weight_scale_inv",),
        _deepseek_config,
    )
)


def layout(name: str) -> HFLayout:
    """The layout record named ``name``; raises UnsupportedFormatError naming the known ones."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise UnsupportedFormatError(
            f"unknown Hugging Face layout '{name}'; ckptq writes and reads {sorted(LAYOUTS)}"
        ) from None


# ----------------------------------------------------------------------------- detection
def detect_layout(
    config: Mapping | None, hf_quant: Mapping | None, names: Sequence[str], where: str
) -> HFLayout | None:
    """The layout of a folder from its ``config.json`` / ``hf_quant_config.json`` and tensor names.

    The config decides when it names a layout; then tensor names of *another* layout's markers with
    none of this one's are an error (config and tensors disagree). Without a config, the marker
    suffixes decide. None: no quantized layout (plain safetensors).
    """
    qc = (config or {}).get("quantization_config") if isinstance(config, Mapping) else None
    suffixes = {n.rsplit(".", 1)[-1] for n in names}
    by_config = None
    if isinstance(hf_quant, Mapping) and str((hf_quant.get("producer") or {}).get("name", "")).lower() == "modelopt":
        by_config = LAYOUTS["modelopt"]
    elif isinstance(qc, Mapping) and qc.get("quant_method") is not None:
        method = str(qc["quant_method"])
        by_config = next((lay for lay in LAYOUTS.values() if method in lay.quant_methods), None)
        if by_config is None:
            raise UnsupportedFormatError(
                f"{where}: config.json quantization_config quant_method '{method}' is not a layout ckptq "
                f"reads ({', '.join(m for lay in LAYOUTS.values() for m in lay.quant_methods)}); convert it "
                f"with its own tools, or remove quantization_config if the tensors are not quantized"
            )
    by_names = [lay for lay in LAYOUTS.values() if suffixes & set(lay.marker_suffixes)]
    if by_config is not None:
        others = [lay for lay in by_names if lay is not by_config]
        if others and not suffixes & set(by_config.marker_suffixes) and by_config.marker_suffixes:
            bad = sorted(n for n in names if n.rsplit(".", 1)[-1] in others[0].marker_suffixes)[:3]
            raise CheckpointFormatError(
                f"{where}: config says layout '{by_config.name}' (quantization_config), but tensors "
                f"{bad} are '{others[0].name}' tensors; fix quantization_config in config.json (or "
                f"hf_quant_config.json) to match the tensors"
            )
        return by_config
    return by_names[0] if len(by_names) == 1 else (None if not by_names else by_names[0])


def group_modules(names: Sequence[str], lay: HFLayout) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Split tensor names into quantized-weight candidates ``{module: {suffix: name}}`` (modules that
    have one of ``lay``'s scale suffixes) and the other names."""
    known = sorted({t.suffix for fm in lay.formats for t in fm.tensors}, key=len, reverse=True)
    scale_suffixes = {t.suffix for fm in lay.formats for t in fm.tensors if t.component != "data"}
    groups: dict[str, dict[str, str]] = {}
    for n in names:
        for suf in known:
            if n.endswith("." + suf):
                groups.setdefault(n[: -len(suf) - 1], {})[suf] = n
                break
    quantized = {m: g for m, g in groups.items() if set(g) & scale_suffixes}
    used = {n for g in quantized.values() for n in g.values()}
    return quantized, [n for n in names if n not in used]


def match_formats(
    lay: HFLayout, module: str, group: Mapping[str, str], dtypes: Mapping[str, torch.dtype], where: str
) -> list[FormatMap]:
    """The format maps of ``lay`` whose tensors are exactly ``group`` with dtypes it reads
    (:attr:`HFTensor.dtypes`), in table order (the caller picks the first whose shapes fit:
    compressed-tensors' FP8 per-tensor and block formats differ only in the scale's shape).

    Raises:
        UnsupportedFormatError: the tensors are those of a format of the layout, but one has a dtype
            ckptq does not read there (names the tensor, the dtype found and the supported ones).
        CheckpointFormatError: no format of the layout has this set of tensors (one is missing or extra).
    """
    same_names = [fm for fm in lay.formats if set(fm.suffixes()) == set(group)]
    found = [fm for fm in same_names if all(dtypes[group[t.suffix]] in t.dtypes for t in fm.tensors)]
    if found:
        return found
    if same_names:
        # the first map's misfit tensor, and what each map reads it as
        fm = same_names[0]
        suffix = next(t.suffix for t in fm.tensors if dtypes[group[t.suffix]] not in t.dtypes)
        reads: dict[str, list[str]] = {}
        for fm in same_names:
            t = next(t for t in fm.tensors if t.suffix == suffix)
            reads.setdefault(", ".join(dtype_to_str(d) for d in t.dtypes), []).append(fm.format)
        supported = "; ".join(f"{' / '.join(dict.fromkeys(f))}: {d}" for d, f in reads.items())
        raise UnsupportedFormatError(
            f"{where}: tensor '{group[suffix]}' is {dtype_to_str(dtypes[group[suffix]])}, a dtype ckptq does not "
            f"read as {lay.name} '{suffix}' (supported: {supported}); convert that tensor with its producer's "
            f"tools, or report the producer and version that wrote it"
        )
    got = {s: dtype_to_str(dtypes[n]) for s, n in sorted(group.items())}
    want = "; ".join(
        f"{fm.format}: " + ", ".join(f"{t.suffix} {'/'.join(dtype_to_str(d) for d in t.dtypes)}" for t in fm.tensors)
        for fm in lay.formats
    )
    raise CheckpointFormatError(
        f"{where}: module '{module}' has tensors {got}, which are not the tensor set of any {lay.name} "
        f"format ({want}); a tensor is missing or extra: copy the missing tensor or re-export the folder"
    )


def import_recipe(
    fm: FormatMap, stored: Mapping[str, torch.Tensor], config: Mapping | None, shape: Sequence[int] = ()
) -> dict:
    """Recipe options of an imported tensor (fp8 ``pow2`` when every scale is a power of two; the
    block from the config, or ``(1, K)`` for a per-row map, :data:`PER_ROW`)."""
    rec: dict[str, Any] = {}
    if fm.format in ("fp8_block", "fp8_tensor"):
        s = next(stored[t.suffix] for t in fm.tensors if t.component == "scale_inv").float()
        bits = s.reshape(-1).view(torch.int32)
        rec["pow2"] = bool(((bits & 0x7FFFFF) == 0).all() and (s > 0).all())
    if fm.format == "fp8_block":
        per_row = PER_ROW in fm.requires.get("block", ((),))[0]
        rec["block"] = (1, int(shape[-1])) if per_row and shape else tuple(_block_of(config))
    return rec


def _block_of(config: Mapping | None) -> tuple[int, int]:
    qc = (config or {}).get("quantization_config") or {}
    if "weight_block_size" in qc:
        return tuple(int(b) for b in qc["weight_block_size"])
    for g in (qc.get("config_groups") or {}).values():
        bs = ((g or {}).get("weights") or {}).get("block_structure")
        if bs:
            return tuple(int(b) for b in bs)
    return (128, 128)


def logical_shape(fm: FormatMap, data_shape: Sequence[int]) -> tuple[int, ...]:
    """Logical (..., M, K) of a weight from its data tensor's shape (FP4 packs two per byte)."""
    shape = list(data_shape)
    if fm.format == "nvfp4":
        shape[-1] *= 2
    return tuple(shape)


def descriptor(
    fm: FormatMap,
    lay: HFLayout,
    shape: Sequence[int],
    dtype: torch.dtype,
    recipe: Mapping,
    keys: Mapping[str, str],
    producer_name: str,
    stored: Mapping[str, tuple[torch.dtype, Sequence[int]]] | None = None,
) -> dict:
    """The ckptq (native) descriptor of an imported weight; components' ``fqn`` = their HF names.

    ``stored``: ``{suffix: (dtype, shape)}`` of the HF tensors as found, recorded in the producer
    record (``"stored": {suffix: {"dtype", "shape"}}``) so that an export back to the same layout
    writes them as they were (:func:`stored_plan`)."""
    cls = format_class(fm.format)
    rec = cls._recipe_from_json(dict(recipe))
    comps = {
        s.name: {"dtype": dtype_to_str(s.dtype), "shape": list(s.shape(shape)), "fqn": keys[s.name]}
        for s in cls.component_specs(shape, rec)
    }
    return {
        "format": fm.format,
        "version": DESCRIPTOR_VERSION,
        "shape": [int(s) for s in shape],
        "dtype": dtype_to_str(dtype),
        "recipe": cls._recipe_to_json(rec),
        "components": comps,
        "mode": "native",
        "producer": {
            "name": producer_name,
            "layout": lay.name,
            **(
                {
                    "stored": {
                        k: {"dtype": dtype_to_str(d), "shape": [int(x) for x in sh]} for k, (d, sh) in stored.items()
                    }
                }
                if stored
                else {}
            ),
        },
    }


def expected_shape(t: HFTensor, fm: FormatMap, shape: Sequence[int], recipe: Mapping) -> tuple[int, ...]:
    """The on-disk shape of HF tensor ``t`` for a weight of logical ``shape``."""
    cls = format_class(fm.format)
    rec = cls._recipe_from_json(dict(recipe))
    spec = next(s for s in cls.component_specs(shape, rec) if s.name == t.component)
    cshape = spec.shape(shape)
    if t.codec == "vec1" or t.codec == "gs":
        return tuple(cshape) + (1,)
    if t.codec == "rows16":
        return tuple(shape[:-1]) + (cshape[-1],)
    return tuple(cshape)


def _per_matrix(t: HFTensor, fm: FormatMap) -> bool:
    """A one-value-per-matrix scale copied as is (fp8_tensor's ``scale_inv``): stored as ``(...)`` or ``(..., 1)``."""
    return fm.format == "fp8_tensor" and t.component == "scale_inv" and t.codec in ("same", "vec1")


def shape_fits(t: HFTensor, fm: FormatMap, got: Sequence[int], shape: Sequence[int], recipe: Mapping) -> bool:
    """Whether HF tensor ``t`` of on-disk shape ``got`` fits a weight of logical ``shape``: its
    :func:`expected_shape`, or for a per-matrix FP8 scale either convention producers write
    (ModelOpt ``()``, compressed-tensors ``(1,)``: ``quantization/lifecycle/initialize.py`` of 0.20)."""
    got = tuple(int(g) for g in got)
    if got == expected_shape(t, fm, shape, recipe):
        return True
    batch = tuple(shape[:-2])
    return _per_matrix(t, fm) and got in (batch, batch + (1,))


def stored_layout(
    fm: FormatMap, producer: Mapping | None, lay: HFLayout
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{suffix: (dtype, shape)}`` an imported tensor's producer record says its HF tensors had,
    for the byte-copied tensors (codecs ``same`` / ``vec1``) of a dtype the layout reads there;
    empty when the record is of another layout (then the layout's own dtypes and shapes apply)."""
    from ..formats.base import str_to_dtype

    if not isinstance(producer, Mapping) or producer.get("layout") != lay.name:
        return {}
    rec = producer.get("stored") or {}
    out = {}
    for t in fm.tensors:
        r = rec.get(t.suffix)
        if t.codec in ("same", "vec1") and isinstance(r, Mapping):
            try:
                dt = str_to_dtype(str(r["dtype"]))
                sh = tuple(int(x) for x in r["shape"])
            except Exception:
                continue
            if dt in t.dtypes:
                out[t.suffix] = (dt, sh)
    return out


# ----------------------------------------------------------------------------- NVFP4 global scale
_INV_2688 = torch.tensor(1.0 / 2688.0, dtype=_F32)
_2688 = torch.tensor(2688.0, dtype=_F32)
_E2M1 = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=_F32)
_SEARCH = 4  # fp32 neighbours tried on each side


def _neighbours(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` and its fp32 neighbours, nearest first (x, +1, -1, +2, ...), positive finite only."""
    bits = int(x.reshape(()).view(torch.int32))
    out = []
    for k in [0] + [s * i for i in range(1, _SEARCH + 1) for s in (1, -1)]:
        b = bits + k
        if 0 < b < 0x7F800000:
            out.append(torch.tensor(b, dtype=torch.int32).view(_F32))
    return out


def _ckptq_mult(s: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return _E2M1[:, None] * ((s * amax) * _INV_2688)[None, :]


def _consumer_mult(codec: str, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    eff = s * g if codec == "ws2" else s / g  # ModelOpt: s * ws2; compressed-tensors: s / gs
    return _E2M1[:, None] * eff[None, :]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def _occurring_scales(scale: torch.Tensor) -> torch.Tensor:
    import numpy as np

    counts = np.bincount(scale.contiguous().reshape(-1).view(torch.uint8).numpy(), minlength=256)
    counts = counts[:128] + counts[128:]  # the sign bit does not change |decode|
    counts[0] = counts[0x7F] = 0  # zero blocks decode to 0 either way; NaN is NaN either way
    return torch.from_numpy(np.nonzero(counts)[0].astype(np.uint8)).view(E4M3).float()


def nvfp4_global_for_layout(codec: str, amax: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The fp32 global scale a layout stores for one NVFP4 matrix, and its worst decode difference.

    ``codec`` ``"ws2"`` (ModelOpt ``weight_scale_2``, decode) or ``"gs"`` (compressed-tensors
    ``weight_global_scale``, encode). Among ``amax/2688`` (``2688/amax``) and its fp32 neighbours,
    the one whose consumer decode ``e2m1 * (s * ws2)`` (``e2m1 * (s / gs)``) differs least, in fp32
    ulps, from ckptq's ``e2m1 * ((s * amax) * (1/2688))`` over the block scales ``s`` occurring in
    ``scale`` (ties: the nearest). Returns ``(value, max_ulps)`` (0 = bit-exact). amax 0, inf or
    NaN: the plain formula, and ulps -1 (not comparable).
    """
    amax = amax.reshape(()).to(_F32)
    base = amax / _2688 if codec == "ws2" else _2688 / amax
    if not torch.isfinite(amax) or amax <= 0 or not torch.isfinite(base) or base <= 0:
        return (base if torch.isfinite(base) and base > 0 else torch.tensor(1.0)), -1
    s = _occurring_scales(scale)
    ref = _ckptq_mult(s, amax)
    best, best_u = base, None
    for cand in _neighbours(base):
        u = _ulps(_consumer_mult(codec, s, cand), ref)
        if best_u is None or u < best_u:
            best, best_u = cand, u
        if u == 0:
            break
    return best, int(best_u or 0)


def amax_from_layout(codec: str, g: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """ckptq's ``amax`` for a stored global scale (the inverse search of :func:`nvfp4_global_for_layout`):
    among ``ws2*2688`` (``2688/gs``) and its neighbours, the one whose ckptq decode is closest to the
    consumer's. Returns ``(amax, max_ulps)``."""
    g = g.reshape(()).to(_F32)
    base = g * _2688 if codec == "ws2" else _2688 / g
    if not torch.isfinite(g) or g <= 0 or not torch.isfinite(base) or base <= 0:
        raise CheckpointFormatError(f"global scale {float(g)} is not finite and positive")
    s = _occurring_scales(scale)
    ref = _consumer_mult(codec, s, g)
    best, best_u = base, None
    for cand in _neighbours(base):
        u = _ulps(_ckptq_mult(s, cand), ref)
        if best_u is None or u < best_u:
            best, best_u = cand, u
        if u == 0:
            break
    return best, int(best_u or 0)


def amax_metadata_key(hf_name: str) -> str:
    """The safetensors ``__metadata__`` key where the exporter records ckptq's amax of a global scale."""
    return f"ckptq.amax.{hf_name}"


def encode_amax(amax: torch.Tensor) -> str:
    """Fixed-width text of fp32 values (8 hex digits each, comma separated)."""
    return ",".join(f"{b & 0xFFFFFFFF:08x}" for b in amax.reshape(-1).to(_F32).view(torch.int32).tolist())


def decode_amax(text: str, shape: Sequence[int]) -> torch.Tensor | None:
    try:
        vals = [struct.unpack("<f", struct.pack("<I", int(h, 16)))[0] for h in text.split(",")]
        return torch.tensor(vals, dtype=_F32).reshape(tuple(shape))
    except (ValueError, RuntimeError, struct.error):
        return None


# ----------------------------------------------------------------------------- import / export
def import_components(
    fm: FormatMap, stored: Mapping[str, torch.Tensor], shape: Sequence[int], amax_hint: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """ckptq components of one weight from its HF tensors ``{suffix: tensor}``.

    ``amax_hint``: ckptq's amax recorded by the exporter; used when it maps back to the stored
    global scale exactly (else the inverse search decides). Returns ``(components, numerics)``
    with ``numerics`` ``{"max_ulps": int}`` for NVFP4 (0: the ckptq decode equals the consumer's).
    """
    comps: dict[str, torch.Tensor] = {}
    info: dict = {}
    batch = tuple(shape[:-2])
    for t in fm.tensors:
        x = stored[t.suffix]
        if x.dtype in t.accepts:
            x = x.to(t.dtype)  # bf16 / fp16 -> fp32: every value is exact
        if t.codec == "vec1" or _per_matrix(t, fm):
            comps[t.component] = x.reshape(batch)
        elif t.codec == "same":
            comps[t.component] = x
        elif t.codec == "rows16":
            comps[t.component] = x  # the layouts' 1x16 grid is ckptq's 1-D recipe
    for t in fm.tensors:
        if t.codec not in ("ws2", "gs"):
            continue
        g = stored[t.suffix].to(_F32).reshape(batch)
        scale = comps["scale"]
        amax = torch.empty(batch, dtype=_F32)
        worst = 0
        for idx in _batch_indices(batch):
            s_i = scale[idx]
            a = None
            if amax_hint is not None and tuple(amax_hint.shape) == batch:
                cand = amax_hint[idx]
                back, _ = nvfp4_global_for_layout(t.codec, cand, s_i)
                if bool(torch.equal(back.reshape(()), g[idx].reshape(()))):
                    a, u = (
                        cand,
                        _ulps(
                            _ckptq_mult(_occurring_scales(s_i), cand),
                            _consumer_mult(t.codec, _occurring_scales(s_i), g[idx]),
                        ),
                    )
            if a is None:
                a, u = amax_from_layout(t.codec, g[idx], s_i)
            amax[idx] = a
            worst = max(worst, u)
        comps[t.component] = amax
        info["max_ulps"] = worst
    return comps, info


def _batch_indices(batch: tuple) -> list[tuple]:
    import itertools

    return [tuple(i) for i in itertools.product(*[range(b) for b in batch])] if batch else [()]


def check_exportable(
    fm: FormatMap | None, lay: HFLayout, fqn: str, fmt: str, recipe: Mapping, shape: Sequence[int]
) -> None:
    """Raise UnsupportedFormatError (naming the tensor and the fix) when ``lay`` cannot hold it."""
    if fm is None:
        raise UnsupportedFormatError(
            f"tensor '{fqn}' is {fmt}, which layout '{lay.name}' cannot hold (it holds "
            f"{lay.format_names()}); pass --format one of those to requantize, or --ignore "
            f"'{fqn}' to keep it in high precision"
        )
    for field, (allowed, why) in fm.requires.items():
        v = recipe.get(field)
        v = tuple(v) if isinstance(v, list) else v
        if not _meets(v, allowed, shape):
            raise UnsupportedFormatError(
                f"tensor '{fqn}' ({fmt}, {field}={v}) cannot be written in layout '{lay.name}': {why}; "
                f"pass --format {fmt} to requantize it with the layout's recipe, or --ignore it"
            )
    if shape[-1] % fm.k_multiple:
        raise UnsupportedFormatError(
            f"tensor '{fqn}' of shape {list(shape)}: {lay.name} {fmt} needs the last dim (K = {shape[-1]}) to be "
            f"a multiple of {fm.k_multiple} (its consumers' group size"
            f"{'; FP4 packs two values per byte' if fmt == 'nvfp4' else ''}); "
            f"--ignore '{fqn}' to keep it in high precision, pad K, or choose another --format"
        )


def export_plan(
    fm: FormatMap, module: str, shape: Sequence[int], recipe: Mapping, stored: Mapping | None = None
) -> list[tuple[str, torch.dtype, tuple]]:
    """``[(hf name, dtype, shape)]`` of one weight in layout format ``fm`` (before any data is read);
    ``stored`` (:func:`stored_layout`) overrides the dtype / shape of the tensors it names."""
    stored = stored or {}
    return [
        (f"{module}.{t.suffix}", *stored.get(t.suffix, (t.dtype, expected_shape(t, fm, shape, recipe))))
        for t in fm.tensors
    ]


def export_tensors(
    fm: FormatMap,
    module: str,
    comps: Mapping[str, torch.Tensor],
    shape: Sequence[int],
    recipe: Mapping,
    stored: Mapping | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict]:
    """The HF tensors of one canonical weight: ``({hf name: tensor}, {metadata key: text}, numerics)``.

    ``stored`` (:func:`stored_layout`): tensors written in the dtype / shape the source had (a bf16
    scale imported from compressed-tensors goes back as the same bf16 bytes); the narrowing must be
    exact, else CheckpointFormatError (the values are no longer the imported ones).
    ``numerics``: ``{"max_ulps": n}`` for NVFP4 (fp32 ulps between the consumer's decode and ckptq's
    over the scales that occur; 0 = bit-exact).
    """
    stored = stored or {}
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    info: dict = {}
    batch = tuple(shape[:-2])
    for t in fm.tensors:
        name = f"{module}.{t.suffix}"
        x = comps[t.component]
        if t.suffix in stored:
            dt, sh = stored[t.suffix]
            y = x.to(dt).reshape(sh)
            if not torch.equal(y.to(x.dtype).reshape(x.shape).view(_int_view(x)), x.view(_int_view(x))):
                raise CheckpointFormatError(
                    f"tensor '{name}': its values are not {dtype_to_str(dt)} values any more, as its producer "
                    f"record says they were; export with --format {fm.format} to requantize it"
                )
            out[name] = y.contiguous()
            continue
        if t.codec == "same":
            y = x
        elif t.codec == "vec1":
            y = x.reshape(batch + (1,))
        elif t.codec == "rows16":
            y = x
            if recipe.get("two_d"):
                y = x.repeat_interleave(16, dim=-2)[..., : shape[-2], :]
        else:
            g = torch.empty(batch, dtype=_F32)
            worst = 0
            for idx in _batch_indices(batch):
                v, u = nvfp4_global_for_layout(t.codec, x[idx], comps["scale"][idx])
                g[idx] = v
                worst = max(worst, u)
            y = g.reshape(batch + (1,)) if t.codec == "gs" else g
            meta[amax_metadata_key(name)] = encode_amax(x)
            info["max_ulps"] = worst
        if y.dtype != t.dtype:
            raise CheckpointFormatError(
                f"tensor '{module}': component '{t.component}' is {y.dtype}, layout wants {t.dtype}"
            )
        out[name] = y.contiguous()
    return out, meta, info


def _int_view(x: torch.Tensor) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize]


def glob_matches(name: str, globs: Sequence[str]) -> bool:
    """Whether ``name`` (or its module path without ``.weight``) matches one of the fnmatch globs."""
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    return any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(module, g) for g in globs)


# ----------------------------------------------------------------------------- names
def parse_rename_rules(rules: Any) -> list[tuple[str, str]]:
    """``SRC=DST`` glob rename rules (a list of strings, a ``{SRC: DST}`` mapping, a ``.json`` rule
    file holding either, or None).

    ``*`` in ``SRC`` matches any text (dots included); the i-th ``*`` of ``DST`` is replaced by the
    text the i-th ``*`` of ``SRC`` matched, so both need the same number of ``*``. The first rule that
    matches the whole name applies; names no rule matches are kept (identity).

    Raises:
        ValueError: a rule without ``=`` or with different numbers of ``*`` on its two sides.
    """
    if not rules:
        return []
    if isinstance(rules, (str, bytes)) or hasattr(rules, "__fspath__"):
        rules = [rules]
    if (
        not isinstance(rules, Mapping)
        and len(rules) == 1
        and str(rules[0]).endswith(".json")
        and "=" not in str(rules[0])
    ):
        import json

        try:
            with open(rules[0]) as f:
                rules = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"rename rule file {rules[0]}: {e}") from e
    items = list(rules.items()) if isinstance(rules, Mapping) else []
    if not isinstance(rules, Mapping):
        for r in rules:
            if "=" not in str(r):
                raise ValueError(f"rename rule '{r}' has no '='; write SRC=DST, e.g. 'model.layers.*=layers.*'")
            src, dst = str(r).split("=", 1)
            items.append((src.strip(), dst.strip()))
    for src, dst in items:
        if not src or not dst or src.count("*") != dst.count("*"):
            raise ValueError(
                f"rename rule '{src}={dst}': both sides must be non-empty with the same number "
                f"of '*' ({src.count('*')} vs {dst.count('*')})"
            )
    return items


def rename(name: str, rules: Sequence[tuple[str, str]], *, inverse: bool = False) -> str:
    """``name`` after the first matching rule of :func:`parse_rename_rules` (``inverse``: DST -> SRC)."""
    for src, dst in rules:
        if inverse:
            src, dst = dst, src
        pattern = "^" + "(.*)".join(re.escape(p) for p in src.split("*")) + "$"
        m = re.match(pattern, name)
        if m:
            parts = dst.split("*")
            out = parts[0]
            for i, p in enumerate(parts[1:]):
                out += m.group(i + 1) + p
            return out
    return name


# ----------------------------------------------------------------------------- the consumer's default decode
#: which loaders read each layout (docs/producers.md, "4.6 Which consumer loads which layout")
CONSUMERS = {
    "compressed-tensors": "transformers (from_pretrained, through compressed-tensors), vLLM",
    "deepseek-fp8": "transformers (from_pretrained, FineGrainedFP8), vLLM, DeepSeek-V3's inference code",
    "modelopt": (
        "vLLM and TensorRT-LLM; not transformers (5.24 has no ModelOpt loader: it loads the E4M3 codes "
        "unscaled, with only an 'unexpected keys' note; export --layout compressed-tensors for transformers)"
    ),
}


@dataclasses.dataclass(frozen=True)
class ConsumerDecode:
    """How the default loader of a layout decodes one exported weight, compared with ckptq's
    dequantization in the model's dtype (``status``: ``equal``, ``differs``, ``unloadable`` or
    ``unchecked``: no loader modelled, ModelOpt). ``elements`` / ``max_abs_diff``: how many decoded
    values differ and by how much (``differs``); ``reason``: why it differs or cannot load."""

    status: str
    elements: int = 0
    max_abs_diff: float = 0.0
    reason: str = ""


def consumer_decode(
    lay: HFLayout,
    fm: FormatMap,
    module: str,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    ckptq_decode: Callable[[torch.dtype], torch.Tensor],
) -> ConsumerDecode:
    """Predict what transformers' ``from_pretrained(folder)`` (no arguments: the model is built in
    the config's ``dtype``) decodes for one exported weight, and compare it with ``ckptq_decode(dtype)``.

    The rules (docs/producers.md, "Which consumer loads which layout"; checked against the real
    loaders by scripts/border_matrix.py):

    * compressed-tensors FP8 (``fp8_tensor``, ``fp8_block``): transformers 5.24 builds the module
      with compressed-tensors 0.20's ``initialize_qparams``, whose ``weight_scale`` parameter takes the
      model's dtype; the stored scale is cast into it, and the decode is ``data * scale`` in that dtype
      (one rounding of the exact product). Equal to ckptq's ``(data * scale_fp32).to(dtype)`` whenever
      every scale is a ``dtype`` value; else computed and compared.
    * compressed-tensors MXFP8: 0.20 turns the E8M0 scale into bf16 (``compressors/mx_utils.py``)
      and decodes in bf16 whatever the model's dtype: equal to ckptq's bf16 decode; in a float16 /
      float32 model the decoded bf16 weight then fails the model's forward (dtype mismatch). NVFP4
      decodes in bf16 too (the same failure; its values: ``numerics`` of the export, the global scale).
    * DeepSeek FP8: transformers 5.24 ``integrations/finegrained_fp8.py`` ``Fp8Dequantize``
      (CPU, or a GPU without FP8) multiplies in fp32 and casts to the parameter's dtype: equal, but
      it derives the block size as dims // grid, so both dims must be multiples of 128.
    """
    data = tensors[f"{module}.{fm.data.suffix}"]
    if lay.name == "compressed-tensors" and fm.format in ("fp8_tensor", "fp8_block"):
        scale = tensors[f"{module}.weight_scale"]
        if torch.equal(scale.to(dtype).to(_F32), scale.to(_F32)):
            return ConsumerDecode("equal")
        s = scale.to(dtype).to(_F32)
        if fm.format == "fp8_tensor":
            s = s.reshape(s.shape[: data.dim() - 2] + (1, 1))
        else:
            bm, bk = -(-data.shape[-2] // s.shape[-2]), -(-data.shape[-1] // s.shape[-1])
            s = s.repeat_interleave(bm, -2).repeat_interleave(bk, -1)[..., : data.shape[-2], : data.shape[-1]]
        theirs = (data.to(_F32) * s).to(dtype)
        ours = ckptq_decode(dtype)
        bad = theirs.view(_int_view(theirs)) != ours.view(_int_view(ours))
        n = int(bad.sum())
        if n == 0:
            return ConsumerDecode("equal")
        diff = float((theirs.float() - ours.float()).abs()[bad].max())
        return ConsumerDecode(
            "differs",
            n,
            diff,
            f"its fp32 scale is not a {dtype_to_str(dtype)} value; compressed-tensors casts it to the model dtype",
        )
    if lay.name == "compressed-tensors" and fm.format in ("mxfp8", "nvfp4"):
        if dtype != torch.bfloat16:
            return ConsumerDecode(
                "unloadable",
                reason=f"compressed-tensors 0.20 decodes {fm.format.upper()} to bfloat16 whatever the model dtype; "
                f"the {dtype_to_str(dtype)} model's forward then fails (dtype mismatch)",
            )
        return ConsumerDecode("equal" if fm.format == "mxfp8" else "unchecked")
    if lay.name == "deepseek-fp8":
        m, k = data.shape[-2:]
        if m % 128 or k % 128:
            return ConsumerDecode(
                "unloadable",
                reason=f"transformers 5.24 Fp8Dequantize takes the block as the weight's dims over the scale "
                f"grid, which is not 128 x 128 for a {m} x {k} weight (it fails or decodes wrong blocks)",
            )
        return ConsumerDecode("equal")
    return ConsumerDecode("unchecked")

"""Hugging Face safetensors layouts of quantized weights: ModelOpt, compressed-tensors, DeepSeek FP8 / V4, gpt-oss.

One :class:`HFLayout` record per layout, each with one :class:`FormatMap` per ckptq format it can
hold. A format map is a small table: which HF tensor (``<module>.<suffix>``) holds which ckptq
component, in which on-disk dtype, through which *codec* (a named, exact or bounded transform).
Everything layout-specific lives here; :mod:`ckptq.io.safetensors` (import) and
:mod:`ckptq.export` (export) only walk these tables.

Layouts (facts: docs/producers.md, "4. Hugging Face folders" and "7. MXFP4")::

    layout              format      HF tensors of module m (dtype)                                  codec
    modelopt            nvfp4       m.weight (u8, M x K/2), m.weight_scale (e4m3, M x K/16),
                                    m.weight_scale_2 (fp32, ()) -> global_scale_inv                 same
                        fp8_tensor  m.weight (e4m3), m.weight_scale (fp32, ())                       same
                        mxfp8       m.weight (e4m3), m.weight_scale (u8 E8M0, M x K/32)              same
    compressed-tensors  nvfp4       m.weight_packed (u8), m.weight_scale (e4m3),
                                    m.weight_global_scale (fp32, (1,)) -> global_scale              vec1
                        mxfp8       m.weight (e4m3), m.weight_scale (u8 E8M0)                        same
                        fp8_block   m.weight (e4m3), m.weight_scale (fp32, ceil grid)                same
                        fp8_block   m.weight (e4m3), m.weight_scale (fp32, (M, 1)): block (1, K)     same
                        fp8_tensor  m.weight (e4m3), m.weight_scale (fp32, (1,))                     vec1
    deepseek-fp8        fp8_block   m.weight (e4m3), m.weight_scale_inv (fp32, ceil(M/128) x
                                    ceil(K/128)), a decode multiplier despite the name               same
    compressed-tensors  mxfp4       m.weight_packed (u8, M x K/2), m.weight_scale (u8 E8M0, M x K/32) same
    deepseek-v4         mxfp4       m.weight (i8 on disk: packed E2M1), m.scale (f8_e8m0, M x K/32)  view
                        fp8_block   m.weight (e4m3), m.scale (f8_e8m0, ceil(M/128) x ceil(K/128))    e8m0
    gpt-oss             mxfp4       p_blocks (u8, E x N x K/32 x 16), p_scales (u8 E8M0, E x N x K/32)  blocks
                                    for the 3-D expert parameter p (..experts.gate_up_proj, (E, out, in))

FP8 scales are read in fp32, bf16 or fp16 (:attr:`HFTensor.accepts`; widened exactly), a per-tensor
scale as ``()`` or ``(1,)``; the descriptor's producer record keeps what was stored, and an export back
to the layout writes it again (:func:`stored_layout`). :func:`consumer_decode` predicts what the
layout's default loader decodes (``ckptq.export``'s ``on_inexact``).

safetensors 0.8 knows F8_E8M0 and F4, but every consumer reads E8M0 scales and packed FP4 as
``uint8`` (torch 2.13 has no ``copy_`` for ``float4_e2m1fn_x2``), so they are stored as U8.

Exactness: the codecs copy bytes (``vec1`` reshapes; ``rows16``: a 16x16-block NVFP4 scale grid is
repeated over its 16 rows, because the layouts only have 1x16 blocks; same decoded values).

NVFP4's global scale keeps its producer's convention (the format map's ``recipe``, docs/formats.md
"Global-scale conventions"): an import stores ``weight_scale_2`` as ``global_scale_inv`` and
``weight_global_scale`` as ``global_scale``, byte for byte, and decodes as the producer does; an
export of a tensor in the layout's convention writes those bytes back. A tensor in another
convention (ckptq's ``amax``) is written with the layout value whose decode is closest to its own
(:meth:`ckptq.formats.NVFP4Tensor.with_per_tensor`; the largest difference, in fp32 ulps, is
reported), and an ``amax`` is recorded in the shard's ``__metadata__`` (``ckptq.amax.<tensor>``):
a re-import that finds it imports ckptq's ``amax`` again, bit-exact, after checking that it still
gives the stored value.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import numerics
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
    "amax_metadata_key",
    "amax_record_names",
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
            NVFP4 scale grid repeated over rows), ``view`` (the same bytes under another dtype label:
            DeepSeek-V4's I8 FP4 data, F8_E8M0 scales), ``blocks`` (packed FP4 data (..., N, K/2)
            stored as gpt-oss's (..., N, K/32, 16): a reshape), ``e8m0`` (an fp32 power-of-two
            ``scale_inv`` stored as its E8M0 byte).
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
    #: between the module path and a suffix (gpt-oss: ``experts.gate_up_proj`` + ``_`` + ``blocks``)
    separator: str = "."
    #: the one tensor rank the layout holds (gpt-oss: 3-D experts), None: any
    ndim: int | None = None
    #: whether the consumer decodes an E8M0 ``scale`` byte 255 as NaN as ckptq does (else it is refused)
    e8m0_nan: bool = True
    #: recipe options of an imported tensor that follow from the layout: fixed by what it stores (NVFP4:
    #: the global scale's ``per_tensor`` convention) or by how its producer quantizes (the MXFP4 scale
    #: rule, which guides a later requantize only, never the decode)
    recipe: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def name(self, module: str, t: HFTensor) -> str:
        """The HF name of tensor ``t`` of the weight at ``module``."""
        return f"{module}{self.separator}{t.suffix}"

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
    #: the training FQN of a weight is ``<module><weight_suffix>`` (gpt-oss: the parameter name itself)
    weight_suffix: str = ".weight"
    #: True: the exporter writes plain floating tensors in their own dtype (DeepSeek-V4 keeps fp32
    #: tensors such as its compressors' weights and attention sinks in fp32); False: in the model's dtype
    keeps_plain_dtype: bool = False

    def module_of(self, name: str) -> str:
        """The module path of a weight's HF name (the inverse of ``weight_suffix``)."""
        ws = self.weight_suffix
        return name[: -len(ws)] if ws and name.endswith(ws) else name

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


def _gpt_oss_config(used: Mapping[str, FormatMap], ignored: Sequence[str]) -> dict:
    # transformers 5.24 Mxfp4Config.to_dict: exactly these two keys (``dequantize`` is a load option)
    return {
        "config.json": {
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": _ignore_globs(ignored)}
        }
    }


def _deepseek_v4_config(used: Mapping[str, FormatMap], ignored: Sequence[str]) -> dict:
    qc = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": _ignore_globs(ignored),
    }
    out: dict[str, Any] = {"quantization_config": qc}
    if any(fm.format == "mxfp4" for fm in used.values()):
        out["expert_dtype"] = "fp4"  # a top-level config key in DeepSeek-V4's config.json
    return {"config.json": out}


def json_key(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True, default=str)


# ----------------------------------------------------------------------------- the tables
_FP8_E4M3 = ((torch.float8_e4m3fn,), "the layout stores E4M3 weights only")
#: FP8 scale dtypes read besides fp32 (written back as they were: the descriptor's producer record)
_HALF = (torch.bfloat16, torch.float16)

LAYOUTS: dict[str, HFLayout] = {}


def _ct_scheme(fmt: str, num_bits: int, strategy: str, **weights: Any) -> dict:
    """A compressed-tensors ``config_groups`` scheme of one format: its ``format`` and the weights'
    ``QuantizationArgs`` (float, symmetric, static, no observer) with ``strategy`` and the format's
    other fields (``group_size``, ``block_structure``, ``scale_dtype``, ...)."""
    return {
        "format": fmt,
        "weights": {
            "num_bits": num_bits,
            "type": "float",
            "symmetric": True,
            "strategy": strategy,
            **weights,
            "dynamic": False,
            "observer": None,
        },
    }


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
                    HFTensor("weight_scale_2", "global_scale_inv", _F32),
                ),
                {
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                },
                k_multiple=16,
                recipe={"per_tensor": "global_scale_inv"},
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
                    HFTensor("weight_global_scale", "global_scale", _F32, "vec1"),
                ),
                _ct_scheme("nvfp4-pack-quantized", 4, "tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn"),
                k_multiple=16,
                recipe={"per_tensor": "global_scale"},
            ),
            FormatMap(
                "mxfp4",
                (HFTensor("weight_packed", "data", U8), HFTensor("weight_scale", "scale", U8)),
                _ct_scheme(
                    "mxfp4-pack-quantized", 4, "group", group_size=32, scale_dtype="torch.uint8", zp_dtype="torch.uint8"
                ),
                k_multiple=32,
                e8m0_nan=False,  # decompress_mx_scale: 2^(255-127) = inf in bf16, not NaN
                recipe={"scale_rule": "even"},  # generate_mx_scales: amax rounded at 1 mantissa bit
            ),
            FormatMap(
                "mxfp8",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale", U8)),
                _ct_scheme("mxfp8-quantized", 8, "group", group_size=32, scale_dtype="torch.uint8"),
                k_multiple=32,
            ),
            FormatMap(
                "fp8_block",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale_inv", _F32, accepts=_HALF)),
                _ct_scheme("float-quantized", 8, "block", block_structure=[128, 128]),
                {"fp8_dtype": _FP8_E4M3, "block": (((128, 128),), "the scheme written is block [128, 128]")},
            ),
            FormatMap(  # one scale per row (M, 1): the channel strategy (compressed-tensors' FP8_DYNAMIC preset)
                "fp8_block",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale_inv", _F32, accepts=_HALF)),
                _ct_scheme("float-quantized", 8, "channel"),
                {"fp8_dtype": _FP8_E4M3, "block": ((PER_ROW,), "the channel scheme has one scale per row")},
            ),
            FormatMap(
                "fp8_tensor",
                (HFTensor("weight", "data", E4M3), HFTensor("weight_scale", "scale_inv", _F32, "vec1", _HALF)),
                _ct_scheme("float-quantized", 8, "tensor"),
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


_register(
    HFLayout(
        "gpt-oss",
        "transformers",
        (
            FormatMap(
                "mxfp4",
                (HFTensor("blocks", "data", U8, "blocks"), HFTensor("scales", "scale", U8)),
                {"quant_method": "mxfp4"},
                k_multiple=32,
                separator="_",
                ndim=3,
                e8m0_nan=False,  # transformers' ldexp decodes byte 255 as x * 2^128, not NaN
                recipe={"scale_rule": "rceil"},  # triton_kernels ROUND_UP (transformers' quantize path)
            ),
        ),
        ("mxfp4",),
        ("blocks", "scales"),
        _gpt_oss_config,
        weight_suffix="",
    )
)

_register(
    HFLayout(
        "deepseek-v4",
        "deepseek",
        (
            FormatMap(
                "mxfp4",
                (
                    HFTensor("weight", "data", torch.int8, "view"),
                    HFTensor("scale", "scale", torch.float8_e8m0fnu, "view"),
                ),
                {"expert_dtype": "fp4"},
                k_multiple=32,
            ),
            FormatMap(
                "fp8_block",
                (HFTensor("weight", "data", E4M3), HFTensor("scale", "scale_inv", torch.float8_e8m0fnu, "e8m0")),
                {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
                {
                    "fp8_dtype": _FP8_E4M3,
                    "block": (((128, 128),), "DeepSeek-V4's FP8 weights use 128x128 blocks"),
                    "pow2": ((True,), "DeepSeek-V4 stores FP8 block scales as E8M0 bytes (powers of two)"),
                },
            ),
        ),
        ("fp8",),
        ("scale",),
        _deepseek_v4_config,
        keeps_plain_dtype=True,
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
    by_config = None
    if isinstance(hf_quant, Mapping) and str((hf_quant.get("producer") or {}).get("name", "")).lower() == "modelopt":
        by_config = LAYOUTS["modelopt"]
    elif isinstance(qc, Mapping) and qc.get("quant_method") is not None:
        method = str(qc["quant_method"])
        claims = [lay for lay in LAYOUTS.values() if method in lay.quant_methods]
        # one quant_method may name several layouts (``fp8``: DeepSeek-V3 and -V4); the markers decide
        by_config = next((lay for lay in claims if _marked(lay, names)), claims[0] if claims else None)
        if by_config is None:
            raise UnsupportedFormatError(
                f"{where}: config.json quantization_config quant_method '{method}' is not a layout ckptq "
                f"reads ({', '.join(m for lay in LAYOUTS.values() for m in lay.quant_methods)}); convert it "
                f"with its own tools, or remove quantization_config if the tensors are not quantized"
            )
    by_names = [lay for lay in LAYOUTS.values() if _marked(lay, names)]
    if by_config is not None:
        others = [lay for lay in by_names if lay is not by_config]
        if others and not _marked(by_config, names) and by_config.marker_suffixes:
            bad = sorted(n for n in names if _marked(others[0], [n]))[:3]
            raise CheckpointFormatError(
                f"{where}: config says layout '{by_config.name}' (quantization_config), but tensors "
                f"{bad} are '{others[0].name}' tensors; fix quantization_config in config.json (or "
                f"hf_quant_config.json) to match the tensors"
            )
        return by_config
    return by_names[0] if len(by_names) == 1 else (None if not by_names else by_names[0])


def _marked(lay: HFLayout, names: Sequence[str]) -> bool:
    """Whether a tensor name ends in one of ``lay``'s marker suffixes (after its separator)."""
    ends = tuple(f"{fm.separator}{m}" for fm in lay.formats for m in lay.marker_suffixes)
    return any(n.endswith(ends) for n in names)


def group_modules(names: Sequence[str], lay: HFLayout) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Split tensor names into quantized-weight candidates ``{module: {suffix: name}}`` (modules that
    have one of ``lay``'s scale suffixes) and the other names."""
    known = sorted(
        {(fm.separator + t.suffix, t.suffix) for fm in lay.formats for t in fm.tensors}, key=lambda x: -len(x[0])
    )
    scale_suffixes = {t.suffix for fm in lay.formats for t in fm.tensors if t.component != "data"}
    groups: dict[str, dict[str, str]] = {}
    for n in names:
        for end, suf in known:
            if n.endswith(end):
                groups.setdefault(n[: -len(end)], {})[suf] = n
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
    fm: FormatMap,
    stored: Mapping[str, torch.Tensor],
    config: Mapping | None,
    shape: Sequence[int] = (),
    amax_record: bool = False,
) -> dict:
    """Recipe options of an imported tensor: the layout's own (:attr:`FormatMap.recipe`: NVFP4's
    global-scale convention, ``per_tensor="amax"`` when ``amax_record``, the exporter's ``ckptq.amax``
    record of the tensor, is present; the MXFP4 scale rule), fp8 ``pow2`` when every scale is a power
    of two, fp8_block's block from the config, or ``(1, K)`` for a per-row map (:data:`PER_ROW`)."""
    rec: dict[str, Any] = dict(fm.recipe)
    if amax_record and "per_tensor" in rec:
        rec["per_tensor"] = "amax"
    if fm.format in ("fp8_block", "fp8_tensor"):
        t = next(t for t in fm.tensors if t.component == "scale_inv")
        s = e8m0_to_fp32(stored[t.suffix]) if t.codec == "e8m0" else stored[t.suffix].float()
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


#: ckptq formats whose ``data`` packs two E2M1 codes per byte
PACKED_FP4 = ("nvfp4", "mxfp4")
#: gpt-oss ``_blocks``: 32 E2M1 codes = 16 bytes per block
_BLOCK_BYTES = 16


def logical_shape(fm: FormatMap, data_shape: Sequence[int], what: str = "a tensor") -> tuple[int, ...]:
    """Logical (..., M, K) of a weight from its data tensor's shape (FP4 packs two per byte; gpt-oss
    ``_blocks`` (..., N, K/32, 16) are 32 values per block).

    Raises:
        CheckpointFormatError: a ``_blocks`` tensor whose last dim is not 16 or of rank < 3.
    """
    shape = list(data_shape)
    if fm.data.codec == "blocks":
        if len(shape) < 3 or shape[-1] != _BLOCK_BYTES:
            raise CheckpointFormatError(
                f"{what} has shape {shape}: MXFP4 blocks must be (..., N, K/32, 16) uint8 (16 bytes = "
                f"32 E2M1 values per block); the file is damaged or not in the gpt-oss layout: re-export it"
            )
        return tuple(shape[:-2]) + (shape[-2] * 2 * _BLOCK_BYTES,)
    if fm.format in PACKED_FP4:
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


def component_keys(fm: FormatMap, group: Mapping[str, str], recipe: Mapping) -> dict[str, str]:
    """``{component: HF name}`` of one imported weight (``group``: ``{suffix: HF name}``); an NVFP4
    ``amax`` imported from the exporter's record stands for the layout's global-scale tensor."""
    keys = {t.component: group[t.suffix] for t in fm.tensors}
    held, wanted = fm.recipe.get("per_tensor"), recipe.get("per_tensor", "amax")
    if held is not None and wanted != held:
        keys[wanted] = keys.pop(held)
    return keys


def expected_shape(t: HFTensor, fm: FormatMap, shape: Sequence[int], recipe: Mapping) -> tuple[int, ...]:
    """The on-disk shape of HF tensor ``t`` for a weight of logical ``shape``."""
    cls = format_class(fm.format)
    rec = cls._recipe_from_json({**recipe, **fm.recipe})
    spec = next(s for s in cls.component_specs(shape, rec) if s.name == t.component)
    cshape = spec.shape(shape)
    if t.codec == "vec1":
        return tuple(cshape) + (1,)
    if t.codec == "rows16":
        return tuple(shape[:-1]) + (cshape[-1],)
    if t.codec == "blocks":
        return tuple(cshape[:-1]) + (cshape[-1] // _BLOCK_BYTES, _BLOCK_BYTES)
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


# ----------------------------------------------------------------------------- E8M0 bytes
def e8m0_to_fp32(x: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 ``2^(b - 127)``, exact (:func:`ckptq.numerics.e8m0_to_fp32`:
    byte 0 is the subnormal 2^-127, byte 255 NaN)."""
    return numerics.e8m0_to_fp32(x.view(torch.uint8))


def fp32_to_e8m0(x: torch.Tensor, what: str) -> torch.Tensor:
    """fp32 powers of two in [2^-127, 2^127] -> their E8M0 bytes (uint8), exact.

    Raises:
        UnsupportedFormatError: a value that is not such a power of two (names ``what`` and the fix).
    """
    bits = x.to(_F32).contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    ok = (bits == 0x00400000) | (((bits & 0x807FFFFF) == 0) & (exp >= 1) & (exp <= 254))
    if not bool(ok.all()):
        bad = x.reshape(-1)[~ok.reshape(-1)][:3].tolist()
        raise UnsupportedFormatError(
            f"{what}: scale values {bad} are not powers of two in [2^-127, 2^127], which an E8M0 byte cannot "
            f"hold; requantize with --format fp8_block (pow2 scales) or --ignore the tensor"
        )
    return numerics.e8m0_from_fp32(x)  # exact for these (no mantissa to round up)


def check_e8m0_finite(fm: FormatMap, x: torch.Tensor, what: str) -> None:
    """Raise CheckpointFormatError when ``fm``'s consumer does not decode E8M0 byte 255 as NaN (gpt-oss,
    compressed-tensors MXFP4: a ``2^128`` multiplier) and the scale bytes ``x`` hold one: ckptq and the
    consumer would disagree on the tensor's values."""
    if fm.e8m0_nan:
        return
    b = x.view(torch.uint8)
    if bool((b == 255).any()):
        n = int((b == 255).sum())
        raise CheckpointFormatError(
            f"{what}: {n} E8M0 scale byte(s) are 255 (NaN in the OCP MX spec and in ckptq; this layout's "
            f"consumer multiplies by 2^128 instead), so the tensor has no value both agree on; fix or "
            f"requantize the source tensor from a finite copy (ckptq.requantize)"
        )


# ----------------------------------------------------------------------------- NVFP4 amax record
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
    fm: FormatMap,
    stored: Mapping[str, torch.Tensor],
    shape: Sequence[int],
    recipe: Mapping | None = None,
    amax_record: torch.Tensor | None = None,
    where: str = "",
) -> dict[str, torch.Tensor]:
    """ckptq components of one weight from its HF tensors ``{suffix: tensor}`` (bytes as stored).

    ``recipe`` (from :func:`import_recipe`) with ``per_tensor="amax"`` where the layout stores
    another NVFP4 convention: ``amax_record`` (the exporter's ``ckptq.amax`` record, batch shape)
    replaces the stored global scale, after checking that it gives that value back.

    Raises:
        CheckpointFormatError: the record does not give the stored global scale (names ``where``).
    """
    comps: dict[str, torch.Tensor] = {}
    batch = tuple(shape[:-2])
    dtypes = {c.name: c.dtype for c in format_class(fm.format).component_specs(shape, format_class(fm.format).Recipe())}
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
        elif t.codec == "view":
            comps[t.component] = x.view(dtypes[t.component])
        elif t.codec == "blocks":
            comps[t.component] = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
        elif t.codec == "e8m0":
            comps[t.component] = e8m0_to_fp32(x)
    layout_pt = fm.recipe.get("per_tensor")
    wanted = layout_pt if recipe is None else recipe.get("per_tensor", "amax")  # JSON omits ckptq's own
    if layout_pt is None or wanted == layout_pt:
        return comps
    cls = format_class(fm.format)
    if amax_record is None or tuple(amax_record.shape) != batch:
        raise CheckpointFormatError(f"{where}: no usable ckptq.amax record of shape {list(batch)} for '{where}'")
    ours = cls.from_components(
        {"data": comps["data"], "scale": comps["scale"], wanted: amax_record},
        shape,
        torch.float32,
        cls._recipe_from_json({"per_tensor": wanted}),
    )
    back, _ = ours.with_per_tensor(layout_pt)
    if not torch.equal(back.components()[layout_pt].view(torch.int32), comps[layout_pt].view(torch.int32)):
        raise CheckpointFormatError(
            f"{where}: the file's ckptq.amax record does not give the stored {layout_pt} of this tensor; the file "
            f"was changed after ckptq exported it. Delete the 'ckptq.amax.*' entries of its __metadata__ to "
            f"import the stored global scales as they are"
        )
    return ours.components()


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
            f"{'; FP4 packs two values per byte' if fmt in PACKED_FP4 else ''}); "
            f"--ignore '{fqn}' to keep it in high precision, pad K, or choose another --format"
        )
    if fm.ndim is not None and len(shape) != fm.ndim:
        raise UnsupportedFormatError(
            f"tensor '{fqn}' of shape {list(shape)}: layout '{lay.name}' holds only {fm.ndim}-D {fmt} tensors "
            f"(stacked experts (E, out, in)); --ignore '{fqn}' to keep it in bf16, or export to another --layout"
        )


def export_plan(
    fm: FormatMap, module: str, shape: Sequence[int], recipe: Mapping, stored: Mapping | None = None
) -> list[tuple[str, torch.dtype, tuple]]:
    """``[(hf name, dtype, shape)]`` of one weight in layout format ``fm`` (before any data is read);
    ``stored`` (:func:`stored_layout`) overrides the dtype / shape of the tensors it names."""
    stored = stored or {}
    return [
        (fm.name(module, t), *stored.get(t.suffix, (t.dtype, expected_shape(t, fm, shape, recipe)))) for t in fm.tensors
    ]


def export_tensors(
    fm: FormatMap, module: str, qt: Any, stored: Mapping | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict]:
    """The HF tensors of one canonical weight ``qt``: ``({hf name: tensor}, {metadata key: text}, numerics)``.

    ``stored`` (:func:`stored_layout`): tensors written in the dtype / shape the source had (a bf16
    scale imported from compressed-tensors goes back as the same bf16 bytes); the narrowing must be
    exact, else CheckpointFormatError (the values are no longer the imported ones).

    NVFP4 in another global-scale convention than the layout's is written with
    :meth:`~ckptq.formats.NVFP4Tensor.with_per_tensor` (``numerics``: ``{"max_ulps": n}``, fp32 ulps
    between the consumer's decode and ``qt``'s over the scales that occur; 0 = bit-exact), and an
    ``amax`` is recorded in the metadata (:func:`amax_metadata_key`).
    """
    stored = stored or {}
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    info: dict = {}
    shape = tuple(qt.shape)
    batch = shape[:-2]
    layout_pt = fm.recipe.get("per_tensor")
    comps = qt.components()
    if layout_pt is not None and qt.recipe.per_tensor != layout_pt:
        converted, info["max_ulps"] = qt.with_per_tensor(layout_pt)
        if qt.recipe.per_tensor == "amax":
            name = fm.name(module, next(t for t in fm.tensors if t.component == layout_pt))
            meta[amax_metadata_key(name)] = encode_amax(comps["amax"])
        comps = converted.components()
    for t in fm.tensors:
        name = fm.name(module, t)
        x = comps[t.component]
        if t.component == "scale":
            check_e8m0_finite(fm, x, f"tensor '{name}'")
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
        if t.codec == "view":
            y = x.view(t.dtype)
        elif t.codec == "blocks":
            y = x.reshape(*x.shape[:-1], x.shape[-1] // _BLOCK_BYTES, _BLOCK_BYTES)
        elif t.codec == "e8m0":
            y = fp32_to_e8m0(x, f"tensor '{name}'").view(t.dtype)
        elif t.codec == "vec1":
            y = x.reshape(batch + (1,))
        elif t.codec == "rows16" and getattr(qt.recipe, "two_d", False):
            y = x.repeat_interleave(16, dim=-2)[..., : shape[-2], :]
        else:
            y = x
        if y.dtype != t.dtype:
            raise CheckpointFormatError(
                f"tensor '{module}': component '{t.component}' is {y.dtype}, layout wants {t.dtype}"
            )
        out[name] = y.contiguous()
    return out, meta, info


def amax_record_names(fm: FormatMap, module: str, recipe: Mapping) -> list[str]:
    """HF names whose ``ckptq.amax`` record :func:`export_tensors` writes for a weight of ``recipe``
    (what the exporter reserves header room for): the layout's NVFP4 global scale when the
    tensor's convention is ckptq's ``amax``."""
    layout_pt = fm.recipe.get("per_tensor")
    if layout_pt is None or recipe.get("per_tensor", "amax") != "amax":
        return []
    return [f"{module}.{t.suffix}" for t in fm.tensors if t.component == layout_pt]


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
    "deepseek-v4": (
        "transformers (from_pretrained: DeepseekV4ForCausalLM, FineGrainedFP8 with scale_fmt ue8m0 and "
        "expert_dtype fp4; dequantize on load on CPU; needs accelerate), DeepSeek-V4's inference code"
    ),
    "gpt-oss": "transformers (from_pretrained with Mxfp4Config; dequantize=True on CPU), vLLM",
    "torchao": "torchao's unflatten_tensor_state_dict (transformers' torchao integration)",
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
      float32 model the decoded bf16 weight then fails the model's forward (dtype mismatch). MXFP4
      (``mxfp4-pack-quantized``) likewise (an E2M1 value times a power of two is a bf16 value). NVFP4
      decodes in bf16 too (the same failure; its values: ``numerics`` of the export, the global scale).
    * DeepSeek FP8 and DeepSeek-V4: transformers 5.24 ``integrations/finegrained_fp8.py``
      ``Fp8Dequantize`` (CPU, or a GPU without FP8) multiplies in fp32 and casts to the parameter's
      dtype: equal, but it derives the block size as dims // grid, so an ``fp8_block`` weight's dims
      must be multiples of 128 or at most 128 (one block). V4's E8M0 scales widen to fp32 exactly,
      and its FP4 experts unpack low nibble first with a ``(M, K/32)`` grid, i.e. 1x32 blocks:
      ``mxfp4`` is always equal (docs/producers.md 7.4).
    """
    data = tensors[fm.name(module, fm.data)]
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
    if lay.name == "compressed-tensors" and fm.format in ("mxfp8", "mxfp4", "nvfp4"):
        if dtype != torch.bfloat16:
            return ConsumerDecode(
                "unloadable",
                reason=f"compressed-tensors 0.20 decodes {fm.format.upper()} to bfloat16 whatever the model dtype; "
                f"the {dtype_to_str(dtype)} model's forward then fails (dtype mismatch)",
            )
        return ConsumerDecode("equal" if fm.format in ("mxfp8", "mxfp4") else "unchecked")
    if lay.name in ("deepseek-fp8", "deepseek-v4"):
        m, k = data.shape[-2:]
        # a dim of one block (<= 128) decodes right whatever its size; a longer one must be whole blocks
        if fm.format == "fp8_block" and any(d > 128 and d % 128 for d in (m, k)):
            return ConsumerDecode(
                "unloadable",
                reason=f"transformers 5.24 Fp8Dequantize takes the block as the weight's dims over the scale "
                f"grid, which is not 128 x 128 for a {m} x {k} weight (it fails or decodes wrong blocks)",
            )
        return ConsumerDecode("equal")
    return ConsumerDecode("unchecked")

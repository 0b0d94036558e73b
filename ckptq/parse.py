"""Parsing of user-supplied option text: meshes, placements, placement rules, ``--to`` targets, dtypes,
recipe options and choices (the CLI's flags and the string arguments of the library calls).

Every parser raises :class:`ckptq.UsageError` (the CLI exits 2) with a message naming the flag;
values that are already typed objects (a ``MeshSpec``, a ``torch.dtype``, ...) pass through.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .errors import UnsupportedFormatError, UsageError
from .formats import FORMATS
from .formats.base import dtype_to_str
from .numerics import HP_FORMATS
from .placement import PRESETS, TP_RULES, MeshSpec, PlacementRules

__all__ = [
    "HP_DTYPES",
    "FP8_DTYPES",
    "parse_mesh",
    "parse_placement",
    "parse_placement_rules",
    "parse_choice",
    "parse_hp_dtype",
    "parse_target",
    "parse_block",
    "parse_fp8_dtype",
    "parse_recipe",
]

#: the names of the high-precision dtypes: torch's (``bfloat16``) and the short ones (``bf16``)
HP_DTYPES = {
    **{dtype_to_str(dtype): dtype for dtype in HP_FORMATS},
    **{short: dtype for dtype, short in HP_FORMATS.items()},
}
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def parse_mesh(text: str | MeshSpec) -> MeshSpec:
    """``"dp_shard=4,tp=2"`` (or ``"4"`` for a 1-D mesh named ``dp_shard``) as a :class:`MeshSpec`."""
    if isinstance(text, MeshSpec):
        return text
    text = str(text).strip()
    if re.fullmatch(r"\d+", text):
        if int(text) < 1:
            raise UsageError(f"--mesh {text}: a mesh has at least 1 rank (e.g. --mesh 8 or --mesh dp_shard=4,tp=2)")
        return MeshSpec(("dp_shard",), (int(text),))
    names, sizes = [], []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([A-Za-z_][\w]*)\s*=\s*(\d+)\s*", part)
        if m and int(m.group(2)) < 1:
            raise UsageError(f"--mesh {text}: mesh dim '{m.group(1)}' has size {m.group(2)}; sizes are >= 1")
        if not m:
            raise UsageError(
                f"--mesh {text}: expected a rank count such as 8, or comma-separated name=size pairs "
                f"such as dp_shard=4,tp=2"
            )
        names.append(m.group(1))
        sizes.append(int(m.group(2)))
    if len(set(names)) != len(names):
        raise UsageError(f"--mesh {text}: repeated mesh dim name")
    return MeshSpec(tuple(names), tuple(sizes))


_PLACEMENT_RE = re.compile(
    r"\s*(?:(R|Replicate)(?:\(\))?|(?:S|Shard)\((\d+)\)|(?:SS|_StridedShard)\((\d+)\s*,\s*(?:sf=|split_factor=)?(\d+)\))\s*"
)


def parse_placement(text: str | Placement) -> Placement:
    """``"R"``/``"Replicate()"``, ``"S(1)"``/``"Shard(1)"``, ``"SS(0,2)"``/``"_StridedShard(0, 2)"``."""
    if isinstance(text, Placement):
        return text
    m = _PLACEMENT_RE.fullmatch(str(text))
    if not m:
        raise UsageError(f"placement '{text}': expected R, S(d), Shard(d), SS(d,sf) or _StridedShard(d, sf)")
    if m.group(1):
        return Replicate()
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return _StridedShard(int(m.group(3)), split_factor=int(m.group(4)))


def parse_placement_rules(
    mesh: MeshSpec, plan: str | PlacementRules, rules: Sequence[str] | Mapping[str, str] = ()
) -> PlacementRules:
    """The placement rules (:class:`PlacementRules`) that ``--plan`` names (a preset name or a
    JSON/YAML file of FQN glob -> placement strings) with ``--rule`` values ``GLOB=col|row`` (or a
    ``{glob: "col"|"row"}`` mapping)."""
    if isinstance(plan, PlacementRules):
        return plan
    plan = str(plan)
    if plan in PRESETS:
        if isinstance(rules, Mapping):
            return _placement_rules(mesh, plan, rules)
        parsed = {}
        for r in rules:
            if "=" not in r:
                raise UsageError(f"--rule {r}: expected GLOB=col or GLOB=row")
            k, v = (s.strip() for s in r.rsplit("=", 1))
            if v not in TP_RULES:
                raise UsageError(f"--rule {k}={v}: expected {' or '.join(TP_RULES)}")
            parsed[k] = v
        return _placement_rules(mesh, plan, parsed)
    path = Path(plan)
    if not path.is_file():
        raise UsageError(f"--plan {plan}: neither a preset ({', '.join(PRESETS)}) nor a file")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise UnsupportedFormatError("YAML placement files need PyYAML (pip install pyyaml); or use JSON") from None
        load, load_errors = yaml.safe_load, yaml.YAMLError
    else:
        load, load_errors = json.loads, ValueError
    try:
        data = load(path.read_text())
    except load_errors as e:
        raise UsageError(f"--plan {path}: cannot parse it: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, (list, tuple)) for v in data.values()):
        raise UsageError(f"--plan {path}: expected a mapping of FQN glob -> list of placements")
    return _placement_rules(mesh, "file", {k: [parse_placement(p) for p in v] for k, v in data.items()})


def check_rules(placement_rules: PlacementRules, fqns: Sequence[str], *, allow_unmatched: bool = False) -> list[str]:
    """The ``--rule`` globs of ``placement_rules`` that match no tensor of ``fqns`` (the source checkpoint's).

    Raises:
        UsageError: ``--rule`` given with a plan other than fsdp2-tp (which alone takes rules), or
            globs that match nothing and not ``allow_unmatched`` (the message names the globs, some
            of the tensors and ``--allow-unmatched``).
    """
    if placement_rules.preset not in ("fsdp2-tp", "file") and placement_rules.rules:
        raise UsageError(f"--rule applies to --plan fsdp2-tp only (the plan is {placement_rules.preset})")
    unmatched = placement_rules.unmatched_rules(fqns)
    if unmatched and not allow_unmatched:
        shown = ", ".join(list(fqns)[:6]) + (", ..." if len(fqns) > 6 else "")
        raise UsageError(
            f"--rule {', '.join(unmatched)}: matches no tensor of the checkpoint ({shown}); "
            f"fix the glob, or pass --allow-unmatched to go on with a warning"
        )
    return unmatched


def _placement_rules(mesh: MeshSpec, preset: str, rules: Mapping[str, Any]) -> PlacementRules:
    """``PlacementRules(mesh, preset, rules)``, its usage errors naming the ``--plan`` flag."""
    try:
        return PlacementRules(mesh, preset, rules)
    except UsageError as e:
        raise UsageError(f"--plan {e}") from None


def parse_choice(flag: str, value: str | None, choices: Sequence[str]) -> str | None:
    """``value`` (``None`` passes) if it is one of ``choices`` (``-`` and ``_`` are the same), in
    the library's spelling (``high-precision`` -> ``high_precision``)."""
    if value is None:
        return None
    norm = str(value).replace("-", "_")
    if norm not in {c.replace("-", "_") for c in choices}:
        raise UsageError(f"{flag} {value}: expected one of {list(choices)}")
    return norm


def parse_hp_dtype(value: str | torch.dtype, flag: str = "--dtype") -> torch.dtype:
    """A high-precision storage dtype: a name of :data:`HP_DTYPES` or one of their ``torch.dtype``."""
    if isinstance(value, torch.dtype) and value in HP_DTYPES.values():
        return value
    if value not in HP_DTYPES:
        raise UsageError(f"{flag} {value}: expected one of {list(HP_DTYPES)}")
    return HP_DTYPES[value]


def parse_target(to: str) -> str:
    """The ``--to`` target: ``native`` (every quantized tensor natively in its own format), a
    quantized format name, or a high-precision dtype name."""
    if to != "native" and to not in FORMATS and to not in HP_DTYPES:
        raise UsageError(
            f"--to {to}: expected native (keep each tensor's format), a format ({', '.join(sorted(FORMATS))}) "
            f"or a high-precision dtype ({', '.join(HP_DTYPES)})"
        )
    return to


def parse_block(text: str | Sequence[int] | None) -> tuple[int, int] | None:
    """``--block`` ``"1x128"`` (or ``"1,128"``, or a pair of ints) as ``(1, 128)``; ``None`` passes."""
    if text is None or isinstance(text, (tuple, list)):
        return None if text is None else tuple(text)
    parts = str(text).lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise UsageError(f"--block {text}: expected BMxBK such as 1x128 or 128x128")
    return (int(parts[0]), int(parts[1]))


def parse_fp8_dtype(text: str | torch.dtype | None) -> torch.dtype | None:
    """``--fp8-dtype`` ``e4m3`` or ``e5m2`` (or one of their ``torch.dtype``); ``None`` passes."""
    if text is None or (isinstance(text, torch.dtype) and text in FP8_DTYPES.values()):
        return text
    if text not in FP8_DTYPES:
        raise UsageError(f"--fp8-dtype {text}: expected e4m3 or e5m2")
    return FP8_DTYPES[text]


def parse_recipe(to: str, **options: Any) -> dict:
    """The recipe options of ``--to`` (``block``, ``two_d``, ``columnwise``, ``fp8_dtype``,
    ``pow2``, ``scale_rule``; ``None`` = the format's default) as a recipe dict; options the target does not
    take are usage errors."""
    recipe = {
        **options,
        "block": parse_block(options.get("block")),
        "fp8_dtype": parse_fp8_dtype(options.get("fp8_dtype")),
    }
    recipe = {k: v for k, v in recipe.items() if v is not None}
    if to in FORMATS:
        extra = sorted(set(recipe) - {f.name for f in dataclasses.fields(FORMATS[to].Recipe)})
        if extra:
            raise UsageError(f"--to {to} does not take {', '.join('--' + e.replace('_', '-') for e in extra)}")
    elif recipe:
        raise UsageError(f"--to {to}: recipe options apply only to quantized formats")
    return recipe

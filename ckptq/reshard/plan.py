"""Planning a reshard / convert from metadata alone: one :class:`TensorJob` per output entry.

:func:`plan_reshard` decides, for every logical entry of the source (after grouped stack/split),
what is written (quantized in a format and recipe, a plain tensor of a dtype, or a verbatim bytes
record), its placements and target boxes on the mesh, the first target rank holding each distinct
box, the stored bytes per rank, and whether a native tensor would be cut inside a block (a problem
that stops the run before anything is written, or a note when it is written in high precision).
Nothing is read but the metadata.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import math
import re
from collections.abc import Collection, Mapping
from pathlib import Path

import torch

from .. import chunks
from .._gc import gc_paused
from ..checkpoint import CheckpointView
from ..contract import HIGH_PRECISION, MODES, NATIVE, Entry
from ..errors import CheckpointFormatError, ShardingError, UnsupportedFormatError
from ..formats import FORMATS, format_class
from ..formats.base import dtype_to_str
from ..parse import HP_DTYPES
from ..placement import MeshSpec, PlacementRules, dim_intervals, first_owner_boxes, format_placements, rank_boxes

__all__ = ["TensorJob", "ReshardPlan", "plan_reshard", "merge_summaries", "MISALIGNED", "GROUPED"]

#: What ``misaligned`` may say: stop (write nothing) or write those tensors dequantized.
MISALIGNED = ("error", HIGH_PRECISION)
#: What ``grouped`` may say.
GROUPED = ("stack", "split")


@dataclasses.dataclass
class TensorJob:
    """How one output entry is produced and where its chunks go (placements, owner ranks)."""

    fqn: str  # output logical name
    sources: list[Entry]  # one, or the members of a grouped stack
    member: int | None  # grouped split: index into the source's leading dim
    out: str  # "quantized", "tensor" or "bytes"
    out_format: str | None
    out_recipe: dict | None
    out_dtype: torch.dtype | None  # stored dtype of a tensor entry / logical dtype of quantized
    shape: tuple[int, ...]
    placements: tuple
    owners: list[tuple[int, chunks.Box]]  # (rank, box), first rank of each distinct box
    bytes_per_rank: dict[int, int]
    problem: str | None = None
    note: str | None = None

    def source_boxes(self) -> dict[str, list | None]:
        """What its owners' boxes read of the source: DCP key -> the boxes of that entry (per
        component of a quantized source, :func:`ckptq.chunks.component_box`), None for all of it
        (a bytes entry, or a component box that does not map). A job that transforms its tensors
        reads them whole instead (:meth:`ckptq.checkpoint.CheckpointView.read`)."""
        out: dict[str, list | None] = {}

        def add(key: str, box) -> None:
            if box is None or out.get(key, []) is None:
                out[key] = None
            else:
                out.setdefault(key, []).append(box)

        for _, (off, size) in self.owners:
            if self.out == "bytes":
                add(self.sources[0].fqn, None)
                continue
            if len(self.sources) > 1:  # grouped stack: the members the box covers, without their index
                parts = [(self.sources[i], (off[1:], size[1:])) for i in range(off[0], off[0] + size[0])]
            elif self.member is not None:  # grouped split: one slice of the 3-D source
                parts = [(self.sources[0], ((self.member, *off), (1, *size)))]
            else:
                parts = [(self.sources[0], (tuple(off), tuple(size)))]
            for src, box in parts:
                if src.kind != "quantized":
                    add(src.fqn, box)
                    continue
                desc = src.descriptor
                cls = format_class(desc.format)
                for spec in cls.component_specs(src.shape, cls._recipe_from_json(desc.recipe)):
                    try:
                        add(src.keys[spec.name], chunks.component_box(spec, src.shape, box))
                    except ShardingError:
                        add(src.keys[spec.name], None)
        return out


@dataclasses.dataclass
class ReshardPlan:
    """The plan: jobs, bytes per target rank and alignment problems (nothing read yet).

    ``ranks`` None: the whole plan (every target rank). Else the part of the target ranks
    ``ranks`` (increasing): the jobs with a box those ranks write, each with only those owners and
    bytes -- the corresponding slice of the whole plan -- plus every job with a problem (decided
    on every rank's boxes, as in the whole plan), so that :attr:`problems` is the whole plan's.
    ``placement_rules`` and ``options`` (the keyword arguments of :func:`plan_reshard`) are what it
    was planned with, so that :meth:`whole_jobs` can plan chosen jobs for every rank."""

    src: Path
    mesh: MeshSpec
    jobs: list[TensorJob]
    ranks: tuple[int, ...] | None = None
    placement_rules: PlacementRules | None = None
    options: dict = dataclasses.field(default_factory=dict)

    def whole_jobs(self, view: CheckpointView, fqns: Collection[str]) -> list[TensorJob]:
        """The jobs of output entries ``fqns`` with every target rank's boxes (plan order): this
        plan's own when it is whole, else planned again from ``view`` for those entries alone."""
        wanted = set(fqns)
        if not wanted:
            return []
        if self.ranks is None:
            return [j for j in self.jobs if j.fqn in wanted]
        return plan_reshard(view, self.mesh, self.placement_rules, **self.options, fqns=wanted).jobs

    @property
    def problems(self) -> list[str]:
        return [j.problem for j in self.jobs if j.problem]

    def bytes_per_rank(self) -> dict[int, int]:
        out: dict[int, int] = {r: 0 for r in (range(self.mesh.world_size) if self.ranks is None else self.ranks)}
        for j in self.jobs:
            for r, b in j.bytes_per_rank.items():
                out[r] += b
        return out

    def summary(self) -> dict:
        """JSON-friendly description (what ``--dry-run`` prints)."""
        per_rank = self.bytes_per_rank()
        return {
            "source": str(self.src),
            "mesh": str(self.mesh),
            "world_size": self.mesh.world_size,
            "ranks": [
                {
                    "rank": r,
                    "file": f"__{r}_0.distcp",
                    "bytes": b,
                    "chunks": sum(1 for j in self.jobs for rr, _ in j.owners if rr == r),
                }
                for r, b in per_rank.items()
            ],
            "tensors": [
                {
                    "fqn": j.fqn,
                    "out": j.out,
                    "format": j.out_format or (dtype_to_str(j.out_dtype) if j.out_dtype else "bytes"),
                    "shape": list(j.shape),
                    "placements": format_placements(j.placements) if j.placements else "",
                    "problem": j.problem,
                    "note": j.note,
                }
                for j in self.jobs
            ],
            "problems": self.problems,
        }


def merge_summaries(summaries: list[dict]) -> dict:
    """The whole plan's :meth:`ReshardPlan.summary` from those of per-rank plans of one plan that
    together cover every target rank (a rank or tensor in several of them is the same row in each):
    ranks in rank order, tensors in plan order (by output FQN)."""
    ranks = {r["rank"]: r for s in summaries for r in s["ranks"]}
    tensors = {t["fqn"]: t for s in summaries for t in s["tensors"]}
    return {
        **summaries[0],
        "ranks": [ranks[r] for r in sorted(ranks)],
        "tensors": [tensors[f] for f in sorted(tensors)],
    }


# --------------------------------------------------------------------------------------- planning
_MEMBER_RE = re.compile(r"^(?P<stem>.*?)(?P<idx>\d+)$")


def _recipe_of(e: Entry) -> Mapping | None:
    """The JSON recipe of a quantized or high-precision entry (None for a plain one)."""
    return e.descriptor.recipe if e.descriptor is not None else None


def _groups_to_stack(view: CheckpointView, glob: str) -> dict[str, list[Entry]]:
    found: dict[str, dict[int, Entry]] = {}
    for e in view.entries():
        m = _MEMBER_RE.match(e.fqn)
        if e.kind == "bytes" or not m or not fnmatch.fnmatchcase(m.group("stem"), glob):
            continue
        found.setdefault(m.group("stem"), {})[int(m.group("idx"))] = e
    groups = {}
    for stem, members in found.items():
        n = len(members)
        if sorted(members) != list(range(n)) or n < 2 or stem in view:
            continue
        ms = [members[i] for i in range(n)]
        first = ms[0]
        for e in ms[1:]:
            if (e.kind, e.shape, e.dtype) != (first.kind, first.shape, first.dtype) or (
                _recipe_of(e) != _recipe_of(first) or e.format != first.format
            ):
                raise CheckpointFormatError(
                    f"grouped stack '{stem}': member '{e.fqn}' ({e.format or e.dtype}, {e.shape}) differs "
                    f"from '{first.fqn}' ({first.format or first.dtype}, {first.shape}); members must share "
                    f"shape, format and recipe"
                )
        groups[stem] = ms
    return groups


@gc_paused()  # many small acyclic objects; the GC's passes over an opened table cost more than planning
def plan_reshard(
    view: CheckpointView,
    mesh: MeshSpec,
    placement_rules: PlacementRules,
    *,
    mode: str | None = None,
    hp_dtype: torch.dtype = torch.bfloat16,
    to: str | None = None,
    to_recipe: dict | None = None,
    grouped: str | None = None,
    grouped_glob: str = "*weight",
    misaligned: str = "error",
    ranks: Collection[int] | None = None,
    fqns: Collection[str] | None = None,
) -> ReshardPlan:
    """Plan a reshard/convert of ``view`` onto ``mesh`` with ``placement_rules`` (reads metadata only).

    Args:
        mode: ``None`` keeps each tensor's mode; ``"native"`` re-encodes high-precision entries of
            quantized tensors in their recorded format; ``"high_precision"`` dequantizes to ``hp_dtype``.
        to: convert quantized (and high-precision quantized) tensors to this format
            (``nvfp4``, ``mxfp8``, ``fp8_block``, ``fp8_tensor``) with ``to_recipe``, or to a plain
            dtype name (``bfloat16``, ``float16``, ``float32``).
        grouped: ``"stack"`` turns ``X0..X{N-1}`` (stems matching ``grouped_glob``) into one
            (N, ...) entry ``X``; ``"split"`` turns 3-D entries matching ``grouped_glob`` into
            ``X0..X{N-1}``. Per-member scales and amax become / come from the leading batch dim.
        misaligned: ``"error"`` (default: report and write nothing) or ``"high_precision"``
            (write those tensors dequantized).
        ranks: plan only what these target ranks write (their files): the slice of the whole plan
            with their boxes (:attr:`ReshardPlan.ranks`), each rank's box computed alone
            (:func:`~ckptq.placement.first_owner_boxes`) rather than every rank's. None: every rank.
        fqns: plan only these output entries (after grouped stack/split; None: all of them).

    Raises:
        UnsupportedFormatError: bad options or a rank outside the mesh. CheckpointFormatError:
            inconsistent grouped members.
    """
    if mode is not None and mode not in MODES:
        raise UnsupportedFormatError(f"mode '{mode}': expected {' or '.join(MODES)}")
    if misaligned not in MISALIGNED:
        raise UnsupportedFormatError(f"misaligned='{misaligned}': expected {' or '.join(MISALIGNED)}")
    if grouped is not None and grouped not in GROUPED:
        raise UnsupportedFormatError(f"grouped='{grouped}': expected stack or split")
    if to is not None and to not in FORMATS and to not in HP_DTYPES:
        raise UnsupportedFormatError(f"--to {to}: expected one of {sorted(FORMATS)} or {sorted(HP_DTYPES)}")
    if to in FORMATS:
        format_class(to).Recipe(**(to_recipe or {}))  # validate early
    if ranks is not None:
        ranks = tuple(sorted(set(ranks)))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < mesh.world_size)]
        if bad:
            raise UnsupportedFormatError(f"ranks {bad[:4]}: mesh {mesh} has ranks 0..{mesh.world_size - 1}")

    units: list[tuple[str, list[Entry], int | None]] = []
    stacked = _groups_to_stack(view, grouped_glob) if grouped == "stack" else {}
    in_group = {e.fqn for ms in stacked.values() for e in ms}
    for e in view.entries():
        if e.fqn in in_group:
            continue
        if grouped == "split" and e.kind != "bytes" and len(e.shape) == 3 and fnmatch.fnmatchcase(e.fqn, grouped_glob):
            units += [(f"{e.fqn}{i}", [e], i) for i in range(e.shape[0])]
        else:
            units.append((e.fqn, [e], None))
    units += [(stem, ms, None) for stem, ms in stacked.items()]
    units.sort(key=lambda u: u[0])

    if grouped == "stack" and not stacked:
        raise UnsupportedFormatError(f"--grouped stack: no entries X0..X(N-1) with stem matching '{grouped_glob}'")
    options = dict(
        mode=mode,
        hp_dtype=hp_dtype,
        to=to,
        to_recipe=to_recipe,
        grouped=grouped,
        grouped_glob=grouped_glob,
        misaligned=misaligned,
    )
    if fqns is not None:
        units = [u for u in units if u[0] in fqns]
    jobs = [
        _plan_job(fqn, sources, member, mesh, placement_rules, mode, hp_dtype, to, to_recipe, misaligned, ranks)
        for fqn, sources, member in units
    ]
    if ranks is not None:  # the jobs these ranks write, and every problem (a run stops on any)
        jobs = [j for j in jobs if j.owners or j.problem]
    return ReshardPlan(view.path, mesh, jobs, ranks, placement_rules, options)


def _plan_job(
    fqn, sources, member, mesh, placement_rules, mode, hp_dtype, to, to_recipe, misaligned, ranks=None
) -> TensorJob:
    src = sources[0]
    if src.kind == "bytes":
        owners, sizes = ([(0, ((), ()))], {0: 0}) if ranks is None or 0 in ranks else ([], {})
        return TensorJob(fqn, sources, None, "bytes", None, None, None, (), (), owners, sizes)
    shape = tuple(src.shape)
    if len(sources) > 1:
        shape = (len(sources),) + shape
    if member is not None:
        shape = shape[1:]
    desc = src.descriptor
    out, fmt, recipe, dtype = "tensor", None, None, src.dtype
    if src.kind == "quantized":
        out, fmt, recipe = "quantized", desc.format, dict(desc.recipe)
    elif desc is not None and mode == NATIVE:  # high-precision entry of a quantized tensor
        out, fmt, recipe, dtype = "quantized", desc.format, dict(desc.recipe), desc.dtype
    if to is not None and desc is not None:
        if to in FORMATS:
            out, fmt, recipe = "quantized", to, dict(to_recipe or {})
            dtype = desc.dtype
        else:
            out, fmt, recipe, dtype = "tensor", None, None, HP_DTYPES[to]
    if out == "quantized" and mode == HIGH_PRECISION:
        out, fmt, recipe, dtype = "tensor", None, None, hp_dtype
    foreign_note = desc.note if desc is not None and src.kind == "tensor" and out == "quantized" else None
    if foreign_note and misaligned != "error":  # keep its exact values (see ckptq.io.foreign)
        out, fmt, recipe, dtype = "tensor", None, None, src.dtype
    placements = placement_rules.placements(fqn, len(shape))
    owners = (
        _owners(shape, mesh, placements, fqn)
        if ranks is None
        else first_owner_boxes(shape, mesh, placements, ranks, fqn=fqn)
    )
    job = TensorJob(fqn, sources, member, out, fmt, recipe, dtype, shape, placements, owners, {})
    if foreign_note:
        if misaligned == "error":
            job.problem = f"tensor '{fqn}' ({desc.format}): {foreign_note}"
        else:
            job.note = f"kept in high precision ({dtype_to_str(dtype)}): {foreign_note}"
    if out == "quantized":
        cls = format_class(fmt)
        specs = cls.component_specs(shape, cls._recipe_from_json(recipe))
        align = chunks.alignment(specs, len(shape))
        # Every rank's boxes decide, in a per-rank plan too: there by the per-dim intervals, and
        # if one is cut inside a block, the first such box in rank order names it.
        checked = owners
        if ranks is not None:
            fine = _intervals_aligned(align, shape, dim_intervals(shape, mesh, placements, fqn=fqn))
            checked = [] if fine else _owners(shape, mesh, placements, fqn)
        try:
            for _, b in checked:
                if not chunks.is_aligned(align, shape, b):
                    chunks.check_aligned(specs, shape, b, fqn=fqn, fmt=fmt)  # raises with details
        except ShardingError as e:
            if misaligned == "error":
                job.problem = str(e)
            else:
                job.out, job.out_format, job.out_recipe, job.out_dtype = "tensor", None, None, hp_dtype
                job.note = f"written in high precision ({dtype_to_str(hp_dtype)}): {e}"
    key = _json_key(job.out_recipe)
    for r, b in owners:
        job.bytes_per_rank[r] = job.bytes_per_rank.get(r, 0) + _box_bytes(job, b, key)
    return job


def _owners(shape: tuple, mesh: MeshSpec, placements: tuple, fqn: str) -> list[tuple[int, chunks.Box]]:
    """(rank, box) of the first rank holding each distinct non-empty box (rank order); an empty
    tensor: rank 0's (empty) box, so that the entry exists."""
    boxes = rank_boxes(shape, mesh, placements, fqn=fqn)
    owners, seen = [], set()
    for r, b in enumerate(boxes):
        if b not in seen and math.prod(b[1]) > 0:
            seen.add(b)
            owners.append((r, b))
    return owners or [(0, boxes[0])]


def _intervals_aligned(align: tuple, shape: tuple, intervals: list) -> bool:
    """Whether every non-empty box made of one interval of ``intervals[d]`` per dim is
    block-aligned (:func:`ckptq.chunks.is_aligned` tests each dim alone: each interval is tested
    as a 1-D box of its dim; dims of alignment 1 need no test)."""
    if math.prod(shape) == 0:
        return True  # its one box is empty
    for d, ivs in enumerate(intervals):
        a, full = (align[d],), (shape[d],)
        if a[0] > 1 and not all(chunks.is_aligned(a, full, ((off,), (size,))) for off, size in ivs):
            return False
    return True


def _box_bytes(job: TensorJob, box: chunks.Box, recipe_key: str) -> int:
    """Stored bytes of ``box`` of the job's output (quantized: the components that follow the
    matrix dims; per-tensor scalars are counted once, not per box)."""
    if job.out != "quantized" or job.problem:
        return math.prod(box[1]) * job.out_dtype.itemsize
    total = 0
    for itemsize, dims in _spec_dims(job.out_format, recipe_key, len(job.shape)):
        if dims:
            n = itemsize
            for d, div in dims:
                n *= _component_extent(box[0][d], box[1][d], div, job.shape[d])
            total += n
    return total


def _json_key(recipe: dict | None) -> str:
    return json.dumps(recipe, sort_keys=True, default=dtype_to_str)  # fp8_dtype may be a torch.dtype


@functools.cache
def _spec_dims(fmt: str, recipe_json: str, ndim: int) -> tuple:
    """Per component of a rank-``ndim`` tensor: (itemsize, ((logical dim, divisor), ...)) -- only
    components that follow a matrix dim; sizes along any shape follow from these."""
    cls = format_class(fmt)
    probe_shape = (1,) * ndim
    out = []
    for spec in cls.component_specs(probe_shape, cls._recipe_from_json(json.loads(recipe_json))):
        if not spec.is_per_tensor(ndim):
            out.append((spec.dtype.itemsize, tuple((dm.logical_dim, dm.divisor) for dm in spec.dims)))
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _component_extent(off: int, size: int, div: int, full: int) -> int:
    if size == 0:
        return 0
    return chunks.cdiv(off + size, div) - off // div

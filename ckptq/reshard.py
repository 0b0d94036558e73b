"""Offline resharding and format conversion of DCP checkpoints, streaming tensor by tensor.

``reshard(src, dst, mesh, plan)`` lays a checkpoint out for a target mesh: each target rank's chunks
go into its own storage file (``__{rank}_0.distcp``), so a rank reads one file at load time. It needs
no process group. Every tensor is planned first (placements, boxes, block alignment, bytes per rank)
and nothing is written if any native tensor would be cut inside a block (unless told to export those
tensors in high precision). Then each logical tensor is read once (all its saved chunks), transformed
if asked (``--mode``, ``--to``, grouped stack/split) and its target chunks are appended to the rank
files. Peak memory is about one source tensor plus its transformed copy plus one chunk, whatever the
checkpoint size. Output goes to a temporary sibling directory renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from . import chunks
from .checkpoint import CheckpointView, open_checkpoint
from .contract import CKPTQ_KEY, Entry, emit_components, high_precision_descriptor, make_record, native_descriptor
from .errors import CheckpointFormatError, CkptqError, ShardingError, UnsupportedFormatError
from .formats import FORMATS, format_class, requantize
from .formats.base import QuantizedTensor, dtype_to_str, slice_box, str_to_dtype
from .layout import LayoutPlan, MeshSpec, format_placements, rank_boxes
from .metrics import sqnr_db
from .io.writer import CheckpointDirWriter, commit_dir, staging_dir

__all__ = ["TensorJob", "ReshardPlan", "plan_reshard", "run_reshard", "reshard_checkpoint", "convert_checkpoint",
           "HP_DTYPES"]

from .parse import HP_DTYPES  # noqa: E402  (user-facing names live with the parsing; re-exported)


@dataclasses.dataclass
class TensorJob:
    """How one output entry is produced and laid out."""

    fqn: str  # output logical name
    sources: list[Entry]  # one, or the members of a grouped stack
    member: Optional[int]  # grouped split: index into the source's leading dim
    out: str  # "quantized", "tensor" or "bytes"
    out_format: Optional[str]
    out_recipe: Optional[dict]
    out_dtype: Optional[torch.dtype]  # stored dtype of a tensor entry / logical dtype of quantized
    shape: tuple[int, ...]
    placements: tuple
    owners: list[tuple[int, chunks.Box]]  # (rank, box), first rank of each distinct box
    bytes_per_rank: dict[int, int]
    problem: Optional[str] = None
    note: Optional[str] = None


@dataclasses.dataclass
class ReshardPlan:
    """The full plan: jobs, bytes per target rank and alignment problems (nothing read yet)."""

    src: Path
    mesh: MeshSpec
    jobs: list[TensorJob]

    @property
    def problems(self) -> list[str]:
        return [j.problem for j in self.jobs if j.problem]

    def bytes_per_rank(self) -> dict[int, int]:
        out: dict[int, int] = {r: 0 for r in range(self.mesh.world_size)}
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
                {"rank": r, "file": f"__{r}_0.distcp", "bytes": b,
                 "chunks": sum(1 for j in self.jobs for rr, _ in j.owners if rr == r)}
                for r, b in per_rank.items()
            ],
            "tensors": [
                {"fqn": j.fqn, "out": j.out, "format": j.out_format or (dtype_to_str(j.out_dtype) if j.out_dtype else "bytes"),
                 "shape": list(j.shape), "placements": format_placements(j.placements) if j.placements else "",
                 "problem": j.problem, "note": j.note}
                for j in self.jobs
            ],
            "problems": self.problems,
        }


# --------------------------------------------------------------------------------------- planning
_MEMBER_RE = re.compile(r"^(?P<stem>.*?)(?P<idx>\d+)$")


def _groups_to_stack(view: CheckpointView, glob: str) -> dict[str, list[Entry]]:
    import fnmatch

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
                (e.descriptor or {}).get("recipe") != (first.descriptor or {}).get("recipe")
                or e.format != first.format
            ):
                raise CheckpointFormatError(
                    f"grouped stack '{stem}': member '{e.fqn}' ({e.format or e.dtype}, {e.shape}) differs "
                    f"from '{first.fqn}' ({first.format or first.dtype}, {first.shape}); members must share "
                    f"shape, format and recipe"
                )
        groups[stem] = ms
    return groups


def plan_reshard(
    view: CheckpointView,
    mesh: MeshSpec,
    layout: LayoutPlan,
    *,
    mode: Optional[str] = None,
    hp_dtype: torch.dtype = torch.bfloat16,
    to: Optional[str] = None,
    to_recipe: Optional[dict] = None,
    grouped: Optional[str] = None,
    grouped_glob: str = "*weight",
    misaligned: str = "error",
) -> ReshardPlan:
    """Plan a reshard/convert of ``view`` onto ``mesh`` with ``layout`` (reads metadata only).

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

    Raises:
        UnsupportedFormatError: bad options. CheckpointFormatError: inconsistent grouped members.
    """
    if mode not in (None, "native", "high_precision"):
        raise UnsupportedFormatError(f"mode '{mode}': expected native or high_precision")
    if misaligned not in ("error", "high_precision"):
        raise UnsupportedFormatError(f"misaligned='{misaligned}': expected error or high_precision")
    if grouped not in (None, "stack", "split"):
        raise UnsupportedFormatError(f"grouped='{grouped}': expected stack or split")
    if to is not None and to not in FORMATS and to not in HP_DTYPES:
        raise UnsupportedFormatError(f"--to {to}: expected one of {sorted(FORMATS)} or {sorted(HP_DTYPES)}")
    if to in FORMATS:
        format_class(to).Recipe(**(to_recipe or {}))  # validate early

    units: list[tuple[str, list[Entry], Optional[int]]] = []
    stacked = _groups_to_stack(view, grouped_glob) if grouped == "stack" else {}
    in_group = {e.fqn for ms in stacked.values() for e in ms}
    import fnmatch

    for e in view.entries():
        if e.fqn in in_group:
            continue
        if grouped == "split" and e.kind != "bytes" and len(e.shape) == 3 and fnmatch.fnmatchcase(e.fqn, grouped_glob):
            units += [(f"{e.fqn}{i}", [e], i) for i in range(e.shape[0])]
        else:
            units.append((e.fqn, [e], None))
    units += [(stem, ms, None) for stem, ms in stacked.items()]
    units.sort(key=lambda u: u[0])

    jobs = [
        _plan_job(fqn, sources, member, mesh, layout, mode, hp_dtype, to, to_recipe, misaligned)
        for fqn, sources, member in units
    ]
    if grouped == "stack" and not stacked:
        raise UnsupportedFormatError(f"--grouped stack: no entries X0..X(N-1) with stem matching '{grouped_glob}'")
    return ReshardPlan(view.path, mesh, jobs)


def _plan_job(fqn, sources, member, mesh, layout, mode, hp_dtype, to, to_recipe, misaligned) -> TensorJob:
    src = sources[0]
    if src.kind == "bytes":
        return TensorJob(fqn, sources, None, "bytes", None, None, None, (), (), [(0, ((), ()))], {0: 0})
    shape = tuple(src.shape)
    if len(sources) > 1:
        shape = (len(sources),) + shape
    if member is not None:
        shape = shape[1:]
    desc = src.descriptor
    out, fmt, recipe, dtype = "tensor", None, None, src.dtype
    if src.kind == "quantized":
        out, fmt, recipe = "quantized", desc["format"], desc.get("recipe", {})
    elif desc is not None and mode == "native":  # high-precision entry of a quantized tensor
        out, fmt, recipe, dtype = "quantized", desc["format"], desc.get("recipe", {}), str_to_dtype(desc["dtype"])
    if to is not None and desc is not None:
        if to in FORMATS:
            out, fmt, recipe = "quantized", to, dict(to_recipe or {})
            dtype = str_to_dtype(desc["dtype"])
        else:
            out, fmt, recipe, dtype = "tensor", None, None, HP_DTYPES[to]
    if out == "quantized" and mode == "high_precision":
        out, fmt, recipe, dtype = "tensor", None, None, hp_dtype
    foreign_note = desc.get("note") if desc is not None and src.kind == "tensor" and out == "quantized" else None
    if foreign_note and misaligned != "error":  # keep its exact values (see ckptq.io.foreign)
        out, fmt, recipe, dtype = "tensor", None, None, src.dtype
    placements = layout.placements(fqn, len(shape))
    boxes = rank_boxes(shape, mesh, placements, fqn=fqn)
    owners, seen = [], set()
    for r, b in enumerate(boxes):
        if b not in seen and math.prod(b[1]) > 0:
            seen.add(b)
            owners.append((r, b))
    if not owners:  # an empty tensor: still one (empty) chunk, so that the entry exists
        owners = [(0, boxes[0])]
    job = TensorJob(fqn, sources, member, out, fmt, recipe, dtype, shape, placements, owners, {})
    if foreign_note:
        if misaligned == "error":
            job.problem = f"tensor '{fqn}' ({desc['format']}): {foreign_note}"
        else:
            job.note = f"kept in high precision ({dtype_to_str(dtype)}): {foreign_note}"
    if out == "quantized":
        cls = format_class(fmt)
        specs = cls.component_specs(shape, cls._recipe_from_json(recipe))
        align = chunks.alignment(specs, len(shape))
        try:
            for _, b in owners:
                if not chunks.is_aligned(align, shape, b):
                    chunks.check_aligned(specs, shape, b, fqn=fqn, fmt=fmt)  # raises with details
        except ShardingError as e:
            if misaligned == "error":
                job.problem = str(e)
            else:
                job.out, job.out_format, job.out_recipe, job.out_dtype = "tensor", None, None, hp_dtype
                job.note = f"written in high precision ({dtype_to_str(hp_dtype)}): {e}"
    key = json_key(job.out_recipe)
    for r, b in owners:
        job.bytes_per_rank[r] = job.bytes_per_rank.get(r, 0) + _box_bytes(job, b, key)
    return job


def _box_bytes(job: TensorJob, box: chunks.Box, recipe_key: str) -> int:
    """Stored bytes of ``box`` of the job's output (quantized: the components that follow the
    matrix dims; per-tensor scalars are counted once, not per box)."""
    if job.out != "quantized" or job.problem:
        return math.prod(box[1]) * _itemsize(job.out_dtype)
    total = 0
    for itemsize, dims in _spec_dims(job.out_format, recipe_key, len(job.shape)):
        if dims:
            n = itemsize
            for d, div in dims:
                n *= _component_extent(box[0][d], box[1][d], div, job.shape[d])
            total += n
    return total


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def json_key(recipe: Optional[dict]) -> str:
    import json

    return json.dumps(recipe, sort_keys=True, default=dtype_to_str)  # fp8_dtype may be a torch.dtype


@functools.lru_cache(maxsize=None)
def _spec_dims(fmt: str, recipe_json: str, ndim: int) -> tuple:
    """Per component of a rank-``ndim`` tensor: (itemsize, ((logical dim, divisor), ...)) -- only
    components that follow a matrix dim; sizes along any shape follow from these."""
    import json

    cls = format_class(fmt)
    probe_shape = (1,) * ndim
    out = []
    for spec in cls.component_specs(probe_shape, cls._recipe_from_json(json.loads(recipe_json))):
        if spec.follows(ndim - 1) or spec.follows(ndim - 2):
            out.append((_itemsize(spec.dtype), tuple((dm.logical_dim, dm.divisor) for dm in spec.dims)))
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _component_extent(off: int, size: int, div: int, full: int) -> int:
    if size == 0:
        return 0
    return chunks.cdiv(off + size, div) - off // div


# --------------------------------------------------------------------------------------- running
def _materialize(view: CheckpointView, job: TensorJob) -> tuple[Any, Optional[float]]:
    """Read the job's source(s) and produce the whole output tensor, plus the SQNR (dB) of its
    values against the source's when it had to be re-encoded (else None)."""
    parts = [view.read(e.fqn) for e in job.sources]
    if len(parts) > 1:  # grouped stack: per-member components gain a leading batch dim
        if isinstance(parts[0], QuantizedTensor):
            q0 = parts[0]
            comps = {k: torch.stack([p._components[k] for p in parts]) for k in q0._components}
            src: Any = type(q0)(comps, (len(parts),) + tuple(q0.shape), q0.dtype, q0.recipe)
        else:
            src = torch.stack(parts)
    else:
        src = parts[0]
    del parts
    if job.member is not None:  # grouped split: member i of the leading (batch) dim
        i = job.member
        if isinstance(src, QuantizedTensor):
            sub = slice_box(src, ((i,) + (0,) * (src.ndim - 1), (1,) + tuple(src.shape[1:])))
            src = type(sub)({k: v[0] for k, v in sub._components.items()}, tuple(src.shape[1:]), src.dtype, src.recipe)
        else:
            src = src[i]
    if job.out == "quantized":
        cls = format_class(job.out_format)
        recipe = cls._recipe_from_json(job.out_recipe)
        if isinstance(src, cls) and src.recipe == recipe:
            return src, None
        out = requantize(src, job.out_format, **dataclasses.asdict(recipe))
        if out.dtype != job.out_dtype:
            out = type(out)(out._components, out.shape, job.out_dtype, out.recipe)
        ref = src.dequantize(torch.float32) if isinstance(src, QuantizedTensor) else src.float()
        return out, sqnr_db(ref, out.dequantize(torch.float32))
    values = src.dequantize(job.out_dtype) if isinstance(src, QuantizedTensor) else src
    return (values.to(job.out_dtype) if values.dtype != job.out_dtype else values), None


def run_reshard(
    view: CheckpointView,
    plan: ReshardPlan,
    dst: Union[str, os.PathLike],
    *,
    overwrite: bool = False,
    progress: Optional[Callable[[int], None]] = None,
) -> dict:
    """Execute ``plan`` into ``dst`` (a new directory; an existing one needs ``overwrite``).

    Writes into a temporary sibling and renames it into place only when complete, so an error
    leaves ``dst`` as it was; the source is only read.

    Returns:
        ``{"path", "world_size", "bytes_per_rank", "tensors", "requantized": {fqn: sqnr_db}}``.

    Raises:
        ShardingError: the plan has alignment problems (nothing is written).
        CkptqError: ``dst`` exists (without ``overwrite``) or overlaps the source.
    """
    dst = Path(dst).absolute()
    src = view.path.absolute()
    if dst == src or src in dst.parents or dst in src.parents:
        raise CkptqError(f"destination {dst} overlaps the source {src}; choose a separate directory")
    if dst.exists() and not overwrite:
        raise CkptqError(f"destination {dst} exists; pass --overwrite to replace it")
    if plan.problems:
        raise ShardingError(
            f"{len(plan.problems)} tensor(s) cannot be laid out natively on mesh {plan.mesh}:\n  "
            + "\n  ".join(plan.problems)
            + "\nNothing was written. Use --misaligned high-precision to export them dequantized."
        )
    tmp = staging_dir(dst)
    writer = CheckpointDirWriter(tmp)
    descriptors: dict[str, dict] = {}
    mappings: dict[str, tuple] = {}
    requantized: dict[str, float] = {}
    try:
        for job in plan.jobs:
            _write_job(view, job, writer, descriptors, mappings, requantized)
            if progress:
                progress(sum(job.bytes_per_rank.values()))
        writer.finish({**mappings, CKPTQ_KEY: make_record(descriptors, plan.mesh.world_size, mesh=str(plan.mesh))})
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, dst)
    return {
        "path": str(dst),
        "world_size": plan.mesh.world_size,
        "bytes_per_rank": writer.bytes_per_rank,
        "tensors": len(plan.jobs),
        "requantized": requantized,
    }


def _write_job(view, job: TensorJob, writer: CheckpointDirWriter, descriptors, mappings, requantized) -> None:
    src = job.sources[0]
    if job.out == "bytes":
        record, transforms = view.read_raw_bytes(src.fqn)
        writer.add_bytes(0, job.fqn, record, transforms)
        if view.mapping(src.fqn):
            mappings[job.fqn] = view.mapping(src.fqn)
        return
    out, sqnr = _materialize(view, job)
    if sqnr is not None:
        requantized[job.fqn] = sqnr
    base = view.mapping(src.fqn) if len(job.sources) == 1 and job.member is None else None
    if isinstance(out, QuantizedTensor):
        kept = sqnr is None and src.descriptor is not None  # the source's bytes: its producer record stays
        desc = native_descriptor(out, job.fqn, out.shape, producer=src.descriptor.get("producer") if kept else None)
        written: set = set()
        for rank, box in job.owners:
            for c in emit_components(slice_box(out, box, fqn=job.fqn), job.fqn, out.shape, box):
                if (c.key, c.box[0]) in written or math.prod(c.box[1]) == 0:
                    continue
                written.add((c.key, c.box[0]))
                writer.add_chunk(rank, c.key, c.size, c.box[0], c.tensor)
        if base is not None:
            for name, comp in desc["components"].items():
                mappings[comp["fqn"]] = (*base[:-1], f"{base[-1]}.{name}")
        descriptors[job.fqn] = desc
        return
    for rank, box in job.owners:
        writer.add_chunk(rank, job.fqn, out.shape, box[0], chunks.narrow_box(out, box))
    if src.descriptor is not None:  # a high-precision entry of a quantized tensor keeps its record
        descriptors[job.fqn] = high_precision_descriptor(src.descriptor, out.dtype, out.shape)
    if base is not None:
        mappings[job.fqn] = base


# --------------------------------------------------------------------------------------- one call per command
def reshard_checkpoint(
    src: Union[str, os.PathLike],
    dst: Union[str, os.PathLike],
    *,
    mesh: Union[str, MeshSpec] = "1",
    plan: Union[str, LayoutPlan] = "fsdp2",
    rules: Union[list[str], tuple[str, ...]] = (),
    mode: Optional[str] = None,
    dtype: Union[str, torch.dtype] = "bfloat16",
    grouped: Optional[str] = None,
    grouped_glob: str = "*weight",
    misaligned: str = "error",
    overwrite: bool = False,
    dry_run: bool = False,
    progress: Union[bool, Callable[[int], None], None] = None,
) -> dict:
    """Lay checkpoint ``src`` out for a target mesh in ``dst`` (``ckptq reshard``): plan, then write.

    Args:
        mesh: ``"dp_shard=4,tp=2"``, ``"8"`` or a :class:`MeshSpec`.
        plan: a preset (``replicate``, ``fsdp2``, ``fsdp2-tp``), a JSON/YAML file of FQN glob ->
            placements, or a :class:`LayoutPlan`; ``rules``: fsdp2-tp ``GLOB=col|row`` strings.
        mode: ``None`` (keep), ``"native"`` or ``"high-precision"`` for every quantized tensor.
        dtype: storage dtype of high-precision output (``bfloat16``, ``float16``, ``float32``, ...).
        grouped: ``"stack"`` / ``"split"`` grouped weights whose stems match ``grouped_glob``.
        misaligned: ``"error"`` or ``"high-precision"`` (export tensors whose cuts split blocks).
        overwrite: replace an existing ``dst``. dry_run: plan only, write nothing.
        progress: ``True`` for a tqdm bar on stderr, or a callable given the bytes of each tensor written.

    Returns:
        ``{"plan": ReshardPlan.summary()}`` and, unless ``dry_run``, the keys of :func:`run_reshard`'s report.

    Raises:
        UsageError: option text that does not parse. ShardingError: misaligned tensors (nothing is
        written). CkptqError: ``dst`` exists or overlaps ``src``; see :func:`plan_reshard`.
    """
    from . import parse

    options = dict(
        mode=parse.parse_choice("--mode", mode, ("native", "high-precision")),
        hp_dtype=parse.parse_hp_dtype(dtype),
        grouped=parse.parse_choice("--grouped", grouped, ("stack", "split")),
        grouped_glob=grouped_glob,
    )
    return _plan_and_run(src, dst, mesh, plan, rules, misaligned, options, overwrite, dry_run, progress)


def convert_checkpoint(
    src: Union[str, os.PathLike],
    dst: Union[str, os.PathLike],
    *,
    to: str,
    block: Union[str, tuple[int, int], None] = None,
    two_d: Optional[bool] = None,
    columnwise: Optional[bool] = None,
    fp8_dtype: Union[str, torch.dtype, None] = None,
    pow2: Optional[bool] = None,
    mesh: Union[str, MeshSpec] = "1",
    plan: Union[str, LayoutPlan] = "fsdp2",
    rules: Union[list[str], tuple[str, ...]] = (),
    misaligned: str = "error",
    overwrite: bool = False,
    dry_run: bool = False,
    progress: Union[bool, Callable[[int], None], None] = None,
) -> dict:
    """Requantize every quantized tensor of ``src`` to format ``to`` into ``dst`` (``ckptq convert``),
    or dequantize it to a high-precision dtype, optionally laying it out for another mesh.

    Args:
        to: ``native`` (every quantized tensor natively in its own format, e.g. a TransformerEngine
            checkpoint's tensors as ckptq components), ``nvfp4``, ``mxfp8``, ``fp8_block``,
            ``fp8_tensor``, or ``bfloat16``/``float16``/``float32``.
        block, two_d, columnwise, fp8_dtype, pow2: recipe options of ``to`` (``None``: its default);
            ``block`` ``"1x128"``, ``fp8_dtype`` ``"e4m3"``/``"e5m2"``.
        mesh, plan, rules, misaligned, overwrite, dry_run, progress: as :func:`reshard_checkpoint`.

    Returns:
        As :func:`reshard_checkpoint`.

    Raises:
        UsageError: an unknown ``to``, a recipe option ``to`` does not take, option text that does
        not parse; otherwise as :func:`reshard_checkpoint`.
    """
    from . import parse

    to = parse.parse_target(to)
    recipe = parse.parse_recipe(to, block=block, two_d=two_d, columnwise=columnwise, fp8_dtype=fp8_dtype, pow2=pow2)
    if to == "native":  # every quantized tensor natively in its own format
        options = dict(mode="native", hp_dtype=torch.bfloat16)
    else:
        options = dict(to=to, to_recipe=recipe, hp_dtype=HP_DTYPES.get(to, torch.bfloat16))
    return _plan_and_run(src, dst, mesh, plan, rules, misaligned, options, overwrite, dry_run, progress)


def _plan_and_run(src, dst, mesh, plan, rules, misaligned, options, overwrite, dry_run, progress) -> dict:
    from . import parse

    misaligned = parse.parse_choice("--misaligned", misaligned, ("error", "high-precision"))
    mesh = parse.parse_mesh(mesh)
    layout = parse.parse_plan(mesh, plan, rules)
    view = open_checkpoint(src)
    rplan = plan_reshard(view, mesh, layout, misaligned=misaligned, **options)
    summary = rplan.summary()
    if dry_run:
        return {"plan": summary}
    if progress is True:
        from tqdm import tqdm

        total = sum(r["bytes"] for r in summary["ranks"])
        with tqdm(total=total, unit="B", unit_scale=True, desc="writing", leave=False) as bar:
            report = run_reshard(view, rplan, dst, overwrite=overwrite, progress=bar.update)
    else:
        report = run_reshard(view, rplan, dst, overwrite=overwrite, progress=progress or None)
    return {**report, "plan": summary}

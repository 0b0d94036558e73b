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

import contextlib
import dataclasses
import functools
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import chunks
from .checkpoint import CheckpointView, open_checkpoint
from .contract import (
    CKPTQ_KEY,
    Entry,
    component_fqn,
    emit_components,
    high_precision_descriptor,
    make_record,
    native_descriptor,
)
from .errors import CheckpointFormatError, CkptqError, ShardingError, UnsupportedFormatError
from .formats import FORMATS, format_class, from_components, requantize
from .formats.base import QuantizedTensor, dtype_to_str, slice_box, str_to_dtype
from .io.writer import CheckpointDirWriter, check_destination, commit_dir, encode_chunk, staging_dir
from .layout import LayoutPlan, MeshSpec, format_placements, rank_boxes
from .metrics import sqnr_db

__all__ = [
    "TensorJob",
    "ReshardPlan",
    "plan_reshard",
    "run_reshard",
    "reshard_checkpoint",
    "convert_checkpoint",
    "HP_DTYPES",
]

from .parse import HP_DTYPES  # noqa: E402  (user-facing names live with the parsing; re-exported)


@dataclasses.dataclass
class TensorJob:
    """How one output entry is produced and laid out."""

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
                (e.descriptor or {}).get("recipe") != (first.descriptor or {}).get("recipe") or e.format != first.format
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
    mode: str | None = None,
    hp_dtype: torch.dtype = torch.bfloat16,
    to: str | None = None,
    to_recipe: dict | None = None,
    grouped: str | None = None,
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

    units: list[tuple[str, list[Entry], int | None]] = []
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


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def json_key(recipe: dict | None) -> str:
    import json

    return json.dumps(recipe, sort_keys=True, default=dtype_to_str)  # fp8_dtype may be a torch.dtype


@functools.cache
def _spec_dims(fmt: str, recipe_json: str, ndim: int) -> tuple:
    """Per component of a rank-``ndim`` tensor: (itemsize, ((logical dim, divisor), ...)) -- only
    components that follow a matrix dim; sizes along any shape follow from these."""
    import json

    cls = format_class(fmt)
    probe_shape = (1,) * ndim
    out = []
    for spec in cls.component_specs(probe_shape, cls._recipe_from_json(json.loads(recipe_json))):
        if not spec.is_per_tensor(ndim):
            out.append((_itemsize(spec.dtype), tuple((dm.logical_dim, dm.divisor) for dm in spec.dims)))
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _component_extent(off: int, size: int, div: int, full: int) -> int:
    if size == 0:
        return 0
    return chunks.cdiv(off + size, div) - off // div


# --------------------------------------------------------------------------------------- running
def _materialize(view: CheckpointView, job: TensorJob, timing: dict | None = None) -> tuple[Any, float | None]:
    """Read the job's source(s) and produce the whole output tensor, plus the SQNR (dB) of its
    values against the source's when it had to be re-encoded (else None). ``timing["read"]`` gains
    the seconds spent reading the sources."""
    t0 = time.perf_counter()
    parts = [view.read(e.fqn) for e in job.sources]
    if timing is not None:
        timing["read"] = timing.get("read", 0.0) + time.perf_counter() - t0
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
    dst: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool | Callable[[int], None] | None = None,
    distributed: bool = False,
) -> dict:
    """Execute ``plan`` into ``dst`` (a new directory; an existing one needs ``overwrite``).

    Writes into a temporary sibling and renames it into place only when complete, so an error
    leaves ``dst`` as it was; the source is only read.

    Tensors whose bytes do not change (same format and recipe, or a plain tensor of the same dtype;
    DCP sources) are copied box by box from the byte ranges of the source chunks each target chunk
    overlaps. A target chunk that is a whole saved chunk is hashed (its recorded checksum checked)
    by reading it through a 1 MiB buffer, and copied file to file by the kernel on a writer thread
    (``copy_file_range``). Others are assembled (:meth:`CheckpointView.read_box`) in one of two
    chunk buffers, hashed, and appended on the writer thread while the next is read. Tensors whose
    bytes change are read whole, transformed and cut into their target chunks.

    Args:
        progress: called with the bytes of each chunk as it is queued for writing, or ``True`` for a
            tqdm bar on stderr (bytes and bytes/s; rank 0's share when distributed).
        distributed: split the work over the processes of the default ``torch.distributed`` process
            group (initialized from torchrun's environment with gloo if it is not yet): every
            record's file and offset is laid out first, the same on every process; each process
            computes and writes the tensors :func:`ckptq.distributed.assign` gives it (balanced by
            estimated work, so a requantized tensor is computed once) at their places in the
            target files of one staging directory; rank 0 writes ``.metadata`` and renames it into
            place once every process reported success. The output is the same bytes as one
            process's. Every process must call this with the same arguments.

    Returns:
        ``{"path", "world_size", "bytes_per_rank", "tensors", "requantized": {fqn: sqnr_db},
        "processes", "process_rank"}`` (in distributed mode: of the whole checkpoint, on every
        process; ``processes`` is 1 and ``process_rank`` 0 otherwise). ``seconds``: ``total`` (this
        call), ``transform`` (the kernels: re-encoding, dequantizing, SQNR of whole tensors) and
        ``whole_reads`` (reading those tensors), both summed over processes; the rest of ``total``
        is byte-range copying, hashing and writing.

    Raises:
        ShardingError: the plan has alignment problems (nothing is written).
        CkptqError: ``dst`` exists (without ``overwrite``) or overlaps the source; in distributed
            mode, on every process, when any process failed (naming the ranks and their errors).
    """
    t_start = time.perf_counter()
    dst = Path(dst).absolute()
    if not distributed:
        return _run(view, plan, dst, overwrite, progress, None, t_start)
    from .distributed import Group

    group = Group.default()
    try:
        return _run(view, plan, dst, overwrite, progress, group, t_start)
    finally:
        group.close()


def _run(view, plan: ReshardPlan, dst: Path, overwrite: bool, progress, group, t_start: float) -> dict:
    tmp = None
    if group is None or group.rank == 0:
        try:
            tmp = _prepare_output(view, plan, dst, overwrite)
        except BaseException as e:
            if group is None:
                raise
            tmp = e
    if group is not None:
        tmp = group.broadcast(tmp)
        if isinstance(tmp, BaseException):
            raise tmp
    writer = CheckpointDirWriter(tmp)
    state = _RunState()
    try:
        try:
            layout = _layout(view, plan)
            copies = [_copy_source(view, job) for job in plan.jobs]
            mine = set(range(len(plan.jobs))) if group is None else group.assign(_job_costs(layout, copies))
            total = sum(o.nbytes for i in mine for o in layout[i])
            with _progress(progress, total, show=group is None or group.rank == 0) as update:
                _execute(view, plan, layout, copies, mine, writer, state, update)
            local = writer.close_local()
        finally:
            if hasattr(view, "close"):
                view.close()
        if group is None:
            writer.finish(_planner_data(plan, state))
        else:
            results = group.gather_ok((local, state), to_root=True)  # raises on every rank if one failed
            if group.rank == 0:
                for shard, st in results[1:]:
                    writer.merge_local(shard)
                    state.merge(st)
                writer.finish(_planner_data(plan, state))
                commit_dir(tmp, dst)
            group.gather_ok("committed" if group.rank == 0 else "ok")
            results_state = group.broadcast(
                (writer.bytes_per_rank, state.requantized, state.transform_s, state.whole_read_s)
                if group.rank == 0
                else None
            )
            writer.bytes_per_rank, state.requantized, state.transform_s, state.whole_read_s = results_state
    except BaseException as e:
        writer.abort()
        if group is not None and not getattr(e, "ckptq_reported", False):
            group.report_failure(e)  # the others fail their next collective with this (once done writing)
        if group is None or group.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if group is None:
        commit_dir(tmp, dst)
    return {
        "path": str(dst),
        "world_size": plan.mesh.world_size,
        "bytes_per_rank": writer.bytes_per_rank,
        "tensors": len(plan.jobs),
        "requantized": state.requantized,
        "processes": 1 if group is None else group.size,
        "process_rank": 0 if group is None else group.rank,
        "seconds": {
            "total": time.perf_counter() - t_start,
            "transform": state.transform_s,
            "whole_reads": state.whole_read_s,
        },
    }


@contextlib.contextmanager
def _progress(progress: bool | Callable[[int], None] | None, total: int, *, show: bool):
    """The progress callback of a run: ``progress`` itself, or for ``True`` a tqdm bar of ``total``
    bytes on stderr (bytes and bytes/s), shown when ``show``."""
    if progress is not True:
        yield progress or None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", leave=False, disable=not show) as bar:
        yield bar.update


def _prepare_output(view, plan: ReshardPlan, dst: Path, overwrite: bool) -> Path:
    check_destination(view.path, dst, overwrite)
    if plan.problems:
        raise ShardingError(
            f"{len(plan.problems)} tensor(s) cannot be laid out natively on mesh {plan.mesh}:\n  "
            + "\n  ".join(plan.problems)
            + "\nNothing was written. Use --misaligned high-precision to export them dequantized."
        )
    return staging_dir(dst)


@dataclasses.dataclass
class _RunState:
    """What the jobs produce besides records: descriptors, flatten mappings, SQNRs (mergeable)."""

    descriptors: dict = dataclasses.field(default_factory=dict)
    mappings: dict = dataclasses.field(default_factory=dict)
    requantized: dict = dataclasses.field(default_factory=dict)
    transform_s: float = 0.0  # transforming whole tensors (the kernels: requantize, dequantize, SQNR)
    whole_read_s: float = 0.0  # reading whole tensors for them

    def merge(self, other: _RunState) -> None:
        self.descriptors.update(other.descriptors)
        self.mappings.update(other.mappings)
        self.requantized.update(other.requantized)
        self.transform_s += other.transform_s
        self.whole_read_s += other.whole_read_s


def _planner_data(plan: ReshardPlan, state: _RunState) -> dict:
    descriptors = {k: state.descriptors[k] for k in sorted(state.descriptors)}
    return {**state.mappings, CKPTQ_KEY: make_record(descriptors, plan.mesh.world_size, mesh=str(plan.mesh))}


#: Each job's records in a target file start at a multiple of this (DCP records may have gaps
#: between them): records of different jobs, which different processes may write, never share a page.
RECORD_ALIGN = 4096


@dataclasses.dataclass
class _Out:
    """One record of the output, laid out before anything is written: chunk ``box`` of entry
    ``key`` (global ``size``; ``part``: the component of a quantized tensor, else None) in target
    rank ``rank``'s file at byte ``at``, ``length`` bytes (the ``torch.save`` framing included;
    a bytes entry, ``dtype`` None: its verbatim record)."""

    rank: int
    key: str
    part: str | None
    size: tuple
    box: chunks.Box
    dtype: torch.dtype | None
    at: int = 0
    length: int = 0

    @property
    def nbytes(self) -> int:
        """Payload bytes (0 for a bytes entry)."""
        return 0 if self.dtype is None else math.prod(self.box[1]) * _itemsize(self.dtype)


def _job_records(view, job: TensorJob) -> list[_Out]:
    """The records ``job`` writes, in the order it writes them (the same dedup and skips as
    :func:`_write_job`: a component chunk that several ranks hold goes to the first; empty
    component chunks are not written)."""
    from .io.records import tensor_record

    if job.out == "bytes":  # small records (step counters, TE extra state): read for their length, not kept
        record, _ = view.read_raw_bytes(job.sources[0].fqn)
        return [_Out(0, job.fqn, None, (), ((), ()), None, length=len(record))]
    outs: list[_Out] = []
    if job.out == "quantized":
        cls = format_class(job.out_format)
        specs = cls.component_specs(job.shape, cls._recipe_from_json(job.out_recipe))
        seen: set = set()
        for rank, box in job.owners:
            for spec in specs:
                cbox = chunks.component_box(spec, job.shape, box, fqn=job.fqn, fmt=job.out_format)
                key = component_fqn(job.fqn, spec.name)
                if (key, cbox[0]) in seen or math.prod(cbox[1]) == 0:
                    continue
                seen.add((key, cbox[0]))
                outs.append(_Out(rank, key, spec.name, spec.shape(job.shape), cbox, spec.dtype))
    else:
        outs = [_Out(rank, job.fqn, None, job.shape, box, job.out_dtype) for rank, box in job.owners]
    for o in outs:
        o.length = tensor_record(o.dtype, tuple(o.box[1])).length
    return outs


def _layout(view, plan: ReshardPlan) -> list[list[_Out]]:
    """Every job's records with their place in the target files: job after job in plan order, a
    job's records in one file contiguous and starting at a multiple of :data:`RECORD_ALIGN`. The
    output is the same bytes however the jobs are split over processes (:func:`_job_costs`)."""
    ends: dict[int, int] = {}
    out = []
    for job in plan.jobs:
        outs = _job_records(view, job) if not job.problem else []
        started: set = set()
        for o in outs:
            pos = ends.get(o.rank, 0)
            if o.rank not in started:
                pos = -(-pos // RECORD_ALIGN) * RECORD_ALIGN
                started.add(o.rank)
            o.at, ends[o.rank] = pos, pos + o.length
        out.append(outs)
    return out


def _job_costs(layout: list[list[_Out]], copies: list[bool]) -> dict[int, int]:
    """Estimated work of each job for splitting jobs over processes: its payload bytes, times 4
    for a job whose bytes are transformed (``copies[i]`` False: read whole, re-encoded, SQNR: the
    convert benchmark in docs/benchmarks.md spends about 4x the copy's time per byte there); bytes
    entries count 1."""
    return {
        i: max(1, sum(o.nbytes for o in outs) * (1 if copy else 4))
        for i, (outs, copy) in enumerate(zip(layout, copies, strict=False))
    }


def _copy_source(view, job: TensorJob) -> bool:
    """Whether ``job``'s bytes are the source's unchanged (same format and recipe, or a plain tensor
    of the same dtype) and readable by byte range, so its chunks are copied, not computed."""
    if (
        job.out == "bytes"
        or len(job.sources) != 1
        or job.member is not None
        or job.problem
        or not hasattr(view, "saved_chunks")
    ):
        return False
    src = job.sources[0]
    if job.out == "quantized":
        if src.kind != "quantized" or src.format != job.out_format or src.dtype != job.out_dtype:
            return False
        cls = format_class(job.out_format)
        if cls._recipe_from_json(src.descriptor.get("recipe", {})) != cls._recipe_from_json(job.out_recipe):
            return False
    elif job.out != "tensor" or src.kind != "tensor" or src.dtype != job.out_dtype:
        return False
    return all(view.saved_chunks(key) is not None for key in src.keys.values())


def _src_key(job: TensorJob, o: _Out) -> str:
    """The source entry a copied record's bytes come from."""
    src = job.sources[0]
    return src.keys[o.part] if o.part is not None else src.fqn


def _copy_descriptor(job: TensorJob) -> dict | None:
    """The descriptor of a job copied by byte range (that of :func:`_write_job` for the same bytes)."""
    src = job.sources[0]
    if job.out == "tensor":
        return (
            high_precision_descriptor(src.descriptor, job.out_dtype, job.shape) if src.descriptor is not None else None
        )
    desc = dict(src.descriptor, shape=list(job.shape))
    probe = from_components(
        desc,
        {
            name: torch.empty(c["shape"], dtype=str_to_dtype(c["dtype"]), device="meta")
            for name, c in desc["components"].items()
        },
    )  # no data: for the descriptor
    return native_descriptor(probe, job.fqn, job.shape, producer=src.descriptor.get("producer"))


def _execute(
    view,
    plan: ReshardPlan,
    layout: list[list[_Out]],
    copies: list[bool],
    mine: set,
    writer: CheckpointDirWriter,
    state: _RunState,
    progress: Callable[[int], None] | None,
) -> None:
    """Write the records of jobs ``mine`` (indices into ``plan.jobs``) at their places in ``layout``;
    ``copies[i]``: job i's chunks are copied by byte range (:func:`_copy_source`)."""
    work = []
    biggest = 0
    for i in sorted(mine):
        job, outs, copy = plan.jobs[i], layout[i], copies[i]
        if copy:
            biggest = max([biggest] + [o.nbytes for o in outs if view.whole_chunk(_src_key(job, o), o.box) is None])
        work.append((job, outs, copy))
    with _WriterThread(writer, buffers=2, buffer_bytes=biggest) as pipe:
        for job, outs, copy in work:
            if not copy:
                _write_job(view, job, outs, pipe, state, progress)
                continue
            for o in outs:
                src_key = _src_key(job, o)
                whole = view.whole_chunk(src_key, o.box)
                if whole is not None:  # a saved chunk verbatim: hashed here, copied by the kernel there
                    sums = view.hash_chunk(whole)
                    pipe.add_copy(o, view.data_fd(whole), whole.payload, *sums)
                else:
                    buf = pipe.buffer(o.nbytes).view(o.dtype).view(o.box[1])
                    known = view.read_box(src_key, o.box, buf)
                    pipe.add_chunk(o, buf, reused=True, encode=True, known=known)
                if progress:
                    progress(o.nbytes)
            desc = _copy_descriptor(job)
            if desc is not None:
                state.descriptors[job.fqn] = desc
            base = view.mapping(job.sources[0].fqn)
            if base is not None:
                if job.out == "quantized":
                    for name, comp in desc["components"].items():
                        state.mappings[comp["fqn"]] = (*base[:-1], f"{base[-1]}.{name}")
                else:
                    state.mappings[job.fqn] = base


class _WriterThread:
    """Runs a :class:`CheckpointDirWriter`'s appends on one background thread, in order, so that
    reading the next chunk overlaps checksumming and writing this one. Chunks read into the
    reusable buffers (:meth:`buffer`) go back to the pool once written; at most ``buffers`` of
    them exist, and at most two other writes wait in the queue. An error on the thread is raised
    by the next call (or on exit)."""

    def __init__(self, writer: CheckpointDirWriter, *, buffers: int, buffer_bytes: int) -> None:
        import queue
        import threading

        self.writer = writer
        self._free: queue.Queue = queue.Queue()
        for _ in range(buffers):
            self._free.put(torch.empty(buffer_bytes, dtype=torch.uint8))
        self._jobs: queue.Queue = queue.Queue(maxsize=2)
        self._pending: torch.Tensor | None = None  # the buffer handed out last
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckptq-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._jobs.get()
            if fn is None:
                return
            if self._error is None:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                    self._error = e
            elif getattr(fn, "buffer", None) is not None:
                self._free.put(fn.buffer)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A free chunk buffer's first ``nbytes`` (uint8); waits for one to be written."""
        import queue

        while True:
            self._check()
            try:
                buf = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        self._pending = buf
        return buf[:nbytes]

    def _submit(self, fn: Callable[[], None], buffer: torch.Tensor | None = None) -> None:
        self._check()
        fn.buffer = buffer  # type: ignore[attr-defined]
        self._jobs.put(fn)

    def add_chunk(
        self,
        o: _Out,
        tensor: torch.Tensor,
        *,
        reused: bool = False,
        encode: bool = False,
        known: tuple[int, int] | None = None,
    ) -> None:
        """Queue ``tensor`` for writing as record ``o``; ``reused``: it lies in the last
        :meth:`buffer`, which goes back to the pool once written; ``encode``: hash it on this thread
        first (balancing the reading and writing threads), else on the writer thread; ``known``:
        its checksums (:func:`~ckptq.io.writer.encode_chunk`)."""
        if tuple(tensor.shape) != tuple(o.box[1]) or tensor.dtype != o.dtype:  # the layout predicted it
            raise CkptqError(
                f"internal error: '{o.key}' chunk {tuple(o.box[0])} is {tensor.dtype} "
                f"{tuple(tensor.shape)}, laid out as {o.dtype} {tuple(o.box[1])}; please report it"
            )
        buf = self._pending if reused else None
        chunk = encode_chunk(tensor, known=known) if encode else None

        def run() -> None:
            try:
                if chunk is not None:
                    self.writer.add_encoded(o.rank, o.key, o.size, o.box[0], chunk, at=o.at)
                else:
                    self.writer.add_chunk(o.rank, o.key, o.size, o.box[0], tensor, at=o.at)
            finally:
                if buf is not None:
                    self._free.put(buf)

        self._submit(run, buf)

    def add_bytes(self, o: _Out, record: bytes, transforms: Any) -> None:
        """Queue ``record`` (a verbatim non-tensor record, with its transform descriptors) as record ``o``."""
        self._submit(lambda: self.writer.add_bytes(o.rank, o.key, record, transforms, at=o.at))

    def add_copy(self, o: _Out, src_fd: int, src_offset: int, checksum: int, crc32: int) -> None:
        """Queue :meth:`CheckpointDirWriter.add_copy` of record ``o`` (a chunk copied file to file)."""
        self._submit(
            lambda: self.writer.add_copy(
                o.rank, o.key, o.size, o.box[0], o.dtype, o.box[1], src_fd, src_offset, checksum, crc32, at=o.at
            )
        )

    def __enter__(self) -> _WriterThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._jobs.put(None)
        self._thread.join()
        if exc[0] is None:
            self._check()


def _write_job(
    view, job: TensorJob, outs: list[_Out], writer, state: _RunState, progress: Callable[[int], None] | None
) -> None:
    """Read, transform and cut one job whose bytes change into its records ``outs`` (its part of
    the layout, in the order produced here)."""
    descriptors, mappings, requantized = state.descriptors, state.mappings, state.requantized
    src = job.sources[0]
    if job.out == "bytes":
        record, transforms = view.read_raw_bytes(src.fqn)
        if len(record) != outs[0].length:
            raise CheckpointFormatError(f"{view.path}: '{src.fqn}' changed while it was being read; run again")
        writer.add_bytes(outs[0], record, transforms)
        if view.mapping(src.fqn):
            mappings[job.fqn] = view.mapping(src.fqn)
        return
    t0, timing = time.perf_counter(), {}
    out, sqnr = _materialize(view, job, timing)
    state.whole_read_s += timing.get("read", 0.0)
    state.transform_s += time.perf_counter() - t0 - timing.get("read", 0.0)
    if sqnr is not None:
        requantized[job.fqn] = sqnr
    base = view.mapping(src.fqn) if len(job.sources) == 1 and job.member is None else None
    laid = iter(outs)
    if isinstance(out, QuantizedTensor):
        kept = sqnr is None and src.descriptor is not None  # the source's bytes: its producer record stays
        desc = native_descriptor(out, job.fqn, out.shape, producer=src.descriptor.get("producer") if kept else None)
        written: set = set()
        for _, box in job.owners:
            for c in emit_components(slice_box(out, box, fqn=job.fqn), job.fqn, out.shape, box):
                if (c.key, c.box[0]) in written or math.prod(c.box[1]) == 0:
                    continue
                written.add((c.key, c.box[0]))
                _write_laid(writer, next(laid, None), c.key, c.box[0], c.tensor, progress)
        if base is not None:
            for name, comp in desc["components"].items():
                mappings[comp["fqn"]] = (*base[:-1], f"{base[-1]}.{name}")
        descriptors[job.fqn] = desc
    else:
        for _, box in job.owners:
            _write_laid(writer, next(laid, None), job.fqn, box[0], chunks.narrow_box(out, box), progress)
        if src.descriptor is not None:  # a high-precision entry of a quantized tensor keeps its record
            descriptors[job.fqn] = high_precision_descriptor(src.descriptor, out.dtype, out.shape)
        if base is not None:
            mappings[job.fqn] = base
    if next(laid, None) is not None:
        raise CkptqError(f"internal error: '{job.fqn}' wrote fewer records than laid out; please report it")


def _write_laid(
    writer, o: _Out | None, key: str, offsets, tensor: torch.Tensor, progress: Callable[[int], None] | None
) -> None:
    """Write chunk ``tensor`` (entry ``key`` at ``offsets``) as the next laid-out record ``o``."""
    if o is None or o.key != key or tuple(o.box[0]) != tuple(offsets):
        raise CkptqError(
            f"internal error: '{key}' chunk {tuple(offsets)} was not laid out "
            f"(expected {o.key if o else None}); please report it"
        )
    writer.add_chunk(o, tensor)
    if progress:
        progress(tensor.nbytes)


# --------------------------------------------------------------------------------------- one call per command
def reshard_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    mesh: str | MeshSpec = "1",
    plan: str | LayoutPlan = "fsdp2",
    rules: list[str] | tuple[str, ...] = (),
    mode: str | None = None,
    dtype: str | torch.dtype = "bfloat16",
    grouped: str | None = None,
    grouped_glob: str = "*weight",
    misaligned: str = "error",
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool | Callable[[int], None] | None = None,
    distributed: bool = False,
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
        progress: ``True`` for a tqdm bar on stderr (bytes and bytes/s; rank 0's share when
            distributed), or a callable given the bytes of each chunk written.
        distributed: split the writing over the processes of a ``torch.distributed`` job (every
            process calls this with the same arguments; see :func:`run_reshard`). ``ckptq reshard``
            sets it when started by ``torchrun`` with more than one process.

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
    return _plan_and_run(src, dst, mesh, plan, rules, misaligned, options, overwrite, dry_run, progress, distributed)


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str,
    block: str | tuple[int, int] | None = None,
    two_d: bool | None = None,
    columnwise: bool | None = None,
    fp8_dtype: str | torch.dtype | None = None,
    pow2: bool | None = None,
    mesh: str | MeshSpec = "1",
    plan: str | LayoutPlan = "fsdp2",
    rules: list[str] | tuple[str, ...] = (),
    misaligned: str = "error",
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool | Callable[[int], None] | None = None,
    distributed: bool = False,
) -> dict:
    """Requantize every quantized tensor of ``src`` to format ``to`` into ``dst`` (``ckptq convert``),
    or dequantize it to a high-precision dtype, optionally laying it out for another mesh.

    Args:
        to: ``native`` (every quantized tensor natively in its own format, e.g. a TransformerEngine
            checkpoint's tensors as ckptq components), ``nvfp4``, ``mxfp8``, ``fp8_block``,
            ``fp8_tensor``, or ``bfloat16``/``float16``/``float32``.
        block, two_d, columnwise, fp8_dtype, pow2: recipe options of ``to`` (``None``: its default);
            ``block`` ``"1x128"``, ``fp8_dtype`` ``"e4m3"``/``"e5m2"``.
        mesh, plan, rules, misaligned, overwrite, dry_run, progress, distributed: as
            :func:`reshard_checkpoint` (distributed: each requantized tensor is computed by one process).

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
    return _plan_and_run(src, dst, mesh, plan, rules, misaligned, options, overwrite, dry_run, progress, distributed)


def _plan_and_run(src, dst, mesh, plan, rules, misaligned, options, overwrite, dry_run, progress, distributed) -> dict:
    from . import parse

    misaligned = parse.parse_choice("--misaligned", misaligned, ("error", "high-precision"))
    mesh = parse.parse_mesh(mesh)
    layout = parse.parse_plan(mesh, plan, rules)
    view = open_checkpoint(src)
    rplan = plan_reshard(view, mesh, layout, misaligned=misaligned, **options)
    summary = rplan.summary()
    if dry_run:
        return {"plan": summary}
    report = run_reshard(view, rplan, dst, overwrite=overwrite, progress=progress, distributed=distributed)
    return {**report, "plan": summary}

"""Executing a :class:`~ckptq.reshard.plan.ReshardPlan`: the file map of every job's records, then the writing.

Each job's records get their slots first (:mod:`ckptq.io.pipeline`: target file, byte offset and
length from dtypes and shapes alone), and each job is decided once as copied (its bytes are the
source's: target boxes read by byte range, or whole saved chunks copied file to file) or computed
(its source read whole on a thread, :func:`ckptq.reshard.transform.transform` on the CPU or a CUDA
device, then cut into its records). Records go through a
:class:`~ckptq.io.pipeline.WriterThread` into a staging directory renamed into place when complete
(:func:`ckptq.distributed.prepare_write_commit`: alone, or with the jobs split over the processes
of a ``torch.distributed`` job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import chunks
from ..checkpoint import CheckpointView
from ..contract import (
    CKPTQ_KEY,
    Descriptor,
    component_fqn,
    component_path,
    emit_components,
    high_precision_descriptor,
    make_record,
    native_descriptor,
)
from ..distributed import Group, assign, expect_shared_dir, file_share, prepare_write_commit
from ..errors import CheckpointFormatError, CkptqError, ShardingError, UsageError
from ..formats import format_class, from_components
from ..formats.base import QuantizedTensor, slice_box
from ..io import storage
from ..io.device import PrefetchStats, device_scope, prefetch, resolve_device, to_host
from ..io.pipeline import RecordSlot, WriterThread, assign_offsets
from ..io.writer import CheckpointDirWriter, check_destination, commit_dir, staging_dir, write_error
from . import transform
from .plan import ReshardPlan, TensorJob, merge_summaries

__all__ = ["run_reshard"]


def run_reshard(
    view: CheckpointView,
    plan: ReshardPlan,
    dst: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool | Callable[[int], None] | None = None,
    distributed: bool = False,
    device: str | torch.device | None = "auto",
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
            group (initialized from torchrun's environment with gloo if it is not yet): each process
            lays out and writes the target files :func:`ckptq.distributed.file_share` gives it, and
            ``plan`` need only hold those ranks (``plan_reshard(..., ranks=...)``; or every rank);
            tensors that are transformed are computed once, each by one process, for all their files
            (:func:`_share`); all write into one staging directory; rank 0 writes ``.metadata``
            from the processes' records and renames it into place once every process reported
            success. The output is the same bytes as one process's. Every process must call this
            with the same arguments (its own plan).
        device: where tensors that are re-encoded or dequantized are computed: ``"cpu"``,
            ``"cuda"`` / ``"cuda:N"``, or ``"auto"`` (CUDA when a device and ckptq's CUDA kernels are
            there, else the CPU; :func:`ckptq.io.device.resolve_device`). Their sources are read on a
            thread while the previous one is computed and, on CUDA, copied to the device on a side
            stream (:func:`ckptq.io.device.prefetch`); copied bytes never go to the device. The output
            is the same bytes on every device.

    Returns:
        ``{"path", "world_size", "bytes_per_rank", "tensors", "requantized": {fqn: sqnr_db},
        "processes", "process_rank", "device", "plan"}`` (in distributed mode: of the whole checkpoint, on every
        process; ``processes`` is 1 and ``process_rank`` 0 otherwise; ``plan``: the whole plan's
        :meth:`~ckptq.reshard.plan.ReshardPlan.summary`, merged from the processes' plans). ``seconds``: ``total`` (this
        call), ``transform`` (the kernels: re-encoding, dequantizing, SQNR of whole tensors) and
        ``whole_reads`` (reading those tensors, on the reader thread, overlapped with the kernels),
        both summed over processes; the rest of ``total``
        is byte-range copying, hashing and writing.

    Raises:
        ShardingError: the plan has alignment problems (nothing is written).
        UsageError: ``device`` names a device that cannot be used; ``plan`` lacks ranks this
            process writes.
        CkptqError: ``dst`` exists (without ``overwrite``) or overlaps the source; in distributed
            mode, on every process, when any process failed (naming the ranks and their errors).
    """
    t_start = time.perf_counter()
    dev = resolve_device(device)
    dst = storage.location(dst)
    group = Group.default() if distributed else None
    try:
        run = _Run(view, plan, dst, overwrite, progress, group, dev)
        totals = prepare_write_commit(
            group, prepare=run.prepare, write=run.write, commit=run.commit, abort=run.abort, discard=run.discard
        )
    finally:
        if group is not None:
            group.close()
    bytes_per_rank, requantized, transform_s, whole_read_s, summary = totals
    return {
        "path": str(dst),
        "world_size": plan.mesh.world_size,
        "bytes_per_rank": bytes_per_rank,
        "tensors": len(summary["tensors"]),
        "plan": summary,
        "requantized": requantized,
        "processes": 1 if group is None else group.size,
        "process_rank": 0 if group is None else group.rank,
        "device": str(dev),
        "seconds": {"total": time.perf_counter() - t_start, "transform": transform_s, "whole_reads": whole_read_s},
    }


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

    def add_output(self, view, job: TensorJob, desc: Descriptor | None) -> None:
        """Record job's descriptor (None: a plain tensor or bytes entry) and its flatten mappings
        (a quantized output's per component: :func:`~ckptq.contract.component_path`)."""
        if desc is not None:
            self.descriptors[job.fqn] = desc
        base = view.mapping(job.sources[0].fqn) if len(job.sources) == 1 and job.member is None else None
        if base is None:
            return
        if job.out == "quantized":
            for name in desc.components:
                self.mappings[component_fqn(job.fqn, name)] = component_path(base, name)
        else:
            self.mappings[job.fqn] = base


class _Run:
    """One run's steps for :func:`~ckptq.distributed.prepare_write_commit` (the same on every process)."""

    def __init__(
        self, view, plan: ReshardPlan, dst: Path, overwrite: bool, progress, group: Group | None, device: torch.device
    ) -> None:
        self.view, self.plan, self.dst, self.overwrite = view, plan, dst, overwrite
        self.progress, self.group, self.device = progress, group, device
        self.writer: CheckpointDirWriter | None = None
        self.state = _RunState()

    def prepare(self) -> Path:
        """Check the destination and the plan; make the staging directory (rank 0)."""
        check_destination(self.view.path, self.dst, self.overwrite)
        plan = self.plan
        if self.group is None and plan.ranks is not None and len(plan.ranks) < plan.mesh.world_size:
            raise UsageError(
                f"the plan holds target ranks {list(plan.ranks)[:8]} of {plan.mesh.world_size}: one process writes "
                f"every rank's file (plan them all, ranks=None), or run distributed (each process its ranks)"
            )
        if plan.problems:
            raise ShardingError(
                f"{len(plan.problems)} tensor(s) cannot be laid out natively on mesh {plan.mesh}:\n  "
                + "\n  ".join(plan.problems)
                + "\nNothing was written. Use --misaligned high-precision to export them dequantized."
            )
        try:
            return staging_dir(self.dst)
        except OSError as e:
            raise write_error(self.dst, e) from e

    def write(self, tmp: Path) -> tuple:
        """Lay this process's records out and write them into ``tmp``; returns what :meth:`commit`
        needs from this process (its writer's part, its :class:`_RunState`, its plan's summary)."""
        view, plan, group = self.view, self.plan, self.group
        expect_shared_dir(tmp, group)
        self.writer = CheckpointDirWriter(tmp, part=0 if group is None else group.rank)
        try:
            if group is None:
                jobs = [j for j in plan.jobs if not j.problem]
                file_map = _file_map(view, jobs)
                work = list(zip(jobs, file_map, _copies(view, jobs, file_map), strict=True))
            else:
                work = _share(view, plan, group)
            total = sum(o.nbytes for _, outs, _ in work for o in outs)
            with _progress(self.progress, total, show=group is None or group.rank == 0) as update:
                _execute(view, work, self.writer, self.state, update, self.device)
            return self.writer.close_local(), self.state, plan.summary()
        except OSError as e:
            raise write_error(self.dst, e) from e
        finally:
            if hasattr(view, "close"):
                view.close()

    def commit(self, tmp: Path, parts: list) -> tuple:
        """Merge the other processes' parts into this writer, write ``.metadata``, rename ``tmp``
        into place (rank 0); returns the run's totals and the whole plan's summary (merged from the
        processes' summaries: :func:`~ckptq.reshard.plan.merge_summaries`)."""
        writer, state = self.writer, self.state
        for shard, st, _ in parts[1:]:  # parts[0] is this process's own
            writer.merge_local(shard)
            state.merge(st)
        descriptors = {k: state.descriptors[k] for k in sorted(state.descriptors)}
        mappings = {k: state.mappings[k] for k in sorted(state.mappings)}  # one order, however split
        plan = self.plan
        try:
            writer.finish({**mappings, CKPTQ_KEY: make_record(descriptors, plan.mesh.world_size, mesh=str(plan.mesh))})
            commit_dir(tmp, self.dst)
        except OSError as e:
            raise write_error(self.dst, e) from e
        summary = merge_summaries([s for _, _, s in parts])
        return writer.bytes_per_rank, state.requantized, state.transform_s, state.whole_read_s, summary

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()

    def discard(self, tmp: Path) -> None:
        storage.remove_tree(tmp)


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


# ------------------------------------------------------------------------------ file map
def _job_records(view, job: TensorJob) -> list[RecordSlot]:
    """The records ``job`` writes, in the order it writes them: per owner box, per component; a
    component chunk that several boxes hold (a per-tensor scalar) goes to the one box
    :func:`ckptq.chunks.writes_component_chunk` names; empty component chunks are not written. The
    one place these are decided: :func:`_write_job` writes exactly these."""
    if job.out == "bytes":  # small records (step counters, TE extra state): read for their length, not kept
        record, _ = view.read_raw_bytes(job.sources[0].fqn)
        return [RecordSlot.raw(0, job.fqn, len(record))]
    if job.out != "quantized":
        return [RecordSlot.tensor(rank, job.fqn, None, job.shape, box, job.out_dtype, box) for rank, box in job.owners]
    cls = format_class(job.out_format)
    specs = cls.component_specs(job.shape, cls._recipe_from_json(job.out_recipe))
    outs: list[RecordSlot] = []
    for rank, box in job.owners:
        for spec in specs:
            if not chunks.writes_component_chunk(spec, box):
                continue
            cbox = chunks.component_box(spec, job.shape, box, fqn=job.fqn, fmt=job.out_format)
            if math.prod(cbox[1]) == 0:
                continue
            key = component_fqn(job.fqn, spec.name)
            outs.append(RecordSlot.tensor(rank, key, spec.name, spec.shape(job.shape), cbox, spec.dtype, box))
    return outs


def _file_map(view, jobs: list[TensorJob]) -> list[list[RecordSlot]]:
    """The file map: every job's records with their slots in the target files
    (:func:`~ckptq.io.pipeline.assign_offsets`, job after job in plan order). The slots of a file
    depend only on the jobs with records in it: those of a per-rank plan's files are the whole plan's."""
    file_map = [_job_records(view, job) for job in jobs]
    assign_offsets(file_map)
    return file_map


def _cost(outs: list[RecordSlot], copy: bool) -> int:
    """Estimated work of writing records ``outs`` for splitting jobs over processes: their payload
    bytes, times 4 for a job whose bytes are transformed (``copy`` False: read whole, re-encoded,
    SQNR: the convert benchmark in docs/benchmarks.md spends about 4x the copy's time per byte
    there); at least 1 (a bytes entry)."""
    return max(1, sum(o.nbytes for o in outs) * (1 if copy else 4))


def _share(view, plan: ReshardPlan, group: Group) -> list[tuple[TensorJob, list[RecordSlot], bool]]:
    """This process's work when the jobs are split over ``group``: ``[(job, its records here, copied)]``.

    Each process lays out and writes the target files :func:`~ckptq.distributed.file_share` gives
    it (``plan`` need only hold those ranks: ``plan_reshard(..., ranks=...)``): every record of a
    copied job in its files (processes sharing one file split its copied jobs by cost). A
    transformed job (read whole, computed) is computed by one process for all its files: the
    processes send each other, in one gather, the cost of each transformed job in their files, the
    bytes they copy and where each such job's records start in each of their files
    (:func:`_lay_out`); every process then assigns the transformed jobs alike
    (:func:`~ckptq.distributed.assign`, largest first, on top of the copying), and plans its own for
    every rank (:meth:`ReshardPlan.whole_jobs`), their records placed at those starts. No process
    plans or reads more than its files and its jobs.
    """
    ranks, part, parts = file_share(plan.mesh.world_size, group.size, group.rank)
    if plan.ranks is not None and not set(ranks) <= set(plan.ranks):
        raise UsageError(
            f"process {group.rank} of {group.size} writes target ranks {ranks.start}..{ranks.stop - 1}, "
            f"its plan holds ranks {list(plan.ranks)[:8]}: plan them (ckptq.distributed.file_share) or every rank"
        )
    work, summary = _lay_out(view, plan, ranks, part, parts)
    got = group.gather_ok(summary)
    total: dict[str, int] = {}
    for _, names, costs, _ in got:
        for fqn, cost in zip(names, costs.tolist(), strict=True):
            total[fqn] = total.get(fqn, 0) + cost
    computed = group.assign(total, [g[0] for g in got])
    mixed = sorted({job.fqn for job, _, _ in work} & total.keys())
    if mixed:  # another process could not read its part of these by byte range (a view from the index checks its own)
        raise _split_decision(view, mixed)
    at: dict[tuple[str, int], int] = {}
    for _, names, _, starts in got:
        if names:
            rows = starts[np.array([f in computed for f in names])[starts[:, 0]]]
            at.update(((names[k], r), pos) for k, r, pos in rows.tolist())
    for job in plan.whole_jobs(view, computed):
        outs = _job_records(view, job)
        ends: dict[int, int] = {}
        for o in outs:  # a job's records in one file are contiguous from its start (assign_offsets)
            if (job.fqn, o.rank) not in at:  # that file's process copies it
                raise _split_decision(view, [job.fqn])
            o.at = ends.get(o.rank, at[(job.fqn, o.rank)])
            ends[o.rank] = o.at + o.length
        work.append((job, outs, False))
    return work


def _split_decision(view, fqns: list[str]) -> CheckpointFormatError:
    """The error of tensors that some processes copy and another computes (:func:`_share`)."""
    return CheckpointFormatError(
        f"{view.path}: the saved chunks of {fqns[:4]} can be read by byte range in some target files' "
        f"parts and not in others (records of another kind among them); run it in one process"
    )


def _lay_out(view, plan: ReshardPlan, ranks: range, part: int, parts: int) -> tuple[list, tuple]:
    """Target files ``ranks`` laid out from ``plan`` (which holds them) by process ``part`` of the
    ``parts`` that share them: ``(work, summary)``, ``work`` its copied jobs (:func:`_share`),
    ``summary`` what the other processes need from it: ``(bytes it copies, [FQN of each transformed
    job with records in these files], their costs (int64), int64 rows (job number in that list,
    target rank, byte where the job's records start in that rank's file))`` (the lists empty unless
    ``part`` is 0: one process speaks for a file)."""
    mine = set(ranks)
    jobs = [j for j in plan.jobs if not j.problem and any(r in mine for r, _ in j.owners)]
    file_map = [[o for o in outs if o.rank in mine] for outs in (_job_records(view, j) for j in jobs)]
    assign_offsets(file_map)
    copies = _copies(view, jobs, file_map)
    copied = assign({i: _cost(file_map[i], True) for i, c in enumerate(copies) if c}, parts)[part]
    work = [(jobs[i], file_map[i], True) for i in sorted(copied)]
    names, costs, starts = [], [], []
    for i, (job, outs) in enumerate(zip(jobs, file_map, strict=True)):
        if part == 0 and not copies[i]:
            names.append(job.fqn)
            costs.append(_cost(outs, False))
            first: dict[int, int] = {}
            for o in outs:
                first.setdefault(o.rank, o.at)
            starts += [(len(names) - 1, r, at) for r, at in first.items()]
    loads = sum(_cost(outs, True) for _, outs, _ in work)
    summary = (loads, names, np.asarray(costs, dtype=np.int64), np.asarray(starts, dtype=np.int64).reshape(-1, 3))
    return work, summary


# ------------------------------------------------------------------------------ copied jobs
def _copies(view, jobs: list[TensorJob], file_map: list[list[RecordSlot]]) -> list[bool]:
    """Per job: whether its bytes are the source's unchanged (same format and recipe, or a plain
    tensor of the same dtype) and the saved chunks its records (``file_map``) read are readable by
    byte range (:meth:`~ckptq.checkpoint.CheckpointView.saved_chunks_for`), so that they are copied,
    not computed. A view opened from the chunk index reads the rows of all those entries at once."""
    if not hasattr(view, "saved_chunks_for"):
        return [False] * len(jobs)
    wanted: list[dict[str, list]] = []
    for job, outs in zip(jobs, file_map, strict=True):
        boxes: dict[str, list] = {}
        if _same_bytes(job):
            for o in outs:
                boxes.setdefault(_src_key(job, o), []).append(o.box)
        wanted.append(boxes)
    if hasattr(view, "need"):  # one pass over all the rows (one call each costs far more)
        everything: dict[str, list] = {}
        for boxes in wanted:
            for key, b in boxes.items():
                everything.setdefault(key, []).extend(b)
        view.need(everything)
    return [
        _same_bytes(job) and all(view.saved_chunks_for(key, b) is not None for key, b in boxes.items())
        for job, boxes in zip(jobs, wanted, strict=True)
    ]


def _same_bytes(job: TensorJob) -> bool:
    """Whether ``job`` writes its one source's bytes unchanged (same format, recipe and dtype, or a
    plain tensor of the same dtype): from the plan alone."""
    if job.out == "bytes" or len(job.sources) != 1 or job.member is not None or job.problem:
        return False
    src = job.sources[0]
    if job.out == "quantized":
        if src.kind != "quantized" or src.format != job.out_format or src.dtype != job.out_dtype:
            return False
        cls = format_class(job.out_format)
        return cls._recipe_from_json(src.descriptor.recipe) == cls._recipe_from_json(job.out_recipe)
    return job.out == "tensor" and src.kind == "tensor" and src.dtype == job.out_dtype


def _src_key(job: TensorJob, o: RecordSlot) -> str:
    """The source entry a copied record's bytes come from."""
    src = job.sources[0]
    return src.keys[o.part] if o.part is not None else src.fqn


def _copy_descriptor(job: TensorJob) -> Descriptor | None:
    """The descriptor of a job copied by byte range (that of :func:`_write_job` for the same bytes)."""
    src = job.sources[0]
    if job.out == "tensor":
        return (
            high_precision_descriptor(src.descriptor, job.out_dtype, job.shape) if src.descriptor is not None else None
        )
    desc = dataclasses.replace(src.descriptor, shape=job.shape)
    probe = from_components(
        desc, {name: torch.empty(c.shape, dtype=c.dtype, device="meta") for name, c in desc.components.items()}
    )  # no data: for the descriptor
    return native_descriptor(probe, job.fqn, job.shape, producer=src.descriptor.producer)


# ------------------------------------------------------------------------------ writing
def _execute(
    view,
    work: list[tuple[TensorJob, list[RecordSlot], bool]],
    writer: CheckpointDirWriter,
    state: _RunState,
    progress: Callable[[int], None] | None,
    device: torch.device,
) -> None:
    """Write ``work`` (``[(job, its record slots, copied)]``): the jobs whose chunks are copied by
    byte range (:func:`_copies`) first; then the others, computed on ``device`` while the next
    one's source is read."""
    copied, computed = [], []
    biggest = 0
    kernel_copy = getattr(view, "local", False) and not writer.remote  # copy_file_range needs two local files
    for job, outs, copy in work:
        if copy:
            biggest = max(
                [biggest]
                + [o.nbytes for o in outs if not kernel_copy or view.whole_chunk(_src_key(job, o), o.box) is None]
            )
            copied.append((job, outs))
        else:
            computed.append((job, outs))
    with WriterThread(writer, buffers=2, buffer_bytes=biggest) as pipe:
        for job, outs in copied:
            for o in outs:
                src_key = _src_key(job, o)
                whole = view.whole_chunk(src_key, o.box) if kernel_copy else None
                if whole is not None:  # a saved chunk verbatim: hashed here, copied by the kernel there
                    sums = view.hash_chunk(whole)
                    pipe.add_copy(o, view.data_fd(whole), whole.payload, *sums)
                else:
                    buf = pipe.buffer(o.nbytes).view(o.dtype).view(o.box[1])
                    known = view.read_box(src_key, o.box, buf)
                    pipe.add_chunk(o, buf, reused=True, encode=True, known=known)
                if progress:
                    progress(o.nbytes)
            state.add_output(view, job, _copy_descriptor(job))
        # the rest: the next job's source is read on a thread while this one is computed (on `device`)
        if hasattr(view, "will_read"):  # and the disk reads the ones after it meanwhile
            view.will_read([e.fqn for job, _ in computed for e in job.sources])
        stats = PrefetchStats()
        stream = prefetch(
            computed,
            lambda work: _read_job(view, work[0]),
            device=device,
            wants_device=lambda work, value: work[0].out != "bytes" and transform.computes(work[0], value),
            stats=stats,
        )
        with contextlib.closing(stream), device_scope(device):  # closing: the reader thread stops on an error
            for (job, outs), value in stream:
                _write_job(view, job, outs, value, pipe, state, progress)
        state.whole_read_s += stats.read_s


def _read_job(view, job: TensorJob) -> Any:
    """What :func:`_write_job` needs read for ``job``: a bytes entry's record and transforms, else
    its whole source tensor (:func:`~ckptq.reshard.transform.read_source`)."""
    if job.out == "bytes":
        return view.read_raw_bytes(job.sources[0].fqn)
    return transform.read_source(view, job)


def _write_job(
    view, job: TensorJob, outs: list[RecordSlot], value: Any, pipe: WriterThread, state: _RunState, progress
) -> None:
    """Transform and cut one job whose bytes change (``value``: from :func:`_read_job`, maybe on a
    CUDA device) into its record slots ``outs``."""
    src = job.sources[0]
    if job.out == "bytes":
        record, transforms = value
        if len(record) != outs[0].length:
            raise CheckpointFormatError(f"{view.path}: '{src.fqn}' changed while it was being read; run again")
        pipe.add_bytes(outs[0], record, transforms)
        state.add_output(view, job, None)
        return
    t0 = time.perf_counter()
    out, sqnr = transform.transform(value, job)
    out = to_host(out)
    del value
    state.transform_s += time.perf_counter() - t0
    if sqnr is not None:
        state.requantized[job.fqn] = sqnr
    if isinstance(out, QuantizedTensor):
        kept = sqnr is None and src.descriptor is not None  # the source's bytes: its producer record stays
        desc = native_descriptor(out, job.fqn, out.shape, producer=src.descriptor.producer if kept else None)
        for box, records in _by_piece(outs):
            pieces = {c.name: c for c in emit_components(slice_box(out, box, fqn=job.fqn), job.fqn, out.shape, box)}
            for o in records:
                c = pieces[o.part]
                _write_slot(pipe, o, c.key, c.box[0], c.tensor, progress)
    else:
        for o in outs:
            _write_slot(pipe, o, job.fqn, o.piece[0], chunks.narrow_box(out, o.piece), progress)
        # a high-precision entry of a quantized tensor keeps its record
        desc = high_precision_descriptor(src.descriptor, out.dtype, out.shape) if src.descriptor is not None else None
    state.add_output(view, job, desc)


def _by_piece(outs: list[RecordSlot]) -> list[tuple[chunks.Box, list[RecordSlot]]]:
    """``outs`` in runs of the same ``piece`` (consecutive, as :func:`_job_records` makes them)."""
    runs: list[tuple[chunks.Box, list[RecordSlot]]] = []
    for o in outs:
        if runs and runs[-1][0] == o.piece:
            runs[-1][1].append(o)
        else:
            runs.append((o.piece, [o]))
    return runs


def _write_slot(
    pipe: WriterThread, o: RecordSlot, key: str, offsets, tensor: torch.Tensor, progress: Callable[[int], None] | None
) -> None:
    """Write chunk ``tensor`` (entry ``key`` at ``offsets``) into record slot ``o``."""
    if o.key != key or tuple(o.box[0]) != tuple(offsets):
        raise CkptqError(
            f"internal error: '{key}' chunk {tuple(offsets)} has no slot (the slot holds {o.key}); please report it"
        )
    pipe.add_chunk(o, tensor)
    if progress:
        progress(tensor.nbytes)

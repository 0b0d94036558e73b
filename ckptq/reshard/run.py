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
from ..distributed import Group, expect_shared_dir, prepare_write_commit
from ..errors import CheckpointFormatError, CkptqError, ShardingError
from ..formats import format_class, from_components
from ..formats.base import QuantizedTensor, slice_box
from ..io import storage
from ..io.device import PrefetchStats, device_scope, prefetch, resolve_device, to_host
from ..io.pipeline import RecordSlot, WriterThread, assign_offsets
from ..io.writer import CheckpointDirWriter, check_destination, commit_dir, staging_dir, write_error
from . import transform
from .plan import ReshardPlan, TensorJob

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
            group (initialized from torchrun's environment with gloo if it is not yet): every
            record's file and offset is fixed first (the file map), the same on every process; each process
            computes and writes the tensors :func:`ckptq.distributed.assign` gives it (balanced by
            estimated work, so a requantized tensor is computed once) at their places in the
            target files of one staging directory; rank 0 writes ``.metadata`` and renames it into
            place once every process reported success. The output is the same bytes as one
            process's. Every process must call this with the same arguments.
        device: where tensors that are re-encoded or dequantized are computed: ``"cpu"``,
            ``"cuda"`` / ``"cuda:N"``, or ``"auto"`` (CUDA when a device and ckptq's CUDA kernels are
            there, else the CPU; :func:`ckptq.io.device.resolve_device`). Their sources are read on a
            thread while the previous one is computed and, on CUDA, copied to the device on a side
            stream (:func:`ckptq.io.device.prefetch`); copied bytes never go to the device. The output
            is the same bytes on every device.

    Returns:
        ``{"path", "world_size", "bytes_per_rank", "tensors", "requantized": {fqn: sqnr_db},
        "processes", "process_rank", "device"}`` (in distributed mode: of the whole checkpoint, on every
        process; ``processes`` is 1 and ``process_rank`` 0 otherwise). ``seconds``: ``total`` (this
        call), ``transform`` (the kernels: re-encoding, dequantizing, SQNR of whole tensors) and
        ``whole_reads`` (reading those tensors, on the reader thread, overlapped with the kernels),
        both summed over processes; the rest of ``total``
        is byte-range copying, hashing and writing.

    Raises:
        ShardingError: the plan has alignment problems (nothing is written).
        UsageError: ``device`` names a device that cannot be used.
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
    bytes_per_rank, requantized, transform_s, whole_read_s = totals
    return {
        "path": str(dst),
        "world_size": plan.mesh.world_size,
        "bytes_per_rank": bytes_per_rank,
        "tensors": len(plan.jobs),
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
        """Lay every record out, write this process's jobs' records into ``tmp``; returns what
        :meth:`commit` needs from this process."""
        view, plan, group = self.view, self.plan, self.group
        expect_shared_dir(tmp, group)
        self.writer = CheckpointDirWriter(tmp, part=0 if group is None else group.rank)
        try:
            file_map = _file_map(view, plan)
            copies = [_copy_source(view, job) for job in plan.jobs]
            mine = set(range(len(plan.jobs))) if group is None else group.assign(_job_costs(file_map, copies))
            total = sum(o.nbytes for i in mine for o in file_map[i])
            with _progress(self.progress, total, show=group is None or group.rank == 0) as update:
                _execute(view, plan, file_map, copies, mine, self.writer, self.state, update, self.device)
            return self.writer.close_local(), self.state
        except OSError as e:
            raise write_error(self.dst, e) from e
        finally:
            if hasattr(view, "close"):
                view.close()

    def commit(self, tmp: Path, parts: list) -> tuple:
        """Merge the other processes' parts into this writer, write ``.metadata``, rename ``tmp``
        into place (rank 0); returns the run's totals."""
        writer, state = self.writer, self.state
        for shard, st in parts[1:]:  # parts[0] is this process's own
            writer.merge_local(shard)
            state.merge(st)
        descriptors = {k: state.descriptors[k] for k in sorted(state.descriptors)}
        plan = self.plan
        try:
            writer.finish(
                {**state.mappings, CKPTQ_KEY: make_record(descriptors, plan.mesh.world_size, mesh=str(plan.mesh))}
            )
            commit_dir(tmp, self.dst)
        except OSError as e:
            raise write_error(self.dst, e) from e
        return writer.bytes_per_rank, state.requantized, state.transform_s, state.whole_read_s

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
    component chunk that several boxes hold (a per-tensor scalar) goes to the first; empty
    component chunks are not written. The one place these are decided: :func:`_write_job` writes
    exactly these."""
    if job.out == "bytes":  # small records (step counters, TE extra state): read for their length, not kept
        record, _ = view.read_raw_bytes(job.sources[0].fqn)
        return [RecordSlot.raw(0, job.fqn, len(record))]
    if job.out != "quantized":
        return [RecordSlot.tensor(rank, job.fqn, None, job.shape, box, job.out_dtype, box) for rank, box in job.owners]
    cls = format_class(job.out_format)
    specs = cls.component_specs(job.shape, cls._recipe_from_json(job.out_recipe))
    outs: list[RecordSlot] = []
    seen: set = set()
    for rank, box in job.owners:
        for spec in specs:
            cbox = chunks.component_box(spec, job.shape, box, fqn=job.fqn, fmt=job.out_format)
            key = component_fqn(job.fqn, spec.name)
            if (key, cbox[0]) in seen or math.prod(cbox[1]) == 0:
                continue
            seen.add((key, cbox[0]))
            outs.append(RecordSlot.tensor(rank, key, spec.name, spec.shape(job.shape), cbox, spec.dtype, box))
    return outs


def _file_map(view, plan: ReshardPlan) -> list[list[RecordSlot]]:
    """The file map: every job's records with their slots in the target files
    (:func:`~ckptq.io.pipeline.assign_offsets`, job after job in plan order); jobs with a problem have none."""
    file_map = [_job_records(view, job) if not job.problem else [] for job in plan.jobs]
    assign_offsets(file_map)
    return file_map


def _job_costs(file_map: list[list[RecordSlot]], copies: list[bool]) -> dict[int, int]:
    """Estimated work of each job for splitting jobs over processes: its payload bytes, times 4
    for a job whose bytes are transformed (``copies[i]`` False: read whole, re-encoded, SQNR: the
    convert benchmark in docs/benchmarks.md spends about 4x the copy's time per byte there); bytes
    entries count 1."""
    return {
        i: max(1, sum(o.nbytes for o in outs) * (1 if copy else 4))
        for i, (outs, copy) in enumerate(zip(file_map, copies, strict=False))
    }


# ------------------------------------------------------------------------------ copied jobs
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
        if cls._recipe_from_json(src.descriptor.recipe) != cls._recipe_from_json(job.out_recipe):
            return False
    elif job.out != "tensor" or src.kind != "tensor" or src.dtype != job.out_dtype:
        return False
    return all(view.saved_chunks(key) is not None for key in src.keys.values())


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
    plan: ReshardPlan,
    file_map: list[list[RecordSlot]],
    copies: list[bool],
    mine: set,
    writer: CheckpointDirWriter,
    state: _RunState,
    progress: Callable[[int], None] | None,
    device: torch.device,
) -> None:
    """Write the records of jobs ``mine`` (indices into ``plan.jobs``) in their slots in ``file_map``;
    ``copies[i]``: job i's chunks are copied by byte range (:func:`_copy_source`), first; then the
    others, computed on ``device`` while the next one's source is read."""
    copied, computed = [], []
    biggest = 0
    kernel_copy = getattr(view, "local", False) and not writer.remote  # copy_file_range needs two local files
    for i in sorted(mine):
        job, outs, copy = plan.jobs[i], file_map[i], copies[i]
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

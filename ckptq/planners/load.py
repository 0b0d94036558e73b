"""`QuantizedLoadPlanner`: DCP load planner for quantized and high-precision checkpoints."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from .. import adapters, chunks
from .._gc import gc_paused
from ..checksums import check, checksum_key
from ..contract import (
    CKPTQ_KEY,
    DIGEST_KEY,
    RECORD_FOREIGN,
    Entry,
    check_digest,
    fold_entries,
    has_record,
    is_verified,
    merge_sidecar_checksums,
    read_checksums,
    sidecar_ranks,
    verified_facts,
)
from ..errors import CheckpointFormatError, MissingKeyError, ShardingError, UnsupportedFormatError
from ..formats import format_class, requantize
from ..formats.base import QuantizedTensor, slice_box
from ..io.read_buffers import empty_for_read
from ..io.safe_pickle import load_pickled_object
from ..metrics import sqnr_db
from ._common import local_box, local_tensor

__all__ = ["QuantizedLoadPlanner"]

logger = logging.getLogger("ckptq")


#: A target on a CUDA device whose source must be decoded or re-encoded (another format or recipe,
#: high-precision values, a plain target of a quantized entry) has its source region read into
#: that device's memory and converted there when the region's stored bytes are at most this many;
#: a larger region (e.g. the whole of a large tensor that every shard reads for its per-tensor
#: value) is read into CPU memory and converted there, as every region was before, so that the
#: load's temporary GPU memory stays bounded. Measured: ``docs/benchmarks.md``.
DEVICE_DECODE_BYTES = 1 << 30


@dataclasses.dataclass
class _Buffer:
    """A destination of read items: a tensor allocated on first use, with its chunk box."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor | None = None  # preset for raw loads into a target's component
    route: _Route | None = None
    device: torch.device | None = None  # where it is allocated (None: the CPU)

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            if self.device is None or self.device.type == "cpu":
                self.tensor = empty_for_read(self.shape, self.dtype)  # filled by reads
            else:
                self.tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.tensor


@dataclasses.dataclass
class _Target:
    """One state_dict value to load.

    ``qt`` is the canonical quantized target: the value's own ckptq tensor, or fresh canonical
    buffers of a foreign tensor (``adapter`` set; inserted into ``local`` when its reads complete);
    None for a plain target.
    """

    fqn: str
    obj: torch.Tensor
    local: torch.Tensor
    qt: QuantizedTensor | None
    adapter: adapters.Adapter | None
    global_shape: tuple[int, ...]
    box: chunks.Box


class _Route:
    """One read strategy for one target: :meth:`plan` returns its read items; :meth:`complete`
    runs once the last of them is committed (then a foreign target gets its canonical bytes)."""

    def __init__(self, planner: QuantizedLoadPlanner, t: _Target, entry: Entry | None):
        self.p, self.t, self.entry = planner, t, entry
        self.pending = 0

    def plan(self) -> list[ReadItem]:
        raise NotImplementedError

    def read(self, key: str, cbox: chunks.Box, buf: _Buffer) -> list[ReadItem]:
        items = self.p._read(key, cbox, buf, self.t.fqn)
        buf.route = self
        self.pending += len(items)
        return items

    def complete(self) -> None:
        """Work after the reads (decode / re-encode); nothing for raw reads."""

    def committed(self) -> None:
        self.pending -= 1
        if self.pending:
            return
        self.complete()
        t = self.t
        if t.adapter is not None:
            sqnr = t.adapter.insert(t.local, t.qt, t.fqn)
            if sqnr is not None:
                self.p.derived[t.fqn] = sqnr


class _Raw(_Route):
    """Native source in the target's format and recipe: each component read straight into the
    target's component tensors (raw bytes, resharded by DCP's box math on component chunks)."""

    def plan(self) -> list[ReadItem]:
        t = self.t
        specs = t.qt.component_specs(t.global_shape, t.qt.recipe)
        chunks.check_aligned(specs, t.global_shape, t.box, fqn=t.fqn, fmt=t.qt.FORMAT)
        items = []
        for spec in specs:
            cbox = chunks.component_box(spec, t.global_shape, t.box, fqn=t.fqn, fmt=t.qt.FORMAT)
            dest = t.qt._components[spec.name]
            items += self.read(self.entry.keys[spec.name], cbox, _Buffer(cbox[1], spec.dtype, tensor=dest))
        return items


class _Decode(_Route):
    """Read the source region enclosing the target's box (block-aligned for the source's and the
    target's blocks; the whole tensor when the target has a per-tensor value, so that every shard
    derives the same global amax) into temporary buffers, then :meth:`apply` it."""

    def target_alignment(self) -> list[int]:
        return [1] * len(self.t.global_shape)

    def plan(self) -> list[ReadItem]:
        t, e = self.t, self.entry
        ndim = len(t.global_shape)
        align = self.target_alignment()
        self.native = e is not None and e.kind == "quantized"
        if self.native:
            self.src_cls = format_class(e.format)
            self.src_recipe = self.src_cls._recipe_from_json(e.descriptor.recipe)
            src_specs = self.src_cls.component_specs(t.global_shape, self.src_recipe)
            align = [math.lcm(a, b) for a, b in zip(align, chunks.alignment(src_specs, ndim), strict=False)]
        full = ((0,) * ndim, t.global_shape)
        if t.qt is not None and t.qt.per_tensor_names() and t.box != full:
            self.region = full
        else:
            self.region = chunks.expand_to_aligned(align, t.global_shape, t.box)
        if math.prod(t.box[1]) == 0:
            return []
        self.buffers: dict[str, _Buffer] = {}
        items: list[ReadItem] = []
        if self.native:
            fmt = self.src_cls.FORMAT
            cboxes = [chunks.component_box(s, t.global_shape, self.region, fqn=t.fqn, fmt=fmt) for s in src_specs]
            pairs = list(zip(src_specs, cboxes, strict=True))
            dev = self._decode_device(sum(math.prod(b[1]) * s.dtype.itemsize for s, b in pairs))
            for spec, cbox in pairs:
                self.buffers[spec.name] = _Buffer(cbox[1], spec.dtype, device=dev)
                items += self.read(e.keys[spec.name], cbox, self.buffers[spec.name])
        else:
            md = self.p.metadata.state_dict_metadata[t.fqn]
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointFormatError(
                    f"tensor '{t.fqn}': checkpoint entry is {_describe_md(md)}, the target is a tensor "
                    f"of shape {t.global_shape}"
                )
            if tuple(md.size) != t.global_shape:
                raise _size_mismatch(t.fqn, md.size, t.global_shape)
            if not md.properties.dtype.is_floating_point or md.properties.dtype in _NO_SCALE_DTYPES:
                raise UnsupportedFormatError(
                    f"tensor '{t.fqn}': checkpoint entry is {_describe_md(md)}, the target a quantized "
                    f"{t.qt.FORMAT} tensor; a quantized target is encoded from values of a float entry "
                    f"(float16, bfloat16, float32, float64, or a quantized one); load it into a plain "
                    f"{md.properties.dtype} tensor"
                )
            dev = self._decode_device(math.prod(self.region[1]) * md.properties.dtype.itemsize)
            self.buffers["values"] = _Buffer(self.region[1], md.properties.dtype, device=dev)
            items += self.read(t.fqn, self.region, self.buffers["values"])
        return items

    def _decode_device(self, nbytes: int) -> torch.device | None:
        """Where the source region (``nbytes`` stored bytes) is read into and decoded / re-encoded:
        the target's CUDA device (the reader copies the bytes there, and :func:`ckptq.requantize`
        runs its CUDA kernels, bit-exact with the CPU's) when the region is at most
        :data:`DEVICE_DECODE_BYTES`, else the CPU (None)."""
        t = self.t
        ref = next(iter(t.qt._components.values())) if t.qt is not None else t.local
        if ref.device.type != "cuda" or nbytes > DEVICE_DECODE_BYTES:
            return None
        return ref.device

    def source(self) -> Any:
        """The source region: a QuantizedTensor (native source) or a plain tensor of values."""
        if not self.native:
            return self.buffers["values"].get()
        comps = {k: b.get() for k, b in self.buffers.items()}
        return self.src_cls.from_components(
            comps, self.region[1], self.entry.descriptor.dtype, self.src_recipe, fqn=self.t.fqn
        )

    def values(self, src: Any) -> torch.Tensor:
        return src.dequantize(torch.float32) if self.native else src

    def complete(self) -> None:
        self.apply(self.source(), chunks.box_within(self.t.box, self.region))
        self.buffers.clear()

    def apply(self, src: Any, rel: chunks.Box) -> None:
        raise NotImplementedError


class _ToPlain(_Decode):
    """A plain target: the source decoded (native) or read as is, cut to the target's box."""

    def apply(self, src: Any, rel: chunks.Box) -> None:
        local_tensor(self.t.obj).copy_(chunks.narrow_box(self.values(src), rel))


class _Requantize(_Decode):
    """A quantized target of another format or recipe (or a high-precision source): the source
    re-encoded with the target's recipe through :func:`ckptq.requantize`, then cut to the box; or,
    where the recipes differ only in a per-tensor value's representation (NVFP4 global-scale
    conventions), the source with that value converted (``QuantizedTensor.with_recipe``)."""

    def target_alignment(self) -> list[int]:
        t = self.t
        specs = t.qt.component_specs(t.global_shape, t.qt.recipe)
        chunks.check_aligned(specs, t.global_shape, t.box, fqn=t.fqn, fmt=t.qt.FORMAT)
        return list(chunks.alignment(specs, len(t.global_shape)))

    def apply(self, src: Any, rel: chunks.Box) -> None:
        target = self.t.qt
        kept = src.with_recipe(target.recipe) if type(src) is type(target) else None
        if kept is not None:  # only a per-tensor value's representation differs: codes and scales kept
            new, ulps = kept
            logger.info(
                "ckptq: tensor '%s': codes and block scales kept, per-tensor value converted to %s "
                "(decode within %d fp32 ulps)",
                self.t.fqn,
                target.recipe,
                ulps,
            )
        else:
            new = requantize(src, target.FORMAT, **dataclasses.asdict(target.recipe))
            logger.info(
                "ckptq: tensor '%s': %s checkpoint entry re-encoded as %s %s for the target",
                self.t.fqn,
                self.entry.format if self.native else "high-precision",
                target.FORMAT,
                target.recipe,
            )
        part = slice_box(new, rel, fqn=self.t.fqn)
        for name, t in target._components.items():
            t.copy_(part._components[name])


class _LocalEncode(_Decode):
    """A quantized target whose shard cuts blocks of the global grid (``requantize_misaligned``):
    its box re-encoded as a local tensor (its own blocks; the whole tensor's amax), SQNR recorded."""

    def apply(self, src: Any, rel: chunks.Box) -> None:
        t, target = self.t, self.t.qt
        whole = self.values(src).float()
        values = chunks.narrow_box(whole, rel).contiguous()
        amax = whole.abs().amax(dim=(-2, -1)) if target.per_tensor_names() else None  # region = whole tensor
        new = requantize(values, target.FORMAT, amax=amax, **dataclasses.asdict(target.recipe))
        for name, c in target._components.items():
            c.copy_(new._components[name])
        self.p.requantized[t.fqn] = sqnr_db(values, new.dequantize(torch.float32))
        logger.warning(
            "ckptq: tensor '%s': shard box %s cuts %s blocks of the global grid; re-encoded "
            "as a local tensor (requantize_misaligned=True), SQNR %.2f dB",
            t.fqn,
            t.box,
            target.FORMAT,
            self.p.requantized[t.fqn],
        )


class _Grouped(_Route):
    """A stacked (N, ...) target filled from saved members, or a member target from a saved stack:
    raw bytes per member (quantized; scales and amax are the stack's leading batch dim) or values."""

    def plan(self) -> list[ReadItem]:
        p, t = self.p, self.t
        fqn, global_shape, box = t.fqn, t.global_shape, t.box
        if t.adapter is not None:
            raise UnsupportedFormatError(
                f"tensor '{fqn}': grouped loads fill ckptq or plain targets; load the "
                f"{type(t.local).__name__} members one by one"
            )
        if fqn in p.grouped:  # target = stack (N, ...); checkpoint = members
            members = p.grouped[fqn]
            if global_shape[0] != len(members):
                raise CheckpointFormatError(
                    f"tensor '{fqn}': stacked shape {global_shape} but {len(members)} grouped members"
                )
            (o0, *o), (s0, *sz) = box
            pieces = [(members[i], (tuple(o), tuple(sz)), i - o0) for i in range(o0, o0 + s0)]
            expect = global_shape[1:]
        else:  # target = member i; checkpoint = stack
            stacked, i = p._member_of[fqn]
            pieces = [(stacked, ((i,) + box[0], (1,) + box[1]), None)]
            expect = None

        def dest_view(x: torch.Tensor, j: int | None) -> torch.Tensor:
            return x.unsqueeze(0) if j is None else x[j]

        items: list[ReadItem] = []
        for src_fqn, sbox, j in pieces:
            e = p._entries.get(src_fqn)
            if t.qt is not None:
                cls = type(t.qt)
                if (
                    e is None
                    or e.kind != "quantized"
                    or e.format != cls.FORMAT
                    or cls._recipe_from_json(e.descriptor.recipe) != t.qt.recipe
                ):
                    raise UnsupportedFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' is not a native {cls.FORMAT} "
                        f"entry with recipe {t.qt.recipe}; convert it first (ckptq convert / "
                        f"ckptq reshard --grouped)"
                    )
                shape = tuple(e.shape)
                if expect is not None and shape != tuple(expect) or expect is None and shape[1:] != global_shape:
                    raise CheckpointFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' has shape {shape}, which does not "
                        f"match the target {global_shape}"
                    )
                specs = cls.component_specs(shape, t.qt.recipe)
                chunks.check_aligned(specs, shape, sbox, fqn=fqn, fmt=cls.FORMAT)
                for spec in specs:
                    cbox = chunks.component_box(spec, shape, sbox, fqn=fqn, fmt=cls.FORMAT)
                    dest = dest_view(t.qt._components[spec.name], j)
                    items += self.read(e.keys[spec.name], cbox, _Buffer(cbox[1], spec.dtype, tensor=dest))
            else:
                md = p.metadata.state_dict_metadata.get(src_fqn)
                if not isinstance(md, TensorStorageMetadata):
                    raise CheckpointFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' is not a plain tensor entry of the "
                        f"checkpoint ({_describe_md(md) if md is not None else 'missing'}); a plain "
                        f"target reads plain members or stacks"
                    )
                if e is not None:
                    _check_plain_target_of(e, t.local.dtype, fqn)
                _check_plain_cast(fqn, md.properties.dtype, t.local.dtype)
                if p.strict_dtype and md.properties.dtype != t.local.dtype:
                    raise CheckpointFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' is {md.properties.dtype}, the "
                        f"target {t.local.dtype}"
                    )
                dest = dest_view(t.local, j)
                items += self.read(src_fqn, sbox, _Buffer(sbox[1], md.properties.dtype, tensor=dest))
        return items


def _verify_metadata(metadata: Any) -> Any:
    """What :class:`ckptq.io.SafeFileSystemReader` does to the metadata it reads, for metadata that
    another storage reader (DCP's ``FileSystemReader``) read: check the ckptq record's digest, and
    read in the per-rank checksum files from the directory the checkpoint was saved to (its
    ``storage_meta.checkpoint_id``; if they are not there, e.g. the checkpoint was moved, the data
    is loaded unverified with a notice: load with ``SafeFileSystemReader`` to verify it)."""
    where = getattr(metadata.storage_meta, "checkpoint_id", None) or "checkpoint"
    check_digest(metadata, where=str(where))
    if sidecar_ranks(metadata.planner_data) is None:
        return metadata
    try:
        records = [checksum_key(k) for k in (metadata.storage_data or {})]
        planner_data = merge_sidecar_checksums(metadata.planner_data, where, records)
    except CheckpointFormatError as e:
        logger.warning("ckptq: %s; its data is loaded unverified (load it with ckptq.io.SafeFileSystemReader)", e)
        return metadata
    return dataclasses.replace(metadata, planner_data=planner_data)


class QuantizedLoadPlanner(DefaultLoadPlanner):
    """Load planner that restores quantized tensors from ckptq checkpoints.

    Use as ``dcp.load(state_dict, checkpoint_id=path, planner=QuantizedLoadPlanner())``. For each
    state_dict value (plain, or a DTensor with any placement and world size):

    * quantized target, checkpoint native in the same format and recipe: each component is read
      straight into the target's component tensors -- the raw bytes, bit-exact, resharded by
      DCP's box math on component chunks. The same holds when the recipes differ only in a stored
      columnwise copy: a target without one reads the rowwise components; a foreign target that
      holds one (e.g. TransformerEngine) from a checkpoint without it reads the rowwise components
      and its adapter derives the copy on insertion (requantized: a warning, SQNR in ``derived``);
    * quantized target, checkpoint in another format/recipe or high precision (or a plain DCP
      entry): the source region is decoded and re-encoded with the *target's* recipe through the
      :mod:`ckptq.ops` registry (logged once per tensor). Targets with a per-tensor value (FP8
      ``scale_inv``, NVFP4 ``amax``) read the whole source tensor, so that every shard computes the
      same global amax;
    * plain target, checkpoint native: the enclosing block-aligned region is read and dequantized;
    * everything else: DCP's default behaviour.

    Every target cut on a blocked dim must be block-aligned for a raw load (else
    :class:`ckptq.ShardingError` while planning, before any data moves); every target element must
    be covered by saved chunks (else :class:`ckptq.ShardingError`).

    Plain targets get the checks DCP does not make: a DTensor shard must be one contiguous box
    (DCP silently mis-loads ``(Shard(d), _StridedShard(d, sf))``), the saved chunks must cover it,
    and its dtype must be the saved one.

    Grouped weights: ``grouped={"experts.weight": ["experts.weight0", ..., "experts.weight7"]}`` maps
    a stacked (N, out, in) FQN to its per-GEMM members. A stacked target is filled from saved
    members and a member target from a saved stack, raw bytes (quantized) or values (plain); each
    member keeps its own scales and amax (the stack's leading batch dim). Any placement of the
    target works, e.g. ``Shard(d)`` of a member is ``Shard(d + 1)`` of the stack.

    Args (the first three positional, as ``DefaultLoadPlanner``'s in torch 2.11 and 2.13; ckptq's own
    keyword-only):
        flatten_state_dict, flatten_sharded_tensors: as for ``DefaultLoadPlanner``.
        allow_partial_load: skip targets missing from the checkpoint instead of raising.
        grouped: stacked FQN -> member FQNs (see above).
        requantize_misaligned: instead of raising ShardingError for a quantized target whose shard
            cuts a block of the global grid, re-encode its shard from the source values as a local
            tensor (its own blocks; per-tensor amax of the whole tensor) and record the SQNR in
            :attr:`requantized` (also logged).
        strict_dtype: raise when a plain target's dtype differs from the saved dtype of a plain or
            high-precision entry (DCP would cast silently); ``False`` allows DCP's cast. A native
            quantized entry decodes into any float16/bfloat16/float32/float64 target either way.
            Never allowed, whatever ``strict_dtype`` (:class:`ckptq.UnsupportedFormatError`, naming
            the FQN, dtype and the allowed targets): a quantized entry (either mode) into a plain
            integer, bool, float8, float4 or E8M0 target; a plain entry of another dtype into a
            plain float8/float4/E8M0 target (a cast with no scale); a plain integer, bool or
            float8/float4/E8M0 entry into a quantized target. docs/design.md ("Loading") lists
            every cast.
        verify_checksums: check what is read against the checksums the checkpoint records
            (:mod:`ckptq.checksums`; written by :class:`ckptq.io.ChecksumFileSystemWriter`,
            ``AtomicFileSystemWriter`` and the offline tools). On by default; a mismatch raises
            :class:`ckptq.ChecksumMismatchError` naming the file, byte range and FQN. With
            :class:`ckptq.io.SafeFileSystemReader` every record is verified as it is read; with
            DCP's stock ``FileSystemReader`` the planner verifies each read that covers a whole saved
            chunk (logging once that partial reads are unverified). A checkpoint without checksums
            loads with a one-line notice on the ``ckptq`` logger.
        trust_pickled_objects: unpickle non-tensor (bytes) entries with
            ``torch.load(weights_only=False)``, as ``DefaultLoadPlanner`` does: only for
            checkpoints from a trusted source. Off: see below.

    Non-tensor (bytes) entries are unpickled by :func:`ckptq.io.safe_pickle.load_pickled_object`:
    ``torch.load(weights_only=True)`` plus the types trainers store (numpy arrays, scalars and
    ``np.random.get_state()``, ``io.BytesIO``, ``datetime``, paths, builtins); any other global
    raises :class:`ckptq.UnsafePickledObjectError` naming it and ``trust_pickled_objects``.

    Errors keep DCP's phrases, so that callers matching DCP's messages still match: a target
    missing from the checkpoint raises :class:`ckptq.MissingKeyError` (a ``RuntimeError``, as
    DCP's) starting "Missing key in checkpoint state_dict: FQN."; a saved size that differs from
    the target's raises :class:`ckptq.CheckpointFormatError` (a ``ValueError``, as DCP's) starting
    "Size mismatch between saved ... and current: ...". Raised while planning, ``dcp.load`` wraps
    them in ``CheckpointException`` as it wraps DCP's own.

    Raises (from ``commit_tensor``/``load_bytes``, wrapped by ``dcp.load`` in
    ``CheckpointException``: see :func:`ckptq.io.dcp_failure`):
        ChecksumMismatchError: a whole-chunk read whose bytes differ from the recorded checksum
            (:func:`ckptq.checksums.check`).
        UnsafePickledObjectError: a bytes entry names a global outside the allow-list.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        strict_dtype: bool = True,
        grouped: Mapping[str, Sequence[str]] | None = None,
        requantize_misaligned: bool = False,
        verify_checksums: bool = True,
        trust_pickled_objects: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict, flatten_sharded_tensors, allow_partial_load)
        self.strict_dtype = strict_dtype
        self.trust_pickled_objects = trust_pickled_objects
        self.verify_checksums = verify_checksums
        #: set by :class:`ckptq.io.SafeFileSystemReader` when it verifies every record itself.
        self.checksums_verified_by_reader = False
        self.grouped = {k: list(v) for k, v in (grouped or {}).items()}
        self._member_of = {m: (k, i) for k, ms in self.grouped.items() for i, m in enumerate(ms)}
        self.requantize_misaligned = requantize_misaligned
        #: FQN -> SQNR (dB) of each misaligned target re-encoded locally (``requantize_misaligned``).
        self.requantized: dict[str, float] = {}
        #: FQN -> SQNR (dB) of derived copies a foreign target had to requantize on insertion
        #: (e.g. a TransformerEngine columnwise copy that the checkpoint does not hold).
        self.derived: dict[str, float] = {}
        self._buffers: dict[tuple[str, tuple[int, ...]], _Buffer] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None and not is_verified(metadata):
            metadata = _verify_metadata(metadata)  # read by a storage reader that is not ckptq's
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._entries, self._checksums = {}, None
        if metadata is not None:  # what the storage reader's checks found, else found here
            facts = verified_facts(metadata)
            if facts is None:
                facts = {"entries": fold_entries(metadata), "checksums": read_checksums(metadata.planner_data)}
            self._entries, self._checksums = facts["entries"], facts["checksums"]
        self._buffers = {}
        self.checksums_verified_by_reader = False
        self._partial_noticed = False
        pd = metadata.planner_data if metadata is not None else None
        record = pd[CKPTQ_KEY] if has_record(pd) else None
        if isinstance(record, Mapping) and DIGEST_KEY not in record and not record.get(RECORD_FOREIGN):
            logger.warning(
                "ckptq: %s has no metadata digest (saved by an older ckptq), so edits of its .metadata go undetected",
                getattr(metadata.storage_meta, "checkpoint_id", None) or "the checkpoint",
            )
        if self.verify_checksums and metadata is not None and self._checksums is None:
            logger.warning(
                "ckptq: %s has no checksums (saved by DCP's FileSystemWriter, an older ckptq or another "
                "library), so its data is loaded unverified; save with "
                "storage_writer=ckptq.io.ChecksumFileSystemWriter(path) to get them",
                getattr(metadata.storage_meta, "checkpoint_id", None) or "the checkpoint",
            )

    # ---------------------------------------------------------------- planning
    @gc_paused()  # read items, boxes and views: many small acyclic objects
    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        self._match_pre_2_4_keys()
        rest, mine = {}, {}
        for fqn, obj in self.state_dict.items():
            native = fqn in self._entries and self._entries[fqn].kind == "quantized"
            if isinstance(obj, torch.Tensor) and (
                adapters.local_quantized(obj) is not None or native or self._is_grouped(fqn)
            ):
                mine[fqn] = obj
            else:
                rest[fqn] = obj
        self._check_keys_and_sizes(rest)
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        self._check_plain_targets(rest, plan.items)
        items = list(plan.items)
        for fqn, obj in mine.items():
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            items += self._plan_tensor(fqn, obj)
        return dataclasses.replace(plan, items=items)

    def _match_pre_2_4_keys(self) -> None:
        """As ``DefaultLoadPlanner.create_local_plan`` (torch 2.11/2.13): checkpoints saved by torch
        <= 2.3 flattened nested containers differently (a dict holding a list of non-tensors was one
        entry, not one per list); when checkpoint keys are missing from the flattened targets and
        the old flattening has some of them, the targets are flattened the old way."""
        if not self.flatten_state_dict:
            return
        missing = self.metadata.state_dict_metadata.keys() - self.state_dict.keys()
        if not missing:
            return
        from torch.distributed.checkpoint import _version
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        _version._derived_version = "2_3"
        try:
            old, old_mappings = flatten_state_dict(self.original_state_dict)
        finally:
            _version._derived_version = None
        if old.keys() & missing:
            self.state_dict, self.mappings = old, old_mappings

    def _check_keys_and_sizes(self, targets: dict) -> None:
        """What DCP's default local plan raises as bare RuntimeError / ValueError, as ckptq errors
        naming the entries: targets missing from the checkpoint (unless ``allow_partial_load``) and
        tensors whose saved size differs from the target's."""
        sdm = self.metadata.state_dict_metadata
        missing = [fqn for fqn in targets if fqn not in sdm]
        if missing and not self.allow_partial_load:
            raise _missing_keys(missing)
        for fqn, obj in targets.items():
            md = sdm.get(fqn)
            size = getattr(obj, "size", None)
            if isinstance(md, TensorStorageMetadata) and callable(size) and tuple(md.size) != tuple(size()):
                raise _size_mismatch(fqn, md.size, size())

    def _check_plain_targets(self, targets: dict, items: list[ReadItem]) -> None:
        """What DCP does not check for ordinary tensors: contiguous DTensor shards, same dtype as
        saved, and every target element covered by saved chunks."""
        covered: dict[str, int] = {}
        for it in items:
            covered[it.dest_index.fqn] = covered.get(it.dest_index.fqn, 0) + math.prod(it.lengths)
        for fqn, obj in targets.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(obj, torch.Tensor) or not isinstance(md, TensorStorageMetadata):
                continue
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            entry = self._entries.get(fqn)
            if entry is not None:
                _check_plain_target_of(entry, obj.dtype)
            _check_plain_cast(fqn, md.properties.dtype, obj.dtype)
            if self.strict_dtype and md.properties.dtype != obj.dtype:
                raise CheckpointFormatError(
                    f"tensor '{fqn}': saved as {md.properties.dtype}, the target is {obj.dtype}; "
                    f"load into a {md.properties.dtype} tensor or pass strict_dtype=False to cast"
                )
            if isinstance(obj, ShardedTensor):  # legacy: any number of local shards, each its own box
                boxes = [
                    (tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in (s.metadata for s in obj.local_shards())
                ]
            else:
                boxes = [local_box(obj, fqn)]
            need = sum(math.prod(b[1]) for b in boxes)
            if covered.get(fqn, 0) != need:
                where = ", ".join(f"offsets {b[0]}, sizes {b[1]}" for b in boxes) or "none"
                raise ShardingError(
                    f"tensor '{fqn}': saved chunks cover {covered.get(fqn, 0)} of the {need} elements "
                    f"this rank holds of it ({where}); the checkpoint is incomplete (e.g. saved with "
                    f"use_collectives=False) or from another tensor"
                )

    def _in_checkpoint(self, fqn: str) -> bool:
        return fqn in self._entries

    def _is_grouped(self, fqn: str) -> bool:
        return (fqn in self.grouped or fqn in self._member_of) and not self._in_checkpoint(fqn)

    def _target(self, fqn: str, obj: torch.Tensor) -> _Target:
        found = adapters.local_quantized(obj)
        local, adapter = found if found is not None else (local_tensor(obj), None)
        qt = None if found is None else (local if adapter is None else adapter.empty_canonical(local, fqn))
        return _Target(fqn, obj, local, qt, adapter, tuple(obj.shape), local_box(obj, fqn))

    def _route(self, t: _Target) -> _Route:
        """The read strategy for ``t`` (see the class docstring)."""
        if self._is_grouped(t.fqn):
            return _Grouped(self, t, None)
        entry = self._entries.get(t.fqn)
        if entry is None:
            raise _missing_keys([t.fqn])
        if t.adapter is not None:
            self._foreign_columnwise(t, entry)
        if entry.kind == "quantized":
            if tuple(entry.shape) != t.global_shape:
                raise _size_mismatch(t.fqn, entry.shape, t.global_shape, "the logical shape of a quantized tensor")
            src_cls = format_class(entry.format)
            src_recipe = src_cls._recipe_from_json(entry.descriptor.recipe)
            if t.qt is not None and type(t.qt) is src_cls:
                # same recipe, or a columnwise copy the target does not keep: the target's components raw
                if t.qt.recipe in (src_recipe, src_cls.rowwise_recipe(src_recipe)):
                    if not (self.requantize_misaligned and not _aligned(t.qt, t.global_shape, t.box)):
                        return _Raw(self, t, entry)
        if t.qt is None:
            _check_plain_target_of(entry, t.local.dtype)
            return _ToPlain(self, t, entry)
        if self.requantize_misaligned and not _aligned(t.qt, t.global_shape, t.box):
            return _LocalEncode(self, t, entry)
        return _Requantize(self, t, entry)

    @staticmethod
    def _foreign_columnwise(t: _Target, entry: Entry) -> None:
        """A foreign target's columnwise copy that the load cannot fill raw is left to its adapter,
        which derives it on insertion (requantized, with a warning): ``t.qt`` becomes rowwise-only
        when the checkpoint holds the tensor natively without such a copy (saved without it), or
        this shard's copy has blocks off the global grid (e.g. TE 1x128 on 80-row shards) while its
        rowwise copy is on it. (Another source is re-encoded into the whole recipe: the copy then
        comes from the source's values, as the producer computes it.)"""
        row = t.qt.rowwise_only()
        if row is t.qt:
            return
        native = entry.kind == "quantized" and entry.format == t.qt.FORMAT
        if native and row.recipe == type(row)._recipe_from_json(entry.descriptor.recipe):
            t.qt = row
        else:
            t.qt = t.qt.columnwise_on_grid(t.global_shape, [t.box])

    def _plan_tensor(self, fqn: str, obj: torch.Tensor) -> list[ReadItem]:
        if self.allow_partial_load and not self._in_checkpoint(fqn) and not self._is_grouped(fqn):
            return []
        return self._route(self._target(fqn, obj)).plan()

    def _read(self, cfqn: str, cbox: chunks.Box, buf: _Buffer, fqn: str) -> list[ReadItem]:
        """Read items filling ``buf`` (chunk ``cbox`` of entry ``cfqn``); checks full coverage."""
        md = self.metadata.state_dict_metadata[cfqn]
        chunk = ChunkStorageMetadata(offsets=torch.Size(cbox[0]), sizes=torch.Size(cbox[1]))
        items = create_read_items_for_chunk_list(cfqn, md, [chunk])
        covered = sum(math.prod(it.lengths) for it in items)
        if covered != math.prod(cbox[1]):
            raise ShardingError(
                f"tensor '{fqn}': the saved chunks of '{cfqn}' cover {covered} of the "
                f"{math.prod(cbox[1])} elements this rank needs (box offsets {cbox[0]}, sizes "
                f"{cbox[1]}); the checkpoint is incomplete (e.g. saved with use_collectives=False)"
            )
        for it in items:
            self._buffers[(it.dest_index.fqn, tuple(it.dest_index.offset))] = buf
        return items

    # ---------------------------------------------------------------- reading
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buf = self._buffers.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset)))
        if buf is None:
            return super().resolve_tensor(read_item)
        return narrow_tensor_by_index(buf.get(), read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self._checksums and self.verify_checksums and not self.checksums_verified_by_reader:
            self._verify_read(read_item, tensor)
        buf = self._buffers.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset)))
        if buf is None or buf.route is None:
            return super().commit_tensor(read_item, tensor)
        buf.route.committed()

    def _verify_read(self, read_item: ReadItem, data: Any) -> None:
        """Compare a read that covers a whole saved chunk (or a bytes entry) with its checksum."""
        index = read_item.storage_index
        expected = self._checksums.get(checksum_key(index))
        if expected is None:
            return
        if isinstance(data, torch.Tensor):
            md = self.metadata.state_dict_metadata.get(index.fqn)
            chunk = next((c for c in getattr(md, "chunks", ()) if tuple(c.offsets) == tuple(index.offset)), None)
            whole = (
                chunk is not None
                and not any(read_item.storage_offsets)
                and tuple(read_item.lengths) == tuple(chunk.sizes)
                and data.dtype == md.properties.dtype
            )
            if not whole:
                if not self._partial_noticed:
                    self._partial_noticed = True
                    logger.warning(
                        "ckptq: reads of parts of saved chunks are not checked against the "
                        "checkpoint's checksums with DCP's FileSystemReader; load with "
                        "storage_reader=ckptq.io.SafeFileSystemReader(path) to verify every record"
                    )
                return
        info = (self.metadata.storage_data or {}).get(index)
        place = (
            f"record '{info.relative_path}' bytes {info.offset}..{info.offset + info.length}"
            if hasattr(info, "relative_path")
            else "its record"
        )
        chunk_text = f" (chunk at offsets {list(index.offset)})" if index.offset is not None else ""
        path = getattr(self.metadata.storage_meta, "checkpoint_id", None) or "checkpoint"
        check(data, expected, f"{path}: '{index.fqn}'{chunk_text}, {place}")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self._checksums and self.verify_checksums and not self.checksums_verified_by_reader:
            self._verify_read(read_item, value.getvalue())  # no copy, and no export left behind on a mismatch
        path = getattr(self.metadata.storage_meta, "checkpoint_id", None) or "checkpoint"
        where = f"{path}: non-tensor entry '{read_item.dest_index.fqn}'"
        obj = load_pickled_object(value, where=where, trust=self.trust_pickled_objects)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _missing_keys(missing: list[str]) -> MissingKeyError:
    """DCP's "Missing key in checkpoint state_dict: FQN." (torch 2.11/2.13 ``default_planner.py``), and what to do."""
    more = f" ({len(missing)} targets are missing: {missing[:5]}{' ...' if len(missing) > 5 else ''})"
    return MissingKeyError(
        f"Missing key in checkpoint state_dict: {missing[0]}.{more if len(missing) > 1 else ''} Check the "
        f"names (inspect the checkpoint with `ckptq inspect`) or pass allow_partial_load=True to skip them"
    )


def _size_mismatch(fqn: str, saved, current, what: str = "") -> CheckpointFormatError:
    """DCP's "Size mismatch between saved S and current: C for FQN" (torch 2.11/2.13
    ``default_planner.py``; a ``ValueError`` there too), and what to do."""
    return CheckpointFormatError(
        f"Size mismatch between saved {torch.Size(saved)} and current: {torch.Size(current)} for {fqn}"
        f"{f' ({what})' if what else ''}; load into a tensor of the saved size"
    )


#: Plain target dtypes that hold a quantized entry's values: its decode (a native entry, in float32)
#: or its high-precision values, rounded to nearest-even by ``Tensor.copy_`` where narrower.
DECODE_TARGET_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Float dtypes of codes or scales: a cast into them has no scale (values past the largest finite
#: one saturate, overflow to inf or wrap to NaN, depending on the dtype and torch version).
_NO_SCALE_DTYPES = frozenset(
    getattr(torch, n)
    for n in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, n)
)


def _check_plain_target_of(entry: Entry, dtype: torch.dtype, fqn: str | None = None) -> None:
    """A plain target of a quantized entry (native components, or high-precision values with a
    descriptor) must be a :data:`DECODE_TARGET_DTYPES` tensor, whatever ``strict_dtype``: casting
    dequantized values to an integer or bool tensor (truncation), or into a float8/float4 tensor
    (no scale), loses them without a word.

    Raises:
        UnsupportedFormatError: naming the target FQN, the entry's format, mode, shape and the
            target's dtype, and the allowed targets.
    """
    if entry.descriptor is None or dtype in DECODE_TARGET_DTYPES:
        return
    d = entry.descriptor
    name = fqn or entry.fqn
    src = f" (source '{entry.fqn}')" if fqn and fqn != entry.fqn else ""
    raise UnsupportedFormatError(
        f"tensor '{name}'{src}: checkpoint entry is a {d.format} tensor of shape {tuple(entry.shape)} "
        f"({d.mode}), the target a plain {dtype} tensor, which cannot hold its values; load it into "
        f"a float tensor ({', '.join(str(x).removeprefix('torch.') for x in DECODE_TARGET_DTYPES)}) "
        f"or a quantized tensor (ckptq.quantize(x, '{d.format}', ...) or a producer's)"
    )


def _check_plain_cast(fqn: str, saved: torch.dtype, dtype: torch.dtype) -> None:
    """A plain entry of another dtype into a float8/float4/E8M0 plain target is refused even with
    ``strict_dtype=False``: DCP's ``copy_`` would cast with no scale.

    Raises:
        UnsupportedFormatError: naming the FQN, both dtypes and what to do.
    """
    if dtype in _NO_SCALE_DTYPES and saved != dtype:
        raise UnsupportedFormatError(
            f"tensor '{fqn}': saved as {saved}, the target is a plain {dtype} tensor; a cast into "
            f"{dtype} has no scale (values saturate, overflow or wrap); load into a {saved} tensor, "
            f"or into a quantized tensor (ckptq.quantize) to re-encode"
        )


def _aligned(target: QuantizedTensor, global_shape, box) -> bool:
    try:
        chunks.check_aligned(target.component_specs(global_shape, target.recipe), global_shape, box)
    except ShardingError:
        return False
    return True


def _describe_md(md: Any) -> str:
    if isinstance(md, TensorStorageMetadata):
        return f"{md.properties.dtype} {tuple(md.size)}"
    return type(md).__name__

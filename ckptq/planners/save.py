"""`QuantizedSavePlanner`: DCP save planner for quantized tensors (native or high precision)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .. import adapters, chunks
from ..contract import (
    CKPTQ_KEY,
    NATIVE,
    component_fqn,
    component_path,
    emit_components,
    high_precision_descriptor,
    make_record,
    native_descriptor,
    validate_mode,
    with_digest,
    with_sidecar_checksums,
)
from ..errors import CheckpointFormatError, InconsistentScaleError, UnsupportedFormatError
from ..formats.base import QuantizedTensor
from ._common import all_boxes, local_box, mode_for
from .quantize import QuantizeRules, quantize_state_dict, validate_rules

__all__ = ["QuantizedSavePlanner"]

logger = logging.getLogger("ckptq")

_SCALARS_KEY = "__ckptq_scalars__"


@dataclasses.dataclass
class _SavedTensor:
    fqn: str
    qt: QuantizedTensor | None  # the local quantized tensor, canonical (None: see ``values``)
    global_shape: tuple[int, ...]
    box: chunks.Box
    sharded: bool  # a DTensor shard (SHARD items) or a whole plain tensor (TENSOR items)
    mode: str
    producer: dict | None = None  # a foreign tensor's producer record (see ckptq.adapters)
    local: Any = None  # the foreign local tensor, for high-precision values it cannot give canonically

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """High-precision values of the local piece (canonical decode, else the producer's own)."""
        if self.qt is not None:
            return self.qt.dequantize(dtype)
        return self.local.dequantize(dtype=dtype)


class QuantizedSavePlanner(DefaultSavePlanner):
    """Save planner that writes quantized tensors natively (raw bytes + scales) or dequantized.

    Use as ``dcp.save(state_dict, checkpoint_id=path, planner=QuantizedSavePlanner())`` (also with
    ``dcp.async_save``). Every ``QuantizedTensor`` value, plain or as the local tensor of a DTensor
    (FSDP2 ``Shard(0)``, TP ``Shard(1)``, ...), is handled; other values go through DCP's default path.

    Native mode: one DCP entry per component (``{fqn}.data``, ``{fqn}.scale``, ...) with the
    component's global size; each shard's chunk is derived from its logical box by
    :func:`ckptq.chunks.component_box`, so DCP's own load-time resharding moves raw bytes and plain
    DCP tools (``dcp_to_torch_save``) see ordinary tensors. A shard boundary inside a block raises
    :class:`ckptq.ShardingError` while planning, before any data is written. Per-tensor values
    (FP8 ``scale_inv``, NVFP4 ``amax``) must be identical on every shard that holds them; the
    coordinator checks this and raises :class:`ckptq.InconsistentScaleError` naming the tensor and
    ranks (quantize shards with ``amax=``/``scale=`` of the reduced global value).

    High-precision mode: the tensor is stored under its own FQN as ``dtype`` values, dequantized
    lazily when the storage writer asks for each item (bounded memory).

    Quantize on save: ``quantize={"*.mlp.*.weight": "nvfp4", "*.attn.*.weight": "mxfp8"}`` (glob ->
    format, or ``{"format": ..., **recipe}``) quantizes plain float shards of rank >= 2 on their own
    device while saving (:func:`ckptq.planners.quantize.quantize_state_dict`: the per-tensor amax is
    all-reduced over each tensor's mesh first, so the bytes equal ``ckptq.quantize`` of the whole
    tensor) and writes them natively. This runs collectives while planning: with ``dcp.async_save``,
    call ``ckptq.quantize_state_dict`` on the state dict first instead (staging then copies the
    compact bytes).

    Args (the first five positional, as ``DefaultSavePlanner``'s in torch 2.11 and 2.13; ckptq's own
    keyword-only):
        flatten_state_dict, flatten_sharded_tensors, dedup_replicated_tensors,
            dedup_save_to_lowest_rank: as for ``DefaultSavePlanner``.
        enable_plan_caching: reuse the plans of the previous save while a rank's local plan is
            unchanged (DCP's plan caching; see below).
        mode: ``"native"`` or ``"high_precision"`` for tensors no rule matches.
        dtype: storage dtype of high-precision entries (default bfloat16).
        rules: ``{fqn_glob: mode}``; the first glob (in insertion order) matching a flattened FQN
            decides its mode (``fnmatch`` syntax, e.g. ``{"*.mlp.*": "high_precision"}``).
        quantize: ``{fqn_glob: format or {"format": ..., **recipe}}``: plain tensors to quantize on
            save (see above).

    Plan caching (``enable_plan_caching=True``) uses DCP's caches (``SavePlanner._cached_*``, keyed
    by the class name), with one difference: a rank's local plan counts as unchanged only if it is
    equal as a whole -- items with their dtypes, and ``planner_data`` with ckptq's descriptors and
    the bytes of every per-tensor value -- where DCP's own comparison looks at FQNs, offsets and
    sizes only. A cached plan therefore never carries a stale descriptor or skips the
    per-tensor-value check; a rank whose FP8 ``scale_inv`` / NVFP4 ``amax`` changed since the last
    save sends its whole local plan again, as any rank whose plan changed does. The local plan is
    cached in :meth:`finish_plan`, once the global plan succeeded (torch 2.13's order; torch 2.11
    caches it earlier). See ``docs/design.md``, "A drop-in for DCP's default planners".

    Descriptors of every quantized entry go to ``metadata.planner_data[ckptq.contract.CKPTQ_KEY]`` as builtins
    (see :mod:`ckptq.contract`); no pickled ckptq class is written.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        *,
        mode: str = "native",
        dtype: torch.dtype = torch.bfloat16,
        rules: Mapping[str, str] | None = None,
        quantize: QuantizeRules | None = None,
    ) -> None:
        super().__init__(
            flatten_state_dict,
            flatten_sharded_tensors,
            dedup_replicated_tensors,
            dedup_save_to_lowest_rank,
            enable_plan_caching,
        )
        self.mode = validate_mode(mode, "QuantizedSavePlanner")
        self.rules = dict(rules or {})
        for pattern, m in self.rules.items():
            validate_mode(m, f"QuantizedSavePlanner rule '{pattern}'")
        if not dtype.is_floating_point:
            raise CheckpointFormatError(f"QuantizedSavePlanner: dtype {dtype} is not a float dtype")
        self.dtype = dtype
        self.quantize = dict(quantize or {})
        validate_rules(self.quantize)
        self._entries: dict[str, _SavedTensor] = {}
        self._objects: dict[str, Any] = {}
        self._local_plan_to_cache: SavePlan | None = None
        self._checksum_dir: str | None = None
        self._hashing: Any = None

    # ---------------------------------------------------------------- planning (every rank)
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._checksum_dir, self._hashing = _checksum_dir(storage_meta), None
        # no local directory for checksum files: warned at the first write unless the storage writer is ckptq's
        self._unrecorded = self._checksum_dir is None and is_coordinator
        self._storage_meta = storage_meta
        if self.quantize:
            self.state_dict = quantize_state_dict(self.state_dict, self.quantize)
        self._entries, self._objects = {}, {}
        rest = {}
        for fqn, obj in self.state_dict.items():
            found = adapters.local_quantized(obj)
            if found is None:
                rest[fqn] = obj
                continue
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # this rank is not in the tensor's mesh
            local, adapter = found
            entry = _SavedTensor(
                fqn,
                local if adapter is None else None,
                tuple(obj.shape),
                local_box(obj, fqn),
                isinstance(obj, DTensor),
                mode_for(fqn, self.mode, self.rules),
            )
            if adapter is not None:
                entry.local = local
                try:
                    entry.qt, entry.producer = adapter.to_canonical(local, fqn)
                except UnsupportedFormatError:
                    if entry.mode == NATIVE:
                        raise
                    # not storable natively; its values (the producer's dequantize) still are
                else:
                    entry.qt = _columnwise_on_grid(entry.qt, obj, fqn)
            self._entries[fqn] = entry
            if entry.mode == NATIVE:
                self._add_component_mappings(entry)
        self.state_dict = rest

    def _add_component_mappings(self, entry: _SavedTensor) -> None:
        path = self.mappings.pop(entry.fqn, None) if self.mappings else None
        for spec in entry.qt.specs:
            cfqn = component_fqn(entry.fqn, spec.name)
            if cfqn in self.state_dict:
                raise CheckpointFormatError(
                    f"tensor '{entry.fqn}': its component key '{cfqn}' collides with another "
                    f"state_dict entry; rename that entry or save '{entry.fqn}' in high_precision mode"
                )
            if path is not None:
                self.mappings[cfqn] = component_path(path, spec.name)

    def create_local_plan(self) -> SavePlan:
        caching, self._enable_plan_caching = self._enable_plan_caching, False
        try:  # DCP's own comparison ignores dtypes and planner_data: compare the whole plan below
            plan = super().create_local_plan()
        finally:
            self._enable_plan_caching = caching
        items = list(plan.items)
        descriptors, scalars = {}, {}
        for entry in self._entries.values():
            if entry.mode == NATIVE:
                descriptors[entry.fqn] = native_descriptor(entry.qt, entry.fqn, entry.global_shape, entry.producer)
                items += self._native_items(entry, scalars)
            else:
                if entry.qt is not None:
                    desc = native_descriptor(entry.qt, entry.fqn, entry.global_shape, entry.producer)
                    descriptors[entry.fqn] = high_precision_descriptor(desc, self.dtype)
                items.append(self._item(entry.fqn, entry.box, entry.global_shape, self.dtype, entry.sharded))
                self._objects[entry.fqn] = entry
        planner_data = dict(plan.planner_data or {})
        planner_data[CKPTQ_KEY] = {fqn: desc.as_dict() for fqn, desc in descriptors.items()}  # builtins on the wire
        planner_data[_SCALARS_KEY] = scalars
        self.plan = dataclasses.replace(plan, items=items, planner_data=planner_data)
        self._local_plan_to_cache = None
        if caching:
            if SavePlanner._cached_save_plan.get(self._cached_plans_key) == self.plan:
                return SavePlan([], usable=False)  # the coordinator reuses what it cached for this rank
            self._local_plan_to_cache = self.plan  # cached in finish_plan, once the global plan succeeded
        return self.plan

    def _native_items(self, entry: _SavedTensor, scalars: dict) -> list[WriteItem]:
        qt, items = entry.qt, []
        if tuple(qt.shape) != tuple(entry.box[1]):
            raise CheckpointFormatError(
                f"tensor '{entry.fqn}': local quantized shard has shape {tuple(qt.shape)} but its "
                f"DTensor placement gives {entry.box[1]}; the shard and its DTensor disagree"
            )
        for c in emit_components(qt, entry.fqn, entry.global_shape, entry.box):
            items.append(self._item(c.key, c.box, c.size, c.dtype, entry.sharded))
            self._objects[c.key] = c.tensor
            if c.per_tensor:
                scalars[f"{c.key}@{list(c.box[0])}"] = c.tensor.detach().cpu().reshape(-1).view(torch.uint8).tolist()
        return items

    @staticmethod
    def _item(fqn: str, box: chunks.Box, size, dtype: torch.dtype, sharded: bool) -> WriteItem:
        offsets, sizes = torch.Size(box[0]), torch.Size(box[1])
        return WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD if sharded else WriteItemType.TENSOR,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(size),
            ),
        )

    # ---------------------------------------------------------------- global (coordinator)
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        # With plan caching DCP hands out its cached Metadata object again; a storage writer may
        # set attributes on what it gets (ckptq's writers put the checksums into planner_data):
        # give it a copy, so that nothing of this save leaks into the next one.
        self.metadata = dataclasses.replace(metadata, planner_data=dict(metadata.planner_data or {}))
        if self._checksum_dir is not None:
            # Each rank that writes stores its checksums in its own file (resolve_data); ckptq's
            # storage writers replace this with the table in the record (checksums_by_writer).
            if len(plans) == 1:  # a save without collectives: this rank's own .metadata
                ranks = [_rank()] if plans[0].items or not plans[0].usable else []
            else:
                ranks = [r for r, p in enumerate(plans) if p.items or not p.usable]
            self.metadata.planner_data = with_sidecar_checksums(self.metadata.planner_data, ranks)
        with_digest(self.metadata)
        return plans, self.metadata

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan of ``all_plans`` (whole local plans: with plan caching, DCP merges the
        ones it cached for ranks whose plan did not change) plus ckptq's record: the per-tensor
        values checked across ranks, the descriptors merged (DCP's caching then keeps the result
        with its global plan and metadata)."""
        descriptor_sets, scalar_sets, stripped = [], [], []
        for p in all_plans:
            pd = dict(p.planner_data or {})
            descriptor_sets.append(pd.pop(CKPTQ_KEY, {}))
            scalar_sets.append(pd.pop(_SCALARS_KEY, {}))
            stripped.append(dataclasses.replace(p, planner_data=pd))
        _check_scalars(scalar_sets)
        tensors = _merge_descriptors(descriptor_sets)
        global_plan, metadata = super()._create_global_plan(stripped)
        planner_data = dict(metadata.planner_data or {})
        planner_data[CKPTQ_KEY] = make_record(tensors, world_size=len(all_plans))
        return global_plan, dataclasses.replace(metadata, planner_data=planner_data)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        if self._enable_plan_caching and self._local_plan_to_cache is not None:
            SavePlanner._cached_save_plan[self._cached_plans_key] = self._local_plan_to_cache
            self._local_plan_to_cache = None
        if self._checksum_dir is not None and plan.items:
            from ..checksums import PlanHasher

            self._hashing = PlanHasher(self._checksum_dir, _rank(), len(plan.items))
        return plan

    def checksums_by_writer(self) -> None:
        """Called by ckptq's storage writers (:class:`ckptq.io.ChecksumFileSystemWriter`), which
        hash what they write themselves: this save's planner then writes no checksum files."""
        self._hashing, self._unrecorded = None, False

    def resolve_data(self, write_item: WriteItem) -> Any:
        """DCP's ``resolve_data``; with a storage writer that is not ckptq's, the value is also
        handed to this rank's :class:`ckptq.checksums.PlanHasher` (hashed on a background thread;
        the rank's checksum file is written when its last item was resolved)."""
        data = super().resolve_data(write_item)
        if getattr(self, "_unrecorded", False):
            _warn_unrecorded(self._storage_meta)
            self._unrecorded = False
        hashing = self._hashing
        if hashing is not None:
            hashing.add(write_item.index, data)
        return data

    # ---------------------------------------------------------------- writing (every rank)
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self._objects.get(index.fqn)
        if obj is None:
            return super().lookup_object(index)
        if isinstance(obj, _SavedTensor):  # high precision: dequantize this shard now, not earlier
            return obj.values(self.dtype)
        return obj


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_WARNED: set = set()


def _checksum_dir(storage_meta: Any) -> str | None:
    """The local directory in which each rank's checksum file goes (the save's ``checkpoint_id``),
    or None when the storage writer gives none (a URL): then only ckptq's storage writers record
    checksums (:func:`_warn_unrecorded` otherwise)."""
    cid = getattr(storage_meta, "checkpoint_id", None)
    if isinstance(cid, (str, os.PathLike)) and "://" not in str(cid):
        return os.fspath(cid)
    return None


def _warn_unrecorded(storage_meta: Any) -> None:
    """One warning per checkpoint that a save with a storage writer not ckptq's, and no local
    directory for checksum files, records no checksums."""
    cid = getattr(storage_meta, "checkpoint_id", None)
    if str(cid) not in _WARNED:
        _WARNED.add(str(cid))
        logger.warning(
            "ckptq: QuantizedSavePlanner cannot record checksums for this save: its storage writer reports "
            "checkpoint_id %r, not a local directory (storage_meta %r), so the checkpoint will have none; pass "
            "storage_writer=ckptq.io.ChecksumFileSystemWriter(path) (or AtomicFileSystemWriter) to get them",
            cid,
            storage_meta,
        )


def _columnwise_on_grid(qt: QuantizedTensor, obj: torch.Tensor, fqn: str) -> QuantizedTensor:
    """A foreign tensor's canonical ``qt``, without its columnwise copy when its shards' copies are
    off the global grid (:meth:`QuantizedTensor.columnwise_on_grid`), decided from every shard's
    box so that all ranks agree. A load then derives the copy (requantized, with a warning)."""
    kept = qt.columnwise_on_grid(tuple(obj.shape), all_boxes(obj, fqn))
    if kept is not qt:
        logger.warning(
            "ckptq: tensor '%s' (%s): its shards' columnwise copies were quantized on blocks that do not line "
            "up with the global grid, so they are not stored; a load into a tensor that holds one requantizes "
            "it from the loaded values",
            fqn,
            qt.FORMAT,
        )
    return kept


def _check_scalars(scalar_sets: list[dict]) -> None:
    """Every (component, chunk) saved by several ranks must carry the same bytes."""
    seen: dict[str, tuple[int, list]] = {}
    for rank, scalars in enumerate(scalar_sets):
        for key, value in scalars.items():
            if key not in seen:
                seen[key] = (rank, value)
                continue
            first_rank, first = seen[key]
            if first != value:
                cfqn = key.split("@", 1)[0]
                fqn, comp = cfqn.rsplit(".", 1)
                a = torch.tensor(first, dtype=torch.uint8).view(torch.float32).tolist()
                b = torch.tensor(value, dtype=torch.uint8).view(torch.float32).tolist()
                raise InconsistentScaleError(
                    f"tensor '{fqn}': per-tensor '{comp}' differs between shards: rank "
                    f"{first_rank} has {a}, rank {rank} has {b}. All shards of one tensor must be "
                    f"quantized with one global value: reduce the amax over the shard group and "
                    f"pass it as ckptq.quantize(..., amax=...) (or scale= for fp8_tensor)."
                )


def _merge_descriptors(descriptor_sets: list[dict]) -> dict:
    merged: dict[str, dict] = {}
    for rank, descs in enumerate(descriptor_sets):
        for fqn, desc in descs.items():
            prev = merged.setdefault(fqn, desc)
            if prev != desc:
                raise CheckpointFormatError(
                    f"tensor '{fqn}': ranks disagree on its quantized layout: {prev} vs rank "
                    f"{rank}: {desc}. Every shard of a tensor must use the same format and recipe."
                )
    return merged

"""`QuantizedLoadPlanner`: DCP load planner for quantized and high-precision checkpoints."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
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

from .. import chunks, ops
from ..errors import CheckpointFormatError, ShardingError, UnsupportedFormatError
from ..formats import format_class
from ..formats.base import QuantizedTensor, slice_box, str_to_dtype, unwrap_quantized
from ..metrics import sqnr_db
from ._common import ckptq_planner_data, component_fqn, local_box, local_tensor

__all__ = ["QuantizedLoadPlanner"]

logger = logging.getLogger("ckptq")


@dataclasses.dataclass
class _Buffer:
    """A destination of read items: a tensor allocated on first use, with its chunk box."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: Optional[torch.Tensor] = None  # preset for raw loads into a target's component
    group: Optional["_Group"] = None

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.empty(self.shape, dtype=self.dtype)
        return self.tensor


@dataclasses.dataclass
class _Group:
    """The read items of one transformed tensor; ``finish`` runs once the last one is committed."""

    fqn: str
    pending: int
    finish: Callable[[], None]


class QuantizedLoadPlanner(DefaultLoadPlanner):
    """Load planner that restores quantized tensors from ckptq checkpoints.

    Use as ``dcp.load(state_dict, checkpoint_id=path, planner=QuantizedLoadPlanner())``. For each
    state_dict value (plain, or a DTensor with any placement and world size):

    * quantized target, checkpoint native in the same format and recipe: each component is read
      straight into the target's component tensors -- the raw bytes, bit-exact, resharded by
      DCP's box math on component chunks;
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

    Args:
        allow_partial_load: skip targets missing from the checkpoint instead of raising.
        grouped: stacked FQN -> member FQNs (see above).
        requantize_misaligned: instead of raising ShardingError for a quantized target whose shard
            cuts a block of the global grid, re-encode its shard from the source values as a local
            tensor (its own blocks; per-tensor amax of the whole tensor) and record the SQNR in
            :attr:`requantized` (also logged).
        strict_dtype: raise when a plain target's dtype differs from the saved dtype (DCP would
            cast silently); ``False`` allows the cast.
        **kwargs: passed to ``DefaultLoadPlanner``.

    Non-tensor (bytes) entries are unpickled with ``torch.load(weights_only=True)``.
    """

    def __init__(
        self,
        *,
        allow_partial_load: bool = False,
        strict_dtype: bool = True,
        grouped: Optional[Mapping[str, Sequence[str]]] = None,
        requantize_misaligned: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(allow_partial_load=allow_partial_load, **kwargs)
        self.strict_dtype = strict_dtype
        self.grouped = {k: list(v) for k, v in (grouped or {}).items()}
        self._member_of = {m: (k, i) for k, ms in self.grouped.items() for i, m in enumerate(ms)}
        self.requantize_misaligned = requantize_misaligned
        #: FQN -> SQNR (dB) of each misaligned target re-encoded locally (``requantize_misaligned``).
        self.requantized: dict[str, float] = {}
        self._buffers: dict[tuple[str, tuple[int, ...]], _Buffer] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._descriptors = ckptq_planner_data(getattr(metadata, "planner_data", None))["tensors"]
        self._buffers = {}

    # ---------------------------------------------------------------- planning
    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        rest, mine = {}, {}
        for fqn, obj in self.state_dict.items():
            native = self._descriptors.get(fqn, {}).get("mode") == "native"
            if isinstance(obj, torch.Tensor) and (
                unwrap_quantized(obj) is not None or native or self._is_grouped(fqn)
            ):
                mine[fqn] = obj
            else:
                rest[fqn] = obj
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        self._check_plain_targets(rest, plan.items)
        items = list(plan.items)
        for fqn, obj in mine.items():
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            items += self._plan_tensor(fqn, obj)
        return dataclasses.replace(plan, items=items)

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
            box = local_box(obj, fqn)
            if self.strict_dtype and md.properties.dtype != obj.dtype:
                raise CheckpointFormatError(
                    f"tensor '{fqn}': saved as {md.properties.dtype}, the target is {obj.dtype}; "
                    f"load into a {md.properties.dtype} tensor or pass strict_dtype=False to cast"
                )
            need = math.prod(box[1])
            if covered.get(fqn, 0) != need:
                raise ShardingError(
                    f"tensor '{fqn}': saved chunks cover {covered.get(fqn, 0)} of the {need} elements "
                    f"of this rank's box (offsets {box[0]}, sizes {box[1]}); the checkpoint is "
                    f"incomplete (e.g. saved with use_collectives=False) or from another tensor"
                )

    def _in_checkpoint(self, fqn: str) -> bool:
        return fqn in self._descriptors or fqn in self.metadata.state_dict_metadata

    def _is_grouped(self, fqn: str) -> bool:
        return (fqn in self.grouped or fqn in self._member_of) and not self._in_checkpoint(fqn)

    def _plan_tensor(self, fqn: str, obj: torch.Tensor) -> list[ReadItem]:
        desc = self._descriptors.get(fqn)
        target = unwrap_quantized(obj)
        global_shape = tuple(obj.shape)
        box = local_box(obj, fqn)
        if self._is_grouped(fqn):
            return self._plan_grouped(fqn, obj, target, global_shape, box)
        if desc is not None and desc.get("mode") == "native":
            src_cls = format_class(desc["format"])
            if tuple(desc["shape"]) != global_shape:
                raise CheckpointFormatError(
                    f"tensor '{fqn}': checkpoint has logical shape {tuple(desc['shape'])}, the target "
                    f"has {global_shape}; load into a tensor of the saved shape"
                )
            src_recipe = src_cls._recipe_from_json(desc.get("recipe", {}))
            if target is not None and type(target) is src_cls and target.recipe == src_recipe:
                if not (self.requantize_misaligned and not _aligned(target, global_shape, box)):
                    return self._plan_raw(fqn, desc, target, global_shape, box)
        elif fqn not in self.metadata.state_dict_metadata:
            if self.allow_partial_load:
                return []
            raise CheckpointFormatError(
                f"tensor '{fqn}' ({type(target).__name__}) is not in the checkpoint; pass "
                f"allow_partial_load=True to skip it"
            )
        return self._plan_transform(fqn, desc, obj, target, global_shape, box)

    def _plan_raw(self, fqn, desc, target: QuantizedTensor, global_shape, box) -> list[ReadItem]:
        """Native source, same format and recipe: read each component into the target's own."""
        specs = target.component_specs(global_shape, target.recipe)
        chunks.check_aligned(specs, global_shape, box, fqn=fqn, fmt=target.FORMAT)
        items = []
        for spec in specs:
            cfqn = self._component_key(fqn, desc, spec.name)
            cbox = chunks.component_box(spec, global_shape, box, fqn=fqn, fmt=target.FORMAT)
            self._check_component_md(fqn, cfqn, spec.shape(global_shape), spec.dtype)
            dest = target._components[spec.name]
            items += self._read(cfqn, cbox, _Buffer(cbox[1], spec.dtype, tensor=dest), fqn)
        return items

    def _plan_transform(self, fqn, desc, obj, target, global_shape, box) -> list[ReadItem]:
        """Read a source region into temporary buffers; decode (and re-encode) when complete."""
        native = desc is not None and desc.get("mode") == "native"
        src_cls = format_class(desc["format"]) if native else None
        src_recipe = src_cls._recipe_from_json(desc.get("recipe", {})) if native else None
        src_specs = src_cls.component_specs(global_shape, src_recipe) if native else []
        ndim = len(global_shape)
        align = [1] * ndim
        local_encode = False  # re-encode the shard as a local tensor (misaligned, opted in)
        if target is not None:
            t_specs = target.component_specs(global_shape, target.recipe)
            if self.requantize_misaligned and not _aligned(target, global_shape, box):
                local_encode = True
            else:
                chunks.check_aligned(t_specs, global_shape, box, fqn=fqn, fmt=target.FORMAT)
                align = list(chunks.alignment(t_specs, ndim))
        if native:
            align = [math.lcm(a, b) for a, b in zip(align, chunks.alignment(src_specs, ndim))]
        full = ((0,) * ndim, global_shape)
        if target is not None and target.per_tensor_names() and box != full:
            region = full  # the target's per-tensor amax must come from the whole tensor
        else:
            region = chunks.expand_to_aligned(align, global_shape, box)
        if math.prod(box[1]) == 0:
            return []

        buffers: dict[str, _Buffer] = {}
        items: list[ReadItem] = []
        if native:
            for spec in src_specs:
                cfqn = self._component_key(fqn, desc, spec.name)
                self._check_component_md(fqn, cfqn, spec.shape(global_shape), spec.dtype)
                cbox = chunks.component_box(spec, global_shape, region, fqn=fqn, fmt=src_cls.FORMAT)
                buffers[spec.name] = _Buffer(cbox[1], spec.dtype)
                items += self._read(cfqn, cbox, buffers[spec.name], fqn)
        else:
            md = self.metadata.state_dict_metadata[fqn]
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != global_shape:
                raise CheckpointFormatError(
                    f"tensor '{fqn}': checkpoint entry is {_describe_md(md)}, the target is a tensor "
                    f"of shape {global_shape}"
                )
            buffers["values"] = _Buffer(region[1], md.properties.dtype)
            items += self._read(fqn, region, buffers["values"], fqn)

        def finish() -> None:
            if native:
                comps = {k: b.get() for k, b in buffers.items()}
                src = src_cls.from_components(comps, region[1], str_to_dtype(desc["dtype"]), src_recipe, fqn=fqn)
            else:
                src = buffers["values"].get()
            rel = chunks.box_within(box, region)
            if target is None:
                values = src.dequantize(torch.float32) if native else src
                dest = local_tensor(obj)
                dest.copy_(chunks.narrow_box(values, rel))
            elif local_encode:
                values = chunks.narrow_box(src.dequantize(torch.float32) if native else src.float(), rel).contiguous()
                amax = None
                if target.per_tensor_names():  # region is the whole tensor: its amax is global
                    whole = src.dequantize(torch.float32) if native else src.float()
                    amax = whole.abs().amax(dim=(-2, -1))
                new = ops.requantize(values, target.FORMAT, amax=amax, **dataclasses.asdict(target.recipe))
                for name, t in target._components.items():
                    t.copy_(new._components[name])
                self.requantized[fqn] = sqnr_db(values, new.dequantize(torch.float32))
                logger.warning(
                    "ckptq: tensor '%s': shard box %s cuts %s blocks of the global grid; re-encoded "
                    "as a local tensor (requantize_misaligned=True), SQNR %.2f dB",
                    fqn, box, target.FORMAT, self.requantized[fqn],
                )
            else:
                recipe = dataclasses.asdict(target.recipe)
                new = ops.requantize(src, target.FORMAT, **recipe)
                logger.info(
                    "ckptq: tensor '%s': %s checkpoint entry re-encoded as %s %s for the target",
                    fqn,
                    desc["format"] if native else "high-precision",
                    target.FORMAT,
                    target.recipe,
                )
                part = slice_box(new, rel, fqn=fqn)
                for name, t in target._components.items():
                    t.copy_(part._components[name])
            buffers.clear()

        group = _Group(fqn, len(items), finish)
        for b in buffers.values():
            b.group = group
        return items

    def _plan_grouped(self, fqn, obj, target, global_shape, box) -> list[ReadItem]:
        """A stacked target from saved members, or a member target from a saved stack."""
        if fqn in self.grouped:  # target = stack (N, ...); checkpoint = members
            members = self.grouped[fqn]
            if global_shape[0] != len(members):
                raise CheckpointFormatError(
                    f"tensor '{fqn}': stacked shape {global_shape} but {len(members)} grouped members"
                )
            (o0, *o), (s0, *sz) = box
            pieces = [(members[i], (tuple(o), tuple(sz)), i - o0) for i in range(o0, o0 + s0)]
            expect = global_shape[1:]
        else:  # target = member i; checkpoint = stack
            stacked, i = self._member_of[fqn]
            pieces = [(stacked, ((i,) + box[0], (1,) + box[1]), None)]
            expect = None

        def dest_view(t: torch.Tensor, j: Optional[int]) -> torch.Tensor:
            return t.unsqueeze(0) if j is None else t[j]

        items: list[ReadItem] = []
        for src_fqn, sbox, j in pieces:
            desc = self._descriptors.get(src_fqn)
            if target is not None:
                cls = type(target)
                if desc is None or desc.get("mode") != "native" or desc["format"] != cls.FORMAT or \
                        cls._recipe_from_json(desc.get("recipe", {})) != target.recipe:
                    raise UnsupportedFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' is not a native {cls.FORMAT} "
                        f"entry with recipe {target.recipe}; convert it first (ckptq convert / "
                        f"ckptq reshard --grouped)"
                    )
                shape = tuple(desc["shape"])
                if expect is not None and shape != tuple(expect) or expect is None and shape[1:] != global_shape:
                    raise CheckpointFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' has shape {shape}, which does not "
                        f"match the target {global_shape}"
                    )
                specs = cls.component_specs(shape, target.recipe)
                chunks.check_aligned(specs, shape, sbox, fqn=fqn, fmt=cls.FORMAT)
                for spec in specs:
                    cfqn = self._component_key(src_fqn, desc, spec.name)
                    self._check_component_md(src_fqn, cfqn, spec.shape(shape), spec.dtype)
                    cbox = chunks.component_box(spec, shape, sbox, fqn=fqn, fmt=cls.FORMAT)
                    dest = dest_view(target._components[spec.name], j)
                    items += self._read(cfqn, cbox, _Buffer(cbox[1], spec.dtype, tensor=dest), fqn)
            else:
                md = self.metadata.state_dict_metadata.get(src_fqn)
                local = local_tensor(obj)
                if not isinstance(md, TensorStorageMetadata):
                    raise CheckpointFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' is not a plain tensor entry of the "
                        f"checkpoint ({_describe_md(md) if md is not None else 'missing'}); a plain "
                        f"target reads plain members or stacks"
                    )
                if self.strict_dtype and md.properties.dtype != local.dtype:
                    raise CheckpointFormatError(
                        f"tensor '{fqn}': grouped source '{src_fqn}' is {md.properties.dtype}, the "
                        f"target {local.dtype}"
                    )
                dest = dest_view(local, j)
                items += self._read(src_fqn, sbox, _Buffer(sbox[1], md.properties.dtype, tensor=dest), fqn)
        return items

    def _component_key(self, fqn: str, desc: dict, name: str) -> str:
        comp = desc.get("components", {}).get(name)
        cfqn = comp.get("fqn") if isinstance(comp, dict) else None
        return cfqn or component_fqn(fqn, name)

    def _check_component_md(self, fqn: str, cfqn: str, shape, dtype: torch.dtype) -> None:
        md = self.metadata.state_dict_metadata.get(cfqn)
        if md is None:
            raise CheckpointFormatError(
                f"tensor '{fqn}': component entry '{cfqn}' is missing from the checkpoint; the "
                f"checkpoint is incomplete or was not written by ckptq"
            )
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape) or md.properties.dtype != dtype:
            raise CheckpointFormatError(
                f"tensor '{fqn}': component '{cfqn}' is {_describe_md(md)} in the checkpoint, "
                f"expected {dtype} {tuple(shape)}"
            )

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
        buf = self._buffers.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset)))
        if buf is None or buf.group is None:
            return super().commit_tensor(read_item, tensor)
        buf.group.pending -= 1
        if buf.group.pending == 0:
            buf.group.finish()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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

"""Meshes, placements and the logical box each rank holds -- without a process group.

Placements follow ``torch.distributed.tensor``: ``Replicate()``, ``Shard(d)`` (``torch.chunk``
semantics: ceil-sized chunks, trailing ones short or empty) and ``_StridedShard(d, split_factor=sf)``
(what FSDP2 puts on its mesh dim when TP also shards dim ``d``: the dim is first cut into the
``sf`` pieces the later mesh dims make, each piece is cut ``n`` ways and coordinate ``c`` holds the
``c``-th cut of every piece; ``_StridedShard.local_shard_size_and_offset`` in
``torch/distributed/tensor/placement_types.py``). FSDP2 shards dim 0; TP column-parallel is
``Shard(0)``, row-parallel ``Shard(1)``; a grouped (N, out, in) weight shifts those to d + 1.

:func:`owned_ranges` computes, per tensor dim, the global index runs a mesh coordinate holds
(range arithmetic, no tensors: planning 2048 ranks stays cheap); :func:`shard_box` turns them into
the one contiguous box DCP stores, and raises
:class:`ckptq.ShardingError` when they are not contiguous (e.g. ``(Shard(0), _StridedShard(0, 2))``,
which DCP saves as overlapping chunks and silently loads wrong). Parsing of user strings (meshes,
placements, plan files) lives in :mod:`ckptq.parse`.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .chunks import Box, cdiv
from .errors import ShardingError, UsageError

__all__ = [
    "MeshSpec",
    "owned_ranges",
    "owned_indices",
    "shard_box",
    "dtensor_box",
    "rank_boxes",
    "first_owner_boxes",
    "dim_intervals",
    "PlacementRules",
    "PRESETS",
    "TP_RULES",
    "format_placements",
]

PRESETS = ("replicate", "fsdp2", "fsdp2-tp")
#: what an ``fsdp2-tp`` rule makes of the tensors its glob matches: column- or row-parallel
TP_RULES = ("col", "row")


def _strided_factor(p: Placement) -> int | None:
    return int(p.split_factor) if isinstance(p, _StridedShard) else None


def _shard_dim(p: Placement) -> int | None:
    """Tensor dim a Shard-like placement splits (``_StridedShard`` is not a ``Shard`` in 2.13)."""
    if isinstance(p, _StridedShard) or isinstance(p, Shard):
        return int(p.dim)
    return None


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh by name and size, e.g. ``dp_shard=4,tp=2`` (row-major rank order, as
    ``init_device_mesh``)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @functools.cached_property
    def coordinates(self) -> list[tuple[int, ...]]:
        """Mesh coordinate of every rank, in rank order."""
        return [self.coordinate(r) for r in range(self.world_size)]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of ``rank`` (row-major, as ``init_device_mesh``)."""
        coord = []
        for size in reversed(self.sizes):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=False))


Ranges = list[tuple[int, int]]


def _take(ranges: Ranges, start: int, stop: int) -> Ranges:
    """Positions ``[start, stop)`` of the concatenation of ``ranges`` (half-open index runs)."""
    out, pos = [], 0
    for a, b in ranges:
        s, e = max(start, pos), min(stop, pos + b - a)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += b - a
        if pos >= stop:
            break
    return out


def _chunk(ranges: Ranges, n: int, c: int) -> Ranges:
    """``torch.chunk(indices, n)[c]`` (ceil-sized chunks; empty when chunk ``c`` does not exist)."""
    if len(ranges) == 1:  # one run (every plain Shard): the same cut without the general walk
        a, b = ranges[0]
        size = cdiv(b - a, n)
        s, e = min(c * size, b - a), min((c + 1) * size, b - a)
        return [(a + s, a + e)] if s < e else []
    length = sum(b - a for a, b in ranges)
    size = cdiv(length, n)
    return _take(ranges, min(c * size, length), min((c + 1) * size, length))


def owned_ranges(
    dim_size: int,
    tensor_dim: int,
    mesh_sizes: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
) -> Ranges:
    """Global indices along ``tensor_dim`` held at mesh coordinate ``coord``, as increasing-order
    runs ``[(start, stop), ...]`` in local storage order. Placements apply left to right."""
    ranges: Ranges = [(0, dim_size)] if dim_size else []
    for n, c, p in zip(mesh_sizes, coord, placements, strict=False):
        if _shard_dim(p) != tensor_dim:
            continue
        sf = _strided_factor(p)
        if sf is None:
            ranges = _chunk(ranges, n, c)
        else:  # right-to-left: the sf pieces made by later mesh dims, each cut n ways
            ranges = [r for piece in range(sf) for r in _chunk(_chunk(ranges, sf, piece), n, c)]
    return _merge_runs(ranges)


def _merge_runs(ranges: Ranges) -> Ranges:
    """Join runs that continue each other: [(0, 4), (4, 6)] -> [(0, 6)]."""
    merged: Ranges = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def owned_indices(dim_size, tensor_dim, mesh_sizes, coord, placements) -> torch.Tensor:
    """:func:`owned_ranges` as a 1-D int64 tensor of global indices."""
    runs = owned_ranges(dim_size, tensor_dim, mesh_sizes, coord, placements)
    return torch.cat([torch.arange(0)] + [torch.arange(a, b) for a, b in runs])


def shard_box(
    global_shape: Sequence[int],
    mesh_sizes: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
    *,
    fqn: str | None = None,
) -> Box:
    """The logical box held at ``coord``: ``(offsets, sizes)``; empty dims get offset = dim size
    (DCP's convention). Raises ShardingError if the held indices are not one increasing run."""
    if len(placements) != len(mesh_sizes):
        raise ShardingError(f"tensor '{fqn}': {len(placements)} placements for a {len(mesh_sizes)}-D mesh")
    for p in placements:
        if not (isinstance(p, Replicate) or _shard_dim(p) is not None):
            raise ShardingError(f"tensor '{fqn}': placement {p} cannot be checkpointed (Partial must be reduced first)")
        d = _shard_dim(p)
        if d is not None and d >= len(global_shape):
            raise ShardingError(f"tensor '{fqn}' of shape {tuple(global_shape)}: {p} names dim {d}")
    offsets, sizes = [], []
    for d, n in enumerate(global_shape):
        runs = owned_ranges(n, d, mesh_sizes, coord, placements)
        if not runs:
            offsets.append(n)
            sizes.append(0)
        elif len(runs) == 1:
            offsets.append(runs[0][0])
            sizes.append(runs[0][1] - runs[0][0])
        else:
            shown = ", ".join(f"{a}..{b - 1}" for a, b in runs[:4]) + (", ..." if len(runs) > 4 else "")
            raise ShardingError(
                f"tensor '{fqn}' of shape {tuple(global_shape)}: with placements "
                f"{format_placements(placements)} mesh coordinate {tuple(coord)} holds indices "
                f"{shown} of dim {d}, not one contiguous box; DCP would store and load this shard "
                f"wrongly. Put the strided placement first ((_StridedShard(d, sf), Shard(d)), "
                f"FSDP2's order) or use other placements."
            )
    return tuple(offsets), tuple(sizes)


def dtensor_box(obj: Any, *, fqn: str | None = None) -> Box:
    """:func:`shard_box` of this process's shard of a DTensor (its mesh coordinate)."""
    mesh = obj.device_mesh
    return shard_box(obj.shape, tuple(mesh.shape), mesh.get_coordinate(), obj.placements, fqn=fqn)


def _dim_table(n: int, cuts: Sequence[tuple[int, int | None]]) -> dict:
    """Runs held along a tensor dim of size ``n`` cut by ``cuts``, the ``(mesh dim size, strided
    factor or None)`` of the mesh dims that shard it, left to right (as :func:`owned_ranges`), for
    every combination of their coordinates, built level by level so that each piece is cut once
    per coordinate prefix: {coords of those mesh dims: runs}."""
    table: dict[tuple, Ranges] = {(): [(0, n)] if n else []}
    for m, sf in cuts:
        nxt = {}
        for prefix, ranges in table.items():
            pieces = [ranges] if sf is None else [_chunk(ranges, sf, k) for k in range(sf)]
            for c in range(m):
                nxt[prefix + (c,)] = [r for piece in pieces for r in _chunk(piece, m, c)]
        table = nxt
    return table


_TABLES: dict = {}


def _box_tables(global_shape: Sequence[int], mesh: MeshSpec, placements: Sequence[Placement], fqn: str | None):
    """Per tensor dim: the mesh dims that shard it and {their coordinates: (offset, size)}, from
    :func:`_dim_table` (validated: raises as :func:`shard_box` would for any rank). Kept per
    (shape, mesh sizes, placements): the tensors of a model repeat a few shapes."""
    key = (tuple(global_shape), tuple(mesh.sizes), tuple(placements))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    shard_box(global_shape, mesh.sizes, mesh.coordinate(0), placements, fqn=fqn)  # validates
    relevant = [[i for i, p in enumerate(placements) if _shard_dim(p) == d] for d in range(len(global_shape))]
    boxes_per_dim = []
    for d, n in enumerate(global_shape):
        table, bad = _dim_boxes(n, tuple((mesh.sizes[i], _strided_factor(placements[i])) for i in relevant[d]))
        if bad is not None:
            coord = [0] * len(mesh.sizes)
            for i, c in zip(relevant[d], bad, strict=False):
                coord[i] = c
            shard_box(global_shape, mesh.sizes, coord, placements, fqn=fqn)  # raises, with details
        boxes_per_dim.append(table)
    if len(_TABLES) > 4096:
        _TABLES.clear()
    _TABLES[key] = out = (relevant, boxes_per_dim)
    return out


def _dim_boxes(n: int, cuts: tuple) -> tuple[dict, tuple | None]:
    """{coords of the mesh dims that shard a tensor dim of size ``n``: (offset, size)} and the first
    coords whose indices are not one run (None if none), for ``cuts``: ``(mesh dim size, strided
    factor or None)`` of those mesh dims, left to right (:func:`_dim_table`). Kept per ``(n, cuts)``:
    a model's tensors of different shapes share their dims' sizes and cuts."""
    key = (n, cuts)
    hit = _DIM_BOXES.get(key)
    if hit is not None:
        return hit
    if all(sf is None for _, sf in cuts):  # plain Shards: one run each, computed when looked up
        table, bad = _ShardTable(n, tuple(m for m, _ in cuts)), None
    else:
        table, bad = {}, None
        for k, runs in _dim_table(n, cuts).items():
            merged = _merge_runs(runs)
            if len(merged) > 1 and bad is None:
                bad = k
            table[k] = (merged[0][0], merged[0][1] - merged[0][0]) if merged else (n, 0)
    if len(_DIM_BOXES) > 4096:
        _DIM_BOXES.clear()
    _DIM_BOXES[key] = out = (table, bad)
    return out


_DIM_BOXES: dict = {}


class _ShardTable(Mapping):
    """:func:`_dim_boxes`' table of a tensor dim of size ``n`` cut by plain ``Shard`` placements on
    mesh dims of ``sizes``, without building a dict of ``prod(sizes)`` entries: a ``torch.chunk``
    of one run is one run, so a coordinate's ``(offset, size)`` is a few divisions, made when it is
    looked up (coordinates in range: the mesh's), and :meth:`values` is built level by level, each
    run cut once (the same table as :func:`_dim_table`'s, tested)."""

    def __init__(self, n: int, sizes: tuple[int, ...]) -> None:
        self.n, self.sizes, self._values = n, sizes, None

    def __getitem__(self, coords: tuple) -> tuple[int, int]:
        if len(coords) != len(self.sizes):
            raise KeyError(coords)
        a, b = 0, self.n
        for m, c in zip(self.sizes, coords, strict=False):
            size = cdiv(b - a, m)
            a, b = a + min(c * size, b - a), a + min((c + 1) * size, b - a)
            if a >= b:
                return self.n, 0
        return a, b - a

    def __iter__(self):
        return itertools.product(*(range(m) for m in self.sizes))

    def __len__(self) -> int:
        return math.prod(self.sizes)

    def values(self) -> list[tuple[int, int]]:  # type: ignore[override]
        """``(offset, size)`` of every coordinate, in :meth:`__iter__`'s order."""
        if self._values is None:
            runs = [(0, self.n)]
            for m in self.sizes:
                runs = [
                    (a + min(c * cdiv(b - a, m), b - a), a + min((c + 1) * cdiv(b - a, m), b - a))
                    for a, b in runs
                    for c in range(m)
                ]
            self._values = [(a, b - a) if a < b else (self.n, 0) for a, b in runs]
        return self._values


def rank_boxes(
    global_shape: Sequence[int], mesh: MeshSpec, placements: Sequence[Placement], *, fqn: str | None = None
) -> list[Box]:
    """:func:`shard_box` for every rank of ``mesh`` (rank order), from per-dim tables of
    :func:`_dim_table` (no work repeated across ranks that share coordinates)."""
    relevant, boxes_per_dim = _box_tables(global_shape, mesh, placements, fqn)
    out = []
    for coord in mesh.coordinates:
        dims = [boxes_per_dim[d][tuple(coord[i] for i in relevant[d])] for d in range(len(global_shape))]
        out.append((tuple(o for o, _ in dims), tuple(s for _, s in dims)))
    return out


def dim_intervals(
    global_shape: Sequence[int], mesh: MeshSpec, placements: Sequence[Placement], *, fqn: str | None = None
) -> list[set[tuple[int, int]]]:
    """Per tensor dim, the distinct non-empty ``(offset, size)`` intervals the ranks hold. The mesh
    dims that shard different tensor dims are different, so every combination of one interval per
    dim is some rank's box: the non-empty boxes are exactly the products of these (when the tensor
    has elements).

    Raises:
        ShardingError: as :func:`rank_boxes`.
    """
    _, boxes_per_dim = _box_tables(global_shape, mesh, placements, fqn)
    return [{iv for iv in table.values() if iv[1]} for table in boxes_per_dim]


def first_owner_boxes(
    global_shape: Sequence[int],
    mesh: MeshSpec,
    placements: Sequence[Placement],
    ranks: Sequence[int],
    *,
    fqn: str | None = None,
) -> list[tuple[int, Box]]:
    """``(rank, box)`` for each rank of ``ranks`` (increasing) that is the *first* rank holding its
    non-empty box: the owners :func:`rank_boxes` gives after keeping the first rank of each distinct
    non-empty box, restricted to ``ranks``, in O(len(ranks)) rather than O(world size).

    Why the rule is exact: coordinates that differ on a mesh dim that shards tensor dim ``d`` hold
    disjoint indices of ``d`` (``torch.chunk`` and ``_StridedShard`` both partition it), so two
    non-empty boxes are equal only when the coordinates differ on replicated mesh dims alone, and
    the first rank of them (row-major order) has coordinate 0 on every replicated mesh dim. A
    tensor with no elements has one owner, rank 0 (as the whole plan gives it).

    Raises:
        ShardingError: as :func:`rank_boxes` (for any rank of the mesh, not only ``ranks``).
    """
    relevant, boxes_per_dim = _box_tables(global_shape, mesh, placements, fqn)
    replicated = [i for i, p in enumerate(placements) if _shard_dim(p) is None]
    empty = math.prod(global_shape) == 0
    out = []
    for r in ranks:
        coord = mesh.coordinate(r)
        if empty:
            if r == 0:
                dims = [boxes_per_dim[d][tuple(coord[i] for i in relevant[d])] for d in range(len(global_shape))]
                out.append((0, (tuple(o for o, _ in dims), tuple(s for _, s in dims))))
            continue
        if any(coord[i] for i in replicated):
            continue
        dims = [boxes_per_dim[d][tuple(coord[i] for i in relevant[d])] for d in range(len(global_shape))]
        if all(s for _, s in dims):
            out.append((r, (tuple(o for o, _ in dims), tuple(s for _, s in dims))))
    return out


def format_placements(placements: Sequence[Placement]) -> str:
    out = []
    for p in placements:
        sf = _strided_factor(p)
        if sf is not None:
            out.append(f"SS({p.dim},{sf})")
        elif isinstance(p, Shard):
            out.append(f"S({p.dim})")
        else:
            out.append("R")
    return "(" + ", ".join(out) + ")"


class PlacementRules:
    """Which placements each FQN gets on a target mesh.

    Presets:
      * ``replicate``: every tensor whole on every rank.
      * ``fsdp2``: ``Shard(0)`` on the ``dp_shard`` mesh dim (or the only dim), Replicate elsewhere.
      * ``fsdp2-tp``: TP on the ``tp`` dim by glob rules ``{glob: "col" | "row"}`` (col ->
        ``Shard(0)``, row -> ``Shard(1)``, both +1 for 3-D grouped weights; unmatched tensors are
        replicated over tp), plus FSDP2 on ``dp_shard``: ``_StridedShard(d, tp)`` when TP shards
        the same dim d = 0, else ``Shard(0)`` (FSDP2's ``_init_sharding_spec_tp``).
    ``file``: ``rules`` maps FQN globs to placement lists, first match wins (a JSON/YAML file such
    as ``{"*.q_proj.weight": ["S(0)", "S(0)"], "*": ["S(0)", "R"]}`` through
    :func:`ckptq.parse.parse_placement_rules`). Tensors of rank < 1 (scalars) are always replicated.

    Raises:
        UsageError: an unknown preset, fsdp2-tp without a ``tp`` mesh dim, a rule that is not col or
            row, or a file rule whose placement count differs from the mesh's dims.
    """

    def __init__(self, mesh: MeshSpec, preset: str = "fsdp2", rules: Mapping[str, Any] | None = None):
        self.mesh = mesh
        self.preset = preset
        self.rules = dict(rules or {})
        if preset not in PRESETS + ("file",):
            raise UsageError(
                f"placement rules '{preset}': presets are {', '.join(PRESETS)}, or 'file' with placement rules"
            )
        if preset == "fsdp2-tp" and "tp" not in mesh.names:
            raise UsageError(f"fsdp2-tp needs a mesh dim named 'tp' (mesh {mesh})")
        if preset == "file":
            for k, v in self.rules.items():
                if len(v) != len(mesh.sizes) or not all(isinstance(p, Placement) for p in v):
                    raise UsageError(
                        f"rule '{k}': {list(v)} is not {len(mesh.sizes)} placements, one per dim of mesh {mesh}"
                    )
        elif preset == "fsdp2-tp":
            for k, v in self.rules.items():
                if v not in TP_RULES:
                    raise UsageError(f"fsdp2-tp rule {k}={v}: expected {' or '.join(TP_RULES)}")

    def unmatched_rules(self, fqns: Sequence[str]) -> list[str]:
        """The fsdp2-tp rule globs that match none of ``fqns`` (the checkpoint's tensors); ``[]``
        for other plans (a placement file's globs may be written for several models)."""
        if self.preset != "fsdp2-tp":
            return []
        return [g for g in self.rules if not any(fnmatch.fnmatchcase(f, g) for f in fqns)]

    def placements(self, fqn: str, ndim: int) -> tuple[Placement, ...]:
        n = len(self.mesh.sizes)
        if ndim == 0 or self.preset == "replicate":
            return (Replicate(),) * n
        if self.preset == "file":
            for pattern, pl in self.rules.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    return tuple(pl)
            return (Replicate(),) * n
        dp = self.mesh.names.index("dp_shard") if "dp_shard" in self.mesh.names else (0 if n == 1 else None)
        out: list[Placement] = [Replicate()] * n
        tp_dim = None
        if self.preset == "fsdp2-tp":
            t = self.mesh.names.index("tp")
            for pattern, kind in self.rules.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    d = (0 if kind == "col" else 1) + (1 if ndim == 3 else 0)
                    if d < ndim:
                        tp_dim = d
                        out[t] = Shard(d)
                    break
        if dp is not None:
            tp = self.mesh.sizes[self.mesh.names.index("tp")] if tp_dim == 0 else 1
            out[dp] = _StridedShard(0, split_factor=tp) if tp > 1 else Shard(0)
        return tuple(out)

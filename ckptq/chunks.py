"""Block and chunk geometry: the one place where logical boxes become component boxes.

A quantized tensor has a *logical* shape (what the model sees) and *components* (plain tensors that
hold it exactly; docs/formats.md, "9. Cuts and block alignment"). Each component dim follows one
logical dim with a divisor: 1 for data, 2 for packed FP4 data (exact), the block size for scales
(ceil). Logical dims a component does not follow are dims it is replicated along (a per-tensor
``amax`` is replicated along rows and columns).

Everything that slices a quantized tensor -- ``narrow``, DCP write and read items, load-time
dequantization of a sub-box -- goes through :func:`component_box`, :func:`check_aligned` and
:func:`expand_to_aligned`. No format-specific slicing code exists elsewhere.

A *box* is ``(offsets, sizes)``, two tuples of ints of the tensor's rank, in elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import ShardingError

__all__ = [
    "DimMap",
    "ComponentSpec",
    "Box",
    "component_box",
    "writes_component_chunk",
    "check_aligned",
    "is_aligned",
    "expand_to_aligned",
    "alignment",
    "box_within",
    "intersect",
    "narrow_box",
    "blocked_view",
    "unblock",
    "cdiv",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class DimMap:
    """How one component dim follows a logical dim.

    Attributes:
        logical_dim: index of the logical dim this component dim follows.
        divisor: elements of the logical dim per element of the component dim (1 data, 2 packed
            FP4, the block size for a scale).
        exact: True when the logical size must be a multiple of ``divisor`` (FP4 packing); False
            for ceil-sized scale grids (ragged edges allowed).
    """

    logical_dim: int
    divisor: int = 1
    exact: bool = False


@dataclass(frozen=True)
class ComponentSpec:
    """One component of a quantized tensor: name, dtype and per-dim geometry.

    ``dims[i]`` says which logical dim component dim ``i`` follows. Logical dims not named in any
    entry are dims this component is replicated along.
    """

    name: str
    dtype: torch.dtype
    dims: tuple[DimMap, ...]

    def shape(self, logical_shape: Sequence[int]) -> tuple[int, ...]:
        """Global component shape for a logical shape (ceil grids for scales)."""
        return tuple(cdiv(logical_shape[d.logical_dim], d.divisor) for d in self.dims)

    def block_of(self, logical_dim: int) -> int:
        """The divisor this component applies along ``logical_dim`` (1 if it does not follow it)."""
        for d in self.dims:
            if d.logical_dim == logical_dim:
                return d.divisor
        return 1

    def follows(self, logical_dim: int) -> bool:
        return any(d.logical_dim == logical_dim for d in self.dims)

    def is_per_tensor(self, ndim: int) -> bool:
        """True for a component of a rank-``ndim`` tensor that follows neither matrix dim (the
        last two; FP8 ``scale_inv``, NVFP4 ``amax``): one value per matrix, which every shard of
        the tensor holds whole."""
        return not (self.follows(ndim - 2) or self.follows(ndim - 1))


def alignment(specs: Sequence[ComponentSpec], ndim: int) -> tuple[int, ...]:
    """Per logical dim, the cut granularity every component needs: lcm of all divisors on it."""
    out = []
    for dim in range(ndim):
        a = 1
        for s in specs:
            a = math.lcm(a, s.block_of(dim))
        out.append(a)
    return tuple(out)


def _describe(fqn: str | None) -> str:
    return f"tensor '{fqn}'" if fqn else "quantized tensor"


def is_aligned(align: Sequence[int], logical_shape: Sequence[int], box: Box) -> bool:
    """True when every cut of ``box`` is a multiple of ``align`` (per dim) or the dim's end; empty
    boxes are aligned. ``align`` comes from :func:`alignment`."""
    for off, size, a, full in zip(box[0], box[1], align, logical_shape, strict=False):
        if size and a > 1 and (off % a or ((off + size) % a and off + size != full)):
            return False
    return True


def check_aligned(
    specs: Sequence[ComponentSpec],
    logical_shape: Sequence[int],
    box: Box,
    *,
    fqn: str | None = None,
    fmt: str | None = None,
) -> None:
    """Raise :class:`ShardingError` if a cut of ``box`` falls inside a block of any component.

    A start must be a multiple of the dim's alignment; an end must be a multiple or the dim's end.
    Empty boxes (size 0) are always aligned. The message names the tensor, dim, boundary and block.
    """
    offsets, sizes = box
    align = alignment(specs, len(logical_shape))
    for dim, (off, size, a) in enumerate(zip(offsets, sizes, align, strict=False)):
        if size == 0 or a == 1:
            continue
        end = off + size
        for boundary in (off, end):
            if boundary % a != 0 and boundary != logical_shape[dim]:
                raise ShardingError(
                    f"{_describe(fqn)} ({fmt or 'quantized'}, logical shape {tuple(logical_shape)}): "
                    f"a cut on dim {dim} at element {boundary} is not a multiple of the block "
                    f"size {a} along that dim, so a block and its scale would be split between "
                    f"shards. Choose a mesh or placement whose shard boundaries on dim {dim} are "
                    f"multiples of {a}, or save/load this tensor in high-precision mode."
                )


def component_box(
    spec: ComponentSpec,
    logical_shape: Sequence[int],
    box: Box,
    *,
    fqn: str | None = None,
    fmt: str | None = None,
) -> Box:
    """Map a logical box to this component's box.

    Replicated dims of the component are taken whole. Raises :class:`ShardingError` when a cut on a
    followed dim is not block-aligned.
    """
    offsets, sizes = box
    c_off, c_size = [], []
    for d in spec.dims:
        off, size, full = offsets[d.logical_dim], sizes[d.logical_dim], logical_shape[d.logical_dim]
        if size == 0:
            start = min(cdiv(off, d.divisor), cdiv(full, d.divisor))
            c_off.append(start)
            c_size.append(0)
            continue
        end = off + size
        if off % d.divisor or (end % d.divisor and end != full):
            check_aligned([spec], logical_shape, box, fqn=fqn, fmt=fmt)
            raise AssertionError("check_aligned must have raised")  # pragma: no cover
        c_off.append(off // d.divisor)
        c_size.append(cdiv(end, d.divisor) - off // d.divisor)
    return tuple(c_off), tuple(c_size)


def writes_component_chunk(spec: ComponentSpec, box: Box) -> bool:
    """Whether the chunk of component ``spec`` that logical ``box`` maps to (:func:`component_box`)
    is written with this box: the one owner rule for a component chunk that several boxes share.

    Boxes of one tensor that differ only along logical dims ``spec`` does not follow map to the same
    chunk (a per-tensor ``scale_inv`` or ``amax``: every box; a per-member scale of a grouped 3-D
    tensor: the boxes of one member range); of those, the box at offset 0 along every such dim
    writes it. Boxes cut along a followed dim at block boundaries (:func:`check_aligned`) map to
    disjoint chunks, so that is the only sharing; the boxes of a sharded tensor are a grid (each
    dim cut on its own), so the box at offset 0 exists for every chunk. A box decides alone, with
    no other box at hand: a process that plans some target ranks writes exactly the shared chunks
    the whole plan gives those ranks, and every process agrees on who writes which.
    """
    followed = {d.logical_dim for d in spec.dims}
    return all(off == 0 for d, off in enumerate(box[0]) if d not in followed)


def expand_to_aligned(align: Sequence[int], logical_shape: Sequence[int], box: Box) -> Box:
    """Smallest box containing ``box`` whose cuts are multiples of ``align`` (or the dim ends)."""
    offsets, sizes = box
    out_off, out_size = [], []
    for off, size, a, full in zip(offsets, sizes, align, logical_shape, strict=False):
        start = (off // a) * a
        end = min(cdiv(off + size, a) * a, full)
        out_off.append(start)
        out_size.append(end - start)
    return tuple(out_off), tuple(out_size)


def box_within(inner: Box, outer: Box) -> Box:
    """``inner`` expressed relative to ``outer``'s origin (``inner`` must lie inside ``outer``)."""
    (io, isz), (oo, osz) = inner, outer
    rel = tuple(i - o for i, o in zip(io, oo, strict=False))
    assert all(r >= 0 and r + s <= os_ for r, s, os_ in zip(rel, isz, osz, strict=False)), (inner, outer)
    return rel, tuple(isz)


def intersect(a: Box, b: Box) -> Box | None:
    """The box where boxes ``a`` and ``b`` (same rank, absolute offsets) overlap, or None when
    they share no element (a 0-d box overlaps a 0-d box)."""
    off, size = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=False):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


def narrow_box(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``t`` at ``box`` (offsets relative to ``t``'s origin)."""
    for d, (o, n) in enumerate(zip(*box, strict=False)):
        t = t.narrow(d, o, n)
    return t


def blocked_view(x: torch.Tensor, block: tuple[int, int], pad_value: float = 0.0) -> torch.Tensor:
    """View the last two dims of ``x`` (..., M, K) as blocks: (..., ceil(M/bm), bm, ceil(K/bk), bk).

    Ragged edges are padded with ``pad_value`` (0 leaves a block's amax over its real elements
    unchanged, since amax >= 0). Returns a new tensor only when padding is needed.
    """
    bm, bk = block
    *batch, m, k = x.shape
    mb, kb = cdiv(m, bm), cdiv(k, bk)
    if mb * bm != m or kb * bk != k:
        x = torch.nn.functional.pad(x, (0, kb * bk - k, 0, mb * bm - m), value=pad_value)
    return x.reshape(*batch, mb, bm, kb, bk)


def unblock(xb: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`blocked_view`: (..., Mb, bm, Kb, bk) -> (..., M, K), cropping padding."""
    *batch, mb, bm, kb, bk = xb.shape
    m, k = shape[-2], shape[-1]
    x = xb.reshape(*batch, mb * bm, kb * bk)
    if mb * bm != m or kb * bk != k:
        x = x[..., :m, :k]
    return x.contiguous()

"""`QuantizedTensor`: a wrapper tensor subclass over plain component tensors.

The wrapper presents the *logical* shape and the original high-precision dtype; the bytes live in
plain component tensors (``data``, ``scale_inv`` / ``scale``, ``amax``, ``columnwise_*``) whose
geometry each format declares as :class:`ckptq.chunks.ComponentSpec` s.

Dispatch is table-driven (as torchao's ``TorchAOBaseTensor``): every supported aten op has one
handler, annotated with the DCP/FSDP path that needs it; any other op raises ``NotImplementedError``
naming the op. Nothing is ever silently dequantized.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from .. import chunks, ops
from ..errors import CheckpointFormatError, QuantizationError, UnsupportedFormatError
from ..ops import FORMATS, format_class

__all__ = [
    "QuantizedTensor",
    "DESCRIPTOR_VERSION",
    "dtype_to_str",
    "str_to_dtype",
    "FORMATS",
    "format_class",
    "from_components",
]

DESCRIPTOR_VERSION = 1
aten = torch.ops.aten

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"`` (the JSON form used in descriptors)."""
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_str` over the dtypes ckptq stores; raises CheckpointFormatError."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise CheckpointFormatError(f"unknown dtype '{name}' in a ckptq descriptor; known: {sorted(_DTYPES)}") from None


class QuantizedTensor(torch.Tensor):
    """Base of the quantized tensor subclasses (one per format).

    Attributes:
        shape / dtype: the logical shape (..., M, K) and the original high-precision dtype.
        recipe: a frozen dataclass of the format's options (block, fp8 dtype, pow2, ...).
        _components: name -> plain tensor, in the canonical (compact, unswizzled) layout.

    Subclasses define ``FORMAT``, ``Recipe``, :meth:`component_specs`, the reference numerics
    ``_reference_quantize(x, recipe, amax=, scale=)`` / ``_reference_dequantize(comps, recipe,
    dtype)`` (:mod:`ckptq.numerics`), and the hooks through which :mod:`ckptq.ops` and
    :mod:`ckptq.inspect` handle the format without knowing it: :meth:`kernel_args` /
    :meth:`recipe_from_kernel_args` / :meth:`kernel_supports`, ``SOURCE_COMPONENTS``, ``PER_TENSOR_OVERRIDES`` /
    :meth:`check_overrides`, ``SCALE_COMPONENT`` / :meth:`decode_scale`. A subclass with a
    ``FORMAT`` registers itself in the format registry (:func:`ckptq.ops.register_format`, the
    dict :data:`FORMATS`).
    """

    FORMAT: ClassVar[str] = ""
    Recipe: ClassVar[type] = object
    #: the components the ``ckptq::requantize`` kernels take as a source, in their order
    SOURCE_COMPONENTS: ClassVar[tuple[str, ...]] = ()
    #: the override keywords (``"amax"``, ``"scale"``) :func:`ckptq.quantize` and
    #: :func:`ckptq.requantize` accept for this target: those of a per-tensor value
    PER_TENSOR_OVERRIDES: ClassVar[frozenset[str]] = frozenset()
    #: the rowwise block-scale component that :meth:`decode_scale` decodes (None: none)
    SCALE_COMPONENT: ClassVar[str | None] = None
    #: formats whose stored columnwise copy (recipe option ``columnwise``) is the rowwise encoding
    #: of the transposed values, transposed back (nvfp4 1x16, fp8_block): columnwise component ->
    #: the rowwise component of x^T it is. :mod:`ckptq.ops` computes it by running the rowwise
    #: kernels on x^T. Empty where the kernels compute the copy themselves (mxfp8) or there is none.
    COLUMNWISE_FROM_TRANSPOSE: ClassVar[dict[str, str]] = {}
    #: recipe options added to the format after its descriptors were first written: a descriptor
    #: stores one only when it differs from its default, so a tensor that does not use it keeps the
    #: descriptor it always had (which older ckptq versions read)
    ADDED_RECIPE_OPTIONS: ClassVar[frozenset[str]] = frozenset()
    _OPS: ClassVar[dict[Any, Callable]] = {}

    _components: dict[str, torch.Tensor]
    recipe: Any

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.FORMAT:
            ops.register_format(cls)

    @staticmethod
    def __new__(
        cls,
        components: Mapping[str, torch.Tensor],
        shape: Sequence[int],
        orig_dtype: torch.dtype,
        recipe: Any,
        requires_grad: bool = False,
    ):
        data = components["data"]
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            tuple(shape),
            dtype=orig_dtype,
            device=data.device,
            requires_grad=requires_grad,
        )
        self._components = dict(components)
        self.recipe = recipe
        return self

    def __init__(self, *args, **kwargs):  # state is set in __new__
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ------------------------------------------------------------------ geometry and views
    @classmethod
    def component_specs(cls, shape: Sequence[int], recipe: Any) -> list[chunks.ComponentSpec]:
        """Specs of every component present for ``shape`` and ``recipe``, in canonical order."""
        raise NotImplementedError

    # ------------------------------------------------------------------ format hooks
    @classmethod
    def kernel_args(cls, recipe: Any) -> dict:
        """The ``ckptq::requantize`` arguments describing this format with ``recipe``:
        ``{"format", "block", "fp8_dtype", "pow2", "eps", "columnwise", "scale_rule"}`` (see
        :func:`ckptq.ops.make_kernel_args`)."""
        raise NotImplementedError

    @classmethod
    def kernel_supports(cls, recipe: Any) -> bool:
        """Whether the ``ckptq::requantize`` kernels take this recipe as a source or target (else
        :mod:`ckptq.ops` decodes and encodes it through the reference numerics). Default: True."""
        return True

    @classmethod
    def recipe_from_kernel_args(
        cls,
        block: Sequence[int],
        fp8_dtype: torch.dtype | None,
        pow2: bool,
        eps: float,
        columnwise: bool,
        scale_rule: str = "",
    ) -> Any:
        """Inverse of :meth:`kernel_args`: the recipe the op arguments describe (the fake kernels'
        output shapes). Raises UnsupportedFormatError as the recipe does for invalid values."""
        raise NotImplementedError

    @classmethod
    def check_overrides(cls, shape: Sequence[int], amax: Any = None, scale: Any = None) -> None:
        """Validate a quantize/requantize call to this format for a logical ``shape``: ``amax=`` /
        ``scale=`` only where the format has that per-tensor value (``PER_TENSOR_OVERRIDES``);
        formats with shape constraints (NVFP4, MXFP4: K even) extend it.

        Raises:
            UnsupportedFormatError: an override the format does not take.
        """
        for name, value in (("amax", amax), ("scale", scale)):
            if value is not None and name not in cls.PER_TENSOR_OVERRIDES:
                # reverse-sorted, as the message has always read ("nvfp4 and fp8_tensor")
                takers = sorted((f for f, c in FORMATS.items() if name in c.PER_TENSOR_OVERRIDES), reverse=True)
                raise UnsupportedFormatError(f"{cls.FORMAT}: {name}= applies only to {' and '.join(takers)}")

    def with_recipe(self, recipe: Any) -> tuple[QuantizedTensor, int] | None:
        """This tensor in ``recipe`` without re-encoding, where the two recipes differ only in how a
        per-tensor value is represented (NVFP4's global-scale convention): ``(tensor, largest
        difference of the two decodes in fp32 ulps)``; None where ``recipe`` needs a requantize.
        Default: None (the formats that can override it)."""
        return None

    @classmethod
    def check_shape(cls, shape: Sequence[int], recipe: Any) -> None:
        """Raise QuantizationError when a component of ``recipe`` packs values along a dim whose
        logical size is not a multiple of the packing (``DimMap.exact``: NVFP4's two E2M1 codes per
        byte, along K, and along M in the columnwise copy)."""
        for s in cls.component_specs(shape, recipe):
            for d in s.dims:
                if d.exact and shape[d.logical_dim] % d.divisor:
                    raise QuantizationError(
                        f"{cls.FORMAT}: dim {d.logical_dim} of shape {tuple(shape)} is {shape[d.logical_dim]}, "
                        f"not a multiple of {d.divisor}: component '{s.name}' packs {d.divisor} values per "
                        f"byte along it. Pad that dim or choose another format or recipe."
                    )

    @classmethod
    def rowwise_recipe(cls, recipe: Any) -> Any:
        """``recipe`` without a stored columnwise copy (``recipe`` itself when it has none)."""
        if getattr(recipe, "columnwise", False):
            return dataclasses.replace(recipe, columnwise=False)
        return recipe

    def rowwise_only(self) -> QuantizedTensor:
        """This tensor without its stored columnwise copy (the same component tensors, no copy);
        ``self`` when it has none."""
        recipe = self.rowwise_recipe(self.recipe)
        if recipe is self.recipe:
            return self
        names = [s.name for s in self.component_specs(self.shape, recipe)]
        return type(self)({k: self._components[k] for k in names}, self.shape, self.dtype, recipe)

    def columnwise_on_grid(self, global_shape: Sequence[int], boxes: Sequence[chunks.Box]) -> QuantizedTensor:
        """This tensor (a shard of one of ``global_shape``), or :meth:`rowwise_only` when the shard
        ``boxes`` cut blocks of the columnwise copy's global grid but not of the rowwise one's: a
        producer that quantized each shard's copy on the shard's own blocks (e.g. TransformerEngine
        1-D blockwise FP8, 128-row columnwise blocks, on 80-row FSDP shards) gives no global copy."""
        row = self.rowwise_only()
        if row is self:
            return self

        def on_grid(t: QuantizedTensor) -> bool:
            align = chunks.alignment(t.component_specs(global_shape, t.recipe), len(global_shape))
            return all(chunks.is_aligned(align, global_shape, b) for b in boxes)

        return row if not on_grid(self) and on_grid(row) else self

    @classmethod
    def decode_scale(cls, t: torch.Tensor) -> torch.Tensor:
        """The ``SCALE_COMPONENT`` tensor ``t`` decoded to fp32 (the default: a plain cast)."""
        return t.float()

    @property
    def specs(self) -> list[chunks.ComponentSpec]:
        return self.component_specs(self.shape, self.recipe)

    def components(self) -> dict[str, torch.Tensor]:
        """The canonical component tensors by name (compact layout, no padding or swizzle)."""
        return dict(self._components)

    def per_tensor_names(self) -> list[str]:
        """Components that follow neither matrix dim (FP8 ``scale_inv``, NVFP4 ``amax``): every
        shard of the tensor holds the same value."""
        return [s.name for s in self.specs if s.is_per_tensor(self.ndim)]

    def block_alignment(self) -> tuple[int, ...]:
        """Per logical dim, the granularity a cut must respect (lcm of all component divisors)."""
        return chunks.alignment(self.specs, self.ndim)

    def descriptor(self, shape: Sequence[int] | None = None) -> dict:
        """JSON-serializable description: format, version, logical shape, dtype, recipe, components.

        ``ckptq.from_components(qt.descriptor(), qt.components())`` rebuilds the tensor exactly.
        ``shape`` describes a tensor of another logical shape with this format and recipe (the
        global tensor a shard belongs to).
        """
        shape = tuple(self.shape if shape is None else shape)
        return {
            "format": self.FORMAT,
            "version": DESCRIPTOR_VERSION,
            "shape": list(shape),
            "dtype": dtype_to_str(self.dtype),
            "recipe": self._recipe_to_json(self.recipe),
            "components": {
                s.name: {"dtype": dtype_to_str(s.dtype), "shape": list(s.shape(shape))}
                for s in self.component_specs(shape, self.recipe)
            },
        }

    @classmethod
    def _recipe_to_json(cls, recipe, *, every_option: bool = False) -> dict:
        """The recipe as JSON builtins; ``ADDED_RECIPE_OPTIONS`` at their defaults are left out
        unless ``every_option``."""
        out = {}
        for f in dataclasses.fields(recipe):
            v = getattr(recipe, f.name)
            if not every_option and f.name in cls.ADDED_RECIPE_OPTIONS and v == f.default:
                continue
            out[f.name] = dtype_to_str(v) if isinstance(v, torch.dtype) else (list(v) if isinstance(v, tuple) else v)
        return out

    @classmethod
    def _recipe_from_json(cls, d: Mapping) -> Any:
        kwargs = {}
        for f in dataclasses.fields(cls.Recipe):
            if f.name not in d:
                continue
            v = d[f.name]
            if isinstance(v, str) and v.startswith("float8"):
                v = str_to_dtype(v)
            elif isinstance(v, list):
                v = tuple(v)
            kwargs[f.name] = v
        try:
            return cls.Recipe(**kwargs)
        except (TypeError, ValueError) as e:
            raise CheckpointFormatError(f"invalid {cls.FORMAT} recipe {dict(d)}: {e}") from e

    @classmethod
    def from_components(
        cls,
        components: Mapping[str, torch.Tensor],
        shape: Sequence[int],
        orig_dtype: torch.dtype,
        recipe: Any,
        *,
        fqn: str | None = None,
    ) -> QuantizedTensor:
        """Wrap existing component tensors; checks names, shapes and dtypes against the specs.

        Raises:
            CheckpointFormatError: a component is missing, extra, or of the wrong shape or dtype.
        """
        where = f"tensor '{fqn}'" if fqn else f"{cls.FORMAT} tensor"
        specs = cls.component_specs(shape, recipe)
        expected = {s.name for s in specs}
        if set(components) != expected:
            raise CheckpointFormatError(
                f"{where} of logical shape {tuple(shape)}: components {sorted(components)} do not "
                f"match the {cls.FORMAT} layout {sorted(expected)}; the checkpoint or descriptor "
                f"is inconsistent."
            )
        for s in specs:
            t = components[s.name]
            if tuple(t.shape) != s.shape(shape) or t.dtype != s.dtype:
                raise CheckpointFormatError(
                    f"{where}: component '{s.name}' is {t.dtype} {tuple(t.shape)}, expected "
                    f"{s.dtype} {s.shape(shape)} for logical shape {tuple(shape)} ({cls.FORMAT})."
                )
        return cls(components, shape, orig_dtype, recipe)

    def _rebuild(self, fn: Callable[[str, torch.Tensor], torch.Tensor], shape=None) -> QuantizedTensor:
        comps = {k: fn(k, v) for k, v in self._components.items()}
        return type(self)(comps, self.shape if shape is None else shape, self.dtype, self.recipe)

    def same_layout(self, other: QuantizedTensor) -> bool:
        """Same format, recipe, logical shape and component set (so a raw byte copy is exact)."""
        return (
            type(self) is type(other)
            and self.recipe == other.recipe
            and tuple(self.shape) == tuple(other.shape)
            and set(self._components) == set(other._components)
        )

    # ------------------------------------------------------------------ numerics
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """High-precision values of the logical shape, computed in fp32 and cast to ``dtype``."""
        return ops.dequantize(self, dtype)

    def __repr__(self) -> str:
        comps = ", ".join(f"{k}={v.dtype}{tuple(v.shape)}" for k, v in self._components.items())
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self.recipe}, {comps})"

    # Traceable-wrapper-subclass protocol: the names __tensor_flatten__ returns must be attributes
    # (torch reads them with getattr, e.g. transform_subclass). A component "data" would collide
    # with Tensor.data, so inner tensors are exposed as "_c_<component>".
    _INNER_PREFIX: ClassVar[str] = "_c_"

    def __getattr__(self, name: str):
        if name.startswith(QuantizedTensor._INNER_PREFIX):
            comps = self.__dict__.get("_components")
            if comps is not None and name[len(QuantizedTensor._INNER_PREFIX) :] in comps:
                return comps[name[len(QuantizedTensor._INNER_PREFIX) :]]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __tensor_flatten__(self):
        names = [self._INNER_PREFIX + k for k in self._components]
        return names, (self.recipe, tuple(self.shape), self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        recipe, shape, dtype = ctx
        comps = {k.removeprefix(cls._INNER_PREFIX): v for k, v in inner.items()}
        return cls(comps, shape, dtype, recipe)

    def __reduce_ex__(self, protocol):
        # Pickle as builtins + plain tensors through one module-level factory (torch.save, deepcopy).
        return (_rebuild_quantized, (self.FORMAT, self.descriptor(), self.components()))

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def implements(cls, ops: Sequence[Any]):
        def deco(fn):
            for op in ops:
                cls._OPS[op] = fn
            return fn

        return deco

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = cls._OPS.get(func) or cls._OPS.get(func.overloadpacket)
        if handler is None:
            arg_types = tuple(type(a).__name__ for a in args)
            raise NotImplementedError(
                f"{cls.__name__} does not support {func} (argument types {arg_types}). ckptq "
                f"quantized tensors implement only what checkpointing needs (detach, to/cpu, "
                f"new_empty, empty_like, zeros_like, copy_, clone, pin_memory, block-aligned "
                f"narrow/slice); call .dequantize() for high-precision math."
            )
        return handler(func, args, kwargs)


def from_components(descriptor: Any, components: Mapping[str, torch.Tensor]) -> QuantizedTensor:
    """Rebuild a QuantizedTensor from ``qt.descriptor()`` and ``qt.components()`` (no copy).

    ``descriptor`` is the JSON dict (``qt.descriptor()``, a record's descriptor) or the typed
    :class:`ckptq.contract.Descriptor` a checkpoint view's entries carry.

    Raises:
        CheckpointFormatError: unknown version, malformed descriptor, or components that do not
            match the declared layout.
        UnsupportedFormatError: unknown format name.
    """
    if not isinstance(descriptor, Mapping):  # the typed form: fields already converted
        version, fmt, shape = descriptor.version, descriptor.format, descriptor.shape
        dtype, recipe_json = descriptor.dtype, descriptor.recipe
    else:
        try:
            version = int(descriptor["version"])
            fmt = descriptor["format"]
            shape = tuple(int(s) for s in descriptor["shape"])
            dtype = str_to_dtype(descriptor["dtype"])
            recipe_json = descriptor.get("recipe", {})
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"malformed ckptq descriptor {dict(descriptor)!r}: {e}") from e
    if version > DESCRIPTOR_VERSION:
        raise CheckpointFormatError(
            f"ckptq descriptor version {version} is newer than this ckptq understands "
            f"({DESCRIPTOR_VERSION}); upgrade ckptq"
        )
    cls = format_class(fmt)
    return cls.from_components(components, shape, dtype, cls._recipe_from_json(recipe_json))


def _rebuild_quantized(fmt: str, descriptor: dict, components: dict) -> QuantizedTensor:
    """What a pickled QuantizedTensor calls to rebuild itself (``__reduce_ex__``): builtins and
    plain tensors in, the checked tensor out (:func:`from_components`); it runs no other code."""
    return from_components(descriptor, components)


# ``torch.load``'s default ``weights_only`` unpickler resolves only allow-listed globals: the rebuild
# function is the one global a pickled QuantizedTensor names (its arguments are builtins and plain
# tensors), so it is the one ckptq allows, as torchao allows its tensor classes when imported.
torch.serialization.add_safe_globals([_rebuild_quantized])


# ---------------------------------------------------------------------- op handlers
_impl = QuantizedTensor.implements


def _device_kw(kwargs) -> dict:
    return {k: kwargs[k] for k in ("device", "non_blocking") if kwargs.get(k) is not None}


@_impl([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    # dcp.save (plan and write paths) and DTensor.to_local call detach.
    return args[0]._rebuild(lambda k, v: func(v))


@_impl([aten.view.default, aten._unsafe_view.default])
def _view(func, args, kwargs):
    # DTensor.from_local calls view_as(self): only the identity view is meaningful.
    self, size = args[0], list(args[1])
    if -1 in size:
        size[size.index(-1)] = self.numel() // max(1, -math.prod(size))
    if tuple(size) != tuple(self.shape):
        raise NotImplementedError(
            f"{type(self).__name__}: view to {tuple(size)} from {tuple(self.shape)} would change "
            f"the block layout; only identity views are supported."
        )
    return self._rebuild(lambda k, v: v.view(v.shape))


@_impl([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    # .to(device)/.cpu() and DCP staging: keep the subclass and the raw bytes.
    self = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != self.dtype:
        raise NotImplementedError(
            f"{type(self).__name__}.to(dtype={dtype}) would dequantize; call .dequantize({dtype}) explicitly."
        )
    kw = _device_kw(kwargs)
    pin = kwargs.get("pin_memory", False)

    def move(k, v):
        # aten._to_copy always returns new storage (``.to(..., copy=True)``, staging): never alias.
        out = v.to(**kw, copy=True) if kw else v.clone()
        return out.pin_memory() if pin else out

    return self._rebuild(move)


@_impl([aten.clone.default])
def _clone(func, args, kwargs):
    return args[0]._rebuild(lambda k, v: v.clone())


@_impl([aten.is_pinned.default])
def _is_pinned(func, args, kwargs):
    # DCP's TensorProperties.create_from_tensor asks.
    return all(v.is_pinned() for v in args[0]._components.values())


@_impl([aten._pin_memory.default])
def _pin_memory(func, args, kwargs):
    return args[0]._rebuild(lambda k, v: v.pin_memory())


def _empty_like_layout(self: QuantizedTensor, size, kwargs, fill: float | None) -> QuantizedTensor:
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != self.dtype:
        raise NotImplementedError(
            f"{type(self).__name__}: a new tensor of dtype {dtype} cannot share this quantized "
            f"layout; create a plain tensor instead."
        )
    device = kwargs.get("device") or self.device
    pin = bool(kwargs.get("pin_memory"))
    comps = {}
    for s in type(self).component_specs(size, self.recipe):
        t = torch.empty(s.shape(size), dtype=s.dtype, device=device, pin_memory=pin)
        if fill is not None:
            t.zero_()
        comps[s.name] = t
    return type(self)(comps, size, self.dtype, self.recipe)


@_impl([aten.new_empty.default])
def _new_empty(func, args, kwargs):
    # dcp.async_save's DefaultStager stages with new_empty (TransformerEngine#2721: a plain tensor
    # here silently stages garbage), so this returns the same quantized layout.
    return _empty_like_layout(args[0], tuple(args[1]), kwargs, None)


@_impl([aten.new_zeros.default])
def _new_zeros(func, args, kwargs):
    return _empty_like_layout(args[0], tuple(args[1]), kwargs, 0.0)


@_impl([aten.empty_like.default])
def _empty_like(func, args, kwargs):
    return _empty_like_layout(args[0], tuple(args[0].shape), kwargs, None)


@_impl([aten.zeros_like.default])
def _zeros_like(func, args, kwargs):
    # BlockingAsyncStager (FileSystemWriter.stage) uses zeros_like(x, device="cpu") then copy_.
    return _empty_like_layout(args[0], tuple(args[0].shape), kwargs, 0.0)


@_impl([aten.copy_.default])
def _copy_(func, args, kwargs):
    # Staging (zeros_like/new_empty + copy_) and quantized->quantized loads: raw bytes only.
    dst, src = args[0], args[1]
    if isinstance(dst, QuantizedTensor) and isinstance(src, QuantizedTensor) and dst.same_layout(src):
        for k, v in dst._components.items():
            v.copy_(src._components[k], non_blocking=bool(kwargs.get("non_blocking")))
        return dst
    raise NotImplementedError(
        f"copy_ from {type(src).__name__}{tuple(src.shape)} into {type(dst).__name__}"
        f"{tuple(dst.shape)}: ckptq copies raw bytes only between tensors of the same format, "
        f"recipe and shape. Use .dequantize() or ckptq.quantize() to convert explicitly."
    )


@_impl([aten.slice.Tensor])
def _slice(func, args, kwargs):
    # narrow / [a:b] and DCP's narrow_tensor_by_index: block-aligned cuts only (ShardingError).
    self = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    dim = dim % self.ndim
    n = self.shape[dim]
    start = 0 if start is None else (start + n if start < 0 else min(start, n))
    end = n if end is None else (end + n if end < 0 else min(end, n))
    end = max(end, start)
    if step != 1:
        raise NotImplementedError(f"{type(self).__name__}: slicing with step {step} is not supported")
    offsets = [0] * self.ndim
    sizes = list(self.shape)
    offsets[dim], sizes[dim] = start, end - start
    return slice_box(self, (tuple(offsets), tuple(sizes)))


def slice_box(qt: QuantizedTensor, box: chunks.Box, *, fqn: str | None = None) -> QuantizedTensor:
    """The sub-tensor of ``qt`` at logical ``box`` (views of the components; raw bytes kept).

    Raises:
        ShardingError: a cut of ``box`` is not block-aligned (names the dim, boundary and block).
    """
    specs = qt.specs
    chunks.check_aligned(specs, qt.shape, box, fqn=fqn, fmt=qt.FORMAT)
    comps = {}
    for s in specs:
        cbox = chunks.component_box(s, qt.shape, box, fqn=fqn, fmt=qt.FORMAT)
        comps[s.name] = chunks.narrow_box(qt._components[s.name], cbox)
    return type(qt)(comps, box[1], qt.dtype, qt.recipe)


def unwrap_quantized(x: Any) -> QuantizedTensor | None:
    """The QuantizedTensor in ``x`` (itself, or a DTensor's local tensor), else None."""
    if isinstance(x, QuantizedTensor):
        return x
    local = getattr(x, "_local_tensor", None)
    return local if isinstance(local, QuantizedTensor) else None


def check_recipe_value(fmt: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise UnsupportedFormatError(f"{fmt}: {name}={value!r} is not supported; choose one of {list(allowed)}.")


def check_recipe_flag(recipe, fmt: str, name: str) -> None:
    """A boolean recipe option: True/False (or 1/0), stored as a bool; anything else (``"no"`` is
    truthy!) raises UnsupportedFormatError instead of silently switching the option on."""
    value = getattr(recipe, name)
    if isinstance(value, str) or value not in (False, True):
        raise UnsupportedFormatError(f"{fmt}: {name}={value!r} must be True or False.")
    object.__setattr__(recipe, name, bool(value))

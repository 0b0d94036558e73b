"""The adapter registry: how foreign quantized tensors enter and leave ckptq.

A foreign representation (a TransformerEngine tensor class, next torchao's) is handled by one
:class:`Adapter`: it is *detected* by the module and qualified name of the object's class (or of a
base class; the foreign library is never imported), *extracted* to a canonical
:class:`ckptq.QuantizedTensor` (compact, unswizzled components) plus a ``producer`` record of
builtins, and *inserted* back into a live object in place. Restricted unpicklers learn the foreign
pickle globals they may resolve from :func:`pickle_globals`.

Planners, chunk math, reshard and the CLI call :func:`local_quantized` / :func:`insert` and stay
producer-agnostic: no foreign class or module name appears outside this package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..formats.base import QuantizedTensor

__all__ = [
    "Adapter",
    "register",
    "adapter_for",
    "local_quantized",
    "pickle_globals",
    "describe_entry",
    "check_fits",
    "refuse",
    "registered",
]


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How one foreign library's quantized tensors map to ckptq's canonical ones.

    Attributes:
        producer: the library's name as recorded in descriptors (``"transformer_engine"``).
        classes: ``(module, qualname)`` of the live tensor classes it handles (subclasses match too).
        to_canonical: ``(obj, fqn) -> (QuantizedTensor, producer dict)``: the canonical tensor of
            ``obj``'s local logical shape (views of ``obj``'s buffers where possible) and a
            JSON-serializable record of the producer and the fields needed to rebuild ``obj``.
            Raises :class:`ckptq.UnsupportedFormatError` naming the FQN, class and field for what
            cannot be stored exactly.
        empty_canonical: ``(obj, fqn) -> QuantizedTensor``: fresh canonical buffers of ``obj``'s
            format, recipe and local shape (what a load reads into before :attr:`insert`).
        insert: ``(obj, qt, fqn) -> Optional[float]``: write canonical ``qt`` into ``obj``'s buffers
            in place (the producer's padding, swizzle and derived copies); returns the SQNR in dB of
            any derived copy it had to requantize (None when everything was exact).
        pickle_globals: ``(module, name) -> object`` for the globals the producer's pickles
            reference, resolved to ckptq stand-ins (never the producer's code).
        payload_types: the ckptq classes those stand-ins build (records of a pickled tensor with
            the live class's attribute names); :func:`adapter_for` recognizes them too.
        pickle_versions: which producer versions' pickles the stand-ins follow (for error messages).
        entry_suffixes: FQN suffix -> what such a non-tensor-format entry of the producer is
            (e.g. TE's ``._extra_state``), for inspect.
    """

    producer: str
    classes: tuple[tuple[str, str], ...]
    to_canonical: Callable[[Any, str], tuple[QuantizedTensor, dict]]
    empty_canonical: Callable[[Any, str], QuantizedTensor]
    insert: Callable[[Any, QuantizedTensor, str], float | None]
    pickle_globals: Mapping[tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    payload_types: tuple[type, ...] = ()
    pickle_versions: str = ""
    entry_suffixes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def pickle_markers(self) -> tuple[bytes, ...]:
        """Byte strings (top-level module names) that occur in any pickle of the producer's."""
        return tuple(sorted({m.split(".")[0].encode() for m, _ in self.pickle_globals}))


_ADAPTERS: list[Adapter] = []
_BY_CLASS: dict[tuple[str, str], Adapter] = {}


def register(adapter: Adapter) -> Adapter:
    """Add ``adapter`` to the registry (its classes must not be claimed by another adapter)."""
    for key in adapter.classes:
        assert key not in _BY_CLASS, f"{key} is already handled by {_BY_CLASS[key].producer}"
        _BY_CLASS[key] = adapter
    _ADAPTERS.append(adapter)
    return adapter


def registered() -> list[Adapter]:
    """The registered adapters, in registration order."""
    return list(_ADAPTERS)


def adapter_for(obj: Any) -> Adapter | None:
    """The adapter whose class list names ``type(obj)`` or one of its bases, or whose payload
    types ``obj`` is an instance of; else None."""
    for cls in type(obj).__mro__:
        found = _BY_CLASS.get((cls.__module__, cls.__qualname__))
        if found is not None:
            return found
    for a in _ADAPTERS:
        if a.payload_types and isinstance(obj, a.payload_types):
            return a
    return None


def _local(obj: Any) -> Any:
    local = getattr(obj, "_local_tensor", None)  # a DTensor's shard
    return obj if local is None else local


def local_quantized(obj: Any) -> tuple[Any, Adapter | None] | None:
    """The quantized tensor ``obj`` holds locally and the adapter it needs.

    Returns ``(local, None)`` for a ckptq :class:`QuantizedTensor` (plain or a DTensor's local
    tensor), ``(local, adapter)`` for a registered foreign tensor, and None for anything else.
    """
    if not isinstance(obj, torch.Tensor):
        return None
    local = _local(obj)
    if isinstance(local, QuantizedTensor):
        return local, None
    adapter = adapter_for(local)
    return None if adapter is None else (local, adapter)


def refuse(where: str, fqn: str, field: str, why: str) -> None:
    """Raise UnsupportedFormatError for a foreign tensor ckptq cannot store exactly: names the
    tensor and class (``where``), the field and why, and the high-precision rule to use instead."""
    from ..errors import UnsupportedFormatError

    raise UnsupportedFormatError(
        f"{where}: {field} {why}, which ckptq cannot store exactly. Save it in high "
        f"precision with QuantizedSavePlanner(rules={{'{fqn}': 'high_precision'}})."
    )


def check_fits(qt: Any, fmt: str, shape: tuple, recipe: Mapping[str, Any], where: str) -> None:
    """Raise unless canonical ``qt`` can be written raw into a foreign target that holds ``fmt`` of
    logical ``shape`` with ``recipe`` (its element dtype and block must agree; other recipe options
    only guide encoding). ``where`` names the tensor and class in the message.

    Raises:
        CheckpointFormatError: another format, logical shape, ``fp8_dtype`` or ``block``.
    """
    from ..errors import CheckpointFormatError

    if getattr(qt, "FORMAT", None) != fmt:
        raise CheckpointFormatError(
            f"{where}: cannot insert a {getattr(qt, 'FORMAT', type(qt).__name__)} tensor; the target holds {fmt}"
        )
    if tuple(qt.shape) != tuple(shape):
        raise CheckpointFormatError(
            f"{where}: the loaded tensor has logical shape {tuple(qt.shape)}, the target {tuple(shape)}"
        )
    for key in ("fp8_dtype", "block"):
        if key in recipe and getattr(qt.recipe, key) != recipe[key]:
            raise CheckpointFormatError(
                f"{where}: the loaded tensor has {key}={getattr(qt.recipe, key)}, the "
                f"target {key}={recipe[key]}; requantize instead of a raw insert"
            )


def describe_entry(fqn: str) -> str | None:
    """What a producer's auxiliary entry named ``fqn`` is (``"transformer_engine: ..."``), if any
    adapter knows its suffix; else None."""
    for a in _ADAPTERS:
        for suffix, what in a.entry_suffixes.items():
            if fqn.endswith(suffix):
                return f"{a.producer}: {what}"
    return None


def pickle_globals() -> dict[tuple[str, str], Any]:
    """Every foreign pickle global the registered adapters map, ``(module, name) -> stand-in``."""
    out: dict[tuple[str, str], Any] = {}
    for a in _ADAPTERS:
        out.update(a.pickle_globals)
    return out


def _register_builtin() -> None:
    from . import te

    register(
        Adapter(
            "transformer_engine",
            tuple(te.TE_CLASSES),
            te.to_canonical,
            te.empty_canonical,
            te.insert,
            dict(te.PICKLE_GLOBALS),
            (te.TEPayload,),
            "TransformerEngine main (2026-08, d0067d0) and the #2974-era builds (transformer_engine_torch.DType)",
            {
                "._extra_state": "module extra state (FP8 recipe state as a uint8 tensor; empty for "
                "stateless recipes; DelayedScaling pickles a dict that ckptq never unpickles)"
            },
        )
    )
    from . import torchao as ao  # noqa: E402  (torchao itself is never imported)

    register(
        Adapter(
            "torchao",
            tuple(ao.AO_CLASSES),
            ao.to_canonical,
            ao.empty_canonical,
            ao.insert,
            dict(ao.PICKLE_GLOBALS),
            ao.PAYLOAD_TYPES,
            "torchao 0.18.0",
        )
    )


_register_builtin()

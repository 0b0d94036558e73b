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

from typing import Any

import torch

from ..formats.base import QuantizedTensor
from . import te
from . import torchao as ao  # torchao itself is never imported
from .base import Adapter, FlatTensor, check_fits, refuse

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
    "FlatTensor",
    "safetensors_groups",
    "flattening",
]


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


def safetensors_groups(metadata: dict, names: Any, where: str) -> dict[str, tuple[Adapter, FlatTensor]]:
    """The foreign quantized tensors a safetensors file stores flattened, by name, each with the
    adapter that reads it (``adapter.safetensors_to_canonical``), from the file's ``__metadata__``
    and the names stored in its folder. Raises what the adapters raise for what they cannot read."""
    out: dict[str, tuple[Adapter, FlatTensor]] = {}
    for a in _ADAPTERS:
        if a.safetensors_groups is not None:
            out.update({fqn: (a, flat) for fqn, flat in a.safetensors_groups(metadata, names, where).items()})
    return out


def flattening(producer: str) -> Adapter | None:
    """The registered adapter of ``producer`` that writes its safetensors form, if any."""
    return next((a for a in _ADAPTERS if a.producer == producer and a.safetensors_flatten is not None), None)


def _register_builtin() -> None:
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
            safetensors_groups=ao.safetensors_groups,
            safetensors_to_canonical=ao.safetensors_to_canonical,
            safetensors_flatten=ao.safetensors_flatten,
        )
    )


_register_builtin()

"""What every adapter module shares: the :class:`Adapter` record the registry
(:mod:`ckptq.adapters`) holds, and the checks and refusals the adapters raise alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointFormatError, UnsupportedFormatError
from ..formats.base import QuantizedTensor

__all__ = ["Adapter", "FlatTensor", "check_fits", "refuse"]


@dataclasses.dataclass(frozen=True)
class FlatTensor:
    """One foreign quantized tensor stored flattened in a safetensors file (e.g. torchao's
    ``flatten_tensor_state_dict``): its name, the producer's class name, its decoded attributes,
    ``{field: stored tensor name}``, the fields read when the file is opened (small values the
    descriptor needs; the others are described from their header dtype and shape), and which field
    holds each canonical component (``{component: field}``, for inspect's stored names)."""

    fqn: str
    kind: str
    attributes: dict
    members: dict
    small: tuple = ()
    components: dict = dataclasses.field(default_factory=dict)


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
        safetensors_groups: ``(file metadata, stored names, where) -> {fqn: FlatTensor}``: the
            producer's tensors a safetensors file stores flattened (``{}``: none); None when the
            producer has no such format.
        safetensors_to_canonical: ``(FlatTensor, {stored name: tensor}) -> (QuantizedTensor,
            producer dict)`` for one of them.
        safetensors_flatten: ``(name, QuantizedTensor, producer dict or None) -> ({stored name:
            tensor}, metadata JSON, numerics)``: the producer's flattened form of a canonical tensor
            (what ``ckptq export --layout <producer>`` writes).
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
    safetensors_groups: Callable[[Mapping, Any, str], dict] | None = None
    safetensors_to_canonical: Callable[[FlatTensor, Mapping], tuple[QuantizedTensor, dict]] | None = None
    safetensors_flatten: Callable[[str, QuantizedTensor, Any], tuple[dict, str, dict]] | None = None

    @property
    def pickle_markers(self) -> tuple[bytes, ...]:
        """Byte strings (top-level module names) that occur in any pickle of the producer's."""
        return tuple(sorted({m.split(".")[0].encode() for m, _ in self.pickle_globals}))


def refuse(where: str, fqn: str, field: str, why: str) -> None:
    """Raise UnsupportedFormatError for a foreign tensor ckptq cannot store exactly: names the
    tensor and class (``where``), the field and why, and the high-precision rule to use instead."""
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

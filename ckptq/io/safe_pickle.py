"""Allow-listed unpickling of DCP ``.metadata`` files.

DCP's ``FileSystemReader.read_metadata`` reads ``.metadata`` with a plain ``pickle.load``, so opening an
untrusted checkpoint can run arbitrary code. :class:`SafeUnpickler` resolves only the globals that
the ``.metadata`` pickles of torch 2.11 and 2.13 contain and refuses everything else with
:class:`ckptq.errors.UnsafeCheckpointError` *before* anything from the pickle is called.

How the allow-list was derived: ``FileSystemWriter`` checkpoints of tensors of every dtype (fp32,
fp16, bf16, fp64, fp8 e4m3/e5m2/e8m0, int8..int64, uint8, bool, complex64, 0-d, empty,
channels-last, ``nn.Parameter``) plus nested non-tensor objects were saved with ``thread_count=1/2``
and ``single_file_per_rank=True/False``, and every global their ``.metadata`` pickle resolved was
recorded (an ``Unpickler.find_class`` hook; cross-checked with ``pickletools`` GLOBAL /
STACK_GLOBAL opcodes). The result is exactly:

- the dataclasses of ``torch.distributed.checkpoint.metadata``: ``Metadata``,
  ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, and the enum ``_MEM_FORMAT_ENCODING``
  (``TensorProperties`` pickles its memory format through it: ``torch.memory_format`` objects are
  not picklable, so they never appear as globals);
- ``torch.distributed.checkpoint.filesystem._StorageInfo``;
- ``torch.Size`` and ``torch.<dtype>`` constants;
- ``torch.serialization._get_layout`` (how ``torch.layout`` pickles); it is replaced here by a
  lookup restricted to ``torch.layout`` constants;
- ``pathlib.PosixPath`` (``StorageMeta.checkpoint_id`` is the writer's ``Path``); the other
  concrete path classes (and Python 3.13's ``pathlib._local`` spelling) are allowed too, and a
  path class of the other OS is read as the matching pure path instead of failing.

torch 2.11 pickles the same classes (its ``metadata.py`` and ``filesystem.py`` declare the same
dataclasses; ``CURRENT_DCP_VERSION`` is ``"1.0.0"`` in both).

ckptq's own record (``planner_data[ckptq.contract.CKPTQ_KEY]``) holds builtins only (dict, list, str, int, float, bool,
None), which need no globals.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import IO, Any

import torch

from ..errors import UnsafeCheckpointError

__all__ = ["SafeUnpickler", "safe_load", "safe_loads", "ALLOWED_GLOBALS"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"

_LAYOUTS: dict[str, torch.layout] = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _get_layout(name: str) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: only ``torch.layout`` constants by name."""
    try:
        return _LAYOUTS[name]
    except (KeyError, TypeError):
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}") from None


def _path_classes() -> dict[tuple[str, str], type]:
    # The current OS's concrete path class is kept; the other OS's is read as a pure path
    # (``pickle.load`` would raise "cannot instantiate 'WindowsPath' on your system").
    native_posix = os.name != "nt"
    posix = pathlib.PosixPath if native_posix else pathlib.PurePosixPath
    windows = pathlib.PureWindowsPath if native_posix else pathlib.WindowsPath
    out = {}
    for module in ("pathlib", "pathlib._local"):
        out[(module, "PosixPath")] = posix
        out[(module, "WindowsPath")] = windows
        out[(module, "PurePosixPath")] = pathlib.PurePosixPath
        out[(module, "PureWindowsPath")] = pathlib.PureWindowsPath
        out[(module, "Path")] = pathlib.Path
    return out


def _build_allow_list() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem as fs_mod
    from torch.distributed.checkpoint import metadata as md_mod

    allowed: dict[tuple[str, str], Any] = {}
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed[(_DCP_METADATA, name)] = getattr(md_mod, name)
    allowed[(_DCP_FILESYSTEM, "_StorageInfo")] = fs_mod._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    allowed.update(_path_classes())
    return allowed


#: ``(module, name)`` -> the object ``find_class`` returns. Anything else is refused.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _build_allow_list()

# Classes whose attributes a pickle could try to overwrite (BUILD with a slot state on the class
# object itself). They are checked after every load.
_MUTABLE_CLASSES: tuple[type, ...] = tuple(
    {id(v): v for v in ALLOWED_GLOBALS.values() if isinstance(v, type) and hasattr(v, "__dict__")}.values()
)


class SafeUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only :data:`ALLOWED_GLOBALS`.

    Args:
        file: a binary file object positioned at the pickle.
        source: the file name used in error messages (e.g. ``/ckpt/.metadata``).
        allowed: override of the allow-list, ``(module, name) -> object``.

    Raises (from :meth:`load`):
        UnsafeCheckpointError: the pickle references a global outside the allow-list, a persistent
            id, or tries to modify an allowed class. Nothing referenced by the pickle was called.
    """

    def __init__(
        self,
        file: IO[bytes],
        *,
        source: str = "<pickle>",
        allowed: dict[tuple[str, str], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self.source = source
        self.allowed = ALLOWED_GLOBALS if allowed is None else allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            pass
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to unpickle global '{module}.{name}': it is not on ckptq's "
            f"allow-list of DCP metadata classes, so loading it could run code. Nothing from the "
            f"file was executed. Only open this checkpoint with plain pickle/DCP if you trust "
            f"where it came from."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"{self.source}: refusing a pickle persistent id ({type(pid).__name__}); DCP metadata never contains one."
        )

    def load(self) -> Any:
        before = [dict(vars(c)) for c in _MUTABLE_CLASSES]
        try:
            return super().load()
        finally:
            _check_classes_untouched(before, self.source)


_MISSING = object()


def _check_classes_untouched(before: list[dict], source: str) -> None:
    changed = []
    for cls, snapshot in zip(_MUTABLE_CLASSES, before, strict=False):
        now = vars(cls)
        if now.keys() == snapshot.keys() and all(now[k] is snapshot[k] for k in snapshot):
            continue
        for k in list(now.keys()):
            if k not in snapshot:
                delattr(cls, k)
        for k, v in snapshot.items():
            if now.get(k, _MISSING) is not v:
                setattr(cls, k, v)
        changed.append(f"{cls.__module__}.{cls.__qualname__}")
    if changed:
        raise UnsafeCheckpointError(
            f"{source}: the pickle tried to modify the class(es) {changed}; the change was undone and the file refused."
        )


def safe_load(file: IO[bytes], *, source: str = "<pickle>") -> Any:
    """Unpickle one object from a binary file with :class:`SafeUnpickler`.

    Raises:
        UnsafeCheckpointError: a global outside the allow-list (see :class:`SafeUnpickler`).
        pickle.UnpicklingError, EOFError, ValueError, TypeError, ...: a malformed pickle, as
            ``pickle.load`` raises them (callers turn these into ``CheckpointFormatError``).
    """
    return SafeUnpickler(file, source=source).load()


def safe_loads(data: bytes, *, source: str = "<pickle>") -> Any:
    """:func:`safe_load` from bytes."""
    return safe_load(io.BytesIO(data), source=source)

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

Non-tensor (bytes) entries are another matter: DCP ``torch.save``-s each one into its own record and
its ``DefaultLoadPlanner.load_bytes`` reads it back with ``torch.load(weights_only=False)`` (torch
2.11 and 2.13 ``default_planner.py``). :func:`load_pickled_object` reads them with torch's own
``weights_only`` unpickler instead, widened (through ``torch.serialization.safe_globals``) by
:func:`trainer_state_globals`: the types trainers keep in their state besides tensors.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import IO, Any

import torch

from ..errors import CheckpointFormatError, UnsafeCheckpointError, UnsafePickledObjectError

__all__ = [
    "SafeUnpickler",
    "safe_load",
    "safe_loads",
    "ALLOWED_GLOBALS",
    "trainer_state_globals",
    "load_pickled_object",
    "check_pickle_memo",
]

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


def _pickle_arg_lengths() -> list[int | None]:
    """Per opcode byte: its argument's width (>= 0: fixed; < 0: ``pickletools``' codes for a line
    or a length-prefixed argument), None for a byte that is no opcode."""
    import pickletools

    table: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        table[ord(op.code)] = 0 if op.arg is None else op.arg.n
    return table


_PICKLE_ARGS = _pickle_arg_lengths()


def check_pickle_memo(data: bytes, source: str, what: str = "the DCP metadata file") -> None:
    """Refuse a pickle whose memo indices or data lengths exceed its length before the C unpickler
    sees it.

    The C unpickler grows its memo array to twice a ``LONG_BINPUT``/``PUT`` index and zero-fills
    it: one flipped byte in ``.metadata`` can ask for gigabytes (a hang, then an allocation
    failure). A real pickle stores at most one memo entry per opcode, so an index >= its length
    is corrupt. Likewise the opcodes that carry a length (``BINBYTES8``, ``BYTEARRAY8``,
    ``BINUNICODE8``, ``BINBYTES`` ...) make the C unpickler allocate that many bytes before it
    reads them (CPython 3.11 / 3.12 ``Modules/_pickle.c``), so a flipped byte that turns an opcode
    into ``BYTEARRAY8`` asks for up to 2^64 bytes; a length past the end of the pickle is refused
    here. (A failed ``bytearray`` allocation there also makes CPython print a spurious
    ``SystemError: deallocated bytearray object has exported buffers``: ``PyByteArray_FromStringAndSize``
    frees the half-made object before setting its export count; see docs/testing.md.) Walks the
    opcodes without building anything; stops at the first unknown opcode or STOP (the unpickler
    then reports what it finds).

    Raises:
        CheckpointFormatError: naming ``source`` and ``what`` (the file's role), the byte and the
            declared size.
    """
    n, i, args = len(data), 0, _PICKLE_ARGS
    frm = int.from_bytes
    while i < n:
        code = data[i]
        k = args[code]
        i += 1
        if k is None or code == 0x2E:  # unknown opcode, or STOP
            return
        if k >= 0:  # most opcodes (a fixed-width argument or none): checked by the one comparison
            if code == 0x72 and frm(data[i : i + 4], "little") >= n:  # LONG_BINPUT
                raise CheckpointFormatError(
                    f"{source}: {what} is corrupt (a pickle memo index "
                    f"{frm(data[i : i + 4], 'little')} in a {n}-byte file); restore the file or re-save the checkpoint"
                )
            i += k
        elif k == -1:  # up to a newline; GLOBAL and INST take two lines
            end = data.find(b"\n", i)
            if end < 0:
                return
            if code == 0x70:  # PUT
                try:
                    idx = int(data[i:end])
                except ValueError:
                    return
                if idx >= n:
                    raise CheckpointFormatError(
                        f"{source}: {what} is corrupt (a pickle memo index {idx} in a "
                        f"{n}-byte file); restore the file or re-save the checkpoint"
                    )
            if code in (0x63, 0x69):
                end = data.find(b"\n", end + 1)
                if end < 0:
                    return
            i = end + 1
        elif k in (-2, -3, -4, -5):  # a length (1, 4 or 8 bytes), then that many bytes
            width = 1 if k == -2 else 8 if k == -5 else 4
            length = frm(data[i : i + width], "little", signed=(k == -3))
            if length < 0:
                return
            if i + width + length > n:
                raise CheckpointFormatError(
                    f"{source}: {what} is truncated or corrupt (a pickle opcode at byte {i - 1} "
                    f"declares {length} bytes of data in a {n}-byte file); restore the file or re-save the checkpoint"
                )
            i += width + length
        else:
            return


def safe_load(file: IO[bytes], *, source: str = "<pickle>") -> Any:
    """Unpickle one object from a binary file with :class:`SafeUnpickler`.

    Raises:
        UnsafeCheckpointError: a global outside the allow-list (see :class:`SafeUnpickler`).
        pickle.UnpicklingError, EOFError, ValueError, TypeError, ...: a malformed pickle, as
            ``pickle.load`` raises them (callers turn these into ``CheckpointFormatError``).
    """
    return SafeUnpickler(file, source=source).load()


def safe_loads(data: bytes, *, source: str = "<pickle>", what: str = "the pickle") -> Any:
    """:func:`safe_load` from bytes, after :func:`check_pickle_memo` (no memo index or declared data
    length past the end of ``data`` reaches the C unpickler; ``what`` names the bytes' role in its
    error). Raises what :func:`safe_load` raises, and ``CheckpointFormatError`` from that check."""
    check_pickle_memo(data, source, what)
    return safe_load(io.BytesIO(data), source=source)


# ------------------------------------------------------------------ non-tensor (bytes) entries

#: how a caller opts in to DCP's own behaviour (``torch.load(weights_only=False)``) for trusted files
TRUST_OPTION = "QuantizedLoadPlanner(trust_pickled_objects=True)"


def trainer_state_globals() -> list[tuple[Any, str]]:
    """The globals, beyond what ``torch.load(weights_only=True)`` allows by default, that trainers'
    non-tensor state pickles, as ``(object, "module.name")`` pairs for
    ``torch.serialization.safe_globals``.

    Each one only rebuilds data; none runs code named by the pickle:

    * numpy arrays, scalars and dtypes, e.g. ``np.random.get_state()`` (a tuple holding a uint32
      array): ``numpy._core.multiarray._reconstruct`` / ``scalar``, ``numpy.ndarray``,
      ``numpy.dtype`` and the ``numpy.dtypes`` classes. numpy 2 pickles ``numpy._core``, numpy 1.x
      ``numpy.core``; both spellings map to the installed numpy's functions. (Object arrays hold
      pickled Python objects; those go through this same allow-list.) Without numpy: none of these;
    * ``io.BytesIO`` (``_io.BytesIO``: rebuilt from its bytes, position and ``__dict__``);
    * ``datetime`` date/time/datetime/timedelta/timezone, ``pathlib`` paths, and the builtins
      ``frozenset``, ``slice`` and ``range``.

    ``collections.OrderedDict`` / ``Counter``, ``set``, ``complex``, ``bytearray``, ``torch.Size``,
    dtypes and tensors are on torch's own default list already. torch's unpickler refuses
    ``collections.defaultdict`` and ``deque`` whatever the list (it allows item assignment only on
    dicts), so they stay refused.
    """
    import builtins
    import datetime
    import io as _io

    out: list[tuple[Any, str]] = [(_io.BytesIO, "_io.BytesIO")]
    out += [(getattr(datetime, n), f"datetime.{n}") for n in ("date", "time", "datetime", "timedelta", "timezone")]
    out += [(getattr(builtins, n), f"builtins.{n}") for n in ("frozenset", "slice", "range")]
    out += [(cls, f"{module}.{name}") for (module, name), cls in _path_classes().items()]
    try:
        import numpy as np
    except ImportError:
        return out
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(multiarray._reconstruct, f"{module}._reconstruct"), (multiarray.scalar, f"{module}.scalar")]
    out += [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype")]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25
    if dtypes is not None:
        out += [
            (c, f"numpy.dtypes.{n}") for n, c in vars(dtypes).items() if isinstance(c, type) and issubclass(c, np.dtype)
        ]
    return out


def load_pickled_object(value: IO[bytes], *, where: str, trust: bool = False) -> Any:
    """Read one non-tensor (bytes) entry of a DCP checkpoint: a ``torch.save`` record.

    With ``trust=False`` it is read by ``torch.load(weights_only=True)`` with
    :func:`trainer_state_globals` added for the call only (globals the caller added with
    ``torch.serialization.add_safe_globals`` stay added and keep working); with ``trust=True`` by
    ``torch.load(weights_only=False)``, as DCP's ``DefaultLoadPlanner`` does.

    Args:
        value: the record (a seekable binary file object, e.g. the ``io.BytesIO`` DCP hands to
            ``load_bytes``); read from its current position.
        where: the checkpoint and entry, for messages (e.g. ``"/ckpt: 'rng.numpy'"``).
        trust: run whatever the pickle names (only for checkpoints from a trusted source).

    Raises:
        UnsafePickledObjectError: the pickle names a global outside both lists; the message names
            the global(s) and the opt-ins. Nothing from the record was run.
        pickle.UnpicklingError, EOFError, RuntimeError, ...: a damaged record, as ``torch.load``
            raises them.
    """
    if trust:
        return torch.load(value, map_location="cpu", weights_only=False)
    start = value.tell()
    present = set(torch.serialization.get_safe_globals())
    extra = [g for g in trainer_state_globals() if g not in present]
    with torch.serialization.safe_globals(extra):  # removes only what it added
        try:
            return torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            value.seek(start)
            try:
                names = torch.serialization.get_unsafe_globals_in_checkpoint(value)
            except Exception:  # noqa: BLE001 - not a zip record: report torch's own reason below
                names = []
            reason = str(e).strip().splitlines()
            detail = next((line for line in reason if "Unsupported" in line or "Can only" in line), reason[-1])
    if names:
        why = f"it references global(s) {names}, which are not on"
    else:
        why = f"torch's weights_only unpickler refuses it ({detail}) even with"
    raise UnsafePickledObjectError(
        f"{where}: refusing to unpickle this non-tensor entry: {why} the allow-list of trainer state "
        f"types (numpy arrays and RNG state, io.BytesIO, datetime, paths, builtins; see "
        f"ckptq.io.safe_pickle.trainer_state_globals), so loading it could run code. Nothing from it "
        f"was run. If you trust where the checkpoint came from, load with {TRUST_OPTION} (what DCP's "
        f"default planner does), or allow just these globals with torch.serialization.add_safe_globals"
    ) from None

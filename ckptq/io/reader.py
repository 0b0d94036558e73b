"""Safe reading of DCP ``FileSystemWriter`` checkpoints: metadata without running pickled code.

- :class:`SafeFileSystemReader` is a drop-in ``FileSystemReader`` for ``dcp.load``: its
  ``read_metadata`` uses :mod:`ckptq.io.safe_pickle`, and its ``read_data`` checks every non-tensor
  (BYTE_IO) item with ``torch.load(weights_only=True)`` before DCP's planner loads it (DCP's
  ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``). Tensor items are
  already read by DCP with ``weights_only=True``. Checkpoints that other libraries wrote with
  pickled quantized tensors (TransformerEngine) are presented through the ckptq contract
  (:mod:`ckptq.io.foreign`), their records unpickled with the adapters' stand-ins only.
- :func:`read_metadata` opens a checkpoint directory for tools (``ckptq inspect``) with clear
  :class:`~ckptq.errors.CheckpointFormatError` s for missing, truncated and non-DCP paths.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
import pickle
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ..errors import CheckpointFormatError, CkptqError, UnsafeCheckpointError
from .safe_pickle import safe_load

__all__ = [
    "SafeFileSystemReader",
    "read_metadata",
    "check_storage",
    "load_entries",
    "dcp_failure",
    "METADATA_FILE",
]

#: The name of the global metadata file DCP's ``FileSystemWriter`` writes.
METADATA_FILE = ".metadata"

PathLike = Union[str, "os.PathLike[str]"]


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never executes code from the checkpoint.

    Use it wherever DCP takes a storage reader:
    ``dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=...)``.

    Args:
        path: the checkpoint directory.
        metadata: already-read metadata of ``path`` (e.g. from :func:`read_metadata`); when given,
            :meth:`read_metadata` returns it instead of unpickling the file again (for tools that
            call ``dcp.load`` once per tensor). ``reset`` to another path drops it.
        **kwargs: passed to ``FileSystemReader``.

    Raises (from :meth:`read_metadata`):
        CheckpointFormatError: the metadata file is missing, truncated, or not DCP ``Metadata``.
        UnsafeCheckpointError: the metadata pickle references a global outside the allow-list, or
            a storage location is absolute or leaves the checkpoint directory.
    Raises (from :meth:`read_data`):
        UnsafeCheckpointError: a non-tensor item cannot be loaded with ``weights_only=True``.
    """

    def __init__(self, path: PathLike, *, metadata: Optional[Metadata] = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._cached_metadata = metadata

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        if checkpoint_id and Path(checkpoint_id) != Path(self.path):
            self._cached_metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self._cached_metadata is not None and rank is None:
            metadata = self._cached_metadata
            if metadata.storage_meta is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata
        path = self._get_metadata_path(rank)
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = safe_load(f, source=str(path))
        except CkptqError:
            raise
        except FileNotFoundError as e:
            raise CheckpointFormatError(
                f"{path}: no DCP metadata file; is '{self.path}' a complete DCP checkpoint "
                f"directory? (DCP writes '{METADATA_FILE}' last, so an interrupted save has none)"
            ) from e
        except OSError as e:
            raise CheckpointFormatError(f"{path}: cannot read the DCP metadata file: {e}") from e
        except Exception as e:  # any malformed pickle: EOFError, UnpicklingError, ValueError, ...
            raise CheckpointFormatError(
                f"{path}: the DCP metadata file is truncated or corrupt "
                f"({type(e).__name__}: {e}); re-save the checkpoint or restore the file"
            ) from e
        if not isinstance(metadata, Metadata):
            raise CheckpointFormatError(
                f"{path}: holds a pickled {type(metadata).__name__}, not DCP Metadata; this is not "
                f"a DCP checkpoint"
            )
        _check_locations_inside(metadata, self.path, str(path))
        from .foreign import virtualize

        metadata = virtualize(metadata, Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        from .foreign import ForeignLocation, read_foreign_items

        foreign = [it for it in plan.items if isinstance(self.storage_data.get(it.storage_index), ForeignLocation)]
        if foreign:  # entries of a checkpoint another library wrote (see ckptq.io.foreign)
            read_foreign_items(Path(self.path), self.storage_data, foreign, planner)
            served = {id(it) for it in foreign}
            plan = dataclasses.replace(plan, items=[it for it in plan.items if id(it) not in served])
        return super().read_data(plan, _WeightsOnlyBytes(planner, str(self.path)))


class _WeightsOnlyBytes:
    """Planner proxy: BYTE_IO values must pass ``torch.load(weights_only=True)`` before the real
    planner's ``load_bytes`` (DCP's default uses ``weights_only=False``) sees them."""

    def __init__(self, planner: LoadPlanner, source: str) -> None:
        self._planner = planner
        self._source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            torch.load(io.BytesIO(value.getvalue()), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{self._source}: refusing to load non-tensor entry '{fqn}': it cannot be read "
                f"with torch.load(weights_only=True), so loading it could run code ({e}). Register "
                f"its classes with torch.serialization.add_safe_globals if you trust them."
            ) from e
        except Exception as e:
            raise CheckpointFormatError(
                f"{self._source}: non-tensor entry '{fqn}' is corrupt ({type(e).__name__}: {e})"
            ) from e
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def dcp_failure(exc: BaseException, where: str) -> Exception:
    """The error to raise for a failed ``dcp.load``/``dcp.save``.

    DCP wraps per-rank failures in ``CheckpointException`` (a ``BaseException``, so ``except
    Exception`` misses it). This returns the first wrapped :class:`~ckptq.errors.CkptqError` as is;
    any other failure becomes a :class:`~ckptq.errors.CheckpointFormatError` naming ``where`` and
    the original error. Use as ``except CheckpointException as e: raise dcp_failure(e, path) from e``.
    """
    failures = getattr(exc, "failures", None)
    causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, Mapping) else [exc]
    for cause in causes:
        if isinstance(cause, CkptqError):
            return cause
    cause = causes[0] if causes else exc
    return CheckpointFormatError(
        f"{where}: reading the checkpoint failed ({type(cause).__name__}: {cause}); the data files "
        f"may be corrupt"
    )


def _check_locations_inside(metadata: Metadata, root: Any, source: str) -> None:
    """Refuse storage locations that are absolute or leave the checkpoint directory ('..')."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        rel = str(rel)
        parts = Path(rel).parts
        if os.path.isabs(rel) or ".." in parts or "\\" in rel:
            raise UnsafeCheckpointError(
                f"{source}: the metadata points '{getattr(index, 'fqn', '?')}' at '{rel}', outside "
                f"the checkpoint directory '{root}'; refusing to read it"
            )


def _describe_non_dcp(p: Path) -> str:
    if list(p.glob("__*.metadata")):
        return (
            f"{p}: has only per-rank metadata files (__<rank>.metadata, written with "
            f"use_collectives=False) and no global '{METADATA_FILE}'; such checkpoints can only be "
            f"loaded into the same topology and are not supported here"
        )
    if list(p.glob("*.safetensors")):
        return f"{p}: is a safetensors directory, not a DCP FileSystemWriter checkpoint (no '{METADATA_FILE}')"
    if list(p.glob("*.distcp")):
        return (
            f"{p}: has .distcp data files but no '{METADATA_FILE}'; the save was probably "
            f"interrupted (DCP writes the metadata last). Re-save the checkpoint"
        )
    return f"{p}: not a DCP checkpoint directory (no '{METADATA_FILE}' file)"


def read_metadata(path: PathLike, *, verify_storage: bool = True) -> Metadata:
    """Read the DCP ``Metadata`` of a checkpoint directory safely (no process group needed).

    Args:
        path: the checkpoint directory (a ``FileSystemWriter`` output), or its ``.metadata`` file.
        verify_storage: also check with :func:`check_storage` that every chunk has a location and
            that every referenced data file exists and is long enough.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        CheckpointFormatError: the path is missing, is not a DCP checkpoint, or its metadata or
            data files are truncated or inconsistent.
        UnsafeCheckpointError: the metadata pickle references a global outside the allow-list, or a
            storage location points outside the checkpoint directory.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or directory")
    if p.is_file():
        if p.name != METADATA_FILE:
            raise CheckpointFormatError(
                f"{p}: is a file; expected a DCP checkpoint directory (the folder that holds "
                f"'{METADATA_FILE}' and the .distcp files)"
            )
        p = p.parent
    if not (p / METADATA_FILE).is_file():
        raise CheckpointFormatError(_describe_non_dcp(p))
    metadata = SafeFileSystemReader(p).read_metadata()
    if verify_storage:
        check_storage(metadata, p)
    return metadata


def check_storage(metadata: Metadata, path: PathLike) -> None:
    """Check that ``metadata``'s storage locations are complete and present under ``path``.

    Every tensor chunk and non-tensor entry must have a ``storage_data`` location; each location's
    file must exist inside ``path`` and hold ``offset + length`` bytes. Skipped for storage layers
    other than DCP's file system one (``storage_data`` values without ``relative_path``).

    Raises:
        CheckpointFormatError: a missing location, a missing file, or a file shorter than the
            metadata says (truncated).
    """
    root = Path(path)
    storage = metadata.storage_data
    if not isinstance(storage, Mapping) or not all(
        hasattr(v, "relative_path") for v in storage.values()
    ):
        return
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            keys = [MetadataIndex(fqn, c.offsets) for c in md.chunks]
        else:
            keys = [MetadataIndex(fqn)]
        for key in keys:
            if key not in storage:
                where = f" chunk at offsets {list(key.offset)}" if key.offset is not None else ""
                raise CheckpointFormatError(
                    f"{root}: entry '{fqn}'{where} has no storage location in the metadata; "
                    f"the checkpoint is incomplete"
                )
    needed: dict[str, tuple[int, str]] = {}
    for index, info in storage.items():
        rel = str(info.relative_path)
        end = int(info.offset) + int(info.length)
        if rel not in needed or needed[rel][0] < end:
            needed[rel] = (end, getattr(index, "fqn", "?"))
    for rel, (end, fqn) in sorted(needed.items()):
        target = root / rel
        if not target.is_file():
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' (holding '{fqn}') is missing; copy the whole "
                f"checkpoint directory"
            )
        size = target.stat().st_size
        if size < end:
            raise CheckpointFormatError(
                f"{root}: data file '{rel}' is truncated: {size} bytes, but the metadata places "
                f"'{fqn}' up to byte {end}"
            )


def load_entries(reader: SafeFileSystemReader, metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """Read whole tensor entries of a checkpoint into fresh full-size CPU tensors (no process group).

    Args:
        reader: a :class:`~ckptq.io.SafeFileSystemReader` on the checkpoint (built with
            ``metadata=`` so the metadata is not re-read per call).
        metadata: the checkpoint's metadata.
        keys: tensor entry names (``TensorStorageMetadata`` keys), e.g. ``["w.data", "w.scale"]``.

    Returns:
        ``{key: tensor}`` with each entry's global size and stored dtype, assembled by DCP from all
        of its chunks.

    Raises:
        CheckpointFormatError: a key is not a tensor entry of the checkpoint, or its data cannot be
            read (corrupt data file).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    sd = {}
    for key in keys:
        entry = metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointFormatError(f"{reader.path}: '{key}' is not a tensor entry of the checkpoint")
        sd[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            raise dcp_failure(e, f"{reader.path}: entries {keys}") from None
    return sd

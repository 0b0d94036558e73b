"""Safe reading of checkpoints (allow-listed unpickling of DCP metadata, a safe DCP reader, foreign
records, the other sources) and writing them (the offline writer, an atomic ``dcp.save`` storage writer).

Modules: :mod:`~ckptq.io.reader` (the DCP storage reader), :mod:`~ckptq.io.metadata` (``.metadata``
checks), :mod:`~ckptq.io.record_check` (one ``torch.save`` record opened and checked),
:mod:`~ckptq.io.records` (record byte layout), :mod:`~ckptq.io.foreign` (other libraries' DCP records),
:mod:`~ckptq.io.source` (the interface every checkpoint source implements), :mod:`~ckptq.io.torchsave`
and :mod:`~ckptq.io.safetensors` (non-DCP sources), :mod:`~ckptq.io.safe_pickle`, :mod:`~ckptq.io.writer`,
:mod:`~ckptq.io.storage` (local paths or fsspec URLs such as ``s3://``: docs/object-storage.md).
"""

from __future__ import annotations

from .metadata import METADATA_FILE, check_storage
from .reader import SafeFileSystemReader, dcp_failure, load_entries, read_metadata
from .safe_pickle import ALLOWED_GLOBALS, SafeUnpickler, safe_load, safe_loads
from .writer import AtomicFileSystemWriter, ChecksumFileSystemWriter, release_staging, reserve_staging

__all__ = [
    "SafeFileSystemReader",
    "AtomicFileSystemWriter",
    "ChecksumFileSystemWriter",
    "reserve_staging",
    "release_staging",
    "read_metadata",
    "check_storage",
    "load_entries",
    "dcp_failure",
    "METADATA_FILE",
    "SafeUnpickler",
    "safe_load",
    "safe_loads",
    "ALLOWED_GLOBALS",
]

"""Safe reading of checkpoints (allow-listed unpickling of DCP metadata, a safe DCP reader, foreign
records) and writing them (the offline writer, an atomic ``dcp.save`` storage writer)."""

from __future__ import annotations

from .reader import (
    METADATA_FILE,
    SafeFileSystemReader,
    check_storage,
    dcp_failure,
    load_entries,
    read_metadata,
)
from .safe_pickle import ALLOWED_GLOBALS, SafeUnpickler, safe_load, safe_loads
from .writer import AtomicFileSystemWriter, ChecksumFileSystemWriter

__all__ = [
    "SafeFileSystemReader",
    "AtomicFileSystemWriter",
    "ChecksumFileSystemWriter",
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

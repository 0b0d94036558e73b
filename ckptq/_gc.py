"""The cyclic garbage collector paused while many small objects are built.

Building a large table of small acyclic objects (an opened checkpoint's entries, a plan's boxes, a
writer's chunk metadata at ``finish``) triggers the collector's full passes over everything already
alive, which cost several times the building itself (measured in ckptq: 0.47 s against 0.12 s for a
7,800-entry table; docs/benchmarks.md, "The chunk index"). Reference counting still frees what
becomes garbage meanwhile; only cycles wait for the collector's next run.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (also usable as a decorator); back on
    after it if it was on before (nesting keeps the outermost state)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

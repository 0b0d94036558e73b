"""Import the TransformerEngine stand-in (``tests/te_standin``) for a test.

The stand-in is never importable by the library: only tests that call :func:`standin` put
``tests/te_standin`` on ``sys.path``. Returns the factory module (``te_factory``), whose module
globals also expose the stand-in classes.
"""

from __future__ import annotations

import importlib
import os
import sys

STANDIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_standin")


def standin():
    """Put the stand-in on ``sys.path`` (once) and return ``te_factory``."""
    if STANDIN_DIR not in sys.path:
        sys.path.insert(0, STANDIN_DIR)
    return importlib.import_module("te_factory")

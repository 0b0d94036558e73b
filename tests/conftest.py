"""Shared pytest setup for the ckptq test suite.

* Makes the checkout importable without an install (``pytest`` from the repo root with a plain venv);
  an installed ckptq (``pip install -e .``) is the same package, so this changes nothing there.
* The ``backend`` fixture: numerics tests run once per active kernel backend.

Helpers that tests import live in ``tests/_helpers.py`` (not here: pytest owns ``conftest``).
"""

from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def active_backends() -> list[str]:
    """``reference`` (the spec, pure PyTorch) plus every compiled backend active for CPU tensors."""
    from ckptq.ops import _backends

    out = ["reference"]
    if _backends.status("cpu")[0]:
        out.append("cpu")
    return out


@pytest.fixture(params=active_backends())
def backend(request):
    """Run the test once per backend (``ckptq.ops.force``): the numerics tests hold every backend
    to the same bytes as the spec, not only the reference implementation."""
    from ckptq.ops import force

    with force(request.param):
        yield request.param

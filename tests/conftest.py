"""Shared pytest setup for the ckptq test suite.

* Makes the checkout importable without an install (``pytest`` from the repo root with a plain venv);
  an installed ckptq (``pip install -e .``) is the same package, so this changes nothing there.
* Helpers for byte-level comparisons used by the format tests.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (works for 0-d tensors and NaN payloads)."""
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8)


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bytes (bit-exact, NaN payloads included)."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    ra, rb = raw_bytes(a), raw_bytes(b)
    if not torch.equal(ra, rb):
        n = int((ra != rb).sum())
        raise AssertionError(f"{what}: {n} of {ra.numel()} bytes differ")


def assert_same_components(a, b, what: str = "") -> None:
    """Two QuantizedTensors hold the same component names and bytes."""
    ca, cb = a.components(), b.components()
    assert sorted(ca) == sorted(cb), f"{what}: components {sorted(ca)} != {sorted(cb)}"
    for k in ca:
        assert_same_bytes(ca[k], cb[k], f"{what} component '{k}'")


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
